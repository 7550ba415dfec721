"""Hybrid models (hybrid.py): window and full layers, learned sinks and layers that read
another layer's cache, in one deeper model. Every cached row equals the full pass with
each layer's own mask written out, with ==; each layer reads its window; a sink costs no
position and merges once, at any count of parts; a layer that reads another's cache has
no Wk and Wv and keeps nothing, counted; mistakes planted in hybrid.py, the window
pattern and the sink are named by the quick check; bad shapes are refused by name."""
import ast
import math
import random
import unittest

import deep_model
import deep_params
import hybrid
import model
import support
import verdicts
from instruments import recording, replacing
from random_models import random_tokens
from support import STORIES, TOK, swapping
from verdicts import Layer, Wrong, by_layer, deep_label, deep_rows, differ, step

LAYER = Layer("hybrid", "hybrid models: window and full layers, sinks, shared caches "
                        "(hybrid.py)", ("deep_model", "blockwise"))


def setUpModule():
    verdicts.set_up("hybrid")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down
PATTERNS = ((("gpt-oss", 5, 3), [3, None, 3, None, 3]),
            (("gemma-3", 13, 5), [5, 5, 5, 5, 5, None, 5, 5, 5, 5, 5, None, 5]))
TAILS = ((([4, None, 4, None, 4, None], 2), [0, 1, 2, 3, 2, 3]),
         (([None, None, None, None], 3), [0, 0, 0, 0]))   # YOCO's: one cache for the rest


def where_patterns_wrong():
    """None if pattern_windows and shared_tail give the lists worked out plainly here for
    PATTERNS and TAILS (gpt-oss: a window in the even layers; Gemma 3: every sixth layer
    full; a shared layer reads the last layer before the tail with its window), else a
    Wrong naming the call and the layer."""
    for args, wanted in PATTERNS:
        step(f"hybrid.pattern_windows{args}")
        why = differ(f"hybrid.pattern_windows{args}", hybrid.pattern_windows(*args), wanted,
                     "pattern_windows", names=("layer",), fed="pattern, layers, window")
        if why:
            return why
    for args, wanted in TAILS:
        step(f"hybrid.shared_tail{args}")
        why = differ(f"hybrid.shared_tail{args}", hybrid.shared_tail(*args), wanted,
                     "shared_tail", names=("layer",), fed="windows, shared")
        if why:
            return why
    return None


def where_attend_wrong():
    """None if deep_model.attend gives, for a head reading three keys with a sink of 2.0 and
    with none, the weights worked out plainly here (softmax of the scores and the sink as
    a last column, the sink's weight dropped, as gpt-oss's sdpa) and the values weighted by
    them, bit for bit; else a Wrong naming the weight or value."""
    q, scale = [1.0, -0.5], 0.7
    keys, values = [[0.5, 1.0], [1.0, 0.0], [-1.0, 2.0]], [[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]]
    for sink in (2.0, None):
        scores = [math.fsum(a * b for a, b in zip(q, k)) * scale for k in keys]
        column = scores + ([] if sink is None else [sink])
        exps = [math.exp(s - max(column)) for s in column]
        weights = [e / math.fsum(exps) for e in exps][:len(keys)]
        mixed = [math.fsum(w * v[c] for w, v in zip(weights, values)) for c in range(2)]
        step(f"deep_model.attend with the sink {sink}")
        got_mixed, got_weights = deep_model.attend(q, sink, scale, keys, values)
        fed = f"q {q}, sink {sink}, scale {scale}, keys {keys}, values {values}"
        why = (differ(f"deep_model.attend's weights with the sink {sink}", got_weights,
                      weights, "attend", names=("weight",), fed=fed)
               or differ(f"deep_model.attend's mixed values with the sink {sink}", got_mixed,
                         mixed, "attend", names=("value",), fed=fed))
        if why:
            return why
    return None


def written_out(params):
    """Each layer's mask written out from its window: model.band(W), or causal for None."""
    return [model.band(window) if window else deep_model.causal
            for window in deep_params.layer_windows(params["shape"])]


