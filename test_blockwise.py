"""Attention read block by block: the exact kind's parts merge to forward_step's bits at
every split count, the online and split kinds stay within rounding of them, the
heuristic's split count is FlashAttention-2's rule, and three mistakes planted in the
real kinds are caught."""
import ast
import math
import random
import unittest
import unittest.mock

import batched
import blockwise
import support
from instruments import is_call_of, replacing
from kv_cache import KVCache
from support import OPENINGS, PARAMS, STORIES, TOK, assert_each_mistake_is_caught, tear_down
from verdicts import (Layer, ROUNDING, Wrong, assert_verdicts, excerpt, quick_check_case,
                      set_up, step, story_name)

LAYER = Layer("blockwise", "attention read block by block (blockwise.py)",
              ("lesson", "batched", "serving"))


READS = []   # (story's name, the (q, keys, values) of each of its rows) for two stories


def setUpModule():
    set_up("blockwise")
    for index, story in enumerate(STORIES[:2]):
        READS.append((story_name(index), attention_reads(story)))


tearDownModule = tear_down
def attention_reads(story):
    """The (q, keys, values) that every row of story, fed to the trained model in one
    batch by batched.forward_rows, hands its attention."""
    cache, reads = KVCache(PARAMS), []
    batched.forward_rows(PARAMS, [(cache, token_id, position) for position, token_id
                                  in enumerate(TOK.encode(story))],
                         attention=lambda q, keys, values, rows: reads.append(
                             (q, keys, values)) or batched.exact_attention(q, keys, values))
    return reads


def where_kind_reads_otherwise(name, kind, parts, label, reads, exact_bits):
    """None if the attention kind (named name, splitting a row into parts, or None for
    one pass) gives, for every (q, keys, values) of reads (the rows of label, in order),
    forward_step's mixed values, bit for bit if exact_bits, else within ROUNDING; else a
    Wrong naming the kind, the row, its length and parts, and the first value that strays,
    with both."""
    for row, (q, keys, values) in enumerate(reads):
        shape = f"{len(keys)} position{'s' * (len(keys) > 1)}"
        if parts:
            step(f"cutting row {row} of {label} ({shape}) into parts with "
                 f"blockwise.parts_of({len(keys)}, {parts}), expecting at most {parts} runs "
                 f"of whole blocks")
            cuts = blockwise.parts_of(len(keys), parts)
            if (len(cuts) > parts or [p for cut in cuts for p in cut] != list(range(len(keys)))
                    or any(cut.start % blockwise.BLOCK for cut in cuts)):
                return Wrong(f"the parts of row {row} of {label} ({shape}) for {name}, "
                             f"blockwise.parts_of({len(keys)}, {parts}): {cuts}, not at most "
                             f"{parts} runs of whole blocks of {blockwise.BLOCK} covering "
                             f"positions 0 to {len(keys) - 1} once each")
            shape += f", parts of {', '.join(str(len(cut)) for cut in cuts)}"
        step(f"reading row {row} of {label} ({shape}) with {name}, expecting "
             f"forward_step's mixed values")
        wanted, got = batched.exact_attention(q, keys, values), kind(q, keys, values, 1)
        strays = [index for index, (a, b) in enumerate(zip(got, wanted))
                  if (a != b if exact_bits else not abs(a - b) <= ROUNDING)]
        if strays or len(got) != len(wanted):
            index = strays[0] if strays else min(len(got), len(wanted))
            mine = got[index] if index < len(got) else "nothing"
            wanted_one = wanted[index] if index < len(wanted) else "nothing"
            gap = "" if exact_bits or not strays else (
                f" ({abs(got[index] - wanted[index]):.3g} apart, more than rounding)")
            return Wrong(f"the mixed values of {name}, at row {row} of {label} ({shape}), "
                         f"value {index}: {mine} from blockwise, {wanted_one} from "
                         f"forward_step's attention{gap}",
                         f"  fed: row {row}'s query and its {len(keys)} keys and values, as "
                         f"forward_rows reads them\n  query: {excerpt(q)}\n"
                         f"  {name} gave: {excerpt(got)}\n  expected:  {excerpt(wanted)}")
    return None


