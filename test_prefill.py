"""One-pass prefill (prefill.py): several new tokens in one call give the lesson's rows bit
for bit, the causal mask offset by what the cache holds; refusals leave the cache as it was."""
import ast
import copy
import unittest
from unittest import mock

import verdicts
import model
import prefill
import support
from instruments import plant, recording, replacing
from kv_cache import KVCache, feed, forward_step, generate_cached
from support import (OPENINGS, PARAMS, STORIES, TOK, UNCHANGED, assert_changed,
                     assert_equal, assert_same_generation, assert_same_rows, cached_rows,
                     chunked_rows, filled_cache, snapshot)


def setUpModule():
    verdicts.set_up("prefill")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down
QuickCheck = verdicts.quick_check_case("prefill", __name__)


def is_causal_slice(node):
    """[:i + 1]: positions 0..i."""
    return (isinstance(node, ast.Slice) and node.lower is None
            and isinstance(node.upper, ast.BinOp) and isinstance(node.upper.op, ast.Add))


SQUARE_MASK = replacing(is_causal_slice, lambda node: ast.Slice(upper=ast.BinOp(
    ast.BinOp(node.upper.left, ast.Sub(), ast.Name("start", ast.Load())), ast.Add(),
    node.upper.right)))   # [:i + 1] becomes [:i - start + 1]
NO_MASK = replacing(lambda node: isinstance(node, ast.Subscript) and is_causal_slice(node.slice),
                    lambda node: node.value)

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
            params, prompt, _, label = support.random_case(index)
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
                with self.assertRaises(ValueError) as caught:
                    prefill.prefill(params, cache, token_ids, start)
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
            planted = plant(prefill, "prefill", mistake)
            if planted is None:
                self.skipTest(f"the planting site of the {name} mask is gone from "
                              f"prefill.prefill: an edit removed the slice [:i + 1]")
            with self.subTest(mask=name), mock.patch.object(prefill, "prefill", planted):
                rows = chunked_rows(PARAMS, ids, 4)
                if name.startswith("offset"):
                    assert_same_rows(self, rows, full)
                else:
                    assert_changed(self, rows, full, f"the rows with the {name} mask")


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of one-pass prefill."""

    def test_one_pass_prefill_gives_forward_step_s_rows_on_every_story(self):
        self.assertEqual(support.recorded("one_pass_prefill")["largest_logit_gap"], 0.0)


if __name__ == "__main__":
    unittest.main()
