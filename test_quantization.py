"""Fewer bits as engines store them (kivi.py and quantization.py): a GroupedCache and a RotatedCache give
back what their docstrings say, worked out plainly; a GroupedCache counts its bytes as the
formula does; re-quantizing compounds only where a group grows; what they cannot store is
refused."""
import ast
import math
import struct
import unittest

import quantization
import support
import verdicts
from instruments import is_call_of, replacing
from kv_cache import KVCache, feed
from kivi import bytes_by_formula, keys_by_channel, value_by_token
from quantization import GroupedCache, RotatedCache
from support import PARAMS, STORIES, TOK, assert_equal
from verdicts import Layer, differ, step, strayed


LAYER = Layer("quantization", "keys by channel, values by token (kivi.py, quantization.py)",
              ("lesson", "prefill", "lossy"))


def setUpModule():
    verdicts.set_up("quantization")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def on_one_grid(numbers, bits):
    """numbers on the grid they share, plainly: a 32-bit zero point, their smallest, and a
    32-bit scale, (largest - smallest) / (2**bits - 1); each number the nearest level
    (ties to even) from 0 to the top, times the scale, plus the zero point. At 64 bits,
    the numbers."""
    if bits == 64:
        return list(numbers)
    top = 2 ** bits - 1
    zero, scale = f32(min(numbers)), f32((max(numbers) - min(numbers)) / top)
    return [min(top, max(0, round((x - zero) / scale))) * scale + zero if scale else zero
            for x in numbers]


# The Hadamard matrix of 16, entry (i, j) (-1) to the number of bits i and j share, over 4.
HADAMARD = [[(-1) ** bin(i & j).count("1") / 4 for j in range(16)] for i in range(16)]


def turn(vector):
    return [math.fsum(h * x for h, x in zip(row, vector)) for row in HADAMARD]


def as_given_back(settings, keys, values):
    """The keys and values a GroupedCache(params, **settings) fed these gives back, by
    its docstring: before position p = residual, 2 residual, ... is added, the positions
    from p - residual ("groups"), or from 0 ("requantize"), to p - 1 are quantized from
    what it gave back until then: keys a group of group at a time, each channel on one
    grid, values each on one grid, turned first and back after if rotate."""
    bits, group, residual = settings["bits"], settings["group"], settings["residual"]
    rotate = settings.get("rotate", False)
    keys, values = [list(k) for k in keys], [list(v) for v in values]
    around = turn if rotate else list
    for p in range(residual, len(keys), residual):
        start = p - residual if settings.get("flush", "groups") == "groups" else 0
        for at in range(start, p, group):
            block = [around(k) for k in keys[at:min(at + group, p)]]
            back = zip(*(on_one_grid(channel, bits) for channel in zip(*block)))
            keys[at:at + len(block)] = [around(list(k)) for k in back]
        values[start:p] = [around(on_one_grid(around(v), bits)) for v in values[start:p]]
    return keys, values


def on_one_scale(vector, top):
    """vector on one scale of its own, plainly: a 32-bit scale, its largest magnitude / top;
    each number the nearest level from -top to top (ties to even), times the scale."""
    scale = f32(max(abs(x) for x in vector) / top)
    return [max(-top, min(top, round(x / scale))) * scale if scale else 0.0 for x in vector]


def turned_on_one_scale(vector, top):
    """vector as a RotatedCache of int8 (top 127) or int4 (top 7) gives it back, by its
    docstring: turned, on one scale, turned back."""
    return turn(on_one_scale(turn(vector), top))


def described(settings):
    words = ", ".join(f"{name}={value!r}" for name, value in settings.items())
    return f"GroupedCache(params, {words})"


SETTINGS = (dict(bits=4, group=8, residual=16), dict(bits=2, group=4, residual=8, rotate=True),
            dict(bits=8, group=16, residual=12, flush="requantize"))


