"""The lossy caches (lossy.py): each format keeps what its numbers allow and measures its
bytes; a window equals the band-masked full pass; what a format cannot store is refused."""
import ast
import struct
import unittest
from types import SimpleNamespace

import kv_cache
import lossy
import model
import prefill
import support
import verdicts
from instruments import is_call_of, largest_gap, replacing
from kv_cache import KVCache, feed, forward_step, generate_cached
from stories import story_ids
from support import (OPENINGS, PARAMS, STORIES, TOK, assert_changed, assert_equal,
                     assert_same_generation, assert_same_rows, cached_rows, swapping)
from verdicts import Layer, Wrong, differ, excerpt, step


LAYER = Layer("lossy", "the lossy caches (lossy.py)", ("lesson", "prefill"))


def setUpModule():
    verdicts.set_up("lossy")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down
def as_stored(fmt, vector):
    """vector as a QuantizedCache of format fmt gives it back, by its docstring, worked out
    plainly: float32 and float16 through struct; int8 and int4 as the nearest of the levels
    -top..top (127 or 7, ties to the even one) of a scale, largest magnitude / top, kept
    as a 32-bit float."""
    if fmt == "float64":
        return list(vector)
    if fmt in ("float32", "float16"):
        code = "f" if fmt == "float32" else "e"
        return [struct.unpack(code, struct.pack(code, x))[0] for x in vector]
    top = 127 if fmt == "int8" else 7
    scale = struct.unpack("f", struct.pack("f", max(abs(x) for x in vector) / top))[0]
    return [max(-top, min(top, round(x / scale))) * scale if scale else 0.0 for x in vector]


# 16 numbers of 8, 4 or 2 bytes; 16 levels of a byte or of half a byte, and a 4-byte scale
BYTES_PER_POSITION = {"float64": 2 * 16 * 8, "float32": 2 * 16 * 4, "float16": 2 * 16 * 2,
                      "int8": 2 * (16 + 4), "int4": 2 * (8 + 4)}   # a key and a value:


def fed_one_by_one(params, cache, ids, label, expected):
    """The rows of ids fed through cache one forward_step at a time, each step said (step),
    with what its row is expected to be."""
    rows = []
    for position, token_id in enumerate(ids):
        step(f"{label}: feeding position {position} ({TOK.vocab[token_id]!r}; expected: "
             f"{expected})")
        rows.append(kv_cache.forward_step(params, cache, token_id, position))
    return rows


def quick_check():
    """The keys and values of the first test story (30 tokens) appended to a QuantizedCache
    of each format, one position at a time as forward_step appends them: every key and
    value it gives back (and stored()) is as_stored's, and it measures BYTES_PER_POSITION;
    the story fed through a float64 one gives forward_step's rows; fed through WindowCaches
    of 8 positions, without and with 2 sinks, the full pass's rows with model.band's mask."""
    ids = TOK.encode(STORIES[0])
    step("feeding the first test story through a KVCache")
    exact = KVCache(PARAMS)
    exact_rows = feed(PARAMS, exact, ids)
    for fmt in lossy.FORMATS:
        label = f"the first test story's keys and values in {fmt}"
        cache = lossy.QuantizedCache(PARAMS, fmt)
        if fmt == "float64":
            rows = fed_one_by_one(PARAMS, cache, ids, f"the first test story through a {fmt} "
                                  f"QuantizedCache", "forward_step's row")
        else:
            for position, kept in enumerate(zip(exact.tokens, exact.keys, exact.values)):
                step(f"{label}: appending position {position} to a QuantizedCache")
                cache.append(*kept)
        for part in ("keys", "values"):
            step(f"{label}: reading its {part} back")
            wanted = [as_stored(fmt, vector) for vector in getattr(exact, part)]
            fed = f"the {part} of the first test story's positions (token IDs {ids})"
            why = (differ(f"{label}: the {part} a QuantizedCache gives back",
                          getattr(cache, part), wanted, "the cache",
                          names=("position", "number"), fed=fed)
                   or differ(f"{label}: the {part} as QuantizedCache.stored gives them",
                             [cache.stored(vector) for vector in getattr(exact, part)], wanted,
                             "the cache", names=("position", "number"), fed=fed))
            if why:
                return why
        step(f"{label}: measuring a QuantizedCache's bytes a position")
        if cache.bytes_per_position() != BYTES_PER_POSITION[fmt]:
            return Wrong(f"{label}: a QuantizedCache measures {cache.bytes_per_position()} "
                         f"bytes a position, {BYTES_PER_POSITION[fmt]} expected (a key and a "
                         f"value of 16 numbers)")
        if fmt == "float64":
            why = differ(f"the first test story through a {fmt} QuantizedCache", rows,
                         exact_rows, "the cache", fed=f"token IDs {ids}")
            if why:
                return why
    for window, sinks in ((8, 0), (8, 2)):
        label = (f"the first test story through a window of {window} positions and {sinks} "
                 f"sinks (WindowCache(params, {window}, {sinks}))")
        rows = fed_one_by_one(PARAMS, lossy.WindowCache(PARAMS, window, sinks), ids, label,
                              f"the row of the full pass with model.band({window}, {sinks})")
        why = differ(label, rows, model.forward(PARAMS, ids, model.band(window, sinks))[0],
                     "the cache", fed=f"token IDs {ids}; the full pass's mask model.band"
                                      f"({window}, {sinks})")
        if why:
            return why
    return next(filter(None, (where_measure_differs(*case) for case in MEASURED)), None)


