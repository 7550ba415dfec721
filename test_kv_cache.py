"""The lab's claims, each as a test: the cache changes no float, it does the work the
formulas say, and every misuse is refused before anything is computed. The mistakes
planted to show that these tests have teeth are in test_kv_cache_teeth.py."""
import ast
import copy
import json
import os
import re
import subprocess
import sys
import time
import textwrap
import unittest
from unittest import mock

import generate
import kv_cache
import model
import random_models
import support
from generate import never_ending
from instruments import is_call_of, plant, recording
from kv_cache import KVCache, feed, forward_step, generate_cached
from stories import story_ids
from support import (HERE, OPENINGS, PARAMS, STORIES, TOK, assert_changed, assert_equal,
                     assert_every_row_equal, assert_same_generation, assert_same_rows,
                     cached_rows, filled_cache, generation_difference, lab_file, snapshot,
                     where_rows_differ)
from verdicts import Layer, skip_unless_sound


LAYER = Layer("lesson", "the lesson (kv_cache.forward_step against model.forward)",
              (), shown_by="Exactness")


def setUpModule():
    """Every test here runs from another folder than the lab's, as a learner might."""
    support.enter_another_folder()


tearDownModule = support.tear_down


NEXT = object()   # stands for "the cache's next position" in Misuse.assertRefused


def quick_check():
    """Every row of the first test story, fed through the cache, is model.forward's."""
    return where_rows_differ(PARAMS, TOK.encode(STORIES[0]))


class BuiltOnTheLesson(unittest.TestCase):
    """A class of tests that need the lesson's rows to be right: when Exactness's quick
    check fails, they skip (one verdict for one mistake: Exactness's)."""

    @classmethod
    def setUpClass(cls):
        skip_unless_sound("lesson")


class Exactness(unittest.TestCase):
    """The lesson's check, the command to run after any change to forward_step (a few
    seconds): python3 -m unittest test_kv_cache.Exactness
    It compares the cached path with the full pass on a few stories; the whole record
    (60 openings, every Part) is test_whole_trace's."""

    def test_every_cached_row_equals_the_full_forward_pass(self):
        longest = [t for story in STORIES for t in TOK.encode(story)][:model.CONTEXT]
        for label, ids in [(f"test story {n}", TOK.encode(story))
                           for n, story in enumerate(STORIES[:3])] + [("64 tokens", longest)]:
            assert_every_row_equal(self, PARAMS, ids, label)

    def test_cached_generation_matches_uncached(self):
        """Greedy to the end of each story; sampled at temperature 1.0, and top-k 3, for
        10 tokens each (the uncached generator's cost grows with the square of the length,
        and this is the check a learner waits for); on three openings."""
        settings = [{}, {"temperature": 1.0, "seed": 1, "max_new_tokens": 10},
                    {"temperature": 1.0, "top_k": 3, "seed": 2, "max_new_tokens": 10}]
        for prompt in OPENINGS[:2] + ["mia found a shell."]:
            for kwargs in settings:
                assert_same_generation(self, PARAMS, prompt, kwargs)

    def test_context_full_stops_at_the_same_point(self):
        never_ends = never_ending(PARAMS, TOK)
        prompt = STORIES[0].rstrip("\n") + " " + STORIES[1].rstrip("\n")
        prompt_tokens = len(TOK.encode(prompt))
        self.assertLess(prompt_tokens, model.CONTEXT)
        cached = assert_same_generation(self, never_ends, prompt, {})
        self.assertEqual(cached["stopped"], "context full")
        self.assertEqual(len(cached["steps"]), model.CONTEXT - prompt_tokens)


class RecordedTrace(unittest.TestCase):

    def test_recorded_trace(self):
        """kv-trace.json, the record of the last python3 trace_kv.py --write, holds the
        lesson's claims (that this run reproduces it is test_whole_trace's, a slow test)."""
        record = json.loads(lab_file("kv-trace.json"))
        self.assertEqual(record["largest_logit_gap_first_story"], 0.0)
        self.assertEqual(record["every_row_of_every_story"]["largest_logit_gap"], 0.0)
        self.assertEqual(record["stories"], len(STORIES))
        self.assertEqual((record["greedy_identical"], record["sampled_identical"]),
                         (len(STORIES), len(STORIES)))
        self.assertEqual([entry for entry in record["cost_by_length"]],
                         [{"positions": entry["positions"],
                           **kv_cache.work(1, entry["positions"] - 1)}
                          for entry in record["cost_by_length"]])
        self.assertEqual((record["cache_floats_per_position"],
                          record["cache_floats_full_context"]),
                         (2 * model.WIDTH, 2 * model.WIDTH * model.CONTEXT))


