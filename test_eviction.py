"""The evicting caches (eviction.py): each keeps what its kind chooses, as its docstring
says, worked out here plainly; each row equals the full pass with that row's reads as its
mask; what cannot be done with a cache that drops positions is refused, saying why."""
import ast
import contextlib
import functools
import math
import re
import unittest
from math import fsum
from types import SimpleNamespace
from unittest import mock

import eviction
import model
import support
import verdicts
from instruments import plant, replacing
from kv_cache import KVCache, feed, generate_cached
from model import SCALE, dot, softmax_row
from stories import story_ids
from support import OPENINGS, PARAMS, STORIES, TOK, cached_rows
from verdicts import Layer, Wrong, differ, step


LAYER = Layer("eviction", "the evicting caches (eviction.py)", ("lesson", "lossy"))


def setUpModule():
    verdicts.set_up("eviction")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down


@functools.lru_cache(maxsize=None)   # once per story: every planting here is in eviction.py
def _full_pass(ids):
    return model.forward(PARAMS, list(ids))[1]


def expected_reads(kind, ids, budget, prompt_tokens=None):
    """The positions each row of ids reads in a cache of kind with budget, worked out
    plainly from eviction.py's docstrings: a row reads the positions held and its own;
    after it, while budget or more are held, the one of lowest score (the earliest of
    equals) among all but the recent - 1 latest goes. Heavy hitters: a score is the weight
    received, summed over the rows; key norms: minus the key's squared norm; SnapKV: none
    go before the end of the prompt, then the budget - window prompt positions before its
    last window rows with the most mean weight from them, averaged over 3 neighbours (0
    past the edges), stay for good, the rest of the budget being a window. The weights are
    the full pass's queries against its keys (a key does not depend on the mask here)."""
    saved = _full_pass(tuple(ids))
    recent = budget // 2 if kind != "SnapKV" else budget
    held, score, reads, rows = [], {}, [], []
    for i in range(len(ids)):
        held.append(i)
        score[i] = -fsum(x * x for x in saved.k[i]) if kind == "key norms" else 0.0
        reads.append(list(held))
        weights = softmax_row([dot(saved.q[i], saved.k[j]) * SCALE for j in held])
        if kind == "heavy hitters":
            for j, w in zip(held, weights):
                score[j] += w
        if kind == "SnapKV":
            rows.append(dict(zip(held, weights)))
            if i + 1 < prompt_tokens:
                continue
            if i + 1 == prompt_tokens:
                window = rows[-4:]
                before = i + 1 - len(window)
                mean = [sum(row[p] for row in window) / len(window) for p in range(before)]
                pooled = {p: sum(mean[q] for q in (p - 1, p, p + 1) if 0 <= q < before) / 3
                          for p in range(before)}
                chosen = sorted(pooled, key=lambda p: (-pooled[p], p))[:budget - 4]
                score = {p: 1.0 if p in chosen else 0.0 for p in held}
                recent = budget - len(chosen)
        while len(held) >= budget:
            older = held[:len(held) - (recent - 1)]
            held.remove(min(older, key=lambda p: (score[p], p)))
    return reads


CASES = [(kind, budget) for kind, _ in eviction.KINDS for budget in (6, 12)]


def make(kind, budget, prompt_tokens):
    cache = dict(eviction.KINDS)[kind]
    return cache(PARAMS, budget, prompt_tokens) if kind == "SnapKV" else cache(PARAMS, budget)


def quick_check():
    """The first test story (30 tokens; its prompt, for SnapKV, its first 14) fed through
    each kind of evicting cache at budgets of 6 and 12: each row's reads are
    expected_reads', and each row is model.forward's with those reads as its mask."""
    ids = TOK.encode(STORIES[0])
    for kind, budget in CASES:
        label = f"the first test story through a {kind} cache of {budget} positions"
        step(f"{label}: feeding it")
        cache = make(kind, budget, 14)
        rows = feed(PARAMS, cache, ids)
        wanted = expected_reads(kind, ids, budget, 14)
        for row, (got, expected) in enumerate(zip(cache.reads, wanted)):
            if got != expected:
                return Wrong(f"{label}: row {row} read positions {got}, {expected} expected",
                             f"token IDs {ids}; the rows before read {wanted[:row]}")
        step(f"{label}: its rows against the full pass with its reads as the mask")
        why = differ(label, rows, model.forward(PARAMS, ids, wanted.__getitem__)[0],
                     "the cache", fed=f"token IDs {ids}; each row's mask: its expected reads")
        if why:
            return why
    return None


