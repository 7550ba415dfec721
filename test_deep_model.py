"""The deeper model's cache is exact too: for multi-head, grouped-query and multi-query
attention, one to four layers, every cached row equals the full pass's with ==; mistakes
of layers, heads and the turn, planted in the real forward_step and rotate, are caught,
and the layer's quick check names each by its model, layer, position and logit; a window
drops what a row sees in one layer but not through several."""
import ast
import copy
import random
import unittest

import deep_model
import model
import support
import verdicts
from generate import load_trained
from instruments import is_call_of, replacing
from random_models import random_tokens
from support import PARAMS, STORIES, TOK, assert_each_mistake_is_caught, assert_each_refused, check_random_cases, deep_snapshot, tear_down
from verdicts import (Layer, deep_label, deep_rows, differ, quick_check_case, set_up, step,
                      where_deep_rows_differ)

LAYER = Layer("deep_model", "the deeper model (deep_model.py)", ("lesson", "deep_params"))


SHAPES = [(layers, heads, kv_heads) for layers in (1, 2, 3, 4)
          for heads, kv_heads in ((1, 1), (4, 4), (4, 2), (4, 1))]   # MHA, GQA, MQA


def assert_rows_equal(test, params, ids, mask=None):
    """where_deep_rows_differ finds nothing; an exception the model raises is a failure
    that names the step it interrupted (the model and the position), not a traceback."""
    why = verdicts.checked(lambda: where_deep_rows_differ(params, ids, mask))
    if why:
        test.fail(why)


def fed_rows(test, params, ids):
    """deep_rows(params, ids), or a failure naming the step an exception interrupted."""
    fed = []
    why = verdicts.checked(lambda: fed.append(deep_rows(params, ids)))
    if why:
        test.fail(why)
    return fed[0]


def setUpModule():
    set_up("deep_model")   # the deeper model's quick check first


tearDownModule = tear_down
def where_rotate_turns_wrong():
    """None if deep_model.rotate turns the pairs (1, 0) and (0, 1) by their angles
    (position x theta) to (cos, sin) and (-sin, cos), as a turn does, exactly (each
    number a sum of one product and a zero); else a Wrong naming the number."""
    import math
    position, thetas = 3, [0.5, 0.25]
    first, second = (position * theta for theta in thetas)
    step("turning the pairs (1, 0) and (0, 1) with deep_model.rotate")
    return differ(f"deep_model.rotate's turn of the pairs (1, 0) and (0, 1) by the angles "
                  f"{first:g} and {second:g}", deep_model.rotate([1.0, 0.0, 0.0, 1.0],
                                                                 position, thetas),
                  [math.cos(first), math.sin(first), -math.sin(second), math.cos(second)],
                  "rotate", names=("number",),
                  fed=f"x = [1.0, 0.0, 0.0, 1.0], position {position}, thetas {thetas}: a "
                      f"turn by the angle a takes (1, 0) to (cos a, sin a), (0, 1) to "
                      f"(-sin a, cos a)")


def where_heads_of_wrong(params):
    """None if deep_model.heads_of gives, for params' shape, what its docstring says: the
    heads, the head width d, a head's key width (d and the rotary key), the query heads a
    key-value head serves and 1 / sqrt(key width); else a Wrong naming the entry."""
    import math
    shape = params["shape"]
    d = shape["width"] // shape["heads"]
    d_key = d + shape["rotary_key"]
    step(f"{deep_label(params)}: its heads (deep_model.heads_of)")
    return differ(f"{deep_label(params)}: deep_model.heads_of (heads, head width, key width, "
                  f"query heads a kv head serves, 1 / sqrt(key width))",
                  list(deep_model.heads_of(shape)),
                  [shape["heads"], d, d_key, shape["heads"] // shape["kv_heads"],
                   1 / math.sqrt(d_key)], "heads_of", names=("entry",), fed=f"shape {shape}")


