"""The paged cache (paged.py): a sequence in a pool of blocks gives a KVCache's rows bit for
bit, shares full blocks and copies on write; the pool's counts stay consistent. What it
refuses, and its answers about room, are test_paged_refusals'."""
import ast
import math
import os
import random
import unittest

import kv_cache
import model
import paged
import support
import verdicts
from instruments import is_call_of, replacing
from kv_cache import feed, forward_step, generate_cached
from stories import story_ids
from support import (OPENINGS, PARAMS, STORIES, TOK, assert_equal, assert_same_generation,
                     assert_same_rows, cached_rows, chunked_rows, filled_cache, snapshot)
from verdicts import Layer, STEPS, Wrong, excerpt, step


LAYER = Layer("paged", "the paged cache (paged.py)", ("lesson", "prefill"))


def setUpModule():
    """The paged cache's quick check (quick_check), before any test of this
    module: sequences written, forked, found by their prefix, freed and found again,
    compared slot by slot with a KVCache fed the same tokens. If it fails, its QuickCheck
    names the sequence, the block and the position where a mistake in the pool shows, and
    no other test runs: they use feed and generate_cached, which see only a sequence that
    disagrees with itself (and would blame the caller)."""
    verdicts.set_up("paged")


tearDownModule = support.tear_down
def where_sequence_differs(label, seq, tokens):
    """None if the paged sequence seq holds, position by position, what a KVCache fed
    tokens holds, where its block table says: position p in block table[p // block_size],
    slot p % block_size. Else a Wrong naming the position, the block and the slot, and
    what differs there; its detail, the tokens, the table and both values."""
    reference, size = filled_cache(tokens), seq.pool.block_size
    fed = f"  {label}: token IDs {tokens}, block table {seq.table}"
    if seq.length != len(reference):
        return Wrong(f"{label} holds {seq.length} positions, where {len(reference)} were "
                     f"written", fed)
    for position in range(len(reference)):
        block_id, slot = seq.table[position // size], position % size
        block = seq.pool.blocks[block_id]
        where = f"{label}, position {position} (block {block_id}, slot {slot})"
        if slot >= len(block.tokens):
            return Wrong(f"{where}: the block holds only {len(block.tokens)} positions", fed)
        for part in ("tokens", "keys", "values"):
            held, wanted = getattr(block, part)[slot], getattr(reference, part)[position]
            if held != wanted:
                return Wrong(f"{where}: its {part[:-1]} is not the one a KVCache fed the same "
                             f"tokens holds", f"{fed}\n  the block holds: {excerpt(held)}\n"
                                              f"  a KVCache:       {excerpt(wanted)}")
    return None


def _write(seq, tokens):
    """Writes seq on, one forward_step a position, until it holds tokens; seq."""
    for token_id in tokens[len(seq):]:
        kv_cache.forward_step(PARAMS, seq, token_id, len(seq))
    return seq


def _new_sequence(pool, label, tokens, hits):
    """A new sequence of pool for tokens, written; a LookupError if it finds another number
    of cached blocks than hits, or then holds other than a KVCache fed tokens holds."""
    step(f"starting {label} with pool.sequence({tokens})")
    seq = pool.sequence(tokens)
    if len(seq.table) != hits:
        raise LookupError(f"{label} found {len(seq.table)} cached block"
                          f"{'s' * (len(seq.table) != 1)} (table {seq.table}), where "
                          f"{hits} hold its first tokens")
    step(f"writing {label}, one forward_step a position")
    why = where_sequence_differs(label, _write(seq, tokens), tokens)
    if why:
        raise LookupError(why)
    return seq


def _where_sequences_differ(sequences):
    """None if each sequence (label: (seq, tokens)) holds what a KVCache fed its tokens
    holds; else the first one's Wrong (where_sequence_differs)."""
    for label, (seq, tokens) in sequences.items():
        why = where_sequence_differs(label, seq, tokens)
        if why:
            return why
    return None


def _where_a_block_miscounts(pool, live):
    """None if each block of pool counts the tables of the live sequences (label: (seq,
    tokens)) that hold it; else a Wrong naming the block and the tables."""
    for block_id, block in enumerate(pool.blocks):
        held = [label for label, (seq, _) in live.items() if block_id in seq.table]
        if block.ref_count != len(held):
            return Wrong(f"block {block_id} counts {block.ref_count} tables holding it, where "
                         f"{len(held)} do ({', '.join(held) or 'none'})",
                         "  " + "\n  ".join(f"{label}: block table {seq.table}"
                                            for label, (seq, _) in live.items()))
    return None


def quick_check():
    """Sequences of one pool (blocks of 4) written one forward_step at a time: a parent of
    10 positions; its fork, writing into the partly filled block they share; the parent
    going on to 12; the fork cropped into a block it shares and written on again; a new sequence finding the parent's first two blocks by their prefix;
    one opening with the tokens of the parent's second block (found nowhere: a block is
    found by every token from position 0, not by its own); and, once the parent and the
    fork are freed, one finding their three full blocks again, as a preempted request
    readmitted does; then one taking every free block (the cached ones evicted), freed,
    and the fork's tokens again: only the blocks still held are found. None if each holds,
    slot by slot, what a KVCache fed its tokens holds, each found as many blocks as hold
    its first tokens, and each block counts the tables that hold it; else a Wrong naming
    the sequence, the position and the block."""
    ids = TOK.encode(OPENINGS[0] + " she was")
    pool = paged.BlockPool(PARAMS, 16, 4)
    moved = ids[4:8] + ids[:4]
    try:
        parent = _new_sequence(pool, "the parent", ids[:10], 0)   # blocks of 4, 4 and 2
        step("forking the parent, and writing the fork into the block they share")
        fork = _write(parent.copy(), ids[:12])
        step("writing the parent on, after its fork wrote")
        _write(parent, ids[:10] + TOK.encode(" tom"))
        step("cropping the fork to 6 positions (into its second block, shared), and "
             "writing it on to 12 again")
        fork.crop(6)
        _write(fork, ids[:12])
        live = {"the prefix hit": (_new_sequence(pool, "the prefix hit", ids[:10], 2), ids[:10]),
                "the sequence opening with the second block's tokens": (
                    _new_sequence(pool, "the sequence opening with the second block's tokens",
                                  moved, 0), moved)}
        why = _where_sequences_differ({"the parent": (parent, ids[:10] + TOK.encode(" tom")),
                                       "the fork": (fork, ids[:12])})
        if why:
            return why
        step("freeing the parent and the fork")
        parent.free()
        fork.free()
        tokens = ids[:10] + TOK.encode(" tom")
        live["the readmitted parent"] = (_new_sequence(pool, "the readmitted parent", tokens, 3),
                                         tokens)
        other = list(reversed(ids)) * 4   # tokens no cached block holds from position 0
        other = other[:pool.block_size * pool.free_blocks()]
        label = "a sequence taking every free block (the cached ones evicted)"
        taking = _new_sequence(pool, label, other, 0)
        step(f"freeing {label}")
        taking.free()
        label = "the fork's tokens after its own block was evicted"
        live[label] = (_new_sequence(pool, label, ids[:12], 2), ids[:12])
    except LookupError as wrong:                     # a wrong hit, or a wrong slot
        why = wrong.args[0]
        return why if isinstance(why, Wrong) else Wrong(why, f"  while {STEPS[-1]}")
    except ValueError as refused:                   # the pool's own guards
        return Wrong(f"{STEPS[-1]}: {refused}")
    return _where_sequences_differ(live) or _where_a_block_miscounts(pool, live)


QuickCheck = verdicts.quick_check_case("paged", __name__)


ROOM_OFF_BY_ONE = replacing(   # block_size - in the last block becomes block_size - ... - 1
    lambda node: (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)
                  and isinstance(node.left, ast.Attribute) and node.left.attr == "block_size"),
    lambda node: ast.BinOp(node, ast.Sub(), ast.Constant(1)))