QuickCheck = verdicts.quick_check_case("eviction", __name__)


def method(name):
    return lambda node: isinstance(node, ast.Attribute) and node.attr == name


SCORES_OF_THE_LAST_ROW = replacing(   # held + w becomes w: the last row's weight alone
    lambda node: (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
                  and getattr(node.left, "id", None) == "held"),
    lambda node: node.right)
A_RECENT_WINDOW_TOO_SHORT = replacing(   # recent - 1 latest kept becomes recent - 2
    lambda node: (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)
                  and method("recent")(node.left) and getattr(node.right, "value", None) == 1),
    lambda node: ast.BinOp(node.left, ast.Sub(), ast.Constant(2)))
NEGATION_DROPPED = replacing(   # -fsum(x * x ...) becomes fsum(...); -pooled[p], pooled[p]
    lambda node: isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub),
    lambda node: node.operand)
ROW_READ = r"cache of \d+ positions: row \d+ read positions \[[\d, ]+\], \[[\d, ]+\] expected"
MISTAKES = [
    ("heavy hitters scored by the last row's weights alone, not summed over every row",
     eviction.HeavyHitterCache, "score", SCORES_OF_THE_LAST_ROW,
     "heavy hitters " + ROW_READ),
    ("a recent window one position short", eviction.EvictingCache, "victim",
     A_RECENT_WINDOW_TOO_SHORT, "heavy hitters " + ROW_READ),
    ("the keys of largest norm kept, not the smallest", eviction.KeyNormCache, "first_score",
     NEGATION_DROPPED, "key norms " + ROW_READ),
    ("SnapKV keeping the prompt positions its window attended to least",
     eviction, "snapkv_choice", NEGATION_DROPPED, "SnapKV " + ROW_READ),
]


class Teeth(unittest.TestCase):
    """Each mistake, planted in the real eviction.py (by its syntax tree), makes the
    layer's quick check fail, naming the kind, its budget and the row that reads
    otherwise."""

    def test_each_mistake_is_named_by_the_quick_check(self):
        verdicts.assert_verdicts(self, "eviction", MISTAKES)