# lossy.measure's check: (the test openings it measures, the window): in the first, the
# largest gap in the first opening, the second unchanged; in the second, the opening
# changes its first chosen token alone (the prompt's last row)
MEASURED = (((2, 0), 28), ((9,), 14))


def where_measure_differs(measured_openings, window):
    """None if lossy.measure of a WindowCache of window positions on the test openings
    measured_openings (by index) gives the figures worked out plainly here
    (each greedy story fed through a new cache; each sampled one generated again through
    one by generate_cached), tells each_story what it fed, and returns the last story's
    cache; else a Wrong naming the figure or the opening, with both values."""
    prompts = [OPENINGS[index] for index in measured_openings]
    where = f"lossy.measure of a window of {window} positions on test openings {measured_openings}"
    step(f"{where}: the exact greedy and sampled stories (generate_cached) and their rows")
    greedy = [generate_cached(PARAMS, TOK, prompt) for prompt in prompts]
    sampled = [generate_cached(PARAMS, TOK, prompt, temperature=1.0, seed=index)
               for index, prompt in enumerate(prompts)]
    stories = [story_ids(TOK, prompt, result) for prompt, result in zip(prompts, greedy)]
    runs = SimpleNamespace(greedy=greedy, sampled=sampled,
                           greedy_rows=[cached_rows(PARAMS, ids[:-1]) for ids in stories])

    def make(prompt_tokens):
        return lossy.WindowCache(PARAMS, window)
    told = []
    step(f"{where}: measuring")
    measured, last = lossy.measure(SimpleNamespace(params=PARAMS, tok=TOK, prompts=prompts),
                                   runs, make, lambda cache, ids, rows, prompt_tokens:
                                   told.append((list(cache.tokens), ids, rows, prompt_tokens)))
    step(f"{where}: working the figures out plainly")
    expected = {"largest_logit_gap": 0.0, "greedy_stories_changed": 0,
                "sampled_stories_changed": 0}
    for index, (prompt, ids, rows) in enumerate(zip(prompts, stories, runs.greedy_rows)):
        prompt_tokens = len(TOK.encode(prompt))
        fed = feed(PARAMS, make(prompt_tokens), ids[:-1])
        if index < len(told) and told[index] != (ids[:-1], ids[:-1], fed, prompt_tokens):
            return Wrong(f"{where}: what it tells each_story of opening {index} is not the "
                         f"cache holding its greedy story, the IDs fed, their rows and "
                         f"{prompt_tokens} prompt tokens",
                         f"  told: cache tokens, IDs: {excerpt(told[index][:2])}, prompt "
                         f"tokens {told[index][3]}\n  expected IDs: {excerpt(ids[:-1])}")
        expected["largest_logit_gap"] = max(expected["largest_logit_gap"], largest_gap(fed, rows))
        expected["greedy_stories_changed"] += any(
            fed[p].index(max(fed[p])) != ids[p + 1] for p in range(prompt_tokens - 1, len(fed)))
        again = generate_cached(PARAMS, TOK, prompt, len(sampled[index]["steps"]), 1.0,
                                seed=index, cache=make(prompt_tokens))
        expected["sampled_stories_changed"] += ([s["token"] for s in again["steps"]]
                                                != [s["token"] for s in sampled[index]["steps"]])
    for name, wanted in expected.items():
        if measured.get(name) != wanted:
            return Wrong(f"{where}: its {name} is {measured.get(name)!r}, {wanted!r} worked "
                         f"out plainly", f"  measure gave: {measured}\n  expected: {expected}")
    if len(told) != len(prompts) or list(last.tokens) != stories[-1][:-1]:
        return Wrong(f"{where}: it told each_story of {len(told)} stories and returned a cache "
                     f"of {len(last.tokens)} tokens, where {len(prompts)} stories and the last "
                     f"one's cache ({len(stories[-1]) - 1} tokens) are expected")
    return None