def quick_check():
    """The keys and values of the first test story (30 tokens) appended one position at a
    time to GroupedCaches of SETTINGS: after each, every key and value it gives back is
    as_given_back's. Fed the story, one at 64 bits gives forward_step's rows, and one at
    64 bits turned and back gives them within rounding."""
    ids = TOK.encode(STORIES[0])
    step("feeding the first test story through a KVCache")
    exact = KVCache(PARAMS)
    exact_rows = feed(PARAMS, exact, ids)
    for settings in SETTINGS:
        cache = GroupedCache(PARAMS, **settings)
        for n, kept in enumerate(zip(exact.tokens, exact.keys, exact.values), 1):
            label = f"the first test story's keys and values through {described(settings)}"
            step(f"{label}: appending position {n - 1}")
            cache.append(*kept)
            wanted = as_given_back(settings, exact.keys[:n], exact.values[:n])
            for part, expected in zip(("keys", "values"), wanted):
                why = differ(f"{label}, {n} positions held: the {part} it gives back",
                             getattr(cache, part), expected, "the cache",
                             names=("position", "number"), fed=f"token IDs {ids[:n]}")
                if why:
                    return why
    for rotate, compare in ((False, differ), (True, strayed)):
        settings = dict(bits=64, group=4, residual=8, rotate=rotate)
        step(f"the first test story through {described(settings)}")
        why = compare(f"the first test story through {described(settings)}",
                      feed(PARAMS, GroupedCache(PARAMS, **settings), ids), exact_rows,
                      "the cache", fed=f"token IDs {ids}")
        if why:
            return why
    for fmt, top in (("int8", 127), ("int4", 7)):
        label = f"the first test story's keys and values through RotatedCache(params, {fmt!r})"
        cache = RotatedCache(PARAMS, fmt)
        wanted = {part: [turned_on_one_scale(vector, top) for vector in getattr(exact, part)]
                  for part in ("keys", "values")}
        for n, kept in enumerate(zip(exact.tokens, exact.keys, exact.values), 1):
            step(f"{label}: appending position {n - 1}")
            cache.append(*kept)
            for part in ("keys", "values"):
                why = differ(f"{label}, {n} positions held: the {part} it gives back",
                             getattr(cache, part), wanted[part][:n], "the cache",
                             names=("position", "number"), fed=f"token IDs {ids[:n]}")
                if why:
                    return why
        step(f"{label}: stored() of each key")
        why = differ(f"{label}: the keys as stored() gives them back",
                     list(map(cache.stored, exact.keys)), wanted["keys"], "the cache",
                     names=("position", "number"), fed=f"token IDs {ids}")
        if why:
            return why
    step("the first test story through RotatedCache(params, 'float64')")
    return strayed("the first test story through RotatedCache(params, 'float64')",
                   feed(PARAMS, RotatedCache(PARAMS, "float64"), ids), exact_rows, "the cache",
                   fed=f"token IDs {ids}")


QuickCheck = verdicts.quick_check_case("quantization", __name__)


ONE_GRID_A_GROUP = replacing(   # _grid(channel, top): _grid(every number of the group, top)
    lambda node: is_call_of(node, "_grid") and getattr(node.args[0], "id", None) == "channel",
    lambda node: ast.Call(node.func, [ast.parse("[x for key in keys for x in key]",
                                                mode="eval").body, node.args[1]], []))
RESIDUAL_OF_ONE_MORE = replacing(   # len(self.exact_keys) == self.residual: ... + 1
    lambda node: isinstance(node, ast.Attribute) and node.attr == "residual"
    and isinstance(node.ctx, ast.Load),
    lambda node: ast.BinOp(node, ast.Add(), ast.Constant(1)))


def values_not_turned_back(tree):
    """A planting for GroupedCache._flush: the values given back are not turned back."""
    return replacing(lambda node: is_call_of(node, "map", 2)
                     and isinstance(node.args[1], ast.Name)
                     and node.args[1].id == "values_back",
                     lambda node: node.args[1])(tree)


VALUES_KEPT_TURNED = replacing(   # map(turned, self.values[held:]): self.values[held:]
    lambda node: is_call_of(node, "map") and isinstance(node.args[1], ast.Subscript)
    and getattr(node.args[1].value, "attr", None) == "values", lambda node: node.args[1])
STORED_NOT_TURNED_BACK = replacing(   # turned(QuantizedCache.stored(...)): without turned
    lambda node: is_call_of(node, "turned") and isinstance(node.args[0], ast.Call)
    and getattr(node.args[0].func, "attr", None) == "stored", lambda node: node.args[0])