def where_split_counts_stray():
    """None if blockwise.split_count gives, for steps of 1 to 8 rows and rows of 1 to 64
    positions, a count of parts from 1 to the row's blocks (and PROCESSORS), and 1 where
    the rows alone fill 80% of the processors; else a Wrong naming the rows and length."""
    for rows in range(1, blockwise.PROCESSORS + 1):
        for length in range(1, 65):
            step(f"blockwise.split_count({rows}, {length}), expecting a count of parts from 1 "
                 f"to the row's {-(-length // blockwise.BLOCK)} blocks of {blockwise.BLOCK}")
            parts = blockwise.split_count(rows, length)
            most = min(blockwise.PROCESSORS, -(-length // blockwise.BLOCK))
            if not (type(parts) is int and 1 <= parts <= most) or (
                    rows >= 0.8 * blockwise.PROCESSORS and parts != 1):
                return Wrong(f"blockwise.split_count({rows}, {length}) for {rows} row(s) of "
                             f"{length} positions is {parts!r}, where a count from 1 to {most} "
                             f"is expected" + (" (1: the rows alone fill the processors)"
                                               if rows >= 0.8 * blockwise.PROCESSORS else ""))
    return None


def quick_check():
    """Every row of the first test story (1 to 30 positions), read by the online kind
    (blocks of 4) and split in 3 and in 5 parts (counts that divide few rows' blocks), by
    the split kind within ROUNDING of forward_step's attention, by the exact kind bit for
    bit; and FlashAttention-2's split counts, each a count the row's blocks allow
    (where_split_counts_stray)."""
    step("reading the first test story's rows through batched.forward_rows")
    reads = attention_reads(STORIES[0])
    for name, kind, parts, exact_bits in (
            ("the online kind", blockwise.online, None, False),
            ("the split kind in 3 parts", blockwise.split(3), 3, False),
            ("the split kind in 5 parts", blockwise.split(5), 5, False),
            ("the exact kind in 3 parts", blockwise.exact(3), 3, True),
            ("the exact kind in 5 parts", blockwise.exact(5), 5, True)):
        why = where_kind_reads_otherwise(name, kind, parts, "the first test story", reads,
                                         exact_bits)
        if why:
            return why
    return where_split_counts_stray()


QuickCheck = quick_check_case("blockwise", __name__)


def where_kind_strays(name, kind, parts, exact_bits):
    """None if kind (named name, in parts or None) reads every row of READS as it should
    (forward_step's bits, or within ROUNDING of them), else the first row where it does
    not, named by its story, row, length and parts, with both values."""
    for label, reads in READS:
        why = where_kind_reads_otherwise(name, kind, parts, label, reads, exact_bits)
        if why:
            return why
    return None


class Kinds(unittest.TestCase):

    def test_the_exact_kind_gives_forward_steps_bits_at_every_split_count(self):
        for parts in (1, 2, 3, 4, 8, 16, 64):
            with self.subTest(parts=parts):
                self.assertIsNone(where_kind_strays(f"the exact kind in {parts} parts",
                                                    blockwise.exact(parts), parts, True))

    def test_the_online_and_split_kinds_stay_within_rounding(self):
        for name, kind, parts in (("the online kind", blockwise.online, None),
                                  *((f"the split kind in {parts} parts", blockwise.split(parts),
                                     parts) for parts in (1, 2, 5, 16))):
            with self.subTest(kind=name):
                self.assertIsNone(where_kind_strays(name, kind, parts, False))

    def test_exact_partials_add_up_to_the_exact_sum(self):
        """2,000 random lists of 0 to 30 floats from 1e-30 to 1e30, of both signs: the
        partials' exact sum (in fractions) is the terms'."""
        from fractions import Fraction
        rng = random.Random(0)
        for case in range(2000):
            terms = [rng.uniform(-1, 1) * 10.0 ** rng.randint(-30, 30)
                     for _ in range(rng.randint(0, 30))]
            with self.subTest(case=case):
                self.assertEqual(sum(map(Fraction, blockwise.exact_partials(terms)), Fraction(0)),
                                 sum(map(Fraction, terms), Fraction(0)))

    def test_exact_partials_end_on_nan_infinities_and_overflow(self):
        """NaN (truthy, so no remainder ever looks like none) and an infinity give fsum's
        sum in one round, counted with fsum; a sum beyond the largest float is refused."""
        with few_sums():
            self.assertTrue(math.isnan(blockwise.exact_partials([1.0, math.nan])[0]))
            self.assertEqual(blockwise.exact_partials([math.inf, 1.0]), [math.inf])
        with self.assertRaisesRegex(ValueError, "terms sum beyond the largest float"):
            blockwise.exact_partials([1.7e308] * 8)

    def test_every_kind_reads_a_masked_block_as_the_exact_attention_does(self):
        """Keys whose scores are all -inf in a block (or a part) weigh nothing, as in
        softmax_row; a row all -inf is NaN in every kind, as in exact_attention."""
        q, values = [1.0] * 4, [[float(j), -2.0 * j] for j in range(12)]
        masked = [[-math.inf] * 4] * 4 + [[0.5 * j] * 4 for j in range(8)]
        expected = batched.exact_attention(q, masked, values)
        for name, kind in blockwise.KINDS.items():
            with self.subTest(kind=name), few_sums():
                for got, want in zip(kind(q, masked, values), expected):
                    self.assertAlmostEqual(got, want, delta=ROUNDING)
                self.assertTrue(all(map(math.isnan, kind(q, [[-math.inf] * 4] * 12, values))))

    def test_random_rows_with_masked_blocks_and_nan_scores_are_read_as_exact_attention(self):
        """Case n draws, from random.Random(n), a row of 1 to 24 keys (a query of positive
        numbers, some zero), whole blocks masked (keys of -inf: scores of -inf), single
        positions masked, and keys holding a NaN or meeting a zero of the query with -inf
        (NaN scores), alone in a masked block too; values finite. Every kind (the online,
        split and exact ones of KINDS, and the heuristic for 1 to 8 rows) gives
        exact_attention's answer: NaN where it is NaN (a NaN score anywhere makes every
        weight NaN), its bits for the exact kinds, within ROUNDING for the others; within
        few_sums (no loop that does not end)."""
        kinds = dict(blockwise.KINDS, heuristic=blockwise.heuristic)

        def check(index):
            rng = random.Random(index)
            width, length = rng.randint(2, 4), rng.randint(1, 24)
            q = [rng.choice((0.0, 0.5, 1.0, rng.uniform(0.1, 2.0))) for _ in range(width)]
            masked = {block for block in range(6) if rng.random() < 0.3}
            keys = []
            for position in range(length):
                key = [rng.uniform(-3.0, 3.0) for _ in range(width)]
                if position // blockwise.BLOCK in masked or rng.random() < 0.1:
                    key = [-math.inf] * width
                if rng.random() < 0.08:   # a NaN score, in a masked block or not
                    key[rng.randrange(width)] = math.nan
                keys.append(key)
            values = [[rng.uniform(-5.0, 5.0) for _ in range(2)] for _ in range(length)]
            expected = batched.exact_attention(q, keys, values)
            for name, kind in kinds.items():
                with few_sums():
                    got = kind(q, keys, values, rng.randint(1, 8))
                exact_bits = name.startswith("exact")
                for column, (a, b) in enumerate(zip(got, expected)):
                    if math.isnan(a) != math.isnan(b) or not math.isnan(b) and (
                            a != b if exact_bits else not abs(a - b) <= ROUNDING):
                        return (f"the {name} kind gives {a!r} for column {column}, where "
                                f"exact_attention gives {b!r} (scores "
                                f"{excerpt(blockwise._scores(q, keys))})")
            return None
        support.check_random_cases(self, 200, check)

    def test_values_a_kinds_unscaled_sums_overflow_are_refused(self):
        """Values of 1.7e308: the exact kinds give exact_attention's; the online and split
        kinds, whose sums come before the division, refuse them by name."""
        q, keys, values = [1.0] * 4, [[1.0] * 4] * 8, [[1.7e308] * 2] * 8
        expected = batched.exact_attention(q, keys, values)
        self.assertEqual(blockwise.exact(2)(q, keys, values), expected)
        for kind in (blockwise.online, blockwise.split(2)):
            with self.assertRaisesRegex(ValueError, "values too large for this attention"):
                kind(q, keys, values)

    def test_parts_are_runs_of_whole_blocks_covering_every_position_once(self):
        for length in range(1, 65):
            for parts in range(1, 10):
                cuts = blockwise.parts_of(length, parts)
                with self.subTest(length=length, parts=parts):
                    self.assertEqual([p for cut in cuts for p in cut], list(range(length)))
                    self.assertLessEqual(len(cuts), parts)
                    self.assertTrue(all(cut.start % blockwise.BLOCK == 0 for cut in cuts))

    def test_served_with_an_exact_kind_every_story_is_generates(self):
        """Serving with the exact kind split in 4: the stories of generate (the split
        kinds' stories are the trace's)."""
        import generate
        import paged
        import serving
        requests = [{"prompt": prompt, "temperature": 1.0, "seed": 1, "max_new_tokens": 12}
                    for prompt in OPENINGS[:4]]
        served, _ = serving.serve(PARAMS, TOK, requests, paged.BlockPool(PARAMS, 64, 4), 4,
                                  attention=blockwise.exact(4))
        self.assertEqual(served, [generate.generate(PARAMS, TOK, **r) for r in requests])


class Batches(unittest.TestCase):

    def test_a_fixed_split_gives_a_row_the_same_bits_in_any_batch_and_the_heuristic_does_not(self):
        """The first rows of three stories, fed one at a time and then together: split(4)
        gives the same logits; heuristic, which splits a row alone into more parts, does
        not."""
        ids = [TOK.encode(story)[:24] for story in STORIES[:3]]

        def rows(attention, together):
            caches = [KVCache(PARAMS) for _ in ids]
            feed_all = [(cache, story[p], p) for p in range(len(ids[0])) for cache, story
                        in zip(caches, ids)]
            if together:
                return [row for p in range(len(ids[0])) for row in batched.forward_rows(
                    PARAMS, feed_all[3 * p:3 * p + 3], attention=attention)]
            return [batched.forward_rows(PARAMS, [item], attention=attention)[0]
                    for item in feed_all]
        self.assertEqual(rows(blockwise.split(4), True), rows(blockwise.split(4), False))
        self.assertNotEqual(rows(blockwise.heuristic, True), rows(blockwise.heuristic, False))


class Heuristic(unittest.TestCase):

    def test_the_split_count_is_the_fewest_parts_that_fill_the_processors_nearly_best(self):
        """FlashAttention-2's rule, checked for every batch and length it meets here."""
        for rows in range(1, 2 * blockwise.PROCESSORS):
            for length in range(1, 65):
                parts = blockwise.split_count(rows, length)
                with self.subTest(rows=rows, length=length):
                    if rows >= 0.8 * blockwise.PROCESSORS:
                        self.assertEqual(parts, 1)
                        continue
                    blocks = math.ceil(length / blockwise.BLOCK)
                    counts = [p for p in range(1, min(blockwise.PROCESSORS, blocks) + 1)
                              if p == 1 or math.ceil(blocks / p) != math.ceil(blocks / (p - 1))]

                    def fullness(p):
                        return rows * p / blockwise.PROCESSORS / math.ceil(
                            rows * p / blockwise.PROCESSORS)
                    self.assertIn(parts, counts)
                    self.assertGreaterEqual(fullness(parts), 0.85 * max(map(fullness, counts)))
                    self.assertTrue(all(fullness(p) < 0.85 * max(map(fullness, counts))
                                        for p in counts if p < parts))

    def test_fewer_rows_split_a_long_row_into_more_parts(self):
        splits = [blockwise.split_count(rows, 64) for rows in (1, 2, 4, 8)]
        self.assertEqual(splits, sorted(splits, reverse=True))
        self.assertGreater(splits[0], 1)
        self.assertEqual(splits[-1], 1)

    def test_rows_of_no_keys_and_bad_counts_are_refused(self):
        """No keys (softmax_row refuses them too), no rows, no positions, no parts: a
        ValueError naming the input, not ZeroDivisionError, IndexError or range's."""
        for name, kind in blockwise.KINDS.items():
            with self.subTest(kind=name), self.assertRaisesRegex(ValueError, "got no keys"):
                kind([1.0] * 4, [], [])
        for call, fragment in ((lambda: blockwise.parts_of(10, 0), "parts must be an int >= 1"),
                               (lambda: blockwise.parts_of(0, 2), "length must be an int >= 1"),
                               (lambda: blockwise.split_count(0, 64), "rows must be an int >= 1"),
                               (lambda: blockwise.split_count(1, 0), "length must be an int >= 1")):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                call()

    def test_a_query_of_another_width_and_sums_of_inf_and_minus_inf_are_refused(self):
        """Every kind refuses, naming it: a query of 3 numbers against keys of 4 (the dot
        products stopped at 3), values fewer than the keys, and infinities that meet with
        both signs in one sum, of a score (q and keys) or of a column of values (fsum's
        "-inf + inf in fsum", which named neither)."""
        q, keys = [1.0, -1.0, 0.5, 0.5], [[0.5] * 4, [0.25] * 4, [0.1] * 4]
        values = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
        for name, kind in blockwise.KINDS.items():
            for args, fragment in (((q[:3], keys, values), "q has 3 numbers, and each key 4"),
                                   ((q, keys, values[:2]), "the attention got 2 values for 3 "
                                                           "keys: one value a key"),
                                   ((q, [[math.inf] * 4] + keys[1:], values),
                                    "q and keys hold infinities whose products meet with both "
                                    "signs in a score"),
                                   ((q, keys, [[math.inf, 1.0], [-math.inf, 1.0], [1.0, 1.0]]),
                                    "values hold inf and -inf in one column")):
                with self.subTest(kind=name, fragment=fragment), \
                        self.assertRaisesRegex(ValueError, fragment):
                    kind(*args)

    def test_bad_split_counts_and_attentions_are_refused(self):
        import paged
        import serving
        for parts in (0, -1, 2.0, True, None):
            with self.subTest(parts=parts), self.assertRaisesRegex(ValueError,
                                                                   "parts must be an int"):
                blockwise.split(parts)
            with self.assertRaisesRegex(ValueError, "parts must be an int"):
                blockwise.exact(parts)
        pool = paged.BlockPool(PARAMS, 8, 4)
        with self.assertRaisesRegex(ValueError, "attention must be a function of"):
            serving.serve(PARAMS, TOK, [{"prompt": OPENINGS[0]}], pool, 1, attention=5)
        self.assertEqual(pool.free_blocks(), 8)


def few_sums(most=1000):
    """A patch of blockwise's fsum that fails after most sums: a loop that would not end
    (on a NaN, say) fails the test instead of hanging it."""
    calls = []

    def counted(terms):
        calls.append(1)
        if len(calls) > most:
            raise AssertionError(f"blockwise took more than {most} sums")
        return math.fsum(terms)
    return unittest.mock.patch.object(blockwise, "fsum", counted)


def not_rescaled_beside(name):
    """A planting: running * rescale + name(...) becomes running + name(...), the running
    value (the sum beside fsum, the output beside dot) kept as it is when a block raises
    the maximum."""
    return replacing(lambda node: isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
                     and isinstance(node.left, ast.BinOp) and isinstance(node.left.op, ast.Mult)
                     and is_call_of(node.right, name),
                     lambda node: ast.BinOp(node.left.left, ast.Add(), node.right))


class Teeth(unittest.TestCase):
    """Each mistake, planted in the real kind, makes it stray from forward_step on one of
    two stories' rows."""

    def test_a_partial_output_not_rescaled_when_the_maximum_grows_is_caught(self):
        assert_each_mistake_is_caught(self, blockwise, "online", {
            "the output so far kept as it is when a block raises the maximum":
                not_rescaled_beside("dot"),
        }, lambda: where_kind_strays("the online kind", blockwise.online, None, False))

    def test_a_merge_that_forgets_a_parts_maximum_is_caught(self):
        assert_each_mistake_is_caught(self, blockwise, "split", {
            "each part's sums merged as they are, not brought to the common maximum":
                replacing(lambda node: is_call_of(node, "exp")
                          and isinstance(node.args[0], ast.BinOp),
                          lambda node: ast.Constant(1.0)),
        }, lambda: where_kind_strays("the split kind in 4 parts", blockwise.split(4), 4,
                                     False))

    def test_exps_from_a_parts_own_maximum_are_caught(self):
        own = ast.parse("max(_scores(q, part_keys))", mode="eval").body
        assert_each_mistake_is_caught(self, blockwise, "exact", {
            "each part's exps taken from its own maximum, not the row's":
                replacing(lambda node: isinstance(node, ast.BinOp) and ast.unparse(node)
                          == "s - top", lambda node: ast.BinOp(node.left, ast.Sub(), own)),
        }, lambda: where_kind_strays("the exact kind in 4 parts", blockwise.exact(4), 4, True))


ROW_OF_THE_STORY = r"at row \d+ of the first test story \(\d+ positions"
MIXED_VALUE = r"\), value \d+: \S+ from blockwise, \S+ from forward_step's attention"


class Verdicts(unittest.TestCase):
    """Each mistake planted in the real blockwise.py (by its syntax tree) makes the
    layer's own check fail, naming the kind (and its split count), the row of the first
    test story, its length and parts, and the mixed value that strays, with both."""

    MISTAKES = [
        ("a row's blocks counted by floor division in split_count (a partial block left out)",
         blockwise, "split_count",
         replacing(lambda node: isinstance(node, ast.Call) and ast.unparse(node)
                   == "math.ceil(length / BLOCK)",
                   lambda node: ast.BinOp(node.args[0].left, ast.FloorDiv(),
                                          node.args[0].right)),
         r"blockwise\.split_count\(\d+, \d+\)"),
        ("the running sum kept as it is when a block raises the maximum", blockwise, "online",
         not_rescaled_beside("fsum"),
         r"the mixed values of the online kind, " + ROW_OF_THE_STORY + MIXED_VALUE
         + r" \(\S+ apart, more than rounding\)"),
        ("the last part stops one short of the row's end (min(..., length - 1))", blockwise,
         "parts_of", replacing(lambda node: is_call_of(node, "min", 2)
                               and isinstance(node.args[1], ast.Name),
                               lambda node: ast.Call(node.func, [node.args[0], ast.BinOp(
                                   node.args[1], ast.Sub(), ast.Constant(1))], [])),
         r"the parts of row 0 of the first test story \(1 position\) for the split kind in 3 "
         r"parts, blockwise\.parts_of\(1, 3\): \[range\(0, 0\)\], not at most 3 runs"),
        ("the blocks of a row shared out by floor division (a part of no blocks)", blockwise,
         "parts_of", replacing(lambda node: isinstance(node, ast.Call)
                               and isinstance(node.func, ast.Attribute)
                               and node.func.attr == "ceil"
                               and isinstance(node.args[0], ast.BinOp)
                               and isinstance(node.args[0].left, ast.Call),
                               lambda node: ast.BinOp(node.args[0].left, ast.FloorDiv(),
                                                      node.args[0].right)),
         r"cutting row 0 of the first test story \(1 position\) into parts with "
         r"blockwise\.parts_of\(1, 3\).*: raised ValueError: range\(\) arg 3 must not be zero"),
        ("the split kind's sums merged without their factors (the outputs with them)",
         blockwise, "split",
         replacing(lambda node: isinstance(node, ast.GeneratorExp)
                   and isinstance(node.elt, ast.BinOp)
                   and isinstance(node.generators[0].target, ast.Tuple)
                   and isinstance(node.generators[0].target.elts[0], ast.Tuple),
                   lambda node: ast.GeneratorExp(node.elt.left, node.generators)),
         r"the mixed values of the split kind in 3 parts, " + ROW_OF_THE_STORY
         + r", parts of [\d, ]+" + MIXED_VALUE),
        ("each part's column sums rounded to one float before the merge (fsum, not "
         "exact_partials)", blockwise, "exact",
         replacing(lambda node: isinstance(node, ast.AugAssign)
                   and is_call_of(node.value, "exact_partials"),
                   lambda node: ast.AugAssign(node.target, ast.Add(), ast.List(
                       [ast.Call(ast.Name("fsum", ast.Load()), node.value.args, [])],
                       ast.Load()))),
         r"the mixed values of the exact kind in 3 parts, " + ROW_OF_THE_STORY
         + r", parts of [\d, ]+" + MIXED_VALUE),
    ]

    def test_each_mistake_is_named_by_the_layer_s_check(self):
        assert_verdicts(self, "blockwise", self.MISTAKES)


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of attention read block by block."""

    def test_exact_partials_give_the_same_bits_and_the_rest_stay_within_rounding(self):
        for kind in support.recorded("blockwise")["kinds"]:
            with self.subTest(kind=kind["kind"], parts=kind["parts"]):
                if kind["kind"] == "exact":
                    self.assertEqual(kind["largest_logit_gap"], 0.0)
                else:   # the same math, reordered
                    self.assertLess(kind["largest_logit_gap"], ROUNDING)


if __name__ == "__main__":
    unittest.main()