class RandomModels(BuiltOnTheLesson):
    """The cache is an identity for any weights, not only the trained ones: random models
    of the lab's shapes, random prompts and random settings. Case n draws everything from
    random.Random(n) (random_models.random_case(n) rebuilds it)."""

    DEFAULT_CASES = 20      # KV_LAB_RANDOM_CASES=1000 runs cases 0..999 instead
    STOP_REASONS = {"end of story", "max_new_tokens", "context full"}

    def test_cached_generation_and_every_row_equal_uncached_on_random_models(self):
        stops, longest = set(), 0

        def check(index):
            nonlocal longest
            params, prompt, settings, label = random_models.random_case(index)
            uncached = generate.generate(params, TOK, prompt, **settings)
            cached = kv_cache.generate_cached(params, TOK, prompt, **settings)
            stops.add(uncached["stopped"])
            if cached != uncached:
                return f"{label}\n" + generation_difference(params, prompt, settings, cached,
                                                           uncached)
            if label["never_ends"] and uncached["stopped"] != "context full":
                return f"{label}: stopped for {uncached['stopped']}, not context full"
            ids = story_ids(TOK, prompt, uncached)
            longest = max(longest, len(ids))
            why = where_rows_differ(params, ids)
            return why and f"{label}\n{why}"
        ran = support.check_random_cases(self, self.DEFAULT_CASES, check)
        if len(ran) >= self.DEFAULT_CASES:   # not when KV_LAB_CASE picks one
            self.assertEqual(stops, self.STOP_REASONS)   # every way a generation can end
            self.assertEqual(longest, model.CONTEXT)     # some case filled every position

    def test_a_bad_case_count_is_refused(self):
        for name, bad in (("KV_LAB_RANDOM_CASES", ("", "many", "2.5", "-1", "0")),
                          ("KV_LAB_CASE", ("", "one", "-1", "1.0"))):
            for raw in bad:
                with self.subTest(name=name, raw=raw), mock.patch.dict(os.environ, {name: raw}):
                    with self.assertRaises(ValueError) as refused:
                        support.case_numbers(self.DEFAULT_CASES)
                    self.assertIn(f"{name} must be a whole number", str(refused.exception))
                    self.assertIn(f"got {raw!r}", str(refused.exception))
        with mock.patch.dict(os.environ, {"KV_LAB_RANDOM_CASES": "1000"}):
            self.assertEqual(support.case_numbers(40), range(1000))
        with mock.patch.dict(os.environ, {"KV_LAB_RANDOM_CASES": "10"}):
            self.assertEqual(support.case_numbers(40), range(40))
        with mock.patch.dict(os.environ, {"KV_LAB_CASE": "7", "KV_LAB_RANDOM_CASES": "1000"}):
            self.assertEqual(support.case_numbers(40), [7])
        with mock.patch.dict(os.environ):
            os.environ.pop("KV_LAB_RANDOM_CASES", None)
            os.environ.pop("KV_LAB_CASE", None)
            self.assertEqual(support.case_numbers(40), range(40))


def mix_added_left_to_right(tree):
    """The statement mixed = [dot(weights, column) for column in zip(*values)] written as
    loops that add each column's products one by one, from position 0 on: an attention
    whose result depends on the order in which the cache holds its positions."""
    body = tree.body[0].body
    mixes = [at for at, node in enumerate(body) if isinstance(node, ast.Assign)
             and isinstance(node.value, ast.ListComp) and is_call_of(node.value.elt, "dot")
             and is_call_of(node.value.generators[0].iter, "zip")]
    if len(mixes) != 1:
        return 0
    mix = body[mixes[0]]
    mixed = ast.unparse(mix.targets[0])
    weights, column = map(ast.unparse, mix.value.elt.args)
    body[mixes[0]:mixes[0] + 1] = ast.parse(textwrap.dedent(f"""\
        {mixed} = []
        for {column} in {ast.unparse(mix.value.generators[0].iter)}:
            total = 0.0
            for weight, number in zip({weights}, {column}):
                total += weight * number
            {mixed}.append(total)""")).body
    return 1


