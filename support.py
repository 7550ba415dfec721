"""What the test modules share, as CPython's test.support does: the trained model and the test
stories; comparisons that name the first number that differs, not thousands; loops over many
cases that fail once, naming the case (a random one by its seed, with the command that reruns
it alone); running from another folder. The layers of the lab, their quick checks' vocabulary
and the skips they decide are verdicts.py's; the random models and prompts that seeded cases
draw, random_models.py's. No test module imports another; they import these three (verdicts.py
alone imports a test module, for its layer's quick_check)."""
import ast
import contextlib
import functools
import json
import os
import reprlib
import sys
import tempfile
import unittest
from unittest import mock

import generate
import kv_cache
import lab_files
import model
from generate import load_trained
from instruments import plant, recording, replacing, where_raised
from kv_cache import KVCache, feed
from stories import openings, split_stories, story_ids

HERE = os.path.dirname(os.path.abspath(__file__))
PARAMS, TOK = load_trained()
with open(os.path.join(HERE, "corpus.txt"), encoding="utf-8") as _corpus:
    STORIES = split_stories(_corpus.read())[2]
OPENINGS = openings(STORIES)
ON_PURPOSE = ("If you did not mean to change this, `git diff` shows what did (and `git "
              "checkout -- FILE` undoes an edit). If you changed the code or retrained on "
              "purpose, this is expected: bring the document up to date")   # the documents' tests


def lab_file(name):
    """The text of one of the lab's files.

    A save of the record and the documents stopped among its renames is finished first (the
    set is then all new), as every command of the lab does."""
    lab_files.finish_saving(HERE)
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=None)   # read once: no test changes the file
def _the_record():
    return json.loads(lab_file("kv-trace.json"))


def recorded(name):
    """The entry name of the recorded run (kv-trace.json), for a Part's claims about its record.

    test_whole_trace proves the file is trace_kv.py's run now; a missing entry says what to add."""
    record = _the_record()
    if name not in record:
        raise AssertionError(
            f"kv-trace.json has no entry {name!r}: no stage of trace_kv.STAGES records it. "
            f"A new Part's stage needs its line there (its module imported in trace_kv.py), e.g.\n"
            f"    Stage(PART, {name!r}, MODULE.experiment, (\"runs\",)),   # or cases=, gather=\n"
            f"then python3 trace_kv.py --write records it")
    return record[name]


# ---- comparisons that name one number -----------------------------------------------

def filled_cache(ids, params=PARAMS):
    """A new cache holding the keys and values of ids."""
    cache = KVCache(params)
    feed(params, cache, ids)
    return cache


def stored_in_reverse(ids, params=PARAMS):
    """A new cache of ids stored last position first (each key and value keeps its position)."""
    cache = filled_cache(ids, params)
    for kept in (cache.tokens, cache.keys, cache.values):
        kept.reverse()
    return cache


def cached_rows(params, ids):
    """The logits of every position of ids, fed one at a time through a new cache."""
    return feed(params, KVCache(params), ids)


def chunked_rows(params, ids, size, cache=None):
    """The logits of each position of ids, prefilled size tokens at a time (cache or a new one)."""
    import prefill
    return prefill.prefill_in_chunks(params, KVCache(params) if cache is None else cache,
                                     ids, size)


def snapshot(cache):
    """What a cache holds: its length, tokens, keys and values (copies)."""
    return (len(cache), list(cache.tokens), [list(k) for k in cache.keys],
            [list(v) for v in cache.values])


def deep_snapshot(cache):
    """What a deep_model.DeepCache holds: its tokens and each layer's lists (copies)."""
    return (list(cache.tokens), [{part: list(vectors) for part, vectors in layer.items()}
                                 for layer in cache.layers])


def pool_snapshot(pool):
    """What a pool holds: its blocks, prefix index, free list in order, hits and evictions.

    A block as its positions, count and index key."""
    return ([(b.tokens, b.keys, b.values, b.ref_count, b.prefix) for b in pool.blocks],
            {key: list(ids) for key, ids in pool.prefix_index.items()}, list(pool.free_list),
            pool.prefix_hits, pool.evictions)