NO_COPY_ON_WRITE = replacing(   # the shared last block is written as if it were its own
    lambda node: (isinstance(node, ast.If) and isinstance(node.test, ast.Call)
                  and isinstance(node.test.func, ast.Attribute)
                  and node.test.func.attr == "_last_block_is_shared"),
    lambda node: ast.If(ast.Constant(False), node.body, node.orelse))
WRONG_BLOCK_FOUND = replacing(   # the holder found, plus 1: the next block's id
    lambda node: (is_call_of(node, "min") and isinstance(node.args[0], ast.Name)
                  and node.args[0].id == "holders"),
    lambda node: ast.BinOp(node, ast.Add(), ast.Constant(1)))


def _block_s_own_tokens(source, replacement):
    """A block looked up (or indexed) by its own block_size tokens, not by every token
    from position 0: source (the expression of the whole prefix) becomes replacement."""
    return replacing(lambda node: ast.unparse(node) == source,
                     lambda node: ast.parse(replacement, mode="eval").body)


class PagedTeeth(unittest.TestCase):
    """Mistakes planted in the real paged.py (by its syntax tree): the pool's quick check
    names the sequence, the position and the block where each shows."""

    MISTAKES = [
        ("an off-by-one in the room left in the last block", paged.PagedSequence,
         "_room_in_last_block", ROOM_OFF_BY_ONE),
        ("a shared block written without a copy", paged.PagedSequence, "extend",
         NO_COPY_ON_WRITE),
        ("a prefix hit that returns the wrong block", paged.BlockPool, "find",
         WRONG_BLOCK_FOUND),
        ("a block found by its own tokens", paged.BlockPool, "find",
         _block_s_own_tokens("tuple(ids[:end])", "tuple(ids[end - self.block_size:end])")),
        ("a full block indexed by its own tokens", paged.BlockPool, "append",
         _block_s_own_tokens("tuple(prefix)", "tuple(prefix[-self.block_size:])")),
        ("a cached block taken for a new table left in the prefix index", paged.BlockPool,
         "take", replacing(lambda node: isinstance(node, ast.stmt) and ast.unparse(node)
                           == "self._unindex(block_id)", lambda node: ast.Pass())),
        ("a crop that keeps only the blocks it fills whole (floor, not ceiling)",
         paged.PagedSequence, "_forget_from",
         replacing(lambda node: isinstance(node, ast.Call) and ast.unparse(node)
                   == "math.ceil(length / self.pool.block_size)",
                   lambda node: ast.parse("length // self.pool.block_size", mode="eval").body)),
        ("a freed full block emptied, though it stays findable", paged.BlockPool, "release",
         replacing(lambda node: isinstance(node, ast.Compare) and ast.unparse(node)
                   == "block.prefix is None", lambda node: ast.Constant(True)))]

    def test_each_mistake_names_its_sequence_block_and_position(self):
        verdicts.assert_verdicts(self, "paged", [
            (what, owner, method, mistake, r"(the [a-z' ]+, position \d+ \(block \d+, slot "
                                           r"\d+\)|block \d+, slot \d+|found \d+ cached block)")
            for what, owner, method, mistake in self.MISTAKES])


