"""One-pass prefill (prefill.py): several new tokens in one call give the lesson's rows bit
for bit, the causal mask offset by what the cache holds; refusals leave the cache as it was."""
import ast
import copy
import reprlib
import unittest

import batched
import model
import prefill
import random_models
import support
import verdicts
from instruments import is_call_of, recording, replaced, replacing, where_raised
from kv_cache import KVCache, feed, forward_step, generate_cached
from support import (OPENINGS, PARAMS, STORIES, TOK, assert_equal, assert_same_generation,
                     assert_same_rows, cached_rows, chunked_rows, filled_cache, snapshot)
from verdicts import Layer, Wrong, differ, step, where_cache_differs


LAYER = Layer("prefill", "one-pass prefill (prefill.py)", ("lesson",))


def setUpModule():
    verdicts.set_up("prefill")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down
PREFILL_HELD = 7   # the positions a cache already holds when _prefill prefills the rest


def saying_each_chunk(label):
    """A stand-in for prefill.prefill (instruments.replaced): each call first says, as the
    check's step, the positions of the chunk it prefills, so that an exception names them."""
    def stand_in(real):
        def prefill(params, cache, token_ids, start):
            step(f"{label}: prefilling the chunk of positions {start} to "
                 f"{start + len(token_ids) - 1} (expected: forward_step's rows)")
            return real(params, cache, token_ids, start)
        return prefill
    return stand_in


def quick_check():
    """The first test story (30 tokens) prefilled in chunks of 4 (the last one short), 5
    (which divide it) and the whole story at once, each into a new cache, and in chunks of
    4 after a cache already holds its first PREFILL_HELD tokens: every row and the cache
    after are forward_step's."""
    ids = TOK.encode(STORIES[0])
    step("feeding the first test story one forward_step at a time")
    reference = KVCache(PARAMS)
    expected = feed(PARAMS, reference, ids)
    for held, size in ((0, 4), (0, 5), (0, model.CONTEXT), (PREFILL_HELD, 4)):
        short = len(ids[held:]) % size
        label = (f"the first test story ({len(ids)} tokens) prefilled "
                 + (f"in chunks of {size}" + (f" (the last of {short})" if short else "")
                    if size < len(ids) else f"in one chunk (size {size})")
                 + (f" after a cache holds its first {held} tokens" if held else ""))
        step(f"{label}: feeding the first {held} one forward_step at a time")
        cache = KVCache(PARAMS)
        rows = feed(PARAMS, cache, ids[:held])
        with replaced(prefill, "prefill", saying_each_chunk(label)):
            rows += prefill.prefill_in_chunks(PARAMS, cache, ids, size)
        if len(rows) != len(expected):
            return Wrong(f"{label}: {len(rows) - held} rows from prefill, "
                         f"{len(expected) - held} expected (one for each position from {held})",
                         f"  fed: token IDs {ids}")
        why = (differ(label, rows, expected, "prefill",
                      fed=f"token IDs {ids}, {held} held, chunks of {size} from position {held}")
               or where_cache_differs(label, cache, reference, "prefill"))
        if why:
            return why
    return None


QuickCheck = verdicts.quick_check_case("prefill", __name__)


def is_causal_slice(node):
    """[:i + 1]: positions 0..i."""
    return (isinstance(node, ast.Slice) and node.lower is None
            and isinstance(node.upper, ast.BinOp) and isinstance(node.upper.op, ast.Add))


POSITIONS_FROM_ZERO = replacing(   # enumerate(..., start) becomes enumerate(...): 0, 1, ...
    lambda node: is_call_of(node, "enumerate", 2),
    lambda node: ast.Call(node.func, node.args[:1], []))
SQUARE_MASK = replacing(is_causal_slice, lambda node: ast.Slice(upper=ast.BinOp(
    ast.BinOp(node.upper.left, ast.Sub(), ast.parse("len(cache)", mode="eval").body), ast.Add(),
    node.upper.right)))   # [:i + 1] becomes [:i - len(cache) + 1]
NO_MASK = replacing(lambda node: isinstance(node, ast.Subscript) and is_causal_slice(node.slice),
                    lambda node: node.value)
OWN_POSITION_LEFT_OUT = replacing(is_causal_slice,   # [:i + 1] becomes [:i]
                                  lambda node: ast.Slice(upper=node.upper.left))
SHORT_LAST_CHUNK_DROPPED = replacing(   # range(held, len(ids), size): to len(ids) - size + 1
    lambda node: is_call_of(node, "range", 3),
    lambda node: ast.Call(node.func, [node.args[0], ast.BinOp(
        ast.BinOp(node.args[1], ast.Sub(), node.args[2]), ast.Add(), ast.Constant(1)),
        node.args[2]], []))
HELD_PREFIX_FORGOTTEN = replacing(   # range(held_prefix(cache, ids), ...): from position 0
    lambda node: is_call_of(node, "range", 3),
    lambda node: ast.Call(node.func, [ast.Constant(0), *node.args[1:]], []))

A_LATER_ROW = (r"chunks of [1-9]\d*.*, at position [1-9]\d*, logit \d+: \S+ from prefill, \S+ "
               r"expected")   # a row after position 0 differs