def paths(value, where):
    """Every path (a tuple of keys) into a record's value, from where, value's own first."""
    yield where
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, list) else ())
    for key, inner in items:
        yield from paths(inner, (*where, key))


def first_gap(got, expected, within=None, where=()):
    """Where two nested lists (or tuples) of numbers first differ, or None if nowhere.

    Given within, by more than that: (indices, got's number, expected's, True); or where two
    of their lists differ in length: (indices, both lengths in words, False)."""
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        if len(got) != len(expected):
            return where, f"{len(got)} items", f"{len(expected)} items", False
        for index, (a, b) in enumerate(zip(got, expected)):
            found = first_gap(a, b, within, where + (index,))
            if found:
                return found
        return None
    equal = got == expected if within is None else abs(got - expected) <= within
    return None if equal else (where, got, expected, True)


def first_difference(got, expected, where=""):
    """Where two nested lists (or tuples, numbers) first differ (first_gap), or None if equal.

    As (where, got, expected) in a few words: ("[3][5]", "0.25", "0.5")."""
    found = first_gap(got, expected)
    if found is None:
        return None
    indices, mine, wanted, numbers = found
    place = where + "".join(f"[{index}]" for index in indices)
    if not numbers:
        return place or "the lists", mine, wanted
    return place or "the value", str(mine)[:80], str(wanted)[:80]


def assert_equal(test, got, expected, what):
    """assertEqual that names the first differing number instead of printing both sides."""
    if got == expected:
        return                # == first: looking for the difference is for a failure
    found = first_difference(got, expected)
    if found:
        test.fail(f"{what} differ at {found[0]}: {found[1]} != {found[2]}")


def assert_same_rows(test, rows, expected, what="rows"):
    """rows == expected, or a failure naming the first number that differs."""
    assert_equal(test, rows, expected, what)


def assert_changed(test, got, unchanged, what):
    """assertNotEqual that does not print both sides when they are equal."""
    if got == unchanged:
        test.fail(f"{what}: nothing changed, but a difference was expected")


# ---- the lesson's row, value by value -----------------------------------------------

ROW = ("x0", "h1", "q", "k", "v", "scores", "weights", "mixed", "x1", "h2", "a", "x2", "hf",
       "logits")   # one position's row, in the order the README's section 5 computes it


def assert_each_refused(test, refusals, state):
    """Each (call, fragment) of refusals raises a ValueError with it, leaving state() as before."""
    before = state()
    for call, fragment in refusals:
        with test.subTest(fragment=fragment):
            with test.assertRaisesRegex(ValueError, fragment):
                call()
            test.assertEqual(state(), before)


@contextlib.contextmanager
def locals_of(function):
    """Inside this block, record each call of function as it ends: its locals and "returned".

    For failure messages only (renamed values are left out); sys.settrace watches, not a patch."""
    code, calls = function.__code__, []

    def on_return(frame, event, returned):
        if event == "return":
            calls.append(dict(frame.f_locals, returned=returned))
        return on_return

    def on_call(frame, event, arg):
        return on_return if frame.f_code is code else None
    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield calls
    finally:
        sys.settrace(previous)


