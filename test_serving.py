"""Part 2's claims: one-pass prefill and a paged cache give the lesson's rows bit for bit;
the lossy caches change them, by what they measure; every refusal leaves everything as
it was. The helpers are test_kv_cache's."""
import ast
import copy
import json
import math
import os
import random
import struct
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import generate
import model
import serving
import trace_kv
from kv_cache import KVCache, feed, forward_step, generate_cached
import test_kv_cache
from train import split_stories
from test_kv_cache import (OPENINGS, PARAMS, STORIES, TOK, UNCHANGED, assert_changed,
                           assert_equal, assert_same_generation, assert_same_rows, cached_rows,
                           check_every_case, filled_cache, plant, replacing, setUpModule,
                           snapshot, tearDownModule)   # the module set-up: run from elsewhere


def is_causal_slice(node):
    """[:i + 1]: positions 0..i."""
    return (isinstance(node, ast.Slice) and node.lower is None
            and isinstance(node.upper, ast.BinOp) and isinstance(node.upper.op, ast.Add))



SQUARE_MASK = replacing(is_causal_slice, lambda node: ast.Slice(upper=ast.BinOp(
    ast.BinOp(node.upper.left, ast.Sub(), ast.Name("start", ast.Load())), ast.Add(),
    node.upper.right)))   # [:i + 1] becomes [:i - start + 1]
NO_MASK = replacing(lambda node: isinstance(node, ast.Subscript) and is_causal_slice(node.slice),
                    lambda node: node.value)

def chunked_rows(params, ids, size, cache=None):
    """The logits of every position of ids, prefilled size tokens at a time, through a
    new cache unless one is given."""
    return serving.prefill_in_chunks(params, KVCache(params) if cache is None else cache,
                                      ids, size)


def pool_snapshot(pool):
    """Everything a pool holds: each block's positions, count and index key, the prefix
    index, the free list in order, and the counts of hits and evictions."""
    return ([(b.tokens, b.keys, b.values, b.ref_count, b.prefix) for b in pool.blocks],
            {key: list(ids) for key, ids in pool.prefix_index.items()}, list(pool.free_list),
            pool.prefix_hits, pool.evictions)


class OnePassPrefill(unittest.TestCase):
    """Several new tokens in one call, the causal mask offset by what the cache holds."""

    CHUNKS = (1, 2, 4, 8, model.CONTEXT)   # the last: the whole input in one pass

    def test_every_chunk_size_gives_the_rows_of_the_full_pass(self):
        longest = [t for story in STORIES for t in TOK.encode(story)][:model.CONTEXT]
        for ids in [TOK.encode(story) for story in STORIES[:3]] + [longest]:
            full, _ = model.forward(PARAMS, ids)
            for size in self.CHUNKS:
                with self.subTest(tokens=len(ids), chunk=size):
                    assert_same_rows(self, chunked_rows(PARAMS, ids, size), full)

    def test_a_mix_of_chunks_and_single_steps(self):
        ids = TOK.encode(STORIES[1])
        cache = KVCache(PARAMS)
        rows = serving.prefill(PARAMS, cache, ids[:5], 0)
        rows += [forward_step(PARAMS, cache, ids[i], i) for i in range(5, 8)]
        rows += serving.prefill(PARAMS, cache, ids[8:15], 8)
        rows += feed(PARAMS, cache, ids[:17])
        rows += chunked_rows(PARAMS, ids, 3, cache)
        assert_same_rows(self, rows, cached_rows(PARAMS, ids))

    def test_every_chunk_size_on_random_models(self):
        for index in range(0, 200, 10):
            params, prompt, _, label = test_kv_cache.RandomModels.case(index)
            ids = TOK.encode(prompt)
            full, _ = model.forward(params, ids)
            for size in self.CHUNKS:
                with self.subTest(chunk=size, **label):
                    assert_same_rows(self, chunked_rows(params, ids, size), full)

    def test_one_pass_generation_matches_uncached(self):
        for prompt in OPENINGS[:3]:
            for settings in ({}, {"temperature": 1.0, "seed": 4},
                             {"temperature": 1.0, "top_k": 3, "seed": 5}):
                assert_same_generation(self, PARAMS, prompt, settings, serving.generate_one_pass)

    def test_one_pass_generation_makes_one_call_for_the_prompt(self):
        calls = []
        real = serving.prefill

        def counting(params, cache, token_ids, start):
            calls.append(len(token_ids))
            return real(params, cache, token_ids, start)
        with mock.patch.object(serving, "prefill", counting):
            result = serving.generate_one_pass(PARAMS, TOK, OPENINGS[0])
        self.assertEqual(calls, [len(TOK.encode(OPENINGS[0]))] + [1] * (len(result["steps"]) - 1))

    def test_chunks_need_a_size_and_the_cache_s_own_sequence(self):
        ids = TOK.encode(OPENINGS[0])
        for size in (0, -1, 2.0, True, None):
            with self.subTest(size=size), self.assertRaisesRegex(ValueError, "chunk size"):
                serving.prefill_in_chunks(PARAMS, KVCache(PARAMS), ids, size)
        other = filled_cache(TOK.encode(OPENINGS[1])[:3])
        for attempt in (lambda: serving.prefill_in_chunks(PARAMS, other, ids, 4),
                        lambda: feed(PARAMS, other, ids)):
            with self.assertRaisesRegex(ValueError, "do not begin ids"):
                attempt()

    def test_refusals_leave_the_cache_unchanged(self):
        ids = TOK.encode(OPENINGS[0])
        cache = filled_cache(ids)
        n = len(ids)
        cases = [((copy.deepcopy(PARAMS), [5], n), "different parameters"),
                 ((PARAMS, [5], n - 1), f"expected start {n}, got {n - 1}"),
                 ((PARAMS, [5], 0), f"expected start {n}, got 0"),
                 ((PARAMS, [5], float(n)), f"expected start {n}, got {float(n)!r}"),
                 ((PARAMS, [], n), "token_ids must be a non-empty list"),
                 ((PARAMS, 5, n), "token_ids must be a non-empty list"),
                 ((PARAMS, [5] * (model.CONTEXT - n + 1), n),
                  f"beyond the {model.CONTEXT} positions"),
                 ((PARAMS, [5, model.VOCAB_SIZE], n), "token_ids[1] = 96 is outside the vocabulary"),
                 ((PARAMS, [5, True], n), "token_ids[1] = True is outside the vocabulary")]
        for (params, token_ids, start), fragment in cases:
            before = snapshot(cache)
            with self.subTest(fragment=fragment):
                with self.assertRaises(ValueError) as caught:
                    serving.prefill(params, cache, token_ids, start)
                self.assertIn(fragment, str(caught.exception))
                assert_equal(self, snapshot(cache), before,
                             "the cache (length, tokens, keys, values)")

    def test_a_wrong_mask_is_caught(self):
        """The square mask (new position start + i sees 0..i) and no mask (every new
        position sees the whole chunk), planted in the real source of prefill."""
        ids = TOK.encode(STORIES[0])
        full, _ = model.forward(PARAMS, ids)
        masks = {"square": SQUARE_MASK, "none": NO_MASK,
                 "offset (the real one, recompiled)": UNCHANGED}
        for name, mistake in masks.items():
            planted = plant(serving, "prefill", mistake)
            if planted is None:
                self.skipTest(f"the planting site of the {name} mask is gone from "
                              f"serving.prefill: an edit removed the slice [:i + 1]")
            with self.subTest(mask=name), mock.patch.object(serving, "prefill", planted):
                rows = chunked_rows(PARAMS, ids, 4)
                if name.startswith("offset"):
                    assert_same_rows(self, rows, full)
                else:
                    assert_changed(self, rows, full, f"the rows with the {name} mask")