ONLY_THE_NEW_POSITIONS = replacing(   # start = len(...) if groups else 0: len(...) always
    lambda node: isinstance(node, ast.IfExp) and getattr(node.orelse, "value", None) == 0,
    lambda node: node.body)


def given_back_wrong(part, settings=r"[^)]*"):
    return (rf"through GroupedCache\(params, {settings}\), \d+ positions held: the {part} "
            rf"it gives back, at position \d+, number \d+: \S+ from the cache, \S+ expected")


MISTAKES = [
    ("one zero point and scale for a group's keys, not one per channel", quantization,
     "keys_by_channel", ONE_GRID_A_GROUP, given_back_wrong("keys")),
    ("a residual of one more position than asked", GroupedCache, "extend",
     RESIDUAL_OF_ONE_MORE, r"bits=4, group=8, residual=16\), 17 positions held: the keys"),
    ("the values not turned back", GroupedCache, "_flush", values_not_turned_back,
     given_back_wrong("values", "bits=2, group=4, residual=8, rotate=True")),
    ("a re-quantizing flush that quantizes only the positions waiting", GroupedCache,
     "_flush", ONLY_THE_NEW_POSITIONS, given_back_wrong("keys", ".*requantize'")),
    ("a RotatedCache's values not turned back", RotatedCache, "extend", VALUES_KEPT_TURNED,
     r"through RotatedCache\(params, 'int8'\), 1 positions held: the values it gives back, "
     r"at position 0, number \d+: \S+ from the cache, \S+ expected"),
    ("a RotatedCache's stored() not turning back", RotatedCache, "stored",
     STORED_NOT_TURNED_BACK, r"RotatedCache\(params, 'int8'\): the keys as stored\(\) gives "
                             r"them back, at position 0"),
]


class Teeth(unittest.TestCase):
    """Each mistake, planted in the real quantization.py (by its syntax tree), makes the
    layer's quick check fail, naming the cache, the positions held, the part and both
    numbers."""

    def test_each_mistake_is_named_by_the_quick_check(self):
        verdicts.assert_verdicts(self, "quantization", MISTAKES)


LONGEST = [t for story in STORIES for t in TOK.encode(story)][:64]