def where_rows_differ(params, ids):
    """None if each position of ids fed through a new cache gives model.forward's very row.

    Else a line: the first position and value (x0, ..., logits) that differ, with both numbers."""
    with recording(model, "softmax_row") as scores:   # the full pass: once per position
        logits, saved = model.forward(params, ids)
    if cached_rows(params, ids) == logits:
        return None
    full = [{name: getattr(saved, name)[i] for name in saved._fields} for i in range(len(ids))]
    for i, row in enumerate(full):
        row["logits"] = logits[i]
        if len(scores) == len(ids):   # not when model.forward is a planted copy
            row["scores"] = scores[i].args[0]
    with locals_of(kv_cache.forward_step) as steps:
        feed(params, KVCache(params), ids)
    for position, (step, wanted) in enumerate(zip(steps, full)):
        step = dict(step, logits=step["returned"])
        equal = []
        for name in ROW:
            if name not in step or name not in wanted:
                continue      # a value one of the two functions does not name
            found = first_difference(step[name], wanted[name], name)
            if found:
                same = (f"; {', '.join(equal[:-1])} and {equal[-1]} are equal"
                        if len(equal) > 1 else f"; {equal[0]} is equal" if equal else "")
                return (f"position {position} ({TOK.vocab[ids[position]]!r}): the first value "
                        f"of the row that differs is {found[0]}: {found[1]} in forward_step, "
                        f"{found[2]} in model.forward{same}")
            equal.append(name)
    return "the rows differ"


def assert_every_row_equal(test, params, ids, label="the input"):
    """The lab's comparison: every row fed through a new cache == model.forward's row.

    A failure names the position and the first value of its row that differs."""
    why = described(where_rows_differ, params, ids)
    if why:
        test.fail(f"{label}: {why}")


def generation_difference(params, prompt, settings, cached, uncached):
    """Why a cached generator gave another result than generate, in a few lines.

    Where the stories part, and the first value of a row that differs. New token 1, the
    first generated, is chosen by the row at the prompt's last position (from 0), as always."""
    last_prompt_position = len(TOK.encode(prompt)) - 1
    for number, (mine, theirs) in enumerate(zip(cached["steps"], uncached["steps"]), 1):
        if mine != theirs:
            how = (f"new token {number} (chosen by the row at position "
                   f"{last_prompt_position + number - 1}) is {mine['token']!r} (probability "
                   f"{mine['probability']}) where generate chose {theirs['token']!r} "
                   f"({theirs['probability']})")
            break
    else:
        how = (f"the cached generator stopped at another point: after "
               f"{len(cached['steps'])} new tokens ({cached['stopped']}), where generate "
               f"stopped after {len(uncached['steps'])} ({uncached['stopped']})")
    rows = described(where_rows_differ, params, story_ids(TOK, prompt, uncached))
    why = f"because at {rows}" if rows else ("every row is equal, so the difference is in "
                                             "how the tokens were chosen")
    return f"generate_cached({prompt!r}, {settings}) differs from generate: {how},\n{why}"


def assert_same_generation(test, params, prompt, settings, generator=None, uncached=None,
                           **cached_only):
    """kv_cache.generate_cached(...) (or generator) == generate(...), or a failure saying why.

    uncached: generate's, if at hand. A failure: where the stories part, which row differs."""
    uncached = uncached or generate.generate(params, TOK, prompt, **settings)
    generator = generator or kv_cache.generate_cached   # looked up now: a test may patch it
    cached = generator(params, TOK, prompt, **settings, **cached_only)
    if cached != uncached:
        test.fail(generation_difference(params, prompt, settings, cached, uncached))
    return cached


# ---- many cases, one failure --------------------------------------------------------

def described(check, *args):
    """check(*args): None, or why it fails, in a line.

    An exception it raises (but a skip) fails too, named with the lab's lines it came through."""
    try:
        return check(*args)
    except unittest.SkipTest:
        raise
    except Exception as e:   # a planted mistake may raise anything
        return f"raised {raised(e)}{where_raised(e)}"


def raised(error):
    """An exception in words that never end at its name: a KeyError's key, or "with no message"."""
    if isinstance(error, KeyError) and len(error.args) == 1:
        return f"KeyError: no entry for the key {reprlib.repr(error.args[0])}"
    return f"{type(error).__name__}: {error}" if str(error) else \
        f"{type(error).__name__} (with no message)"