QuickCheck = verdicts.quick_check_case("lossy", __name__)


def values_packed_from_keys(tree):
    """A planting for QuantizedCache.extend(token_ids, keys, values): what it packs from its
    values it packs from its keys (a line copied and not edited)."""
    keys, values = (argument.arg for argument in tree.body[0].args.args[2:4])
    return replacing(lambda node: isinstance(node, ast.comprehension)
                     and isinstance(node.iter, ast.Name) and node.iter.id == values,
                     lambda node: ast.comprehension(node.target, ast.Name(keys, ast.Load()),
                                                    node.ifs, node.is_async))(tree)


NIBBLES_SWAPPED = replacing(   # for shift in (0, 4) becomes (4, 0): the high nibble first
    lambda node: isinstance(node, ast.Tuple) and [getattr(e, "value", None)
                                                  for e in node.elts] == [0, 4],
    lambda node: ast.Tuple([ast.Constant(4), ast.Constant(0)], ast.Load()))
LEVELS_TRUNCATED = replacing(   # round(x / scale) becomes int(x / scale): toward zero
    lambda node: is_call_of(node, "round"),
    lambda node: ast.Call(ast.Name("int", ast.Load()), node.args, []))
SCALE_FROM_THE_LARGEST_NUMBER = replacing(   # max(map(abs, vector)) becomes max(vector)
    lambda node: is_call_of(node, "max", 1) and is_call_of(node.args[0], "map"),
    lambda node: ast.Call(node.func, [node.args[0].args[1]], []))
RING_OF_WINDOW_LESS_SINKS = replacing(   # (position - sinks) % window: % (window - sinks)
    lambda node: (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)
                  and isinstance(node.right, ast.Attribute) and node.right.attr == "window"),
    lambda node: ast.BinOp(node.left, ast.Mod(), ast.BinOp(
        node.right, ast.Sub(), ast.Attribute(node.right.value, "sinks", ast.Load()))))
KEPT_FOR_THE_NEXT_POSITION = replacing(   # band(...)(len(self) - 1) becomes (len(self))
    lambda node: (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)
                  and is_call_of(node.left, "len") and getattr(node.right, "value", None) == 1),
    lambda node: node.left)

def given_back(fmt, parts="keys", position=r"\d+"):
    """The verdict's pattern for a number the cache gives back wrong, in format fmt."""
    return (rf"in {fmt}: the {parts} .*, at position {position}, number \d+: \S+ from the "
            rf"cache, \S+ expected")