def where_hybrid_differs(params, ids):
    """None if params' DeepCache reads, at each position and layer, its window's positions
    or every one; fed ids, gives rows == the full pass with written_out's masks; and keeps
    numbers_per_position's numbers a position, counted, and 2 x the layers that keep a
    cache x kv_heads x head width; else a Wrong naming the model, layer and position."""
    label, shape = deep_label(params), params["shape"]
    windows = deep_params.layer_windows(shape)
    step(f"{label}: the positions each layer reads (DeepCache.positions_read)")
    reads = [[list(read) for read in deep_model.DeepCache(params).positions_read(i)]
             for i in range(len(ids))]
    why = differ(f"{label}: the positions each layer reads", reads,
                 [[list(range(max(0, i - w + 1) if w else 0, i + 1)) for w in windows]
                  for i in range(len(ids))], "positions_read", ("position", "layer", "entry"),
                 fed=f"windows {windows}: a window w reads i - w + 1 to i")
    caches = []

    def compare(weights):
        rows, cache = deep_rows(weights, ids)
        caches.append(cache)
        step(f"{deep_label(weights)}: its full pass with each layer's mask written out")
        return differ("the cached row", rows, deep_model.forward(weights, ids, written_out(
            weights)), "forward_step", fed=f"token IDs {ids}; expected: deep_model.forward "
                                           f"with model.band(w) or causal, a layer")
    why = why or by_layer(params, compare)
    if why:
        return why
    keeping = [read for layer, read in enumerate(deep_params.kv_layers(shape)) if read == layer]
    plain = 2 * len(keeping) * shape["kv_heads"] * (shape["width"] // shape["heads"])
    counted, formula = caches[0].floats_per_position(), hybrid.numbers_per_position(shape)
    if not counted == formula == plain:
        return Wrong(f"{label}: its DeepCache holds {counted:g} numbers a position, "
                     f"hybrid.numbers_per_position gives {formula}, and 2 x {len(keeping)} "
                     f"layers that keep a cache x kv_heads x head width is {plain}")
    return None


def where_merge_differs(params, ids):
    """None if each head's read of the last row of ids (hybrid.head_reads), merged again
    by hybrid.exact_with_sink in 1 to all of its keys' parts, gives deep_model.attend's
    mixed values bit for bit; else a Wrong naming the parts, layer, head and value."""
    label = deep_label(params)
    step(f"{label}: the reads of the row at position {len(ids) - 1} (hybrid.head_reads)")
    for layer, head, args, mixed in hybrid.head_reads(params, ids):
        sink, keys = args[1], args[3]
        for parts in range(1, len(keys) + 1):
            where = (f"hybrid.exact_with_sink in {parts} parts, {label}: layer {layer}, head "
                     f"{head}, the row at position {len(ids) - 1} ({len(keys)} keys, sink "
                     f"{sink})")
            step(where)
            why = differ(where, hybrid.exact_with_sink(parts)(*args), mixed,
                         "exact_with_sink", names=("value",),
                         fed=f"token IDs {ids}; expected: deep_model.attend's mixed values")
            if why:
                return why
    return None


def quick_models():
    """The quick check's models: gpt-oss's pattern (window 4) on 4 layers of grouped-query
    attention, with sinks and rotary positions, and with learned positions and its last 2
    layers reading earlier layers' caches."""
    windows = hybrid.pattern_windows("gpt-oss", 4, 4)
    return (deep_model.init_params(4, 4, 2, 16, 0, "rotary", windows=windows, sinks=True),
            deep_model.init_params(4, 4, 2, 16, 0, windows=windows,
                                   kv_from=hybrid.shared_tail(windows, 2)))


def quick_check():
    """Hybrid models' patterns, reads, rows, caches and sink merges are what they should be.

    pattern_windows and shared_tail against the lists worked out plainly
    (where_patterns_wrong); deep_model.attend with and without a sink, worked out plainly
    (where_attend_wrong); then the first 12 tokens of the first test story through
    quick_models(): each layer's reads, rows against the full pass with the masks written
    out, numbers a position (where_hybrid_differs); and the last row's heads, merged again
    in every count of parts, against attend's bits (where_merge_differs)."""
    ids = TOK.encode(STORIES[0])[:12]
    why = where_patterns_wrong() or where_attend_wrong()
    if why:
        return why
    step("making quick_models()")
    sinks, shared = quick_models()
    return (where_hybrid_differs(sinks, ids) or where_merge_differs(sinks, ids)
            or where_hybrid_differs(shared, ids))


QuickCheck = verdicts.quick_check_case("hybrid", __name__)


def expression(source):
    return ast.parse(source, mode="eval").body


def in_every_part(tree):
    """The sink's exp added to every part's exact partials, not once at the merge."""
    return all([replacing(lambda node: isinstance(node, ast.GeneratorExp)
                          and ast.unparse(node) == "(exp(s - top) for s in part)",
                          lambda node: expression("(exp(s - top) for s in part + sinks)"))(tree),
                replacing(lambda node: isinstance(node, ast.BinOp)
                          and ast.unparse(node.right) == "[exp(s - top) for s in sinks]",
                          lambda node: node.left)(tree)])


SINKS = (r"the 4-layer grouped-query model \(4 heads, 2 kv heads, rotary positions, windows "
         r"\[4, None, 4, None\], sinks\)")
SHARED_LABEL = (r"the 4-layer grouped-query model \(4 heads, 2 kv heads, learned positions, "
                r"windows \[4, None, 4, None\], kv_from \[0, 1, 0, 1\]\)")


class QuickCheckTeeth(unittest.TestCase):
    """Each mistake planted in the real hybrid.py, or in the window pattern and the sink
    of deep_model.py, makes the quick check fail with a line naming the module's function,
    the quantity and where (layer, position, parts, head), with both values."""

    MISTAKES = [
        ("the sink added in every part, not once at the merge", hybrid, "exact_with_sink",
         in_every_part,
         r"^hybrid\.exact_with_sink in 2 parts, " + SINKS + r": layer 0, head 0, the row at "
         r"position 11 \(4 keys, sink \S+\), at value 0: \S+ from exact_with_sink, \S+ "
         r"expected$"),
        ("Gemma 3's full layer first (layer % 6, not (layer + 1) % 6)", hybrid,
         "pattern_windows", swapping("(layer + 1) % 6", "layer % 6"),
         r"^hybrid\.pattern_windows\('gemma-3', 13, 5\), at layer 0: None from "
         r"pattern_windows, 5 expected$"),
        ("a shared layer reads the first earlier layer of its window, not the last", hybrid,
         "shared_tail", swapping("kind[-1]", "kind[0]"),
         r"^hybrid\.shared_tail\(\[4, None, 4, None, 4, None\], 2\), at layer 4: 0 from "
         r"shared_tail, 2 expected$"),
        ("numbers a position counted for every layer, not those that keep a cache", hybrid,
         "numbers_per_position",
         swapping("read == layer", "True"),
         r"^" + SHARED_LABEL + r": its DeepCache holds 32 numbers a position, "
         r"hybrid\.numbers_per_position gives 64, and 2 x 2 layers that keep a cache x "
         r"kv_heads x head width is 32$"),
        ("a window layer reads one position more than its window", deep_model, "own_mask",
         swapping("band(window)", "band(window + 1)"),
         r"^" + SINKS + r": the positions each layer reads, at position 4, layer 0: 5 items "
         r"from positions_read, 4 items expected$"),
        ("the sink left out of the softmax (both paths share attend)", deep_model, "attend",
         swapping("softmax_row(scores) if sink is None else softmax_row(scores + [sink])[:-1]",
                  "softmax_row(scores)"),
         r"^deep_model\.attend's weights with the sink 2\.0, at weight 0: \S+ from attend, "
         r"\S+ expected$"),
        ("the full pass's shared layer reads the layer before it, not kv_from's", deep_model,
         "forward", swapping("kept[read]", "kept[-1]"),
         r"^" + SHARED_LABEL + r", wrong from layer 2 on \(layers 0 to 1 alone agree\): the "
         r"cached row, at position \d+, logit \d+: \S+ from forward_step, \S+ expected$"),
    ]

    def test_the_quick_check_names_each_mistake_and_where(self):
        verdicts.assert_verdicts(self, "hybrid", self.MISTAKES)


def random_hybrid(rng):
    """A random hybrid model: 1 to 6 layers, a width of 8 or 16, heads and kv heads that
    divide it, learned or rotary positions, each layer full or of a window of 1 to 8,
    sinks or none, and each layer reading its own cache or, one in two where it can, an
    earlier layer's of its window that keeps one."""
    layers, width = rng.randint(1, 6), rng.choice((8, 16))
    heads = rng.choice((1, 2, 4))
    kv_heads = rng.choice([k for k in (1, 2, 4) if heads % k == 0])
    windows = [rng.choice((None, rng.randint(1, 8))) for _ in range(layers)]
    kv_from = []
    for layer, window in enumerate(windows):
        keeping = [j for j in range(layer) if kv_from[j] == j and windows[j] == window]
        kv_from.append(rng.choice(keeping) if keeping and rng.random() < 0.5 else layer)
    return deep_model.init_params(layers, heads, kv_heads, width, rng.randrange(99),
                                  rng.choice(("learned", "rotary")), windows=windows,
                                  sinks=rng.random() < 0.5, kv_from=kv_from)


class Exactness(unittest.TestCase):

    def test_random_patterns_sinks_and_shared_caches(self):
        """Case n draws from random.Random(n) a random_hybrid model and 6 to 24 tokens:
        where_hybrid_differs finds nothing (reads, rows, numbers a position), and the rows
        equal deep_model.forward's with no mask given (each layer its own)."""
        def check(index):
            rng = random.Random(index)
            params = random_hybrid(rng)
            ids = random_tokens(rng.randint(6, 24), seed=index)
            why = where_hybrid_differs(params, ids)
            if why is None and deep_rows(params, ids)[0] != deep_model.forward(params, ids):
                why = f"{deep_label(params)}: the cached rows differ from forward's, no mask given"
            return why
        support.check_random_cases(self, 3, check)


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of the hybrid models."""

    def test_every_model_is_exact_and_counted_and_the_sinks_cost_no_position(self):
        """Every model's rows equal its full pass's (largest gap 0.0) at every position;
        its cache holds every position and the numbers numbers_per_position counts; the
        model with sinks holds as much without them, its rows differ, and every merging of
        its last row's reads is attend's."""
        record = support.recorded("hybrid_models")
        for run in record["models"]:
            with self.subTest(model=run["model"]):
                self.assertEqual((run["rows_compared"], run["largest_logit_gap"],
                                  run["positions_held"]),
                                 (record["positions"], 0.0, record["positions"]))
                self.assertEqual(run["numbers_per_position"], run["formula"])
        sinks = record["sinks"]
        self.assertEqual(sinks["positions_held"], [record["positions"]] * 2)
        self.assertEqual(sinks["numbers_per_position"][0], sinks["numbers_per_position"][1])
        self.assertGreater(sinks["largest_logit_change"], 0.0)
        self.assertEqual(sinks["mergings_equal"], sinks["mergings_compared"])
        self.assertGreater(sinks["mergings_compared"], sinks["reads"])

    def test_window_layers_counted_full_double_gpt_oss_20b_s_cache(self):
        """hf-mem issue #70's case: gpt-oss-20b, 32 requests of 8,192 tokens, 12.00 GiB with
        every layer full against 6.09 GiB with its window layers holding 128 positions."""
        self.assertEqual(hybrid.WORKLOADS[0], (8192, 32))
        found = support.recorded("hybrid_models")["real_models"][0]
        self.assertEqual(found["model"], "gpt-oss-20b")
        self.assertEqual(found["bytes_as_full"][0], 12 * 2 ** 30)
        self.assertEqual(found["bytes_as_windows"][0],
                         32 * 2 * 8 * 64 * 2 * (12 * 8192 + 12 * 128))


class Sinks(unittest.TestCase):

    def test_the_merge_gives_attend_s_bits_for_any_sink_at_every_count_of_parts(self):
        """Every head's read of every row of 8 tokens through the quick check's model with
        sinks, with its own sink, one far below its scores (-30), one far above (30) and
        none: exact_with_sink in 1 to all of its keys' parts == deep_model.attend's."""
        params, ids = quick_models()[0], random_tokens(8)
        with recording(deep_model, "attend") as calls:
            hybrid.fed(params, ids)
        for call in calls:
            q_h, own, scale, keys, values = call.args
            for sink in (own, -30.0, 30.0, None):
                wanted = deep_model.attend(q_h, sink, scale, keys, values)[0]
                for parts in range(1, len(keys) + 1):
                    self.assertEqual(hybrid.exact_with_sink(parts)(q_h, sink, scale, keys,
                                                                   values), wanted,
                                     f"{parts} parts of {len(keys)} keys, sink {sink}")


def numbers_in(params):
    """The numbers params holds, counted: every weight of every matrix and vector."""
    def count(value):
        return sum(map(count, value)) if isinstance(value, list) else 1
    return sum(count(value) for name, value in params.items() if name != "blocks") + sum(
        count(value) for block in params["blocks"] for value in block.values())


class Sharing(unittest.TestCase):

    def test_a_layer_that_reads_another_s_cache_has_no_wk_wv_and_keeps_nothing(self):
        """The quick check's model whose layers 2 and 3 read layers 0's and 1's caches:
        they hold no Wk and Wv (2 x 2 x 16 x 8 = 512 numbers fewer than the same model
        without kv_from), and fed 5 tokens their lists in the cache are none, {}."""
        shared = quick_models()[1]
        alike = deep_model.init_params(4, 4, 2, 16, 0, windows=shared["shape"]["windows"])
        self.assertEqual([sorted({"Wk", "Wv"} & set(block)) for block in shared["blocks"]],
                         [["Wk", "Wv"], ["Wk", "Wv"], [], []])
        self.assertEqual(numbers_in(alike) - numbers_in(shared), 2 * 2 * 16 * 8)
        _, cache = hybrid.fed(shared, random_tokens(5))
        self.assertEqual([sorted(layer) for layer in cache.layers],
                         [["keys", "values"], ["keys", "values"], [], []])
        self.assertEqual([len(layer["keys"]) for layer in cache.layers[:2]], [5, 5])


class Defaults(unittest.TestCase):

    def test_a_model_without_hybrid_fields_is_made_and_read_as_before(self):
        """init_params without windows, sinks and kv_from keeps a shape of SHAPE's fields
        alone, and the same params given their defaults; such a model's own mask is causal,
        in forward and in its DeepCache."""
        params = deep_model.init_params(2, 4, 2, 16, 0)
        self.assertEqual(tuple(params["shape"]), deep_params.SHAPE)
        self.assertEqual(params, deep_model.init_params(2, 4, 2, 16, 0, windows=None,
                                                        sinks=False, kv_from=None))
        self.assertIs(deep_model.own_mask(params["shape"]), deep_model.causal)
        self.assertIs(deep_model.DeepCache(params).mask, deep_model.causal)


class Refusals(unittest.TestCase):

    def test_bad_windows_sinks_and_kv_from_are_refused_naming_them(self):
        """Refused by init_params (so by DeepCache and forward, whose check_params calls
        the same check), before a weight is made, naming the field."""
        for given, fragment in (
                (dict(windows=[4, None]), r"windows must be None or a list of one entry a "
                                          r"layer \(3\), got \[4, None\]"),
                (dict(windows=(4, None, 4)), r"windows must be None or a list"),
                (dict(windows=[0, None, 4]), r"windows\[0\] must be an int from 1 to 64 \(the "
                                             r"positions a row reads; None for a full layer\), "
                                             r"got 0"),
                (dict(windows=[4, 65, 4]), r"windows\[1\] must be an int from 1 to 64"),
                (dict(windows=[4, 2.0, 4]), r"windows\[1\] must be an int .*, got 2\.0"),
                (dict(windows=[4, None, True]), r"windows\[2\] must be an int .*, got True"),
                (dict(sinks=1), r"sinks must be True or False .*, got 1"),
                (dict(sinks="yes"), r"sinks must be True or False .*, got 'yes'"),
                (dict(sinks=None), r"sinks must be True or False .*, got None"),
                (dict(kv_from=[0, 0]), r"kv_from must be None or a list of one entry a layer"),
                (dict(kv_from=[0, 2, 2]), r"kv_from\[1\] must be an int from 0 to 1 \(the "
                                          r"layer itself, or an earlier one\), got 2"),
                (dict(kv_from=[1, 1, 2]), r"kv_from\[0\] must be an int from 0 to 0"),
                (dict(kv_from=[0, -1, 2]), r"kv_from\[1\] must be an int from 0 to 1"),
                (dict(kv_from=[0, 0, 1]), r"kv_from\[2\] is 1, a layer that keeps no cache of "
                                          r"its own \(it reads layer 0's\): read that one"),
                (dict(windows=[4, None, None], kv_from=[0, 0, 2]),
                 r"kv_from\[1\] is 0, a layer of window 4, and layer 1's window is None: a "
                 r"layer reads the cache of a layer of its own window")):
            with self.subTest(given=given), self.assertRaisesRegex(ValueError, fragment):
                deep_model.init_params(3, 4, 2, 16, 0, **given)
        with self.assertRaisesRegex(ValueError, "a latent model's layers are all alike here"):
            deep_model.init_params(2, 4, 4, 16, 0, "learned", 8, sinks=True)

    def test_params_whose_hybrid_fields_were_edited_by_hand_are_refused(self):
        """A shape with a field of another name, or a window list of another length; sinks
        in the shape but not in the blocks; kv_from in the shape with Wk still held:
        refused by DeepCache and forward alike, naming what is wrong."""
        sinks, shared = quick_models()
        no_sinks = dict(sinks, blocks=hybrid.without_sinks(sinks)["blocks"])
        own = deep_model.init_params(4, 4, 2, 16, 0, windows=shared["shape"]["windows"])
        for params, fragment in (
                (dict(shared, shape=dict(shared["shape"], window=4)),
                 r"a \"shape\" of .* \(and any of windows, sinks, kv_from\)"),
                (dict(shared, shape=dict(shared["shape"], windows=[4])),
                 r"windows must be None or a list of one entry a layer \(4\)"),
                (no_sinks, r"blocks\[0\] must hold \[.*'sinks'"),
                (dict(own, shape=shared["shape"]), r"blocks\[2\] must hold \['W1', 'W2', 'Wo', "
                                                   r"'Wq', 'b1', 'b2', 'ln1_b'")):
            for attempt in (lambda: deep_model.DeepCache(params),
                            lambda: deep_model.forward(params, [1, 2])):
                with self.subTest(fragment=fragment), \
                        self.assertRaisesRegex(ValueError, fragment):
                    attempt()

    def test_the_helpers_refuse_bad_arguments_naming_them(self):
        shape = quick_models()[0]["shape"]
        for attempt, fragment in (
                (lambda: hybrid.pattern_windows("gemma-4", 6, 4),
                 r"pattern must be \"gpt-oss\" or \"gemma-3\", got 'gemma-4'"),
                (lambda: hybrid.pattern_windows("gpt-oss", 0, 4), "layers must be an int >= 1"),
                (lambda: hybrid.pattern_windows("gpt-oss", 4, 0), r"window must be an int >= 1"),
                (lambda: hybrid.pattern_windows("gpt-oss", 4, 4.0), r"window must be an int"),
                (lambda: hybrid.shared_tail((4, None), 1), r"windows must be a list"),
                (lambda: hybrid.shared_tail([4, None], 2), r"shared must be an int from 0 to 1 "
                                                           r"\(at least one layer keeps a cache\)"),
                (lambda: hybrid.shared_tail([4, 4, None], 1),
                 r"layer 2's window is None, and no layer before the shared tail \(layers 0 to "
                 r"1\) has it"),
                (lambda: hybrid.numbers_per_position({"width": 16}), r"shape must be a "
                                                                     r"deep_model shape"),
                (lambda: hybrid.numbers_per_position(dict(shape, sinks=2)), r"sinks must be"),
                (lambda: hybrid.numbers_per_position(
                    deep_model.init_params(1, 4, 4, 16, 0, "learned", 8)["shape"]),
                 r"latent_attention\.cache_floats"),
                (lambda: hybrid.exact_with_sink(0), r"parts must be an int >= 1, got 0"),
                (lambda: hybrid.exact_with_sink(3)([1.0], None, 1.0, [[1.0], [2.0]],
                                                   [[1.0], [2.0]]),
                 r"parts must be an int from 1 to 2 \(the row's 2 keys\), got 3")):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                attempt()


if __name__ == "__main__":
    unittest.main()