def where_angles_wrong(params):
    """None if deep_model.angles gives, for params' shape, pair i of every head of q and k
    the angle 10000^(-2i/d) (d the head width) and pair i of a rotary query or key
    10000^(-2i/r) (r the rotary key's width), as RoFormer's, and none with learned
    positions; else a Wrong naming the pair."""
    shape = params["shape"]
    heads, d, r = shape["heads"], shape["width"] // shape["heads"], shape["rotary_key"]
    wanted = [[], []]   # learned positions: no turn
    if shape["positions"] == "rotary":
        wanted = [[10000.0 ** (-2 * i / d) for _ in range(heads) for i in range(d // 2)],
                  [10000.0 ** (-2 * i / r) for _ in range(heads) for i in range(r // 2)]]
    step(f"{deep_label(params)}: its rotary angles (deep_model.angles)")
    return differ(f"{deep_label(params)}: deep_model.angles (thetas, then r_thetas)",
                  list(deep_model.angles(shape)), wanted, "angles", names=("list", "pair"),
                  fed=f"shape {shape}")


def where_lesson_differs(ids):
    """None if a 1-layer, 1-head deep_model holding the lesson's trained weights gives the
    lesson's rows (model.forward's), fed ids through its cache; else a Wrong naming the
    position and the logit. The deeper model does the lesson's arithmetic per layer and
    per head, so this meets what its two paths share (and would share a mistake in)."""
    step("holding the lesson's weights in a 1-layer, 1-head deep_model")
    block = {name: PARAMS[name] for name in ("ln1_g", "ln1_b", "Wq", "Wk", "Wv", "Wo", "ln2_g",
                                             "ln2_b", "W1", "b1", "W2", "b2")}
    params = {"shape": {"layers": 1, "heads": 1, "kv_heads": 1, "width": model.WIDTH,
                        "positions": "learned", "latent": None, "rotary_key": 0},
              "blocks": [block], **{name: PARAMS[name] for name in ("tok_emb", "pos_emb", "lnf_g",
                                                                     "lnf_b", "W_out", "b_out")}}
    label = f"{deep_label(params)} holding the lesson's weights"
    rows, _ = deep_rows(params, ids, label=label)
    step("the lesson's full pass (model.forward)")
    return differ(f"{label}: the cached row",
                  rows, model.forward(PARAMS, ids)[0], "forward_step",
                  fed=f"token IDs {ids}; expected: the lesson's model.forward")


DEEP_MODELS = ((2, 4, 2, 16, 0), (2, 4, 1, 16, 0, "rotary"), (2, 4, 4, 16, 0, "learned", 8),
               (2, 4, 4, 16, 0, "rotary", 8))   # deep_model.init_params's arguments


def with_biases_and_gains_drawn(params, seed=0):
    """params with every gain and bias (each vector of a layer, and the final ones) drawn
    at random, each layer its own: init_params makes them 1 and 0 in every layer, and then
    a row that reads another layer's would look right."""
    rng = random.Random(seed)

    def drawn(name, value):
        if isinstance(value, list) and value and not isinstance(value[0], list):
            return [rng.gauss(1.0 if name.endswith("_g") else 0.0, 0.3) for _ in value]
        return value
    return dict(params, blocks=[{name: drawn(name, value) for name, value in block.items()}
                                for block in params["blocks"]],
                **{name: drawn(name, value) for name, value in params.items()
                   if name not in ("shape", "blocks")})


def quick_check():
    """The deeper model's cached rows are its full pass's and the lesson's; a turn is a turn.

    Feeds deep_model.rotate the pairs (1, 0) and (0, 1) (where_rotate_turns_wrong); the
    first 12 tokens of the first test story through a 1-layer, 1-head deep_model holding
    the lesson's weights, whose rows are the lesson's (where_lesson_differs); then through
    the cache of 2-layer models of grouped-query attention (4 heads, 2 kv heads, learned
    positions), multi-query attention (rotary) and latent attention (learned, and rotary
    with a rotary key): their heads as heads_of's docstring says (where_heads_of_wrong),
    their rotary angles RoFormer's (where_angles_wrong), and every row == the full pass's
    (where_deep_rows_differ); and, for the grouped-query model, with a mask a layer (a band
    of 2 in layer 0, causal in layer 1)."""
    ids = TOK.encode(STORIES[0])[:12]
    why = where_rotate_turns_wrong() or where_lesson_differs(ids)
    for args in DEEP_MODELS:
        if why:
            return why
        step(f"making a model of deep_model.init_params{args}")
        params = with_biases_and_gains_drawn(deep_model.init_params(*args))
        why = (where_heads_of_wrong(params) or where_angles_wrong(params)
               or where_deep_rows_differ(params, ids))
        if args == DEEP_MODELS[0]:
            why = why or where_deep_rows_differ(params, ids, [model.band(2), deep_model.causal])
    return why


QuickCheck = quick_check_case("deep_model", __name__)


class Exactness(unittest.TestCase):

    def test_every_cached_row_equals_the_full_pass_for_every_shape(self):
        """16 positions, seed 1 (the trace does every shape of 4 heads on 64 positions
        with seed 0)."""
        ids = random_tokens(16)
        for layers, heads, kv_heads in SHAPES:
            params = deep_model.init_params(layers, heads, kv_heads, 16, 1)
            with self.subTest(layers=layers, heads=heads, kv_heads=kv_heads):
                assert_rows_equal(self, params, ids)

    def test_random_shapes_masks_and_inputs(self):
        """Case n draws, from random.Random(n), 1 to 3 layers, a width of 4 to 24, heads
        that divide it and key-value heads that divide those (or, one case in three, a
        latent of 2 to 12 and, if rotary, a rotary key of 0 to 6), learned or (for an even
        head width) rotary positions, a seed, 1 to 20 random tokens, and the causal mask,
        a band of 1 to 8 (with sinks) or a band of its own in each layer: every cached row
        == the full pass's, and the
        cache keeps 2 x layers x kv_heads x head width numbers a position (the rotation
        adds none), or layers x (latent + rotary key)."""
        def check(index):
            rng = random.Random(index)
            width = rng.choice((4, 6, 8, 12, 16, 24))
            heads = rng.choice([h for h in range(1, width + 1) if width % h == 0])
            kv_heads = rng.choice([k for k in range(1, heads + 1) if heads % k == 0])
            layers = rng.randint(1, 3)
            positions = rng.choice(("learned", "rotary")) if width // heads % 2 == 0 else "learned"
            latent, rotary_key = None, 0
            if rng.randrange(3) == 0:
                kv_heads, latent = heads, rng.randint(2, 12)
                rotary_key = rng.choice((0, 2, 4, 6)) if positions == "rotary" else 0
            params = deep_model.init_params(layers, heads, kv_heads, width, rng.randrange(99),
                                            positions, latent, rotary_key)
            window = rng.randint(1, 8)
            mask = rng.choice((deep_model.causal, model.band(window, rng.randrange(window)),
                               [model.band(rng.randint(1, 8)) for _ in range(layers)]))
            ids = random_tokens(rng.randint(1, 20), seed=index)
            rows, cache = deep_rows(params, ids, mask)
            label = (f"{layers} layers, {heads} heads, {kv_heads} kv heads, width {width}, "
                     f"{positions} positions, latent {latent}, rotary key {rotary_key}")
            if rows != deep_model.forward(params, ids, mask):
                return f"{label}: {where_deep_rows_differ(params, ids, mask)}"
            kept = (layers * (latent + rotary_key) if latent
                    else 2 * layers * kv_heads * (width // heads))
            if cache.floats_per_position() != kept:
                return (f"{label}: the cache keeps {cache.floats_per_position()} numbers a "
                        f"position, where the formula counts {kept}")
            return None
        check_random_cases(self, 15, check)

    def test_the_cache_keeps_2_x_layers_x_kv_heads_x_head_width_numbers_per_position(self):
        for layers, heads, kv_heads in SHAPES:
            params = deep_model.init_params(layers, heads, kv_heads, 16, 0)
            with self.subTest(layers=layers, heads=heads, kv_heads=kv_heads):
                _, cache = fed_rows(self, params, random_tokens(5))
                self.assertEqual(cache.floats_per_position(),
                                 2 * layers * kv_heads * (16 // heads),
                                 f"the numbers the cache keeps a position "
                                 f"({layers} layers, {heads} heads, {kv_heads} kv heads)")


def both(*mistakes):
    """A mistake for plant made of several, each of which must find its place."""
    return lambda tree: all([mistake(tree) for mistake in mistakes])


class Teeth(unittest.TestCase):
    """Each mistake planted in the real deep_model.forward_step makes a row differ."""

    MISTAKES = {
        "a query head reads the wrong key-value head (head % group, not head // group)":
            replacing(lambda node: isinstance(node, ast.BinOp)
                      and isinstance(node.op, ast.FloorDiv) and isinstance(node.left, ast.Name)
                      and node.left.id == "head",
                      lambda node: ast.BinOp(node.left, ast.Mod(), node.right)),
        "every layer reads and writes the first layer's cache":
            replacing(lambda node: isinstance(node, ast.Attribute) and node.attr == "layers"
                      and isinstance(node.value, ast.Name) and node.value.id == "cache",
                      lambda node: ast.parse("[cache.layers[0]] * len(cache.layers)",
                                             mode="eval").body),
        "each head's output placed before the heads before it (the wrong columns)":
            replacing(lambda node: isinstance(node, ast.AugAssign)
                      and isinstance(node.target, ast.Name) and node.target.id == "mixed",
                      lambda node: ast.Assign([ast.Name("mixed", ast.Store())],
                                              ast.BinOp(node.value, ast.Add(),
                                                        ast.Name("mixed", ast.Load())))),
    }

    ROTATION_MISTAKES = {
        "keys cached before their rotation, and rotated when read by the reading position":
            both(replacing(lambda node: isinstance(node, ast.Assign)
                           and ast.unparse(node.targets[0]) == "(q, k)",
                           lambda node: ast.Assign([ast.Name("q", ast.Store())],
                                                   node.value.elts[0])),
                 replacing(lambda node: isinstance(node, ast.ListComp)
                           and ast.unparse(node.elt) == "held_keys[j]",
                           lambda node: ast.ListComp(
                               ast.parse("rotate(held_keys[j], position, thetas)",
                                         mode="eval").body, node.generators))),
        "the query rotated by the next position (position + 1)":
            replacing(lambda node: isinstance(node, ast.Call)
                      and ast.unparse(node).startswith("rotate(q,"),
                      lambda node: ast.Call(node.func, [node.args[0],
                                                        ast.parse("position + 1",
                                                                  mode="eval").body,
                                                        *node.args[2:]], [])),
    }

    def test_each_mistake_of_layers_and_heads_is_caught(self):
        self.check_caught(deep_model.init_params(2, 4, 2, 16, 0), self.MISTAKES)

    def test_each_mistake_of_the_rotation_is_caught(self):
        self.check_caught(deep_model.init_params(2, 4, 2, 16, 0, "rotary"),
                          self.ROTATION_MISTAKES)

    def check_caught(self, params, mistakes):
        """params is a GQA model: two query heads a group."""
        ids = random_tokens(12)
        assert_rows_equal(self, params, ids)
        assert_each_mistake_is_caught(self, deep_model, "forward_step", mistakes,
                                      lambda: where_deep_rows_differ(params, ids))


def expression(source):
    return ast.parse(source, mode="eval").body


def a_position_on(call):
    """A call of rotate(x, position, thetas) turned into rotate(x, position + 1, thetas)."""
    call.args[1] = ast.BinOp(call.args[1], ast.Add(), ast.Constant(1))
    return call


KV_HEAD_BY_MODULO = replacing(   # kv = head // group becomes head % group
    lambda node: isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv),
    lambda node: ast.BinOp(node.left, ast.Mod(), node.right))
KV_HEAD_BY_KV_HEADS = replacing(   # kv = head // group becomes head // kv_heads
    lambda node: isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv),
    lambda node: ast.BinOp(node.left, ast.FloorDiv(), expression('params["shape"]["kv_heads"]')))
FIRST_LAYER_S_CACHE = replacing(   # cache.layers becomes [cache.layers[0]] * layers
    lambda node: (isinstance(node, ast.Attribute) and node.attr == "layers"
                  and isinstance(node.value, ast.Name) and node.value.id == "cache"),
    lambda node: expression("[cache.layers[0]] * len(cache.layers)"))
QUERY_A_POSITION_ON = replacing(   # q, k = rotate(q, position + 1, ...), rotate(k, position, ...)
    lambda node: (isinstance(node, ast.Tuple) and len(node.elts) == 2
                  and all(is_call_of(element, "rotate") for element in node.elts)),
    lambda node: ast.Tuple([a_position_on(node.elts[0]), node.elts[1]], ast.Load()))
SIN_SIGN = replacing(   # in rotate, (cos, -sin) becomes (cos, sin): no longer a turn
    lambda node: isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub),
    lambda node: node.operand)
NOT_ITSELF = replacing(   # layer["keys"] + [k] becomes layer["keys"]: the new key not held
    lambda node: (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
                  and isinstance(node.right, ast.List) and isinstance(node.left, ast.Subscript)
                  and isinstance(node.left.slice, ast.Constant)
                  and node.left.slice.value == "keys"),
    lambda node: node.left)
SCALED_BY_WIDTH = replacing(   # 1 / sqrt(d_key) becomes 1 / sqrt(width), the lesson's SCALE
    lambda node: (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "sqrt"),
    lambda node: ast.Call(node.func, [expression('shape["width"]')], []))
NOT_BY_COLUMNS = replacing(   # [list(column) for column in zip(*matrix)]: zip(*matrix) becomes matrix
    lambda node: (is_call_of(node, "zip", 1)
                  and isinstance(node.args[0], ast.Starred)),
    lambda node: node.args[0].value)

GROUPED = r"the 2-layer grouped-query model \(4 heads, 2 kv heads, learned positions\)"
MULTI_QUERY = r"the 2-layer multi-query model \(4 heads, 1 kv head, rotary positions\)"
LESSON = (r"the 1-layer multi-head model \(1 head, 1 kv head, learned positions\) holding the "
          r"lesson's weights")
ROW = r"the cached row, at position \d+, logit \d+: \S+ from forward_step, \S+ expected"


class QuickCheckTeeth(unittest.TestCase):
    """Each mistake planted in the real deep_model.py makes the layer's quick check fail
    with a line that names the model, the layer, the position and the logit (or, for the
    turn itself, the number), with both numbers."""

    MISTAKES = [
        ("every layer's MLP the first layer's", deep_model, "forward_step",
         replacing(lambda node: is_call_of(node, "mlp_residual"),
                   lambda node: ast.Call(node.func, [node.args[0], ast.parse(
                       "params['blocks'][0]", mode="eval").body, node.args[2]], [])),
         GROUPED + r", wrong from layer 1 on \(layer 0 alone agrees\): " + ROW),
        ("a query head reads the wrong key-value head (head % group, not head // group)",
         deep_model, "forward_step", KV_HEAD_BY_MODULO,
         GROUPED + r", wrong from layer 0 on: " + ROW),
        ("a query head's key-value head counted by kv_heads (head // kv_heads)",
         deep_model, "forward_step", KV_HEAD_BY_KV_HEADS,
         MULTI_QUERY + r", wrong from layer 0 on: " + ROW),
        ("every layer reads and writes the first layer's cache", deep_model, "forward_step",
         FIRST_LAYER_S_CACHE,
         GROUPED + r", wrong from layer 1 on \(layer 0 alone agrees\): " + ROW),
        ("the query turned by the next position (position + 1)", deep_model, "forward_step",
         QUERY_A_POSITION_ON, MULTI_QUERY + r", wrong from layer 0 on: " + ROW),
        ("the full pass's layers all masked by the first layer's mask", deep_model, "forward",
         replacing(lambda node: isinstance(node, ast.Name) and node.id == "layer_mask"
                   and isinstance(node.ctx, ast.Load), lambda node: expression("masks[0]")),
         GROUPED + r", wrong from layer 1 on \(layer 0 alone agrees\): " + ROW),
        ("the turn's sin with the wrong sign in the first number of a pair: not a turn",
         deep_model, "rotate", SIN_SIGN,
         r"deep_model.rotate's turn of the pairs \(1, 0\) and \(0, 1\) by the angles 1.5 and "
         r"0.75, at number 2: \S+ from rotate, \S+ expected"),
        ("the frequency index counted from the start of q, not restarted at each head "
         "(the angles both paths share)", deep_model, "angles",
         replacing(lambda node: ast.unparse(node) == "c % d", lambda node: node.left),
         MULTI_QUERY + r": deep_model.angles \(thetas, then r_thetas\), at list 0, pair 2: "
         r"\S+ from angles, 1.0 expected"),
        ("the scores scaled by 1 / sqrt(width), as the lesson's one head, not by the head's",
         deep_model, "heads_of", SCALED_BY_WIDTH,
         GROUPED + r": deep_model.heads_of \(heads, head width, key width, query heads a kv "
         r"head serves, 1 / sqrt\(key width\)\), at entry 4: 0.25 from heads_of, 0.5 expected"),
        ("the matrices kept by rows, not by columns, for both paths (columns_by_block)", deep_model,
         "columns_by_block", NOT_BY_COLUMNS,
         LESSON + r": the cached row, at position 0: 16 items from forward_step, 96 items "
         r"expected"),
        ("a position's own key not held when it attends (an IndexError)", deep_model,
         "forward_step", NOT_ITSELF,
         LESSON + r": forward_step of token \d+ at position 0, which should give the full "
         r"pass's row: raised IndexError: .* \(in deep_model.py line \d+, forward_step"),
    ]

    def test_the_quick_check_names_each_mistake_s_model_layer_and_position(self):
        verdicts.assert_verdicts(self, "deep_model", self.MISTAKES)


class WhatEachLayerReads(unittest.TestCase):

    def test_a_mask_a_layer_gives_each_layer_its_own_reads(self):
        """A list of masks, one a layer (a band of 2 in layer 0, causal in layer 1): the
        cached rows are the full pass's, and differ from those of either mask alone."""
        params, ids = deep_model.init_params(2, 4, 2, 16, 0), random_tokens(10)
        masks = [model.band(2), deep_model.causal]
        assert_rows_equal(self, params, ids, masks)
        rows = deep_model.forward(params, ids, masks)
        for alone in masks:
            self.assertNotEqual(rows, deep_model.forward(params, ids, alone),
                                "the rows of one mask a layer, against one mask in both")

    def test_the_cache_is_told_what_each_layer_read_once_the_step_succeeded(self):
        """DeepCache.attended(layer, weights_by_head) is called for every layer, in order,
        after the step is kept: one list of weights a head, over the layer's reads, each
        the softmax of that head's scores (they sum to 1, up to rounding); a step that
        fails part-way tells it nothing."""
        told = []

        class Told(deep_model.DeepCache):
            def attended(self, layer, weights_by_head):
                told.append((len(self), layer, weights_by_head))
        params = deep_model.init_params(2, 4, 2, 16, 0)
        cache = Told(params, [model.band(3), deep_model.causal])
        for position, token_id in enumerate(random_tokens(5)):
            deep_model.forward_step(params, cache, token_id, position)
        self.assertEqual([(held, layer) for held, layer, _ in told],
                         [(position + 1, layer) for position in range(5) for layer in (0, 1)])
        for held, layer, weights_by_head in told:
            reads = cache.positions_read(held - 1)[layer]
            self.assertEqual([len(weights) for weights in weights_by_head], [len(reads)] * 4)
            for weights in weights_by_head:
                self.assertAlmostEqual(sum(weights), 1.0, places=12)
        spoiled = copy.deepcopy(params)
        cache, told[:] = Told(spoiled), []
        spoiled["blocks"][1]["b2"][0] = "x"   # layer 0 computes; layer 1 fails
        with self.assertRaises(TypeError):
            deep_model.forward_step(spoiled, cache, 3, 0)
        self.assertEqual((told, len(cache)), ([], 0))

    def test_masks_of_another_count_or_a_bad_mask_of_a_layer_are_refused(self):
        params = deep_model.init_params(2, 4, 2, 16, 0)
        for masks, fragment in (([deep_model.causal], "a list of one per layer \\(2\\), got a "
                                                      "list of 1"),
                                ([deep_model.causal, 5], "layer 1's mask must be a function"),
                                ([deep_model.causal, lambda i: [i + 1]],
                                 r"layer 1's mask\(0\) gives \[1\]")):
            for attempt in (lambda: deep_model.forward(params, [1, 2], masks),
                            lambda: deep_model.forward_step(
                                params, deep_model.DeepCache(params, masks), 5, 0)):
                with self.subTest(fragment=fragment), \
                        self.assertRaisesRegex(ValueError, fragment):
                    attempt()


class Window(unittest.TestCase):

    def test_through_layers_a_window_passes_on_what_it_dropped(self):
        """With a window of 8, the token at position 0 changes rows up to position 7 in one
        layer, 14 in two, 21 in three: layers x (window - 1). The cached path with the same
        band mask gives the full pass's rows."""
        ids = random_tokens(24)
        changed = [(ids[0] + 1) % model.VOCAB_SIZE] + ids[1:]
        band = model.band(8)
        for layers in (1, 2, 3):
            params = deep_model.init_params(layers, 4, 2, 16, 0)
            with self.subTest(layers=layers):
                assert_rows_equal(self, params, ids, band)
                rows = deep_model.forward(params, ids, band)
                other = deep_model.forward(params, changed, band)
                reached = [position for position, (a, b) in enumerate(zip(rows, other))
                           if a != b]
                self.assertEqual(reached, list(range(layers * 7 + 1)),
                                 "the positions whose rows changing the token at position 0 "
                                 "changes, with a window of 8")


def refused_params(good, lesson):
    """Params that deep_model refuses, each with what its refusal says: the lesson's, or
    good's (1 layer, 4 heads, 2 kv heads) changed in shape or holding what is not a weight."""
    three_heads = copy.deepcopy(good)
    three_heads["shape"]["heads"] = 3
    short_key = copy.deepcopy(good)
    short_key["blocks"][0]["Wk"].pop()
    one_layer_short = dict(good, shape=dict(good["shape"], layers=2))
    rotary = deep_model.init_params(1, 4, 2, 16, 0, "rotary")
    without_positions = dict(good, shape={name: value for name, value in good["shape"].items()
                                          if name != "positions"})
    holding = {}   # params holding a value that is not a weight the lab takes
    for label, bad in (("nan", float("nan")), ("True", True), ("'x'", "x"), ("1e+308", 1e308)):
        holding[label] = copy.deepcopy(good)
        holding[label]["blocks"][0]["Wq"][3][1] = bad
    holding["tok_emb"] = copy.deepcopy(good)
    holding["tok_emb"]["tok_emb"][5][0] = float("inf")
    return ((lesson, "params must be deep_model.init_params"),
            (None, "params must be deep_model.init_params"),
            (without_positions, "params must be deep_model.init_params"),
            (dict(rotary, pos_emb=good["pos_emb"]), "a rotary model has no pos_emb"),
            (dict(good, shape=dict(good["shape"], positions="rotary")),
             "a rotary model has no pos_emb"),
            (dict(rotary, shape=dict(rotary["shape"], positions="learned")),
             "learned positions needs its pos_emb table"),
            (dict(rotary, shape=dict(rotary["shape"], positions=None)),
             "positions must be .* got None"),
            (three_heads, "width 16 must be a multiple of heads 3"),
            (short_key, r"blocks\[0\]\['Wk'\] must have shape 16 x 8"),
            (one_layer_short, "blocks must be a list of 2 blocks"),
            (holding["nan"], r"blocks\[0\]\['Wq'\] holds nan, not a finite"),
            (holding["True"], r"blocks\[0\]\['Wq'\] holds True, not a "),
            (holding["'x'"], r"blocks\[0\]\['Wq'\] holds 'x', not a "),
            (holding["1e+308"], r"holds 1e\+308, larger than 1e\+30"),
            (holding["tok_emb"], "tok_emb holds inf, not a finite float"))


class Refusals(unittest.TestCase):

    def test_bad_shapes_and_misuse_are_refused(self):
        for args, fragment in (((0, 4, 2, 16, 0), "layers must be an int >= 1"),
                               ((1, 3, 1, 16, 0), "width 16 must be a multiple of heads 3"),
                               ((1, 4, 3, 16, 0), "heads 4 must be a multiple of kv_heads 3"),
                               ((1, 4, 2.0, 16, 0), "kv_heads must be an int >= 1"),
                               ((1, 4, 2, 16, 0, "circular"),
                                "positions must be \"learned\" or \"rotary\", got 'circular'"),
                               ((1, 4, 2, 12, 0, "rotary"),
                                r"the head width 3 \(width 12 / heads 4\) must be even")):
            with self.subTest(args=args), self.assertRaisesRegex(ValueError, fragment):
                deep_model.init_params(*args)
        params = deep_model.init_params(2, 4, 2, 16, 0)
        _, cache = fed_rows(self, params, random_tokens(3))
        other = deep_model.init_params(2, 4, 2, 16, 0)    # equal weights, another model
        _, full = fed_rows(self, params, random_tokens(model.CONTEXT))
        with self.assertRaisesRegex(ValueError, "beyond the 64 positions"):
            deep_model.forward_step(params, full, 5, model.CONTEXT)
        self.assertEqual([len(layer["keys"]) for layer in cache.layers], [3, 3])
        assert_each_refused(self, (
            (lambda: deep_model.forward_step(other, cache, 5, 3), "different parameters"),
            (lambda: deep_model.forward_step(params, cache, 5, 0), "expected position 3, got 0"),
            (lambda: deep_model.forward_step(params, cache, 96, 3), "outside the vocabulary")),
            lambda: deep_snapshot(cache))


    def test_params_of_another_shape_or_model_and_bad_ids_are_refused(self):
        lesson, _ = load_trained()
        good = deep_model.init_params(1, 4, 2, 16, 0)
        for params, fragment in refused_params(good, lesson):
            with self.subTest(fragment=fragment):
                for attempt in (lambda: deep_model.forward(params, [1, 2]),
                                lambda: deep_model.DeepCache(params)):
                    with self.assertRaisesRegex(ValueError, fragment):
                        attempt()
        nothing = lambda i: []   # a mask that leaves a position nothing to attend to
        for attempt in (lambda: deep_model.forward(good, [1, 2], nothing),
                        lambda: model.forward(lesson, [1, 2], nothing)):
            with self.assertRaisesRegex(ValueError, r"mask\(0\) gives \[\]: position 0 must"):
                attempt()
        cache = deep_model.DeepCache(good, lambda i: [i + 1])   # a later position
        with self.assertRaisesRegex(ValueError, r"mask\(0\) gives \[1\]"):
            deep_model.forward_step(good, cache, 5, 0)
        self.assertEqual((len(cache), [len(layer["keys"]) for layer in cache.layers]), (0, [0]))
        for mask, fragment in ((5, "mask must be a function of a position"),
                               (lambda i: None, r"mask\(0\) gives None"),
                               (lambda i: [0.0], r"mask\(0\) gives \[0.0\]"),
                               (lambda i: [[0]], r"mask\(0\) gives \[\[0\]\]"),
                               (lambda i: [True], r"mask\(0\) gives \[True\]")):
            for attempt in (lambda: deep_model.forward(good, [1, 2], mask),
                            lambda: model.forward(lesson, [1, 2], mask),
                            lambda: deep_model.forward_step(good, deep_model.DeepCache(good, mask),
                                                            5, 0)):
                with self.subTest(fragment=fragment), \
                        self.assertRaisesRegex(ValueError, fragment):
                    attempt()
        spoiled = copy.deepcopy(good)   # checked when the cache was made, spoiled after
        cache = deep_model.DeepCache(spoiled)
        deep_model.forward_step(spoiled, cache, 3, 0)
        before = copy.deepcopy((cache.tokens, cache.layers))
        spoiled["blocks"][0]["b2"][0] = "x"
        for _ in range(2):   # a retry must not grow the cache either
            with self.assertRaises(TypeError):
                deep_model.forward_step(spoiled, cache, 4, 1)
            self.assertEqual((cache.tokens, cache.layers), before)
        for ids, fragment in ((None, "ids must be a list"), ([], "ids is empty"),
                              ([1, 96], r"ids\[1\] = 96 is outside")):
            with self.subTest(ids=ids), self.assertRaisesRegex(ValueError, fragment):
                deep_model.forward(good, ids)


if __name__ == "__main__":
    unittest.main()