MISTAKES = [
    ("int4's two numbers of a byte read high nibble first", lossy, "_unpack", NIBBLES_SWAPPED,
     given_back("int4")),
    ("levels truncated toward zero, not rounded", lossy, "_pack", LEVELS_TRUNCATED,
     given_back("int8")),
    ("the scale taken from the largest number, not the largest magnitude", lossy, "_pack",
     SCALE_FROM_THE_LARGEST_NUMBER, given_back("int8", "(keys|values)")),
    ("the values packed from the keys", lossy.QuantizedCache, "extend", values_packed_from_keys,
     given_back("float64", "values", "0")),
    ("a ring of window - sinks slots", lossy.WindowCache, "_slot", RING_OF_WINDOW_LESS_SINKS,
     r"window of 8 positions and 2 sinks.*, at position [1-9]\d*, logit \d+: \S+ from the "
     r"cache, \S+ expected"),
    ("the positions kept for the next position, not this one", lossy.WindowCache, "_kept",
     KEPT_FOR_THE_NEXT_POSITION, r"window of 8 positions and 0 sinks.*feeding position 0"),
    ("the largest gap of the last story only", lossy, "measure",
     swapping("max(gap, largest_gap(fed, rows))", "largest_gap(fed, rows)"),
     r"^lossy\.measure of a window .*: its largest_logit_gap is \S+, \S+ worked out plainly"),
    ("each row's best token met with the token fed there, not the next", lossy, "measure",
     swapping("ids[p + 1]", "ids[p]"),
     r"^lossy\.measure .*: its greedy_stories_changed is \d+, \d+ worked out plainly"),
    ("the prompt's last row, the first that chooses, left out", lossy, "measure",
     swapping("range(prompt_tokens - 1, len(fed))", "range(prompt_tokens, len(fed))"),
     r"^lossy\.measure .*: its greedy_stories_changed is \d+, \d+ worked out plainly"),
    ("each sampled story met with the first opening's", lossy, "measure",
     swapping("runs.sampled[index]", "runs.sampled[0]"),
     r"^lossy\.measure .*: its sampled_stories_changed is \d+, \d+ worked out plainly"),
]


class Teeth(unittest.TestCase):
    """Each mistake, planted in the real lossy.py (by its syntax tree), makes the layer's
    quick check fail, naming the format or window, the position and both numbers."""

    def test_each_mistake_is_named_by_the_quick_check(self):
        verdicts.assert_verdicts(self, "lossy", MISTAKES)