class Grouped(unittest.TestCase):
    """What a GroupedCache keeps, counts and refuses."""

    @classmethod
    def setUpClass(cls):
        cls.exact = KVCache(PARAMS)
        feed(PARAMS, cls.exact, LONGEST)

    def test_its_bytes_are_the_formula_s_at_every_length(self):
        for settings in (*SETTINGS, *(rung for _, rung in quantization.RUNGS),
                         quantization.COMPOUNDING, quantization.TURNED_ONLY):
            cache = GroupedCache(PARAMS, **settings)
            for n, kept in enumerate(zip(self.exact.tokens, self.exact.keys,
                                         self.exact.values), 1):
                cache.append(*kept)
                wanted = bytes_by_formula(settings["bits"], settings["group"],
                                          settings["residual"], n)
                if cache.bytes_per_position() != wanted:
                    self.fail(f"{described(settings)} holding {n} positions counts "
                              f"{cache.bytes_per_position()} bytes a position, the formula "
                              f"{wanted}")
        # By hand: a quantized key of 16 numbers at 4 bits, 8 bytes, and its share of a
        # group's 16 zero points and 16 scales, 128 / 8; a value, 8 bytes and its own 8.
        self.assertEqual([bytes_by_formula(4, 8, 16, 17) * 17 - 256, 8 + 16 + 8 + 8], [640, 40])
        self.assertEqual([bytes_by_formula(2, 16, 16, 64), bytes_by_formula(64, 16, 16, 5)],
                         [(48 * (4 + 8 + 4 + 8) + 16 * 256) / 64, 256])

    def test_re_quantizing_a_group_that_stays_gives_its_levels_back(self):
        twins = [GroupedCache(PARAMS, 2, 16, 16, flush=flush) for flush in ("groups",
                                                                             "requantize")]
        for cache in twins:
            cache.extend(self.exact.tokens, self.exact.keys, self.exact.values)
        assert_equal(self, (twins[1].keys, twins[1].values), (twins[0].keys, twins[0].values),
                     "re-quantized at each flush and quantized once")
        self.assertEqual((twins[1].requantized, twins[1].moved), (2 * 16 * (16 + 32), 0))

    def test_copy_and_crop(self):
        alone = feed(PARAMS, GroupedCache(PARAMS, 2, 4, 8), LONGEST)
        cache = GroupedCache(PARAMS, 2, 4, 8)
        feed(PARAMS, cache, LONGEST[:20])   # positions 0 to 15 quantized, 16 to 19 exact
        fork = cache.copy()
        support.assert_same_rows(self, feed(PARAMS, fork, LONGEST), alone[20:])
        self.assertEqual(len(cache), 20, "a copy must not share what its parent keeps")
        cache.crop(17)
        support.assert_same_rows(self, feed(PARAMS, cache, LONGEST), alone[17:])
        before = support.snapshot(cache)
        for length in (16, 3):
            with self.assertRaisesRegex(ValueError, rf"crop length must be 0, or from 57 to "
                                                    rf"64, got {length}: positions 0 to 55"):
                cache.crop(length)
        self.assertEqual(support.snapshot(cache), before)
        cache.crop(0)
        support.assert_same_rows(self, feed(PARAMS, cache, LONGEST), alone)

    def test_bad_settings_are_refused_naming_them(self):
        for args, named, fragment in (
                ((3, 8, 16), {}, "bits must be 2, 4, 8 or 64, got 3"),
                ((4.0, 8, 16), {}, "bits must be 2, 4, 8 or 64, got 4.0"),
                ((True, 8, 16), {}, "bits must be 2, 4, 8 or 64, got True"),
                ((4, 0, 16), {}, r"group must be an int from 1 to 64 \(positions\), got 0"),
                ((4, 8.0, 16), {}, "group must be an int from 1 to 64"),
                ((4, 8, 0), {}, "residual must be an int from 1 to 64 .*, got 0"),
                ((4, 8, True), {}, "residual must be an int from 1 to 64 .*, got True"),
                ((4, 8, 12), {}, "residual 12 is not a multiple of group 8"),
                ((4, 8, 16), {"rotate": 1}, "rotate must be True or False, got 1"),
                ((4, 8, 16), {"flush": "all"}, "flush must be 'groups' or 'requantize', "
                                               "got 'all'")):
            with self.subTest(args=args, named=named), self.assertRaisesRegex(ValueError,
                                                                              fragment):
                GroupedCache(PARAMS, *args, **named)

    def test_the_formula_and_the_quantizers_refuse_bad_arguments_by_name(self):
        """bytes_by_formula: no positions, no group or residual (divisions by zero), -5
        positions (a negative size) or 3 bits (a size for a format the cache lacks);
        keys_by_channel and value_by_token: bits of no format (16 and 9 packed no level to a
        byte), no keys; turned: a vector other than the Hadamard matrix's 16 numbers (3 gave
        16 back)."""
        key = self.exact.keys[0]
        for call, fragment in (
                (lambda: bytes_by_formula(4, 8, 16, 0), r"positions must be an int from 1 to "
                                                        r"64 \(.*\), got 0"),
                (lambda: bytes_by_formula(4, 8, 16, -5), "positions must be .*, got -5"),
                (lambda: bytes_by_formula(4, 8, 0, 20), "residual must be an int from 1 to 64"),
                (lambda: bytes_by_formula(4, 0, 16, 20), "group must be an int from 1 to 64"),
                (lambda: bytes_by_formula(3, 8, 16, 20), "bits must be 2, 4, 8 or 64, got 3"),
                (lambda: keys_by_channel([key], 16), "bits must be 2, 4, 8 or 64, got 16"),
                (lambda: keys_by_channel([key], 9), "bits must be 2, 4, 8 or 64, got 9"),
                (lambda: value_by_token(key, 16), "bits must be 2, 4, 8 or 64, got 16"),
                (lambda: keys_by_channel([], 4), r"keys must be a non-empty list of keys of 16 "
                                                 r"numbers, got \[\]"),
                (lambda: keys_by_channel([key, key[:3]], 4), r"keys must be .*, got \[\["),
                (lambda: quantization.turned([1.0, 2.0, 3.0]),
                 r"turned takes a vector of 16 numbers \(the Hadamard matrix's size\), got 3")):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                call()

    def test_what_it_cannot_store_is_refused_before_anything_changes(self):
        cache = GroupedCache(PARAMS, 4, 8, 8, rotate=True)
        feed(PARAMS, cache, LONGEST[:8])   # full: the next position flushes it
        key = self.exact.keys[8]
        support.assert_each_refused(self, [
            (lambda: cache.append(5, key[:3], key), "a key or value of 3 numbers cannot be "
                                                    "stored: a GroupedCache keeps 16"),
            (lambda: cache.extend([5, 6], [key, key], [key, [math.nan] * 16]),
             "cannot store a vector holding nan"),
            (lambda: cache.append(5, [math.inf] + key[1:], key), "holding inf"),
            (lambda: cache.append(5, [1e38] + key[1:], key), r"is beyond 4.25e\+37, the "
                                                             r"largest .* 32-bit zero point"),
            (lambda: cache.stored([-1e38] + key[1:]), "is beyond 4.25e")],
            lambda: (support.snapshot(cache), cache.bytes_per_position()))
        import batched   # rows computed together: they would read what a flush changes
        import prefill
        support.assert_each_refused(self, [
            (lambda: prefill.prefill(PARAMS, cache, LONGEST[8:10], 8),
             "changes the keys and values it holds when it quantizes a group, so rows "
             "prefilled together"),
            (lambda: batched.forward_rows(PARAMS, [(cache, LONGEST[8], 8)]),
             r"items\[0\]: a GroupedCache changes the keys and values")],
            lambda: support.snapshot(cache))
        with self.assertRaisesRegex(ValueError, r"beyond 4.49e\+307, the largest .* turned"):
            GroupedCache(PARAMS, 64, 8, 8, rotate=True).stored([1e308] * 16)
        with self.assertRaisesRegex(ValueError, "no position yet"):
            GroupedCache(PARAMS, 4, 8, 8).bytes_per_position()