class Paged(unittest.TestCase):
    """A pool of blocks shared by sequences: forks, prefix reuse, free, refusals."""

    def setUp(self):
        self.ids = TOK.encode(STORIES[0])

    def test_a_paged_sequence_gives_the_rows_of_a_kv_cache(self):
        expected = cached_rows(PARAMS, self.ids)
        for size in (1, 3, 4, 16, model.CONTEXT):
            pool = paged.BlockPool(PARAMS, model.CONTEXT, size)
            assert_same_rows(self, feed(PARAMS, pool.sequence(), self.ids), expected,
                             f"blocks of {size}, fed one token at a time: the rows")
            assert_same_rows(self, chunked_rows(PARAMS, self.ids, 5, pool.sequence()),
                             expected, f"blocks of {size}, prefilled 5 at a time: the rows")

    def test_generation_from_a_paged_sequence_equals_a_fresh_run_and_frees_its_copy(self):
        pool = paged.BlockPool(PARAMS, 40, 4)
        prompt = OPENINGS[0]
        seq = pool.sequence()
        feed(PARAMS, seq, TOK.encode(prompt))
        free = pool.free_blocks()
        for settings in ({}, {"temperature": 1.0, "seed": 2}):
            assert_same_generation(self, PARAMS, prompt, settings, cache=seq)
            self.assertEqual(pool.free_blocks(), free)

    def test_a_fork_shares_every_block_until_one_side_writes(self):
        pool = paged.BlockPool(PARAMS, 40, 4)
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
        pool = paged.BlockPool(PARAMS, 40, 4)
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

    def test_a_block_table_out_of_order_gives_the_same_logits_until_a_fork_is_cropped(self):
        """A sequence whose block table lists its blocks last first gives forward_step the
        same next logits, bit for bit (attention reads the positions in any order). A
        fork (copy) keeps the table's order, so cropping it keeps the wrong blocks and
        the continuation differs; generate_cached, which forks it, refuses it first: its
        tokens do not begin the prompt."""
        ids = TOK.encode(OPENINGS[0])
        pool = paged.BlockPool(PARAMS, 20, 4)
        in_order = pool.sequence()
        feed(PARAMS, in_order, ids[:12])           # three full blocks
        out_of_order = in_order.copy()
        out_of_order.table.reverse()

        def next_logits(sequence, kept):
            fork = sequence.copy()
            fork.crop(kept)
            logits = forward_step(PARAMS, fork, ids[kept], kept)
            fork.free()
            return logits
        assert_same_rows(self, next_logits(out_of_order, 12), next_logits(in_order, 12),
                         "the next logits of a table out of order and of one in order")
        self.assertEqual(out_of_order.copy().tokens, ids[8:12] + ids[4:8] + ids[:4])
        support.assert_changed(self, next_logits(out_of_order, 4), next_logits(in_order, 4),
                               "the logits after a crop of a fork out of order")
        with self.assertRaisesRegex(ValueError, "the cache is not a prefix of the prompt"):
            generate_cached(PARAMS, TOK, OPENINGS[0], cache=out_of_order)

    def test_a_cut_block_left_to_one_sequence_is_cut_before_it_writes(self):
        """The fork crops into a block it shares; the parent then frees it, so the fork
        holds it alone, longer than its own positions: it must not write after them."""
        pool = paged.BlockPool(PARAMS, 40, 4)
        parent = pool.sequence()
        feed(PARAMS, parent, self.ids[:8])
        fork = parent.copy()
        fork.crop(6)
        parent.free()
        assert_same_rows(self, feed(PARAMS, fork, self.ids), cached_rows(PARAMS, self.ids)[6:])
        assert_equal(self, snapshot(fork), snapshot(filled_cache(self.ids)), "the fork")

    def test_prefix_reuse_takes_full_blocks_and_equals_a_fresh_run(self):
        pool = paged.BlockPool(PARAMS, 60, 4)
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
        pool = paged.BlockPool(PARAMS, 10, 4)
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
        pool = paged.BlockPool(PARAMS, 10, 4)
        first, second = pool.sequence(), pool.sequence()
        feed(PARAMS, first, self.ids[:8])
        feed(PARAMS, second, self.ids[:8])           # the same tokens, in blocks of its own
        self.assertEqual(len(pool.prefix_index[tuple(self.ids[:8])]), 2)
        first.free()
        while pool.evictions < 2:                    # the first sequence's blocks go
            pool.take()
        self.assertEqual(pool.sequence(self.ids[:8]).table, second.table)

    def test_random_operations_keep_every_sequence_and_the_pool_consistent(self):
        """Random runs of new sequences (with prefix reuse), feeds, forks, crops and frees
        on small pools (a feed appends what forward_step would, the keys and values of a
        KVCache fed the story: in this model a position's key and value depend only on its
        token and position): after every operation each live sequence holds exactly the
        tokens, keys and values a KVCache fed the same tokens holds, the pool counts every
        table holding each block, frees exactly the blocks nobody holds, and indexes only
        full blocks under the tokens they and the blocks before them hold."""
        stories = [tuple(TOK.encode(story)) for story in STORIES[:4]]
        reference = {story: filled_cache(list(story)) for story in stories}

        def trial(number):
            rng = random.Random(number)
            pool = paged.BlockPool(PARAMS, rng.randint(3, 16), rng.choice((1, 2, 3, 4)))
            live = []                                    # [sequence, its story]
            for _ in range(20):
                operation = rng.choice(("new", "feed", "feed", "fork", "crop", "free"))
                pair = rng.choice(live) if live else None
                try:
                    if operation == "new" or pair is None:
                        story = rng.choice(stories)
                        live.append([pool.sequence(list(story[:rng.randint(0, 20)])), story])
                    elif operation == "feed":   # what forward_step appends, one at a time
                        seq, story = pair
                        for p in range(len(seq), rng.randint(len(seq), len(story))):
                            seq.append(story[p], reference[story].keys[p],
                                       reference[story].values[p])
                    elif operation == "fork":
                        live.append([pair[0].copy(), pair[1]])
                    elif operation == "crop":
                        pair[0].crop(rng.randint(0, len(pair[0])))
                    else:
                        pair[0].free()
                        live.remove(pair)
                except ValueError as refused:
                    self.assertIn("out of blocks", str(refused))
                label = f"trial {number}, after {operation}"
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
        support.check_random_cases(self, 100, trial)

    def test_a_prefix_hit_shares_a_held_block_before_a_cached_one(self):
        """Two full blocks hold the same tokens, one cached (nobody holds it), one held:
        a new sequence of those tokens shares the held one, and the cached one stays on
        the free list."""
        pool = paged.BlockPool(PARAMS, 4, 4)
        ids = TOK.encode(OPENINGS[0])[:4]
        first = pool.sequence()
        feed(PARAMS, first, ids)
        cached = first.table[0]
        first.free()                                 # its block stays cached
        second = pool.sequence()                     # no prefix given: a block of its own
        feed(PARAMS, second, ids)
        self.assertEqual(len(pool.prefix_index[tuple(ids)]), 2)
        third = pool.sequence(ids)
        self.assertEqual(third.table, second.table)
        self.assertIn(cached, pool.free_list)


class RecordedSlots(unittest.TestCase):

    def test_slots_reserved_are_what_a_real_pool_takes(self):
        """The record's slots per block size, by formula, against a pool that holds the
        first five greedy stories."""
        stories = []
        for prompt in OPENINGS[:5]:
            result = generate_cached(PARAMS, TOK, prompt)
            stories.append(story_ids(TOK, prompt, result)[:-1])
        for size in paged.BLOCK_SIZES:
            pool = paged.BlockPool(PARAMS, 5 * model.CONTEXT, size)
            for ids in stories:
                feed(PARAMS, pool.sequence(), ids)
            with self.subTest(block_size=size):
                self.assertEqual((5 * model.CONTEXT - pool.free_blocks()) * size,
                                 sum(math.ceil(len(ids) / size) * size for ids in stories))


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of the paged cache."""

    def test_every_opening_continued_from_a_shared_prefix_is_generate_s(self):
        self.assertEqual(support.recorded("paged")["prefix_sharing_blocks_of_4"]
                         ["greedy_identical"], len(OPENINGS))


if __name__ == "__main__":
    unittest.main()