class Lossy(unittest.TestCase):
    """Where a cache gives exactness up on purpose: compact formats and a sliding window."""

    VECTOR = [0.75, -1.5, 0.1, 3.0, -0.2, 1e-3, 2.5, -3.0, 0.0, 1.2, -0.7, 0.33, 2.0, -2.9,
              0.05, 1.0]

    def test_each_format_round_trips_as_its_numbers_allow(self):
        unpack = lossy._unpack
        stored = {fmt: lossy._pack(fmt, self.VECTOR) for fmt in lossy.FORMATS}
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
        self.assertEqual(unpack("int4", lossy._pack("int4", [7.0, 0.5, 1.5, -0.5])),
                         [7.0, 0.0, 2.0, 0.0])

    def test_a_float64_array_cache_is_exact(self):
        """On a whole context and in a generation (the quick check: the first test story)."""
        longest = [t for story in STORIES for t in TOK.encode(story)][:model.CONTEXT]
        assert_same_rows(self, feed(PARAMS, lossy.QuantizedCache(PARAMS, "float64"), longest),
                         cached_rows(PARAMS, longest))
        assert_same_generation(self, PARAMS, OPENINGS[0], {},
                               cache=lossy.QuantizedCache(PARAMS, "float64"))

    def test_lower_precision_changes_the_scores(self):
        ids = TOK.encode(STORIES[0])
        exact = cached_rows(PARAMS, ids)
        for fmt in lossy.FORMATS[1:]:
            with self.subTest(fmt=fmt):
                assert_changed(self, feed(PARAMS, lossy.QuantizedCache(PARAMS, fmt), ids),
                               exact, f"the rows through a {fmt} cache")

    def test_the_window_cache_equals_the_band_masked_full_pass(self):
        longest = [t for story in STORIES for t in TOK.encode(story)][:model.CONTEXT]
        self.assertEqual(len(longest), model.CONTEXT)
        causal_rows = cached_rows(PARAMS, longest)
        for window in (8, 16, 32):
            for sinks in (0, 4):
                reference, _ = model.forward(PARAMS, longest, model.band(window, sinks))
                cache = lossy.WindowCache(PARAMS, window, sinks)
                label = f"window {window}, sinks {sinks}"
                assert_same_rows(self, feed(PARAMS, cache, longest), reference,
                                 f"{label}: the rows")
                self.assertEqual(len(cache.keys), window + sinks, label)
                assert_changed(self, reference, causal_rows,
                               f"{label}: the band-masked rows")

    def test_copy_and_crop_on_the_new_caches(self):
        ids = TOK.encode(STORIES[0])
        for make in (lambda: lossy.QuantizedCache(PARAMS, "int8"),
                     lambda: lossy.WindowCache(PARAMS, 16, 4)):
            with self.subTest(cache=type(make()).__name__):
                alone = feed(PARAMS, make(), ids)
                cache = make()
                feed(PARAMS, cache, ids[:10])
                fork = cache.copy()
                assert_same_rows(self, feed(PARAMS, fork, ids), alone[10:])
                self.assertEqual(len(cache), 10, "the positions of the cache copied from, after "
                                 "its copy was fed: a copy must not share what it keeps")
                cache.crop(6)
                assert_same_rows(self, feed(PARAMS, cache, ids), alone[6:])
        window = lossy.WindowCache(PARAMS, 8, 2)
        feed(PARAMS, window, ids[:12])
        with self.assertRaisesRegex(ValueError, "the window has dropped positions 2 to 3"):
            window.crop(5)
        window.crop(2)
        assert_same_rows(self, feed(PARAMS, window, ids), feed(PARAMS, lossy.WindowCache(
            PARAMS, 8, 2), ids)[2:])

    def test_a_window_cache_is_fed_one_token_at_a_time(self):
        cache = lossy.WindowCache(PARAMS, 8, 2)
        feed(PARAMS, cache, TOK.encode(OPENINGS[0]))
        before = (list(cache.tokens), cache.keys)
        with self.assertRaisesRegex(ValueError, "prefill needs a cache that keeps every "
                                                "position, and a WindowCache drops some"):
            prefill.prefill(PARAMS, cache, [5, 6], len(cache))
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
                lossy._pack(fmt, vector)
        with self.assertRaisesRegex(ValueError, "no position yet"):
            lossy.QuantizedCache(PARAMS, "int8").bytes_per_position()
        huge = dict(PARAMS, ln1_g=[1e41] * model.WIDTH)   # keys and values near 1e41
        for fmt in ("float32", "int8"):
            cache = lossy.QuantizedCache(huge, fmt)
            with self.subTest(through="forward_step", fmt=fmt):
                with self.assertRaisesRegex(ValueError, "float32's largest"):
                    forward_step(huge, cache, 5, 0)
                self.assertEqual((len(cache), cache.tokens), (0, []),
                                 "the cache's positions and tokens after a refused step")

    def test_a_window_cache_holding_the_whole_prompt_says_so(self):
        ids = TOK.encode(STORIES[0])
        cache = lossy.WindowCache(PARAMS, 8)
        feed(PARAMS, cache, ids)
        with self.assertRaisesRegex(ValueError, "holds the whole prompt, and its copy cannot "
                                                "give the last position back .*: crop length "
                                                ".* the window has dropped positions 0 to 21"):
            generate_cached(PARAMS, TOK, TOK.decode(ids), cache=cache)

    def test_bad_formats_and_windows_are_refused(self):
        with self.assertRaisesRegex(ValueError, "unknown cache format 'int2'; the formats are "
                                                "float64, float32, float16, int8, int4"):
            lossy.QuantizedCache(PARAMS, "int2")
        for window, sinks, fragment in ((0, 0, "window must be an int >= 1"),
                                        (8.0, 0, "window must be an int >= 1"),
                                        (True, 0, "window must be an int >= 1"),
                                        (8, -1, "sinks must be an int from 0 to 7 .window - 1."),
                                        (8, 8, "sinks must be an int from 0 to 7 .window - 1."),
                                        (8, 2.0, "sinks must be an int from 0 to 7 .window - 1.")):
            with self.subTest(window=window, sinks=sinks):
                with self.assertRaisesRegex(ValueError, fragment):
                    lossy.WindowCache(PARAMS, window, sinks)


if __name__ == "__main__":
    unittest.main()