class Work(unittest.TestCase):

    def setUp(self):
        self.prompt = OPENINGS[0]
        self.prompt_tokens = len(TOK.encode(self.prompt))

    def test_work_counts_match_the_rows_the_model_processes(self):
        # The row calls softmax_row once on its attention scores (greedy choices never do).
        with recording(model, "forward") as passes, recording(model, "softmax_row") as rows:
            result = generate.generate(PARAMS, TOK, self.prompt)
        expected = kv_cache.work(self.prompt_tokens, len(result["steps"]))
        self.assertEqual(sum(len(call.result[0]) for call in passes), expected["uncached_rows"])
        self.assertEqual(sum(len(call.result) for call in rows), expected["uncached_scores"])

    def test_cached_work_counts_match_the_forward_step_calls(self):
        with recording(kv_cache, "forward_step") as steps, \
                recording(kv_cache, "softmax_row") as rows:
            result = generate_cached(PARAMS, TOK, self.prompt)
        expected = kv_cache.work(self.prompt_tokens, len(result["steps"]))
        self.assertEqual(len(steps), expected["cached_rows"])
        self.assertEqual(sum(len(call.result) for call in rows), expected["cached_scores"])

    def test_work_formula_on_small_cases(self):
        # 2 prompt tokens, 3 chosen: the uncached calls see 2, 3, 4 tokens; the cache is
        # fed positions 0..3 (the last chosen token is never fed back).
        self.assertEqual(kv_cache.work(2, 3), {
            "uncached_rows": 2 + 3 + 4, "cached_rows": 4,
            "uncached_scores": (1 + 2) + (1 + 2 + 3) + (1 + 2 + 3 + 4),
            "cached_scores": 1 + 2 + 3 + 4})
        self.assertEqual(kv_cache.work(5, 0), dict.fromkeys(kv_cache.work(5, 0), 0))
        for bad in (-1, 1.0, True, None):
            with self.assertRaisesRegex(ValueError, "prompt_tokens"):
                kv_cache.work(bad, 1)

    def test_work_formula_sums_any_length_at_once(self):
        """The counts of 0 to 30 prompt and chosen tokens, summed call by call here, and
        ten million chosen tokens at once (a sum call by call takes seconds)."""
        for p in range(31):
            for g in range(31):
                calls = range(p, p + g)
                with self.subTest(prompt_tokens=p, generated_tokens=g):
                    counts = kv_cache.work(p, g)
                    self.assertEqual(counts["uncached_rows"], sum(calls))
                    self.assertEqual(counts["uncached_scores"],
                                     sum(n * (n + 1) // 2 for n in calls))
        started = time.process_time()
        self.assertEqual(kv_cache.work(0, 10 ** 7)["uncached_rows"], 10 ** 7 * (10 ** 7 - 1) // 2)
        self.assertLess(time.process_time() - started, 0.05)


class Misuse(unittest.TestCase):

    def setUp(self):
        self.ids = TOK.encode(OPENINGS[0])
        self.cache = filled_cache(self.ids)

    def assertRefused(self, fragment, *, params=None, token_id=5, position=NEXT, cache=None):
        """The call is refused with fragment in the message, leaving the cache as it was."""
        cache = self.cache if cache is None else cache
        before = snapshot(cache)
        with self.assertRaises(ValueError) as caught:
            forward_step(PARAMS if params is None else params, cache, token_id,
                         len(cache) if position is NEXT else position)
        self.assertIn(fragment, str(caught.exception))
        assert_equal(self, snapshot(cache), before,
                     "the cache (length, tokens, keys, values)")

    def test_reusing_a_cache_for_a_new_prompt(self):
        """Section 11: a cache filled with "mia was tired." and a second opening."""
        first, second = TOK.encode("mia was tired."), TOK.encode("tom was sad.")
        self.cache = filled_cache(first)
        self.assertEqual(len(first), 8)
        # Starting the new prompt at position 0 is refused...
        self.assertRefused("expected position 8, got 0", token_id=second[0], position=0)
        # ...and so are feed and generate_cached, which check the tokens the cache holds...
        before = snapshot(self.cache)
        with self.assertRaisesRegex(ValueError, "the cache holds 8 tokens that do not begin ids"):
            feed(PARAMS, self.cache, second)
        with self.assertRaisesRegex(ValueError, "the cache is not a prefix of the prompt: at "
                                                "position 0 it holds 'mia', the prompt has 'tom'"):
            generate_cached(PARAMS, TOK, "tom was sad.", cache=self.cache)
        assert_equal(self, snapshot(self.cache), before, "the cache after the refusals")
        # ...but carrying on from where the old prompt ended is a valid call with wrong
        # logits: the new tokens attend to the old prompt's keys and values.
        continued = [forward_step(PARAMS, self.cache, t, 8 + i) for i, t in enumerate(second)]
        assert_changed(self, continued, cached_rows(PARAMS, second),
                       "the rows of the reused cache")

    def test_tokens_out_of_order(self):
        n = len(self.ids)
        for position in (n + 1, n - 1, 0, -1, float(n), True, None, str(n)):
            with self.subTest(position=position):
                self.assertRefused(f"expected position {n}, got {position!r}", position=position)

    def test_cache_from_other_parameters(self):
        twin = copy.deepcopy(PARAMS)   # equal values, another model to the cache
        self.assertRefused("different parameters", params=twin)
        # Checked first: a wrong position with the wrong params names the params.
        self.assertRefused("different parameters", params=twin, position=0)

    def test_a_cache_that_is_not_a_kv_cache(self):
        for cache in (None, [], {"keys": [], "values": []}):
            with self.subTest(cache=cache):
                with self.assertRaisesRegex(ValueError, f"cache must be a KVCache, got "
                                                        f"{type(cache).__name__}"):
                    forward_step(PARAMS, cache, 5, 0)
                if cache is not None:   # generate_cached's cache=None means "a new cache"
                    with self.assertRaisesRegex(ValueError, "cache must be a KVCache"):
                        generate_cached(PARAMS, TOK, "mia", cache=cache)

    def test_position_beyond_the_table(self):
        full = KVCache(PARAMS)
        full.keys = [[0.0] * model.WIDTH for _ in range(model.CONTEXT)]
        full.values = [[0.0] * model.WIDTH for _ in range(model.CONTEXT)]
        self.assertRefused(f"beyond the {model.CONTEXT} positions", cache=full)
        self.assertRefused(f"beyond the {model.CONTEXT} positions", cache=full, token_id=-1)
        self.assertRefused(f"expected position {model.CONTEXT}, got {model.CONTEXT + 1}",
                           cache=full, position=model.CONTEXT + 1)

    def test_token_outside_the_vocabulary(self):
        for token_id in (-1, model.VOCAB_SIZE, True, False, 1.0, "3", None):
            with self.subTest(token_id=token_id):
                self.assertRefused("outside the vocabulary", token_id=token_id)

    def test_feed_refuses_what_is_not_a_cache_or_a_list_of_token_ids(self):
        for cache, ids, fragment in ((None, [1, 2], "cache must be a KVCache, got NoneType"),
                                     (self.cache, None, "ids must be a list of token IDs"),
                                     (self.cache, 5, "ids must be a list of token IDs"),
                                     (self.cache, iter(self.ids), "ids must be a list")):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                feed(PARAMS, cache, ids)

    def test_params_of_the_wrong_shape_are_refused_by_both_generators(self):
        missing = {k: v for k, v in PARAMS.items() if k != "Wq"}
        short = dict(PARAMS, b1=PARAMS["b1"][:3])
        ragged = dict(PARAMS, W_out=PARAMS["W_out"][:-1] + [PARAMS["W_out"][-1][:5]])
        for params, fragment in ((missing, r"missing \['Wq'\]"), (short, "b1 must have shape 64"),
                                 (ragged, "W_out must have shape 16 x 96"),
                                 ([], "params must be a dict")):
            with self.subTest(fragment=fragment):
                for attempt in (lambda: KVCache(params),
                                lambda: generate.generate(params, TOK, "mia"),
                                lambda: generate_cached(params, TOK, "mia")):
                    with self.assertRaisesRegex(ValueError, fragment):
                        attempt()

    def test_generate_cached_refuses_what_generate_refuses(self):
        bad = [{"prompt": ""}, {"prompt": "Mia!"}, {"prompt": "mia " * 40},
               {"temperature": -1.0}, {"temperature": float("nan")}, {"top_k": 0},
               {"top_k": True}, {"max_new_tokens": -1}, {"max_new_tokens": 2.0}]
        for kwargs in bad:
            kwargs = {"prompt": "mia found a shell.", **kwargs}
            with self.subTest(**kwargs):
                with self.assertRaises(ValueError) as uncached:
                    generate.generate(PARAMS, TOK, **kwargs)
                with self.assertRaises(ValueError) as cached:
                    generate_cached(PARAMS, TOK, **kwargs)
                self.assertEqual(str(cached.exception), str(uncached.exception))


class Reuse(BuiltOnTheLesson):
    """Deliberate reuse: forks, crops, and continuing a prompt from a cache."""

    def setUp(self):
        self.prompt = OPENINGS[0]
        self.ids = TOK.encode(self.prompt)

    def test_a_fork_never_changes_its_parent_or_sibling(self):
        parent = filled_cache(self.ids)
        before = snapshot(parent)
        left, right = parent.copy(), parent.copy()
        for fork, more in ((left, TOK.encode(" she")), (right, TOK.encode(" tom ran"))):
            for token_id in more:
                forward_step(PARAMS, fork, token_id, len(fork))
            assert_equal(self, snapshot(fork), snapshot(filled_cache(self.ids + more)), "the fork")
        assert_equal(self, snapshot(parent), before, "the parent")

    def test_crop_rewinds_the_sequence(self):
        cache = filled_cache(self.ids)
        cache.crop(3)
        assert_equal(self, snapshot(cache), snapshot(filled_cache(self.ids[:3])),
                     "the cropped cache")
        # Feeding the rest again gives the very rows of an uncropped run.
        rows = [forward_step(PARAMS, cache, t, 3 + i) for i, t in enumerate(self.ids[3:])]
        assert_same_rows(self, rows, cached_rows(PARAMS, self.ids)[3:])

    def test_crop_refuses_a_bad_length(self):
        cache = filled_cache(self.ids)
        before = snapshot(cache)
        for length in (-1, len(self.ids) + 1, 2.0, True, None, "2"):
            with self.subTest(length=length):
                with self.assertRaisesRegex(ValueError, "crop length"):
                    cache.crop(length)
                assert_equal(self, snapshot(cache), before,
                             "the cache (length, tokens, keys, values)")

    def test_a_reversed_cache_gives_the_same_logits_until_order_matters(self):
        """A cache holding its positions last first: forward_step's attention sums over the
        positions with fsum, correctly rounded in any order, and each key and value
        carries its position, so the next logits are the same bits (with the mix of the
        values added left to right, planted in forward_step, they are not). Where the
        order is used, it shows: a crop keeps the first positions held, here the last
        ones, and the continuation differs; feed and generate_cached compare the cache's
        tokens with the prompt's, and refuse it."""
        n = len(self.ids) - 1
        in_order = filled_cache(self.ids[:n])
        reversed_ = support.stored_in_reverse(self.ids[:n])

        def next_logits(cache, kept=n):   # of a copy cropped to kept positions
            fork = cache.copy()
            fork.crop(kept)
            return kv_cache.forward_step(PARAMS, fork, self.ids[kept], kept)
        assert_same_rows(self, next_logits(reversed_), next_logits(in_order),
                         "the next logits of a reversed cache and of the cache in order")
        assert_changed(self, next_logits(reversed_, 3), next_logits(in_order, 3),
                       "the logits after a crop of the reversed cache")
        with self.assertRaisesRegex(ValueError, f"holds {n} tokens that do not begin ids"):
            feed(PARAMS, reversed_, self.ids)
        with self.assertRaisesRegex(ValueError, "the cache is not a prefix of the prompt"):
            generate_cached(PARAMS, TOK, self.prompt, cache=reversed_)
        planted = plant(kv_cache, "forward_step", mix_added_left_to_right)
        if planted is None:
            self.skipTest("the mix of the values is gone from kv_cache.forward_step: an edit "
                          "removed it, so the order-dependent attention is not tried")
        with mock.patch.object(kv_cache, "forward_step", planted):
            assert_changed(self, next_logits(reversed_), next_logits(in_order),
                           "a reversed cache's next logits, the values mixed left to right")

    def test_generation_from_a_cache_equals_a_fresh_run(self):
        """An empty cache, one holding part of the prompt, and one holding all of it (the
        fresh run is generate_cached's without a cache, which Exactness shows is generate's)."""
        settings = ({}, {"temperature": 1.0, "seed": 3}, {"temperature": 1.0, "top_k": 3, "seed": 4})
        fresh = [generate_cached(PARAMS, TOK, self.prompt, **kwargs) for kwargs in settings]
        for held in (0, 1, len(self.ids) - 1, len(self.ids)):
            cache = filled_cache(self.ids[:held])
            before = snapshot(cache)
            for kwargs, result in zip(settings, fresh):
                assert_same_generation(self, PARAMS, self.prompt, kwargs, uncached=result,
                                       cache=cache)
                assert_equal(self, snapshot(cache), before,
                             f"the cache holding {held} tokens (length, tokens, keys, values)")

    def test_a_cache_whose_lists_disagree_is_refused(self):
        """A test may set .keys and .values by hand (to stand for a full cache); a cache
        whose tokens then do not match its keys is refused before anything is fed."""
        cache = filled_cache(self.ids[:3])
        cache.keys = cache.keys + [cache.keys[-1]]
        cache.values = cache.values + [cache.values[-1]]
        with self.assertRaisesRegex(ValueError, "the cache holds 4 keys but 3 tokens, where it "
                                                "must hold one of each per position"):
            generate_cached(PARAMS, TOK, self.prompt, cache=cache)

    def test_a_cache_feeds_only_the_prompt_tokens_it_lacks(self):
        for held, fed in ((0, len(self.ids)), (3, len(self.ids) - 3), (len(self.ids), 1)):
            cache = filled_cache(self.ids[:held])
            with recording(kv_cache, "forward_step") as steps:
                generate_cached(PARAMS, TOK, self.prompt, max_new_tokens=1, cache=cache)
            self.assertEqual([call.args[3] for call in steps],
                             list(range(len(self.ids) - fed, len(self.ids))))

    def test_generation_refuses_a_cache_it_cannot_continue(self):
        other = filled_cache(TOK.encode(OPENINGS[1]))
        longer = filled_cache(self.ids + TOK.encode(" she"))
        foreign = KVCache(copy.deepcopy(PARAMS))
        position = next(i for i, (a, b) in enumerate(zip(other.tokens, self.ids)) if a != b)
        for cache, fragment in ((other, f"not a prefix of the prompt: at position {position}"),
                                (longer, "more than the prompt's"),
                                (foreign, "different parameters")):
            before = snapshot(cache)
            with self.subTest(fragment=fragment):
                with self.assertRaisesRegex(ValueError, fragment):
                    generate_cached(PARAMS, TOK, self.prompt, cache=cache)
                assert_equal(self, snapshot(cache), before,
                             "the cache (length, tokens, keys, values)")

    def test_one_cache_per_sequence_interleaved(self):
        """Like a server: several sequences advance one greedy step each in turn, each
        with its own cache, and each ends as it would alone."""
        prompts = OPENINGS[:4]
        running = []
        for prompt in prompts:
            ids = TOK.encode(prompt)
            cache = filled_cache(ids[:-1])
            logits = forward_step(PARAMS, cache, ids[-1], len(ids) - 1)
            running.append({"ids": ids, "cache": cache, "logits": logits})
        for _ in range(12):
            for seq in running:
                token_id = seq["logits"].index(max(seq["logits"]))
                seq["ids"].append(token_id)
                seq["logits"] = forward_step(PARAMS, seq["cache"], token_id, len(seq["ids"]) - 1)
        for prompt, seq in zip(prompts, running):
            alone = generate_cached(PARAMS, TOK, prompt, max_new_tokens=12)
            self.assertEqual(TOK.decode(seq["ids"]), alone["text"])
            self.assertEqual(len(alone["steps"]), 12)


class Playground(BuiltOnTheLesson):

    def run_cli(self, *args):
        """The playground, run from another folder."""
        return subprocess.run([sys.executable, os.path.join(HERE, "kv_cache.py"), *args],
                              capture_output=True, text=True, timeout=120)

    def test_playground_compares_the_two_paths(self):
        done = self.run_cli("mia found a shell.", "--temperature", "1.0", "--seed", "3",
                            "--max-new-tokens", "8")
        self.assertEqual(done.returncode, 0, done.stderr)
        result = generate.generate(PARAMS, TOK, "mia found a shell.", temperature=1.0, seed=3,
                                   max_new_tokens=8)
        counts = kv_cache.work(len(TOK.encode("mia found a shell.")), len(result["steps"]))
        lines = done.stdout.splitlines()
        self.assertEqual(lines[0], result["text"].rstrip("\n"))
        self.assertIn(f"stopped: {result['stopped']}", lines)
        self.assertRegex(done.stdout, rf"uncached: +{counts['uncached_rows']:,} rows, "
                                      rf"+{counts['uncached_scores']:,} attention scores")
        self.assertRegex(done.stdout, rf"cached: +{counts['cached_rows']:,} rows, "
                                      rf"+{counts['cached_scores']:,} attention scores")
        self.assertEqual(lines[-1], "identical: yes")

    def test_show_watches_every_step_and_ends_with_the_plain_run_s_totals(self):
        prompt = "mia was sad."
        shown, plain = self.run_cli("--show", prompt), self.run_cli(prompt)
        self.assertEqual(shown.returncode, 0, shown.stderr)
        lines = shown.stdout.splitlines()
        self.assertEqual(lines[-1], "identical: yes", "the two generators differ (the tests "
                                                      "of Exactness say where)")
        self.assertEqual([line for line in lines if len(line) > 80], [])
        self.assertNotIn("\x1b", shown.stdout)   # no escape codes: it reads the same piped
        def without_times(lines):
            return [re.sub(r"[\d.]+ s$", "", line) for line in lines[-3:]]
        self.assertEqual(without_times(lines), without_times(plain.stdout.splitlines()))
        result = kv_cache.generate_cached(PARAMS, TOK, prompt)   # generate's: "identical: yes"
        ids = story_ids(TOK, prompt, result)[:-1]    # every position fed
        _, saved = model.forward(PARAMS, ids)
        table = lines[lines.index(next(l for l in lines if l.startswith("pos token"))) + 1:]
        columns = (slice(0, 3), slice(4, 12), slice(13, 17), slice(18, 26), slice(27, 33),
                   slice(35, 43), slice(44, None))   # pos token held uncached cached chose ...
        table = [[line[c].strip() for c in columns] for line in table[:len(ids)]]
        first_choice = len(TOK.encode(prompt)) - 1
        for position, cells in enumerate(table):
            with self.subTest(position=position):
                self.assertEqual(cells[:2], [str(position), repr(TOK.vocab[ids[position]])])
                self.assertEqual(cells[2], str(position + 1))          # held: one more a step
                self.assertEqual(cells[3], str(position + 1) if position >= first_choice else "-")
                self.assertEqual(cells[4], "1")
                weights = saved.weights[position]
                self.assertEqual(cells[-1], "".join(
                    kv_cache.SHADES[min(8, int(w / max(weights) * 9))] for w in weights))
        counts = kv_cache.work(first_choice + 1, len(result["steps"]))
        self.assertEqual(sum(int(c[3]) for c in table if c[3] != "-"), counts["uncached_rows"])
        self.assertEqual(len(table), counts["cached_rows"])
        self.assertEqual([c[5] for c in table[first_choice:]],
                         [repr(step["token"]) for step in result["steps"]])

    def test_playground_refuses_bad_arguments_in_one_line(self):
        for args, fragment in ((["mia!"], "unknown character"),
                               (["mia", "--top-k", "0"], "top_k"),
                               (["mia", "--max-new-tokens", "-2"], "max_new_tokens")):
            with self.subTest(args=args):
                done = self.run_cli(*args)
                self.assertEqual(done.returncode, 1)
                self.assertNotIn("Traceback", done.stderr)
                self.assertEqual(len(done.stderr.strip().splitlines()), 1, done.stderr)
                self.assertIn(fragment, done.stderr)
        done = self.run_cli("mia", "--temprature", "1")
        self.assertEqual(done.returncode, 2)
        self.assertNotIn("Traceback", done.stderr)


if __name__ == "__main__":
    unittest.main()