# prefill computes its rows with batched.forward_rows, and the mask is there: so are the
# mistakes in it (a scale forgotten is batched.exact_attention's, forward_rows' default)
MISTAKES = [
    ("the positions of every chunk counted from 0", prefill, "prefill", POSITIONS_FROM_ZERO,
     r"chunks of [1-9]\d*.*expected position [1-9]\d*, got 0"),
    ("the causal mask not offset by what the cache holds", batched, "forward_rows",
     SQUARE_MASK, A_LATER_ROW),
    ("no causal mask within a chunk", batched, "forward_rows", NO_MASK,
     r"chunks of [1-9]\d*.*, at position \d+, logit \d+: \S+ from prefill, \S+ expected"),
    ("a new position that does not attend to itself", batched, "forward_rows",
     OWN_POSITION_LEFT_OUT,
     r"chunks of [1-9]\d*.*the chunk of positions 0 to \d+.*softmax_row got no scores"),
    ("the short last chunk dropped", prefill, "prefill_in_chunks", SHORT_LAST_CHUNK_DROPPED,
     r"chunks of [1-9]\d*.*: \d+ rows from prefill, \d+ expected"),
    ("the positions the cache holds fed again", prefill, "prefill_in_chunks",
     HELD_PREFIX_FORGOTTEN, r"holds its first [1-9]\d* tokens.*expected start [1-9]\d*, got 0"),
]


class Teeth(unittest.TestCase):
    """Each mistake, planted in the real prefill.py or where its rows are computed
    (batched.forward_rows), by its syntax tree, makes the layer's quick check fail, naming
    the chunk size or the prefix held, the position and both numbers."""

    def test_each_mistake_is_named_by_the_quick_check(self):
        verdicts.assert_verdicts(self, "prefill", MISTAKES)


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
        rows = prefill.prefill(PARAMS, cache, ids[:5], 0)
        rows += [forward_step(PARAMS, cache, ids[i], i) for i in range(5, 8)]
        rows += prefill.prefill(PARAMS, cache, ids[8:15], 8)
        rows += feed(PARAMS, cache, ids[:17])
        rows += chunked_rows(PARAMS, ids, 3, cache)
        assert_same_rows(self, rows, cached_rows(PARAMS, ids))

    def test_every_chunk_size_on_random_models(self):
        for index in (0, *range(5, 100, 10)):   # case 0 has a long prompt
            params, prompt, _, label = random_models.random_case(index)
            ids = TOK.encode(prompt)
            full, _ = model.forward(params, ids)
            for size in self.CHUNKS:
                with self.subTest(chunk=size, **label):
                    assert_same_rows(self, chunked_rows(params, ids, size), full)

    def test_one_pass_generation_matches_uncached(self):
        for prompt in OPENINGS[:3]:
            for settings in ({}, {"temperature": 1.0, "seed": 4},
                             {"temperature": 1.0, "top_k": 3, "seed": 5}):
                assert_same_generation(self, PARAMS, prompt, settings, prefill.generate_one_pass,
                                       uncached=generate_cached(PARAMS, TOK, prompt, **settings))

    def test_one_pass_generation_makes_one_call_for_the_prompt(self):
        with recording(prefill, "prefill") as calls:
            result = prefill.generate_one_pass(PARAMS, TOK, OPENINGS[0])
        self.assertEqual([len(call.args[2]) for call in calls],
                         [len(TOK.encode(OPENINGS[0]))] + [1] * (len(result["steps"]) - 1))

    def test_chunks_need_a_size_and_the_cache_s_own_sequence(self):
        ids = TOK.encode(OPENINGS[0])
        for cache, fragment in ((None, "cache must be a KVCache"), ([], "cache must be a")):
            with self.subTest(cache=cache), self.assertRaisesRegex(ValueError, fragment):
                prefill.prefill_in_chunks(PARAMS, cache, ids, 2)
        for size in (0, -1, 2.0, True, None):
            with self.subTest(size=size), self.assertRaisesRegex(ValueError, "chunk size"):
                prefill.prefill_in_chunks(PARAMS, KVCache(PARAMS), ids, size)
        other = filled_cache(TOK.encode(OPENINGS[1])[:3])
        for attempt in (lambda: prefill.prefill_in_chunks(PARAMS, other, ids, 4),
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
                try:
                    prefill.prefill(params, cache, token_ids, start)
                except ValueError as refused:
                    self.assertIn(fragment, str(refused))
                except Exception as error:   # a refusal that is not the one expected
                    self.fail(f"prefill(token_ids {reprlib.repr(token_ids)}, start {start!r}) "
                              f"raised {support.raised(error)}{where_raised(error)}; expected "
                              f"a ValueError saying {fragment!r}")
                else:
                    self.fail(f"prefill accepted token_ids {reprlib.repr(token_ids)} at start "
                              f"{start!r}; expected a ValueError saying {fragment!r}")
                assert_equal(self, snapshot(cache), before,
                             "the cache (length, tokens, keys, values)")


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of one-pass prefill."""

    def test_one_pass_prefill_gives_forward_step_s_rows_on_every_story(self):
        record = support.recorded("one_pass_prefill")
        self.assertEqual((record["largest_logit_gap"], record["greedy_identical"]),
                         (0.0, len(OPENINGS)))


if __name__ == "__main__":
    unittest.main()