class Rotated(unittest.TestCase):
    """What a RotatedCache keeps and refuses."""

    def test_it_takes_its_format_s_bytes_and_copies_and_crops(self):
        ids = TOK.encode(STORIES[0])
        alone = feed(PARAMS, RotatedCache(PARAMS, "int4"), ids)
        cache = RotatedCache(PARAMS, "int4")
        feed(PARAMS, cache, ids[:10])
        self.assertEqual((cache.bytes_per_position(), cache.stores_exactly), (24, False))
        support.assert_same_rows(self, feed(PARAMS, cache.copy(), ids), alone[10:])
        cache.crop(6)
        support.assert_same_rows(self, feed(PARAMS, cache, ids), alone[6:])

    def test_bad_formats_and_what_it_cannot_store_are_refused(self):
        with self.assertRaisesRegex(ValueError, "unknown cache format 'int2'; the formats are "
                                                "float64, float32, float16, int8, int4"):
            RotatedCache(PARAMS, "int2")
        cache, half = RotatedCache(PARAMS, "int4"), RotatedCache(PARAMS, "float16")
        feed(PARAMS, cache, LONGEST[:4])
        key = cache.keys[0]
        support.assert_each_refused(self, [
            (lambda: cache.append(5, key[:3], key), "a key or value of 3 numbers cannot be "
                                                    "stored: a RotatedCache keeps 16"),
            (lambda: cache.extend([5, 6], [key, key], [key, [math.nan] * 16]),
             "a RotatedCache cannot store a vector holding nan"),
            (lambda: cache.append(5, [math.inf] + key[1:], key), "holding inf"),
            (lambda: cache.stored([1e308] + key[1:]), r"is beyond 4.49e\+307, the largest this "
                                                      r"RotatedCache can store turned"),
            (lambda: half.append(5, [3e5] + key[1:], key), "is beyond float16's largest")],
            lambda: (support.snapshot(cache), support.snapshot(half)))


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of GroupedCache and RotatedCache, and
    what Part 3's section 19 says of them."""

    @classmethod
    def setUpClass(cls):
        cls.record = support.recorded("quantization")
        cls.rungs = {rung["cache"]: rung for rung in cls.record["rungs"]}
        cls.ladder = {rung["cache"]: rung for rung in support.recorded("ladder")["rungs"]}

    def test_each_rung_is_the_cache_it_names_counted_as_the_formula_says(self):
        for name, settings in quantization.RUNGS:
            rung = self.rungs[name]
            with self.subTest(name):
                self.assertEqual({key: rung[key] for key in settings}, settings)
                self.assertEqual(rung["bytes_per_position"], bytes_by_formula(
                    settings["bits"], settings["group"], settings["residual"], 64))
        self.assertEqual(len(self.rungs), len(quantization.RUNGS))

    def test_a_quantized_position_takes_int8_s_or_int4_s_bytes(self):
        for bits, fmt in ((4, "int8"), (2, "int4")):
            self.assertEqual({rung["bytes_per_quantized_position"]
                              for rung in self.rungs.values() if rung["bits"] == bits},
                             {self.ladder[fmt]["bytes_per_position"]}, fmt)

    def test_turned_and_back_at_64_bits_the_rows_are_within_rounding(self):
        turned = self.record["turned_only"]
        self.assertEqual((turned["positions"], turned["rows_equal"]), (64, False))
        self.assertLess(turned["largest_logit_gap"], 1e-13)

    def test_re_quantizing_compounds_only_where_a_group_grows(self):
        whole = self.record["whole_groups"]
        self.assertEqual(whole["numbers_moved"], 0)
        self.assertGreater(whole["numbers_requantized"], 0)
        self.assertEqual(whole["largest_key_error"], whole["largest_key_error_quantized_once"])
        grown = self.record["compounding"]
        self.assertGreater(grown["numbers_moved"], 0)
        self.assertGreater(grown["largest_key_error"], grown["largest_key_error_quantized_once"])

    def test_the_rotated_one_scale_rung_is_the_cache_it_names(self):
        self.assertEqual([(r["cache"], r["format"], r["rotate"], r["bytes_per_position"])
                          for r in self.record["one_scale_rungs"]],
                         [(name, fmt, True, self.ladder[fmt]["bytes_per_position"])
                          for name, fmt in quantization.ONE_SCALE_RUNGS])

    def test_the_prompt_rows_reading_quantized_keys_are_a_grouped_cache_s(self):
        """Fed each opening's prompt, a GroupedCache of a rung's settings holds quantized
        positions when these rows read: counted as the record says."""
        settings = quantization.RUNGS[0][1]
        reads = []   # for each opening, each prompt row: whether it read a quantized key
        for opening in support.OPENINGS:
            cache, read = GroupedCache(PARAMS, **settings), []
            for token_id in TOK.encode(opening):
                cache.append(token_id, [0.0] * 16, [0.0] * 16)   # as forward_step does
                read.append(len(cache.stored_values) > 0)        # before the row reads
            reads.append(read)
        self.assertEqual(self.record["prompt_rows"], {
            "residual": settings["residual"], "prompt_rows": sum(map(len, reads)),
            "rows_reading_quantized_keys": sum(map(sum, reads)),
            "stories_choosing_the_first_token_from_them": sum(read[-1] for read in reads)})
        self.assertEqual(sum(map(any, reads)), sum(read[-1] for read in reads),
                         "the stories with a prompt row that read quantized keys, and those "
                         "whose last prompt row (it picks the first token) did")

    def test_what_section_17_says_of_the_rungs(self):
        """At equal bytes a quantized position, int8 and int4 gap less and change fewer
        greedy stories; the rotation helps neither 2-bit figure, and gives one-scale int4 a
        smaller gap but more greedy stories changed; no channel stands out."""
        rotated = self.record["one_scale_rungs"][0]
        self.assertLess(rotated["largest_logit_gap"], self.ladder["int4"]["largest_logit_gap"])
        self.assertGreater(rotated["greedy_stories_changed"],
                           self.ladder["int4"]["greedy_stories_changed"])
        for kivi, fmt in (("KIVI 4-bit, groups of 8", "int8"), ("KIVI 2-bit, groups of 16",
                                                                "int4")):
            for figure in ("largest_logit_gap", "greedy_stories_changed"):
                self.assertGreater(self.rungs[kivi][figure], self.ladder[fmt][figure])
        for figure in ("largest_logit_gap", "greedy_stories_changed", "sampled_stories_changed"):
            self.assertGreaterEqual(self.rungs["rotated 2-bit, groups of 16"][figure],
                                    self.rungs["KIVI 2-bit, groups of 16"][figure])
        self.assertLess(self.record["key_channel_peaks"], self.record["value_channel_peaks"])


if __name__ == "__main__":
    unittest.main()