class Paged(unittest.TestCase):
    """A pool of blocks shared by sequences: forks, prefix reuse, free, refusals."""

    def setUp(self):
        self.ids = TOK.encode(STORIES[0])

    def test_a_paged_sequence_gives_the_rows_of_a_kv_cache(self):
        expected = cached_rows(PARAMS, self.ids)
        for size in (1, 3, 4, 16, model.CONTEXT):
            pool = serving.BlockPool(PARAMS, model.CONTEXT, size)
            assert_same_rows(self, feed(PARAMS, pool.sequence(), self.ids), expected,
                             f"blocks of {size}, fed one token at a time: the rows")
            assert_same_rows(self, chunked_rows(PARAMS, self.ids, 5, pool.sequence()),
                             expected, f"blocks of {size}, prefilled 5 at a time: the rows")

    def test_generation_from_a_paged_sequence_equals_a_fresh_run_and_frees_its_copy(self):
        pool = serving.BlockPool(PARAMS, 40, 4)
        prompt = OPENINGS[0]
        seq = pool.sequence()
        feed(PARAMS, seq, TOK.encode(prompt))
        free = pool.free_blocks()
        for settings in ({}, {"temperature": 1.0, "seed": 2}):
            assert_same_generation(self, PARAMS, prompt, settings, cache=seq)
            self.assertEqual(pool.free_blocks(), free)

    def test_a_fork_shares_every_block_until_one_side_writes(self):
        pool = serving.BlockPool(PARAMS, 40, 4)
        parent = pool.sequence()
        feed(PARAMS, parent, self.ids[:10])        # blocks of 4, 4 and 2 positions
        free = pool.free_blocks()
        fork = parent.copy()
        self.assertEqual((fork.table, pool.free_blocks()), (parent.table, free))   # no block
        self.assertEqual([pool.ref_counts[b] for b in parent.table], [2, 2, 2])
        before = snapshot(parent)
        feed(PARAMS, fork, self.ids[:10] + TOK.encode(" tom ran"))   # copies the last block
        self.assertEqual(fork.table[:2], parent.table[:2])
        self.assertNotEqual(fork.table[2], parent.table[2])
        self.assertEqual([pool.ref_counts[b] for b in parent.table], [2, 2, 1])
        assert_equal(self, snapshot(parent), before, "the parent")
        rows = feed(PARAMS, parent, self.ids)      # writes in place: the block is its own now
        self.assertEqual(pool.ref_counts[parent.table[2]], 1)
        assert_same_rows(self, rows, cached_rows(PARAMS, self.ids)[10:])
        assert_equal(self, snapshot(fork),
                     snapshot(filled_cache(self.ids[:10] + TOK.encode(" tom ran"))), "the fork")

    def test_crop_into_a_shared_block_copies_it_only_when_it_writes(self):
        pool = serving.BlockPool(PARAMS, 40, 4)
        parent = pool.sequence()
        feed(PARAMS, parent, self.ids[:8])
        fork = parent.copy()
        free = pool.free_blocks()
        fork.crop(6)
        self.assertEqual((fork.tokens, fork.table, pool.free_blocks()),
                         (self.ids[:6], parent.table, free))
        self.assertEqual(parent.tokens, self.ids[:8])
        assert_same_rows(self, feed(PARAMS, fork, self.ids), cached_rows(PARAMS, self.ids)[6:])
        self.assertNotEqual(fork.table[1], parent.table[1])
        self.assertEqual(parent.tokens, self.ids[:8])

    def test_a_cut_block_left_to_one_sequence_is_cut_before_it_writes(self):
        """The fork crops into a block it shares; the parent then frees it, so the fork
        holds it alone, longer than its own positions: it must not write after them."""
        pool = serving.BlockPool(PARAMS, 40, 4)
        parent = pool.sequence()
        feed(PARAMS, parent, self.ids[:8])
        fork = parent.copy()
        fork.crop(6)
        parent.free()
        assert_same_rows(self, feed(PARAMS, fork, self.ids), cached_rows(PARAMS, self.ids)[6:])
        assert_equal(self, snapshot(fork), snapshot(filled_cache(self.ids)), "the fork")

    def test_prefix_reuse_takes_full_blocks_and_equals_a_fresh_run(self):
        pool = serving.BlockPool(PARAMS, 60, 4)
        first = TOK.encode("mia was sad. tom gave her a hug.")
        second = TOK.encode("mia was tired.")
        feed(PARAMS, pool.sequence(first), first)
        seq = pool.sequence(second)
        shared = len(seq)
        self.assertEqual(shared, 4 * (len(os.path.commonprefix([first, second])) // 4))
        self.assertGreater(shared, 0)
        assert_same_rows(self, feed(PARAMS, seq, second), cached_rows(PARAMS, second)[shared:])
        assert_same_rows(self, seq.keys, filled_cache(second).keys)
        self.assertEqual(len(pool.sequence(first)), 4 * (len(first) // 4))   # only full blocks

    def test_freed_full_blocks_stay_findable_until_a_new_block_needs_them(self):
        pool = serving.BlockPool(PARAMS, 10, 4)
        seq = pool.sequence()
        feed(PARAMS, seq, self.ids[:10])             # full blocks 0 and 1, then 2 positions
        seq.free()
        self.assertEqual(pool.free_blocks(), 10)     # a freed pool is entirely free
        again = pool.sequence(self.ids[:10])
        self.assertEqual((len(again), pool.prefix_hits), (8, 2))   # found after the free
        assert_same_rows(self, feed(PARAMS, again, self.ids[:12]),
                         cached_rows(PARAMS, self.ids[:12])[8:])
        again.free()   # the free list: the 7 empty blocks, then 2, 1 and 0 (tail first)
        others = [pool.take() for _ in range(7)]     # the empty blocks go first
        self.assertEqual(pool.evictions, 0)
        for evicted, findable in ((1, 8), (2, 4), (3, 0)):   # then the least recent, the tail
            others.append(pool.take())
            probe = pool.sequence(self.ids[:12])
            self.assertEqual((pool.evictions, len(probe)), (evicted, findable))
            probe.free()
        for block_id in others:
            pool.release(block_id)
        self.assertEqual(pool.free_blocks(), 10)

    def test_any_full_block_is_findable_whichever_sequence_filled_it(self):
        pool = serving.BlockPool(PARAMS, 10, 4)
        first, second = pool.sequence(), pool.sequence()
        feed(PARAMS, first, self.ids[:8])
        feed(PARAMS, second, self.ids[:8])           # the same tokens, in blocks of its own
        self.assertEqual(len(pool.prefix_index[tuple(self.ids[:8])]), 2)
        first.free()
        while pool.evictions < 2:                    # the first sequence's blocks go
            pool.take()
        self.assertEqual(pool.sequence(self.ids[:8]).table, second.table)

    def test_sequence_checks_its_ids_like_forward_step(self):
        pool = serving.BlockPool(PARAMS, 10, 4)
        feed(PARAMS, pool.sequence(), [1, 0, 5, 6])
        for ids, fragment in (([1.0, False, 5, 6, 7], "ids[0] = 1.0 is outside the vocabulary"),
                              ([5, 96], "ids[1] = 96 is outside the vocabulary"),
                              ([500], "ids[0] = 500"), ("mia", "ids must be a list"),
                              ([5] * 65, "beyond the 64 positions")):
            with self.subTest(ids=ids):
                self.assert_refused(pool, lambda: pool.sequence(ids), fragment)

    def test_a_refused_continuation_names_the_pool_and_leaks_nothing(self):
        """A pool of one block of 3, held by a sequence of 3 tokens: continuing its prompt
        needs a copy of that block, and there is no room."""
        pool = serving.BlockPool(PARAMS, 1, 3)
        seq = pool.sequence()
        feed(PARAMS, seq, TOK.encode("tom ran"))
        before, held = pool_snapshot(pool), snapshot(seq)
        with self.assertRaisesRegex(ValueError, "the pool is out of blocks: it has 1 blocks "
                                                "of 3 positions, 0 free, and 1 more"):
            generate_cached(PARAMS, TOK, "tom ran", cache=seq)
        assert_equal(self, pool_snapshot(pool), before, "the pool")
        assert_equal(self, snapshot(seq), held, "the sequence")
        seq.free()
        self.assertEqual(pool.free_blocks(), 1)

    def test_feed_and_chunked_prefill_keep_what_was_fed_before_a_refusal(self):
        """Each position joins whole or not at all: a refusal in the middle of an input
        leaves the positions fed before it, as its docstring says, and feeding the rest
        later gives the rows of one run."""
        for fill in (lambda seq, ids: feed(PARAMS, seq, ids),
                     lambda seq, ids: serving.prefill_in_chunks(PARAMS, seq, ids, 4)):
            pool = serving.BlockPool(PARAMS, 2, 4)
            seq = pool.sequence()
            with self.assertRaisesRegex(ValueError, "out of blocks"):
                fill(seq, self.ids[:12])
            self.assertEqual(seq.tokens, self.ids[:8])
            assert_equal(self, snapshot(seq), snapshot(filled_cache(self.ids[:8])),
                         "the sequence")

    def test_random_operations_keep_every_sequence_and_the_pool_consistent(self):
        """Random runs of new sequences (with prefix reuse), feeds, forks, crops and frees
        on small pools: after every operation each live sequence holds exactly the
        tokens, keys and values a KVCache fed the same tokens holds, the pool counts every
        table holding each block, frees exactly the blocks nobody holds, and indexes only
        full blocks under the tokens they and the blocks before them hold."""
        stories = [tuple(TOK.encode(story)) for story in STORIES[:4]]
        reference = {story: filled_cache(list(story)) for story in stories}
        rng = random.Random(0)
        for trial in range(100):
            pool = serving.BlockPool(PARAMS, rng.randint(3, 16), rng.choice((1, 2, 3, 4)))
            live = []                                    # [sequence, its story]
            for _ in range(20):
                operation = rng.choice(("new", "feed", "feed", "fork", "crop", "free"))
                pair = rng.choice(live) if live else None
                try:
                    if operation == "new" or pair is None:
                        story = rng.choice(stories)
                        live.append([pool.sequence(list(story[:rng.randint(0, 20)])), story])
                    elif operation == "feed":
                        seq, story = pair
                        feed(PARAMS, seq, list(story[:rng.randint(len(seq), len(story))]))
                    elif operation == "fork":
                        live.append([pair[0].copy(), pair[1]])
                    elif operation == "crop":
                        pair[0].crop(rng.randint(0, len(pair[0])))
                    else:
                        pair[0].free()
                        live.remove(pair)
                except ValueError as refused:
                    self.assertIn("out of blocks", str(refused))
                label = f"trial {trial}, after {operation}"
                for seq, story in live:
                    held, whole = len(seq), reference[story]
                    assert_equal(self, (seq.tokens, seq.keys, seq.values),
                                 (list(story[:held]), whole.keys[:held], whole.values[:held]),
                                 f"{label}: a sequence")
                tables = [block for seq, _ in live for block in seq.table]
                self.assertEqual(pool.ref_counts,
                                 [tables.count(b) for b in range(len(pool.blocks))], label)
                self.assertEqual(sorted(pool.free_list),
                                 [b for b in range(len(pool.blocks)) if b not in tables], label)
                for prefix, holders in pool.prefix_index.items():
                    story = next(s for s in stories if s[:len(prefix)] == prefix)
                    first = len(prefix) - pool.block_size
                    for block_id in holders:
                        block = pool.blocks[block_id]
                        assert_equal(self, (block.prefix, block.tokens, block.keys),
                                     (prefix, list(prefix[first:]),
                                      reference[story].keys[first:len(prefix)]),
                                     f"{label}: an indexed block")

    def assert_refused(self, pool, attempt, fragment):
        """attempt raises a ValueError naming fragment, and the pool is as it was."""
        before = pool_snapshot(pool)
        with self.assertRaises(ValueError) as caught:
            attempt()
        self.assertIn(fragment, str(caught.exception))
        assert_equal(self, pool_snapshot(pool), before, "the pool")

    def test_refusals_leave_the_pool_unchanged(self):
        pool = serving.BlockPool(PARAMS, 3, 4)
        seq = pool.sequence()
        feed(PARAMS, seq, self.ids[:10])   # blocks of 4, 4 and 2: two free slots, no free block
        self.assert_refused(pool, lambda: serving.prefill(PARAMS, seq, self.ids[10:13], 10),
                            "the pool is out of blocks: it has 3 blocks of 4 positions, 0 free, "
                            "and 1 more are needed")
        fork = seq.copy()                  # takes no block...
        self.assert_refused(pool, lambda: forward_step(PARAMS, fork, self.ids[10], 10),
                            "out of blocks")   # ...until it writes to the shared last one
        fork.free()
        feed(PARAMS, seq, self.ids[:12])   # now every block is full
        self.assert_refused(pool, lambda: forward_step(PARAMS, seq, self.ids[12], 12),
                            "out of blocks")
        self.assertEqual(seq.tokens, self.ids[:12])
        seq.free()
        for attempt in (lambda: forward_step(PARAMS, seq, 5, 0), lambda: feed(PARAMS, seq, [5]),
                        seq.copy, lambda: seq.crop(0), lambda: seq.extend([5], [[0.0]], [[0.0]])):
            self.assert_refused(pool, attempt, "this sequence was freed")
        for blocks, size in ((0, 4), (3, 0), (3, 2.0), (True, 4), (3, None)):
            with self.subTest(blocks=blocks, block_size=size):
                with self.assertRaisesRegex(ValueError, "must be an int >= 1"):
                    serving.BlockPool(PARAMS, blocks, size)


class Lossy(unittest.TestCase):
    """Where a cache gives exactness up on purpose: compact formats and a sliding window."""

    VECTOR = [0.75, -1.5, 0.1, 3.0, -0.2, 1e-3, 2.5, -3.0, 0.0, 1.2, -0.7, 0.33, 2.0, -2.9,
              0.05, 1.0]

    def test_each_format_round_trips_as_its_numbers_allow(self):
        unpack = serving._unpack
        stored = {fmt: serving._pack(fmt, self.VECTOR) for fmt in serving.FORMATS}
        self.assertEqual(unpack("float64", stored["float64"]), self.VECTOR)
        self.assertEqual(unpack("float32", stored["float32"]),
                         [struct.unpack("f", struct.pack("f", x))[0] for x in self.VECTOR])
        self.assertEqual(unpack("float16", stored["float16"]),
                         [struct.unpack("e", struct.pack("e", x))[0] for x in self.VECTOR])
        for fmt, top in (("int8", 127), ("int4", 7)):
            scale = stored[fmt][1][0]
            self.assertEqual(scale, struct.unpack("f", struct.pack("f", 3.0 / top))[0])
            back = unpack(fmt, stored[fmt])
            with self.subTest(fmt=fmt):
                self.assertEqual([round(y / scale) * scale for y in back], back)   # on levels
                self.assertLessEqual(max(abs(x - y) for x, y in zip(self.VECTOR, back)),
                                     scale / 2 * 1.0001)
        # Ties go to the even level: 0.5 and 1.5 of a scale of 1.0 become 0 and 2.
        self.assertEqual(unpack("int4", serving._pack("int4", [7.0, 0.5, 1.5, -0.5])),
                         [7.0, 0.0, 2.0, 0.0])

    def test_each_format_measures_its_bytes(self):
        ids = TOK.encode(OPENINGS[0])
        expected = {"float64": 2 * 16 * 8, "float32": 2 * 16 * 4, "float16": 2 * 16 * 2,
                    "int8": 2 * (16 + 4), "int4": 2 * (8 + 4)}
        for fmt in serving.FORMATS:
            cache = serving.QuantizedCache(PARAMS, fmt)
            feed(PARAMS, cache, ids)
            with self.subTest(fmt=fmt):
                self.assertEqual(cache.bytes_per_position(), expected[fmt])

    def test_a_float64_array_cache_is_exact(self):
        longest = [t for story in STORIES for t in TOK.encode(story)][:model.CONTEXT]
        for ids in (TOK.encode(STORIES[0]), longest):
            assert_same_rows(self, feed(PARAMS, serving.QuantizedCache(PARAMS, "float64"), ids),
                             cached_rows(PARAMS, ids))
        assert_same_generation(self, PARAMS, OPENINGS[0], {},
                               cache=serving.QuantizedCache(PARAMS, "float64"))

    def test_lower_precision_changes_the_scores(self):
        ids = TOK.encode(STORIES[0])
        exact = cached_rows(PARAMS, ids)
        for fmt in serving.FORMATS[1:]:
            with self.subTest(fmt=fmt):
                assert_changed(self, feed(PARAMS, serving.QuantizedCache(PARAMS, fmt), ids),
                               exact, f"the rows through a {fmt} cache")

    def test_the_window_cache_equals_the_band_masked_full_pass(self):
        longest = [t for story in STORIES for t in TOK.encode(story)][:model.CONTEXT]
        self.assertEqual(len(longest), model.CONTEXT)
        for window in (8, 16, 32):
            for sinks in (0, 4):
                reference, _ = model.forward(PARAMS, longest, model.band(window, sinks))
                cache = serving.WindowCache(PARAMS, window, sinks)
                label = f"window {window}, sinks {sinks}"
                assert_same_rows(self, feed(PARAMS, cache, longest), reference,
                                 f"{label}: the rows")
                self.assertEqual(len(cache.keys), window + sinks, label)
                assert_changed(self, reference, cached_rows(PARAMS, longest),
                               f"{label}: the band-masked rows")

    def test_copy_and_crop_on_the_new_caches(self):
        ids = TOK.encode(STORIES[0])
        for make in (lambda: serving.QuantizedCache(PARAMS, "int8"),
                     lambda: serving.WindowCache(PARAMS, 16, 4)):
            with self.subTest(cache=type(make()).__name__):
                alone = feed(PARAMS, make(), ids)
                cache = make()
                feed(PARAMS, cache, ids[:10])
                fork = cache.copy()
                assert_same_rows(self, feed(PARAMS, fork, ids), alone[10:])
                self.assertEqual(len(cache), 10)
                cache.crop(6)
                assert_same_rows(self, feed(PARAMS, cache, ids), alone[6:])
        window = serving.WindowCache(PARAMS, 8, 2)
        feed(PARAMS, window, ids[:12])
        with self.assertRaisesRegex(ValueError, "the window has dropped positions 2 to 3"):
            window.crop(5)
        window.crop(2)
        assert_same_rows(self, feed(PARAMS, window, ids), feed(PARAMS, serving.WindowCache(
            PARAMS, 8, 2), ids)[2:])

    def test_a_window_cache_is_fed_one_token_at_a_time(self):
        cache = serving.WindowCache(PARAMS, 8, 2)
        feed(PARAMS, cache, TOK.encode(OPENINGS[0]))
        before = (list(cache.tokens), cache.keys)
        with self.assertRaisesRegex(ValueError, "prefill needs a cache that keeps every "
                                                "position, and a WindowCache drops some"):
            serving.prefill(PARAMS, cache, [5, 6], len(cache))
        assert_equal(self, (list(cache.tokens), cache.keys), before, "the window cache")

    def test_what_a_format_cannot_store_is_refused(self):
        for fmt, vector, fragment in (("float16", [70000.0] + [0.0] * 15, "beyond float16"),
                                      ("float32", [1e39] + [0.0] * 15, "beyond float32"),
                                      ("int8", [1e300] + [0.0] * 15, "the scale of"),
                                      ("int4", [-1e300] + [0.0] * 15, "the scale of"),
                                      ("float64", [float("nan")] * 16, "holding nan"),
                                      ("int8", [float("inf")] * 16, "holding inf"),
                                      ("int4", [1.0, 2.0, 3.0], "cannot be stored")):
            with self.subTest(fmt=fmt), self.assertRaisesRegex(ValueError, fragment):
                serving._pack(fmt, vector)
        with self.assertRaisesRegex(ValueError, "no position yet"):
            serving.QuantizedCache(PARAMS, "int8").bytes_per_position()
        huge = dict(PARAMS, ln1_g=[1e41] * model.WIDTH)   # keys and values near 1e41
        for fmt in ("float32", "int8"):
            cache = serving.QuantizedCache(huge, fmt)
            with self.subTest(through="forward_step", fmt=fmt):
                with self.assertRaisesRegex(ValueError, "float32's largest"):
                    forward_step(huge, cache, 5, 0)
                self.assertEqual((len(cache), cache.tokens), (0, []))

    def test_a_window_cache_holding_the_whole_prompt_says_so(self):
        ids = TOK.encode(STORIES[0])
        cache = serving.WindowCache(PARAMS, 8)
        feed(PARAMS, cache, ids)
        with self.assertRaisesRegex(ValueError, "holds the whole prompt, and its copy cannot "
                                                "give the last position back .*: crop length "
                                                ".* the window has dropped positions 0 to 21"):
            generate_cached(PARAMS, TOK, TOK.decode(ids), cache=cache)

    def test_bad_formats_and_windows_are_refused(self):
        with self.assertRaisesRegex(ValueError, "unknown cache format 'int2'; the formats are "
                                                "float64, float32, float16, int8, int4"):
            serving.QuantizedCache(PARAMS, "int2")
        for window, sinks, fragment in ((0, 0, "window must be an int >= 1"),
                                        (8.0, 0, "window must be an int >= 1"),
                                        (True, 0, "window must be an int >= 1"),
                                        (8, -1, "sinks must be an int from 0 to window - 1"),
                                        (8, 8, "sinks must be an int from 0 to window - 1"),
                                        (8, 2.0, "sinks must be an int from 0 to window - 1")):
            with self.subTest(window=window, sinks=sinks):
                with self.assertRaisesRegex(ValueError, fragment):
                    serving.WindowCache(PARAMS, window, sinks)

class Serve(unittest.TestCase):
    """Many requests from one pool: continuous batching and preemption by recompute give
    every request exactly generate.generate's result."""

    def requests(self, count, order_seed):
        """count of the test openings, greedy, sampled and top-k in turn, in an order
        shuffled by order_seed."""
        kinds = ({}, {"temperature": 1.0}, {"temperature": 1.0, "top_k": 3})
        requests = [dict(kinds[i % 3], prompt=prompt, seed=i)
                    for i, prompt in enumerate(OPENINGS[:count])]
        random.Random(order_seed).shuffle(requests)
        return requests

    def test_every_result_is_generate_s_for_any_pool_batch_and_order(self):
        requests = self.requests(12, 0)
        expected = [generate.generate(PARAMS, TOK, **request) for request in requests]
        # The smallest pool serve takes: room for the longest any request could grow.
        smallest = max(math.ceil((min(len(TOK.encode(r["prompt"])) + 60, model.CONTEXT) - 1) / 4)
                       for r in requests)
        preempted = 0

        def check(case):
            blocks, max_batch, order = case
            shuffled = random.Random(order).sample(range(len(requests)), len(requests))
            pool = serving.BlockPool(PARAMS, blocks, 4)
            results, counts = serving.serve(PARAMS, TOK, [requests[i] for i in shuffled],
                                            pool, max_batch)
            nonlocal preempted
            preempted += counts["preemptions"]
            for i, result in zip(shuffled, results):
                if result != expected[i]:
                    return f"request {requests[i]} differs: {result['text']!r}"
            if pool.free_blocks() != blocks:
                return f"{blocks - pool.free_blocks()} blocks still held after serving"
            return None
        cases = [(f"{blocks} blocks, batches of {max_batch}, order {order}",
                  (blocks, max_batch, order))
                 for blocks, max_batch, order in (
                     (smallest, 1, 0), (smallest, 3, 1), (smallest, 12, 0), (smallest, 12, 1),
                     (smallest + 3, 12, 2), (2 * smallest, 3, 3), (200, 12, 4), (200, 1, 5))]
        check_every_case(self, cases, check)
        self.assertGreater(preempted, 0)   # the small pools did preempt

    def test_preempted_requests_come_back_with_the_same_result(self):
        requests = self.requests(9, 2)
        pool = serving.BlockPool(PARAMS, 16, 4)
        results, counts = serving.serve(PARAMS, TOK, requests, pool, 9)
        self.assertGreater(counts["preemptions"], 0)
        self.assertGreater(counts["recomputed_rows"], 0)
        for request, result in zip(requests, results):
            expected = generate.generate(PARAMS, TOK, **request)
            if result != expected:
                self.fail(f"{request} came back as {result['text']!r}, where generate "
                          f"writes {expected['text']!r}")

    def test_counts_add_up(self):
        requests = self.requests(6, 3)
        results, counts = serving.serve(PARAMS, TOK, requests, serving.BlockPool(PARAMS, 200, 4),
                                        6)
        fed = sum(len(TOK.encode(r["prompt"])) + len(result["steps"]) - 1
                  for r, result in zip(requests, results))
        self.assertEqual((counts["preemptions"], counts["recomputed_rows"]), (0, 0))
        self.assertEqual(counts["rows"], fed - 4 * counts["prefix_hits"])
        self.assertEqual(counts["steps"], max(len(r["steps"]) for r in results))
        one_at_a_time = serving.serve(PARAMS, TOK, requests, serving.BlockPool(PARAMS, 200, 4),
                                      1)[1]
        self.assertEqual(one_at_a_time["steps"], sum(len(r["steps"]) for r in results))

    def test_bad_requests_and_settings_are_refused_before_anything_runs(self):
        for requests, max_batch, fragment in (
                ([{"prompt": "mia was sad."}], 0, "max_batch must be an int >= 1"),
                ([{"prompt": "mia was sad."}], True, "max_batch must be an int >= 1"),
                ("mia was sad.", 1, "requests must be a list"),
                ([{"prompt": "mia"}, {"text": "mia"}], 1, "request 1 must be a dict"),
                ([{"prompt": "mia", "temprature": 1.0}], 1, "request 0 must be a dict"),
                ([{"prompt": "Mia"}], 1, "request 0: unknown character 'M'"),
                ([{"prompt": "mia", "top_k": 0}], 1, "request 0: top_k must be"),
                ([{"prompt": "mia", "max_new_tokens": 2}, {"prompt": "mia was sad."}], 1,
                 "request 1 may need 16 blocks of 4 positions, and the pool has 8")):
            pool = serving.BlockPool(PARAMS, 8 if "may need" in fragment else 16, 4)
            with self.subTest(fragment=fragment):
                before = pool_snapshot(pool)
                with self.assertRaisesRegex(ValueError, fragment):
                    serving.serve(PARAMS, TOK, requests, pool, max_batch)
                assert_equal(self, pool_snapshot(pool), before, "the pool")
        with self.assertRaisesRegex(ValueError, "a BlockPool made for these params"):
            serving.serve(copy.deepcopy(PARAMS), TOK, [], pool, 1)


def is_rollback(node):
    """node is the call cache.crop(...) that rolls rejected positions back."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "crop")


KEEP_A_REJECTED_POSITION = replacing(   # crop(n) becomes crop(n + 1)
    is_rollback,
    lambda node: ast.Call(node.func, [ast.BinOp(node.args[0], ast.Add(), ast.Constant(1))], []))


def draw_for_a_discarded_draft(tree):
    """Before the rollback, one more random number, as if a discarded drafted token drew."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for index, statement in enumerate(body if isinstance(body, list) else []):
            if isinstance(statement, ast.Expr) and is_rollback(statement.value):
                body.insert(index, ast.parse("generation.rng.random()").body[0])
                return 1
    return 0


class Speculative(unittest.TestCase):
    """Speculative decoding gives generate.generate's result, whatever the drafter."""

    @classmethod
    def setUpClass(cls):
        train, _, _ = split_stories(test_kv_cache.lab_file("corpus.txt"))
        cls.drafters = {"prompt lookup": serving.PromptLookup(),
                        "training stories": serving.NgramDrafter([TOK.encode(story)
                                                                  for story in train])}

    def differences(self, prompts=OPENINGS[:6], lookaheads=(1, 4)):
        """The runs whose result is not generate.generate's, in a few words (compared with
        generate_cached's, which is generate's, as test_kv_cache shows, and 4 times
        cheaper; trace_kv compares with generate's itself on all 60 openings)."""
        found = []
        for index, prompt in enumerate(prompts):
            for settings in ({}, {"temperature": 1.0, "seed": index},
                             {"temperature": 0.8, "top_k": 3, "seed": index}):
                expected = generate_cached(PARAMS, TOK, prompt, **settings)
                for name, drafter in self.drafters.items():
                    for lookahead in lookaheads:
                        result = serving.generate_speculative(
                            PARAMS, TOK, prompt, lookahead=lookahead, drafter=drafter,
                            **settings)
                        if result != expected:
                            found.append(f"{prompt!r} {settings}, {name}, lookahead "
                                         f"{lookahead}: {result['text']!r}")
        return found

    def test_every_result_is_generate_s(self):
        self.assertEqual(self.differences(), [])

    def test_a_drafter_proposes_what_followed(self):
        ids = [1, 2, 3, 9, 1, 2, 3]
        self.assertEqual(serving.PromptLookup().propose(ids, 4), [9, 1, 2, 3])
        self.assertEqual(serving.PromptLookup().propose([5, 6], 4), [])
        drafter = serving.NgramDrafter([[1, 2, 3, 4], [1, 2, 3, 5], [7, 2, 3, 5]])
        self.assertEqual(drafter.propose([2, 3], 2), [5])     # 3 -> 5 twice, 4 once; 5: none
        self.assertEqual(drafter.propose([1, 2, 3], 1), [4])  # a tie: the smallest ID

    def test_a_cache_holding_the_start_of_the_prompt_is_copied_and_one_that_drops_is_refused(
            self):
        prompt = OPENINGS[0]
        ids = TOK.encode(prompt)
        for held in (0, 3, len(ids)):
            cache = filled_cache(ids[:held])
            before = snapshot(cache)
            self.assertEqual(serving.generate_speculative(PARAMS, TOK, prompt, cache=cache),
                             generate.generate(PARAMS, TOK, prompt))
            assert_equal(self, snapshot(cache), before, f"the cache holding {held} tokens")
        window = serving.WindowCache(PARAMS, 8)
        for bad, fragment in (({"cache": window}, "a WindowCache drops positions a crop may "
                                                  "need"),
                              ({"lookahead": 0}, "lookahead must be an int >= 1"),
                              ({"lookahead": 2.0}, "lookahead must be an int >= 1")):
            with self.subTest(**bad), self.assertRaisesRegex(ValueError, fragment):
                serving.generate_speculative(PARAMS, TOK, prompt, **bad)

    def test_a_verifier_that_keeps_a_rejected_position_or_draws_for_a_discarded_draft_fails(
            self):
        for mistake in (KEEP_A_REJECTED_POSITION, draw_for_a_discarded_draft):
            planted = plant(serving, "generate_speculative", mistake)
            self.assertIsNotNone(planted, f"the planting site of {mistake} is gone")
            with self.subTest(mistake=getattr(mistake, "__name__", "keep a rejected one")), \
                    mock.patch.object(serving, "generate_speculative", planted):
                try:
                    found = self.differences(OPENINGS[:3], (4,))
                except ValueError:
                    found = ["raises"]
                self.assertNotEqual(found, [])


class CacheFiles(unittest.TestCase):
    """A cache saved to a file and loaded again, here or in another process, continues
    exactly; every file that is not a cache of these weights is refused, naming it."""

    def setUp(self):
        self.folder = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.folder.name, "cache.json")

    def tearDown(self):
        self.folder.cleanup()

    def test_a_saved_cache_loads_bit_for_bit_and_continues_exactly(self):
        ids = TOK.encode(OPENINGS[0])
        pool = serving.BlockPool(PARAMS, 20, 4)
        paged = pool.sequence()
        feed(PARAMS, paged, ids)
        for cache in (filled_cache(ids), paged):
            serving.save_cache(cache, self.path)
            loaded = serving.load_cache(PARAMS, self.path)
            with self.subTest(cache=type(cache).__name__):
                assert_equal(self, snapshot(loaded), snapshot(cache), "the loaded cache")
                self.assertEqual(generate_cached(PARAMS, TOK, OPENINGS[0], cache=loaded),
                                 generate.generate(PARAMS, TOK, OPENINGS[0]))
        twin = copy.deepcopy(PARAMS)   # the same weights: the same signature, the same keys
        self.assertEqual(len(serving.load_cache(twin, self.path)), len(ids))

    def test_a_cache_loaded_in_another_process_continues_every_opening(self):
        """Greedy for all 60 openings, sampled too for one in six."""
        for index, prompt in enumerate(OPENINGS):
            serving.save_cache(filled_cache(TOK.encode(prompt)),
                               os.path.join(self.folder.name, f"{index}.json"))
        script = (
            "import json, sys; sys.path.insert(0, sys.argv[1])\n"
            "import generate, kv_cache, serving, trace_kv, train\n"
            "params, tok = generate.load_trained()\n"
            "prompts = trace_kv.openings(train.split_stories(open(sys.argv[1] + "
            "'/corpus.txt').read())[2])\n"
            "print(json.dumps([kv_cache.generate_cached(params, tok, prompt, temperature=t, "
            "seed=i, cache=serving.load_cache(params, f'{sys.argv[2]}/{i}.json')) "
            "for i, prompt in enumerate(prompts) for t in ((0.0, 1.0) if i % 6 == 0 else "
            "(0.0,))]))\n")
        done = subprocess.run([sys.executable, "-c", script, test_kv_cache.HERE,
                               self.folder.name], capture_output=True, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)
        never_saved = [generate_cached(PARAMS, TOK, prompt, temperature=t, seed=i,
                                       cache=filled_cache(TOK.encode(prompt)))
                       for i, prompt in enumerate(OPENINGS)
                       for t in ((0.0, 1.0) if i % 6 == 0 else (0.0,))]
        results = json.loads(done.stdout)
        self.assertEqual(len(results), 70)   # every opening greedy, one in six sampled too
        for result, expected in zip(results, never_saved):
            if result != expected:
                self.fail(f"a loaded cache continued as {result['text']!r}, the never-saved "
                          f"one as {expected['text']!r}")

    def test_what_is_not_a_cache_of_these_weights_is_refused_naming_the_file(self):
        serving.save_cache(filled_cache(TOK.encode(OPENINGS[0])), self.path)
        with open(self.path, encoding="utf-8") as f:
            good = json.load(f)
        other = copy.deepcopy(PARAMS)
        other["b_out"][0] = math.nextafter(other["b_out"][0], math.inf)   # one last bit
        bad_files = {
            "not valid JSON": json.dumps(good)[:-40],                        # truncated
            "not a KV cache file of this lab": json.dumps(dict(good, format="kv-lab-cache-2")),
            "a corrupted cache file: 15 tokens, 15 keys and 14 values":
                json.dumps(dict(good, values=good["values"][:-1])),
            "the key of position 3 is not 16 finite floats":
                json.dumps(dict(good, keys=good["keys"][:3] + [good["keys"][3][:15]]
                                + good["keys"][4:])),
            "token 0 is 96, outside the vocabulary": json.dumps(dict(good, tokens=[96]
                                                                     + good["tokens"][1:])),
        }
        self.assertEqual(len(good["tokens"]), 15)
        for fragment, text in bad_files.items():
            with self.subTest(fragment=fragment):
                with open(self.path, "w", encoding="utf-8") as f:
                    f.write(text)
                with self.assertRaises(ValueError) as refused:
                    serving.load_cache(PARAMS, self.path)
                self.assertIn(self.path, str(refused.exception))
                self.assertIn(fragment, str(refused.exception))
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(good, f)
        with self.assertRaisesRegex(ValueError, "computed with other weights .* stale logits"):
            serving.load_cache(other, self.path)
        with self.assertRaisesRegex(ValueError, "not a KV cache file of this lab"):
            serving.load_cache(PARAMS, os.path.join(test_kv_cache.HERE, "best.json"))
        with self.assertRaises(FileNotFoundError):
            serving.load_cache(PARAMS, os.path.join(self.folder.name, "missing.json"))
        with self.assertRaisesRegex(ValueError, "saves a KVCache or a paged sequence"):
            serving.save_cache(serving.WindowCache(PARAMS, 8), self.path)
        nowhere = os.path.join(self.folder.name, "no such folder", "cache.json")
        with self.assertRaisesRegex(FileNotFoundError, f"cannot write .*the folder .* does "
                                                       f"not exist"):
            serving.save_cache(filled_cache([5]), nowhere)

    def test_a_failed_write_keeps_the_previous_file(self):
        serving.save_cache(filled_cache(TOK.encode(OPENINGS[0])), self.path)
        with open(self.path, encoding="utf-8") as f:
            previous = f.read()
        with mock.patch("checkpoint.os.replace", side_effect=OSError("disk full")), \
                self.assertRaises(OSError):
            serving.save_cache(filled_cache(TOK.encode(OPENINGS[1])), self.path)
        with open(self.path, encoding="utf-8") as f:
            self.assertEqual(f.read(), previous)
        self.assertEqual(os.listdir(self.folder.name), ["cache.json"])

    def test_the_command_line_saves_and_continues_and_refuses_in_one_line(self):
        def run(*args):
            return subprocess.run([sys.executable, os.path.join(test_kv_cache.HERE, "serving.py"),
                                   *args], capture_output=True, text=True, timeout=120)
        saved = run("zoe went to the park.", "--save-cache", self.path)
        loaded = run("zoe went to the park.", "--load-cache", self.path)
        for done in (saved, loaded):
            self.assertEqual(done.returncode, 0, done.stderr)
            self.assertTrue(done.stdout.endswith("identical to the uncached generator: yes\n"))
        self.assertIn("continued from 14 positions of", loaded.stdout)
        refused = run("tom was sad.", "--load-cache", self.path)
        self.assertEqual((refused.returncode, len(refused.stderr.splitlines())), (1, 1))
        self.assertIn("the cache is not a prefix of the prompt", refused.stderr)
        self.assertEqual(run("zoe went to the park.").returncode, 2)   # one flag is required


class RecordedSlots(unittest.TestCase):

    def test_slots_reserved_are_what_a_real_pool_takes(self):
        """The record's slots per block size, by formula, against a pool that holds the
        first five greedy stories."""
        stories = []
        for prompt in OPENINGS[:5]:
            result = generate_cached(PARAMS, TOK, prompt)
            stories.append(trace_kv.story_ids(TOK, prompt, result)[:-1])
        for size in trace_kv.BLOCK_SIZES:
            pool = serving.BlockPool(PARAMS, 5 * model.CONTEXT, size)
            for ids in stories:
                feed(PARAMS, pool.sequence(), ids)
            with self.subTest(block_size=size):
                self.assertEqual((5 * model.CONTEXT - pool.free_blocks()) * size,
                                 sum(math.ceil(len(ids) / size) * size for ids in stories))


if __name__ == "__main__":
    unittest.main()