def check_every_case(test, cases, check):
    """Run check(case) on every (label, case) in cases, and fail once if any fails.

    check returns None, or why the case fails; the failure names the first and how many."""
    failed, first, count = 0, None, 0
    for label, case in cases:
        count += 1
        why = described(check, case)
        if why:
            failed += 1
            first = first or f"{label}: {why}"
    if failed:
        test.fail(f"{failed} of {count} cases fail; the first, {first}")


def _whole_number(name, least):
    raw = os.environ.get(name)
    if raw is None:
        return None
    if not raw.strip().isdigit() or int(raw) < least:
        raise ValueError(f"{name} must be a whole number, at least {least}, got {raw!r}")
    return int(raw)


def case_numbers(default):
    """The cases a seeded random test runs: 0 to default - 1, or what the environment asks.

    As many as KV_LAB_RANDOM_CASES asks for, if more; only case n if KV_LAB_CASE=n."""
    alone = _whole_number("KV_LAB_CASE", 0)
    if alone is not None:
        return [alone]
    return range(max(default, _whole_number("KV_LAB_RANDOM_CASES", 1) or 0))


def check_random_cases(test, default, check):
    """check(n) for every case number of case_numbers(default); the numbers it ran.

    Case n draws all from random.Random(n); check returns None or why. It fails once, naming
    the first failing case, how many failed, and the command that reruns it alone."""
    numbers = case_numbers(default)
    failed = [(n, why) for n in numbers for why in [described(check, n)] if why]
    if failed:
        n, why = failed[0]
        test.fail(f"{len(failed)} of {len(numbers)} random cases fail; the first, case {n} "
                  f"(drawn from random.Random({n})): {why}\n"
                  f"rerun it alone: KV_LAB_CASE={n} python3 -m unittest {test.id()}")
    return numbers


def swapping(source, new_source):
    """A mistake for instruments.plant: each node of source becomes new_source's node.

    source is in ast.unparse's spelling; a statement for a statement ("pass" drops it), else
    an expression."""
    new = ast.parse(new_source).body[0]
    statement = not isinstance(new, ast.Expr) or ast.unparse(new) != new_source.strip()
    return replacing(lambda node: (isinstance(node, ast.stmt) == statement
                                   and ast.unparse(node) == source),
                     lambda node: new if statement else new.value)


UNCHANGED = lambda tree: 1   # a planting for instruments.plant: the real function, compiled again


def assert_each_mistake_is_caught(test, module, name, mistakes, difference):
    """Assert difference() finds each of mistakes planted in turn in the real module.name.

    mistakes: what it is -> a planting for instruments.plant; difference() is None when
    nothing differs. A mistake whose planting site an edit removed is skipped, named."""
    for mistake, planting in mistakes.items():
        planted = plant(module, name, planting)
        with test.subTest(mistake=mistake):
            if planted is None:
                test.skipTest(f"the planting site of {mistake!r} is gone from "
                              f"{module.__name__}.{name}")
            with mock.patch.object(module, name, planted):
                test.assertIsNotNone(described(difference))


# ---- another folder -------------------------------------------------------------

class InAFolder(unittest.TestCase):
    """Each test in a new empty folder of its own (self.folder, removed after it).

    With the path of a best.json there (self.path) and fresh params (self.params)."""

    def setUp(self):
        folder = tempfile.TemporaryDirectory()
        self.addCleanup(folder.cleanup)
        self.folder = folder.name
        self.path = os.path.join(self.folder, "best.json")
        self.params = model.init_params(0)

    def assert_only_files(self, *names):
        self.assertEqual(sorted(os.listdir(self.folder)), sorted(names))


_elsewhere = []


def enter_another_folder():
    """Run the tests from now on from a new temporary folder, not the lab's."""
    _elsewhere.append(tempfile.TemporaryDirectory())
    os.chdir(_elsewhere[-1].name)


def tear_down():
    """Back to the lab's folder: the tear-down after enter_another_folder or verdicts.set_up."""
    os.chdir(HERE)
    _elsewhere.pop().cleanup()