class Eviction(unittest.TestCase):

    IDS = TOK.encode(STORIES[1])

    def test_every_kind_reads_at_most_its_budget_and_is_the_masked_pass(self):
        """At every budget the trace runs, on the second test story, beyond its prompt."""
        for kind, _ in eviction.KINDS:
            for budget in eviction.BUDGETS:
                with self.subTest(kind=kind, budget=budget):
                    cache = make(kind, budget, 10)
                    rows = feed(PARAMS, cache, self.IDS)
                    self.assertEqual(cache.reads, expected_reads(kind, self.IDS, budget, 10))
                    self.assertLessEqual(max(map(len, cache.reads[10:])), budget)
                    self.assertEqual(rows, model.forward(PARAMS, self.IDS,
                                                         cache.reads.__getitem__)[0])

    def test_a_budget_the_story_never_fills_is_the_exact_cache(self):
        for kind, _ in eviction.KINDS:
            with self.subTest(kind=kind):
                rows = feed(PARAMS, make(kind, 64, 10), self.IDS)
                self.assertEqual(rows, feed(PARAMS, KVCache(PARAMS), self.IDS))

    def test_generation_through_an_evicting_cache_and_its_fork(self):
        """generate_cached takes an evicting cache (it copies it); a fork goes on as the
        original would, and leaves it as it was."""
        cache = eviction.HeavyHitterCache(PARAMS, 8)
        feed(PARAMS, cache, self.IDS[:12])
        reads, kept = [list(r) for r in cache.reads], list(cache.kept)
        fork = cache.copy()
        feed(PARAMS, fork, self.IDS[:20])
        self.assertEqual((cache.reads, cache.kept), (reads, kept))
        again = cache.copy()
        feed(PARAMS, again, self.IDS[:20])
        self.assertEqual((again.reads, again.kept), (fork.reads, fork.kept))
        prompt = TOK.decode(self.IDS[:12])
        result = generate_cached(PARAMS, TOK, prompt, 5, cache=eviction.HeavyHitterCache(PARAMS, 64))
        self.assertEqual(result, generate_cached(PARAMS, TOK, prompt, 5))

    def test_what_needs_every_position_refuses_an_evicting_cache_saying_why(self):
        import batched
        import cache_files
        import prefill
        import serving
        import speculative
        cache = eviction.HeavyHitterCache(PARAMS, 8)
        feed(PARAMS, cache, self.IDS[:10])
        before = (list(cache.tokens), list(cache.kept), [list(r) for r in cache.reads])
        for what, call, fragment in (
                ("a batch", lambda: batched.forward_rows(PARAMS, [(cache, self.IDS[10], 10)]),
                 "drops positions, and a batched row attends to every one"),
                ("prefill", lambda: prefill.prefill(PARAMS, cache, self.IDS[10:12], 10),
                 "a HeavyHitterCache drops some"),
                ("speculative decoding", lambda: speculative.generate_speculative(
                    PARAMS, TOK, TOK.decode(self.IDS[:11]), 3, cache=cache), "drops positions"),
                ("a cache file", lambda: cache_files.save_cache(cache, "unused.json"),
                 "stores_exactly"),
                ("a crop part of the way", lambda: cache.crop(5),
                 "cannot be rewound part of the way"),
                ("serving, which takes a pool", lambda: serving.serve(
                    PARAMS, TOK, [{"prompt": "mia"}], cache, 1), "BlockPool")):
            with self.subTest(what=what):
                with self.assertRaisesRegex(ValueError, fragment):
                    call()
                self.assertEqual((cache.tokens, cache.kept, cache.reads), before)

    def test_a_crop_to_its_own_length_changes_nothing(self):
        """Cropping to the positions fed (what speculative decoding does when it accepts
        every draft) keeps what each kind kept: its next row reads and gives what an
        uncropped copy's does. Forgetting everything there, planted, is found."""
        forget_all = replacing(lambda node: isinstance(node, ast.If), lambda node: ast.Pass())
        for planted in (False, True):
            with self.subTest(planted=planted), contextlib.ExitStack() as stack:
                if planted:
                    stack.enter_context(mock.patch.object(eviction.EvictingCache,
                                                          "_forget_from", plant(
                        eviction.EvictingCache, "_forget_from", forget_all)))
                for cache in (eviction.HeavyHitterCache(PARAMS, 8), eviction.KeyNormCache(
                        PARAMS, 8), eviction.SnapKVCache(PARAMS, 8, 10)):
                    feed(PARAMS, cache, self.IDS[:20])
                    other = cache.copy()
                    cache.crop(len(cache))
                    rows = [feed(PARAMS, c, self.IDS[:21])[-1] for c in (cache, other)]
                    same = (cache.kept, cache.reads[-1], rows[0]) == (other.kept, other.reads[-1],
                                                                      rows[1])
                    self.assertEqual(same, not planted, type(cache).__name__)

    def test_a_story_of_one_token_runs_through_every_rung(self):
        """A greedy story that ends at its first token (a retrained model may write one)
        leaves no row read after its prompt: every rung measures it, reading none."""
        prompts = OPENINGS[:1]
        greedy, sampled = ([generate_cached(PARAMS, TOK, prompt, 1, **settings)
                            for prompt in prompts] for settings in ({}, {"temperature": 1.0}))
        runs = SimpleNamespace(greedy=greedy, sampled=sampled, greedy_rows=[
            cached_rows(PARAMS, story_ids(TOK, p, r)[:-1]) for p, r in zip(prompts, greedy)])
        lab = SimpleNamespace(params=PARAMS, tok=TOK, prompts=prompts)
        for index, (name, budget) in enumerate(eviction.RUNGS):
            with self.subTest(name=name, budget=budget):
                self.assertEqual(eviction.rung(lab, index, runs)[
                    "most_positions_a_row_read_after_the_prompt"], 0)

    def test_bad_budgets_and_settings_are_refused_by_name(self):
        """A budget, recent, window, prompt or kernel out of range or not an int (None and
        "8" too, which a default recent of budget // 2 met first), each named; weights that
        are not a finite float from 0 to 1 for each position held, refused by attended
        before any score changes."""
        for call, fragment in ((lambda: eviction.HeavyHitterCache(PARAMS, 1), "budget"),
                               (lambda: eviction.KeyNormCache(PARAMS, 8.0), "budget"),
                               (lambda: eviction.HeavyHitterCache(PARAMS, None),
                                r"budget must be an int from 2 to 64 \(positions a row reads\), "
                                r"got None"),
                               (lambda: eviction.KeyNormCache(PARAMS, "8"),
                                "budget must be an int from 2 to 64 .*, got '8'"),
                               (lambda: eviction.HeavyHitterCache(PARAMS, 8, 9), "recent"),
                               (lambda: eviction.SnapKVCache(PARAMS, 8, 0), "prompt_tokens"),
                               (lambda: eviction.SnapKVCache(PARAMS, 8, 5, window=8), "window"),
                               (lambda: eviction.SnapKVCache(PARAMS, 8, 5, kernel=0), "kernel"),
                               (lambda: eviction.SnapKVCache(PARAMS, 8, 5, kernel=4),
                                "kernel must be odd .*, got 4: an even one would pool 5")):
            with self.subTest(fragment=fragment):
                with self.assertRaisesRegex(ValueError, fragment):
                    call()
        cache = eviction.HeavyHitterCache(PARAMS, 8)
        with self.assertRaisesRegex(ValueError, "attended got 2 weights for the 0 positions"):
            cache.attended([0.5, 0.5])
        feed(PARAMS, cache, self.IDS[:3])
        support.assert_each_refused(self, [
            (lambda weights=weights: cache.attended(weights),
             r"weights must be floats from 0 to 1, one for each of the 3 positions held, got "
             + re.escape(repr(weights)))
            for weights in ([0.5, math.nan, 0.5], [1e308, 0.0, 0.0], [0.5, -0.5, 1.0],
                            [0.5, 0.5, math.inf], [1, 0.0, 0.0], [0.5, "0.5", 0.0])],
            lambda: (list(cache.scores), list(cache.kept), [list(r) for r in cache.reads]))

    def test_snapkv_choice_refuses_no_rows_and_bad_counts_by_name(self):
        """No rows (an IndexError), a kernel of 0 (a division by zero) or an even one, a keep
        below 0 (which would slice from the end), rows that are not the window's (row i one
        position longer than row i - 1): each a ValueError naming it."""
        rows = [[0.5, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]]
        for args, fragment in ((([], 1, 3), r"rows must be a non-empty list of the window's "
                                             r"rows of weights, got \[\]"),
                               ((rows, 1, 0), "kernel must be an int >= 1, got 0"),
                               ((rows, 1, 2), "kernel must be odd"),
                               ((rows, -1, 3), "keep must be an int >= 0, got -1"),
                               (([[1.0], [0.5, 0.25, 0.25]], 1, 3),
                                r"rows must be the window's rows of weights, the first of one "
                                r"or more, each one position longer than the one before: got "
                                r"rows of 1, 3 weights"),
                               (([[]], 0, 1), "got rows of 0 weights")):
            with self.subTest(args=args), self.assertRaisesRegex(ValueError, fragment):
                eviction.snapkv_choice(*args)
        self.assertEqual(eviction.snapkv_choice(rows, 1, 3), [0])


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of the evicting caches."""

    @classmethod
    def setUpClass(cls):
        cls.rungs = support.recorded("eviction")["rungs"]
        cls.windows = {rung["cache"]: rung for rung in support.recorded("ladder")["rungs"]}

    def test_every_row_compared_equals_the_masked_pass_and_reads_at_most_its_budget(self):
        compared = [rung for rung in self.rungs if rung["rows_compared_with_the_masked_pass"]]
        self.assertEqual(sorted(name for (name, _), rung in zip(eviction.RUNGS, self.rungs)
                                if rung["rows_compared_with_the_masked_pass"]),
                         sorted(name for name, _ in eviction.KINDS))
        for rung in compared:
            self.assertEqual(rung["rows_equal_to_the_masked_pass"],
                             rung["rows_compared_with_the_masked_pass"], rung["cache"])
        for rung in self.rungs:
            self.assertLessEqual(rung["most_positions_a_row_read_after_the_prompt"],
                                 rung["positions_kept"], rung["cache"])

    def test_what_part_2_says_of_the_kinds_against_the_windows(self):
        """At 20 kept, heavy hitters change fewer greedy stories than a window of 20 or 4
        sinks and a window of 16, and SnapKV a number between the heavy hitters' and the
        window's; at 8 kept, heavy hitters change no fewer than a window of 8; key norms
        change more than a window at 12 and 20 kept."""
        changed = {rung["cache"]: rung["greedy_stories_changed"] for rung in self.rungs}
        window = {kept: self.windows[f"window {kept}, sinks 0"]["greedy_stories_changed"]
                  for kept in (8, 12, 20)}
        self.assertLess(changed["heavy hitters, 20 kept"], min(
            window[20], self.windows["window 16, sinks 4"]["greedy_stories_changed"]))
        self.assertLess(changed["heavy hitters, 20 kept"], changed["SnapKV, 20 kept"])
        self.assertLess(changed["SnapKV, 20 kept"], window[20])
        self.assertGreaterEqual(changed["heavy hitters, 8 kept"], window[8])
        for kept in (12, 20):
            self.assertGreater(changed[f"key norms, {kept} kept"], window[kept])

if __name__ == "__main__":
    unittest.main()
