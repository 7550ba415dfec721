"""Latent attention: the absorbed path reads the cached latents with the same math in
another order, so its rows stay within rounding of the full pass's, while the coupled
design (rebuilt keys turned, no rotary key of their own) cannot be absorbed; the work of
a decode step is what the formulas say, counted in the real code; mistakes planted in
the fold, the absorbed path and the rebuilding path are caught, and the layer's quick
check names each by its model, path, layer, position and logit. (deep_model's tests
prove the rebuilding path exact for latent shapes too.)"""
import ast
import unittest

import deep_model
import latent_attention
import support
import verdicts
from instruments import is_call_of, recording, replacing
from random_models import random_tokens
from support import STORIES, TOK, assert_each_mistake_is_caught, assert_each_refused, deep_snapshot, swapping, tear_down
from verdicts import (Layer, ROUNDING, Wrong, by_layer, deep_label, quick_check_case,
                      set_up, step, stepped_rows, strayed, where_deep_rows_differ)


LAYER = Layer("latent_attention",
              "latent attention read in latent space (latent_attention.py)",
              ("deep_model",))


def setUpModule():
    set_up("latent_attention")


tearDownModule = tear_down
def where_absorbed_strays(params, ids):
    """None if a latent model's rows read through latent_attention.absorbed_step (fed
    ids one at a time through a new cache) stay within ROUNDING of its full pass's, else
    a Wrong naming the model, the first layer whose rows stray (by_layer), the position
    and the logit, with both numbers."""

    def compare(weights):
        label = deep_label(weights)
        step(f"{label}: folding it (latent_attention.fold)")
        folded = latent_attention.fold(weights)
        rows = stepped_rows(label, latent_attention.absorbed_step, folded,
                            deep_model.DeepCache(weights), ids)
        step(f"{label}: its full pass (deep_model.forward)")
        return strayed("the absorbed path's row (read in latent space)", rows,
                       deep_model.forward(weights, ids), "absorbed_step",
                       fed=f"token IDs {ids}, one at a time through a new DeepCache")
    return by_layer(params, compare)


# The work check's models: grouped-query (learned), multi-query (rotary), latent
# (learned; rotary with a rotary key; rotary with its rebuilt keys turned), with their paths.
WORK_MODELS = (((2, 4, 2, 16, 0), ("cached",)), ((2, 4, 1, 16, 0, "rotary"), ("cached",)),
               ((2, 4, 4, 16, 0, "learned", 8), ("rebuilt", "absorbed")),
               ((2, 4, 4, 16, 0, "rotary", 8), ("rebuilt", "absorbed")),
               ((2, 4, 4, 16, 0, "rotary", 8, 0), ("rebuilt",)))
WORK_ATTENDED = 6   # the decode step whose products are counted attends to this many


def where_work_differs(ids):
    """None if, for each model of WORK_MODELS and each of its paths, the decode step
    attending to WORK_ATTENDED positions of ids computes multiply_adds's products (each
    product of dot and linear counted as it runs), and its cache keeps cache_floats's
    numbers a position; else a Wrong naming the model, the path, the positions and both
    counts."""
    for args, paths in WORK_MODELS:
        params = deep_model.init_params(*args)
        shape, label = params["shape"], deep_label(params)
        for path in paths:
            folded = path == "absorbed" and latent_attention._fold(params)
            step_function = latent_attention.absorbed_step if folded else deep_model.forward_step
            cache = deep_model.DeepCache(params)
            stepped_rows(f"the {path} path of {label}", step_function, folded or params, cache,
                         ids[:WORK_ATTENDED - 1])
            step(f"the {path} path of {label}: the decode step at position "
                 f"{WORK_ATTENDED - 1}, its products counted")
            with recording(deep_model, "dot", "linear") as calls, \
                    recording(latent_attention, "dot", "linear") as more:
                step_function(folded or params, cache, ids[WORK_ATTENDED - 1], WORK_ATTENDED - 1)
            computed = latent_attention.products(calls + more)
            formula = latent_attention.multiply_adds(shape, WORK_ATTENDED, path)
            if computed != formula:
                return Wrong(f"{label}, the {path} path: the decode step at position "
                             f"{WORK_ATTENDED - 1} (attending to {WORK_ATTENDED}) computes "
                             f"{computed} products, multiply_adds counts {formula}",
                             f"  fed: token IDs {ids[:WORK_ATTENDED]}; counted: every product "
                             f"of deep_model's and latent_attention's dot and linear")
        kept = latent_attention.cache_floats(shape["layers"], shape["kv_heads"],
                                             shape["width"] // shape["heads"], shape["latent"],
                                             shape["rotary_key"])
        if kept != cache.floats_per_position():
            return Wrong(f"{label}: its cache keeps {cache.floats_per_position():g} numbers a "
                         f"position, cache_floats counts {kept}")
    return None


def quick_check():
    """A latent model's rows, rebuilt and absorbed (within rounding), are its full pass's.

    Feeds the first 12 tokens of the first test story through 2-layer latent models (4
    heads, latent 8), of learned positions and of rotary ones with a rotary key: the rows
    of deep_model.forward_step (keys and values rebuilt) == the full pass's, and those of
    latent_attention.absorbed_step (read in latent space) within ROUNDING of them. Then
    a decode step's products and a cache's numbers a position, counted in the real code,
    are multiply_adds's and cache_floats's (where_work_differs)."""
    ids = TOK.encode(STORIES[0])[:12]
    for positions in ("learned", "rotary"):
        params = deep_model.init_params(2, 4, 4, 16, 0, positions, 8)
        why = where_deep_rows_differ(params, ids) or where_absorbed_strays(params, ids)
        if why:
            return why
    return where_work_differs(ids)


QuickCheck = quick_check_case("latent_attention", __name__)


def assert_none(test, difference):
    """difference() finds nothing; an exception the model raises is a failure that names
    the step it interrupted (the model and the position), not a traceback."""
    why = verdicts.checked(difference)
    if why:
        test.fail(why)


class Absorption(unittest.TestCase):

    def test_the_absorbed_path_stays_within_rounding_of_the_full_pass(self):
        """Seed 1, 20 positions, latents of 2 to 12 (the trace does seed 0 on the test
        stories); the absorbed rows are compared with a tolerance, since they are the
        same math summed in another order."""
        ids = random_tokens(20, 1)
        for layers, positions, latent, rotary_key in ((1, "learned", 2, None),
                                                      (2, "learned", 12, None),
                                                      (1, "rotary", 4, 4),
                                                      (3, "rotary", 8, None)):
            params = deep_model.init_params(layers, 4, 4, 16, 1, positions, latent, rotary_key)
            with self.subTest(layers=layers, positions=positions, latent=latent):
                assert_none(self, lambda: where_absorbed_strays(params, ids))

    def test_a_turn_of_the_rebuilt_keys_cannot_be_absorbed(self):
        coupled = deep_model.init_params(2, 4, 4, 16, 1, "rotary", 8, 0)
        ids = random_tokens(20, 1)
        assert_none(self, lambda: where_deep_rows_differ(coupled, ids))   # exact when rebuilt
        with self.assertRaisesRegex(ValueError, "cannot be folded into the query"):
            latent_attention.fold(coupled)
        folded, cache = latent_attention._fold(coupled), deep_model.DeepCache(coupled)
        rows = []
        assert_none(self, lambda: rows.extend(stepped_rows(
            "the coupled model", latent_attention.absorbed_step, folded, cache, ids)))
        gap = max(abs(a - b) for row, full in zip(rows, deep_model.forward(coupled, ids))
                  for a, b in zip(row, full))
        self.assertGreater(gap, 0.1, "the largest gap of the coupled model's absorbed rows to "
                                     "its full pass's")


class Work(unittest.TestCase):

    def test_a_decode_step_computes_the_products_the_formula_counts(self):
        """Every product of every dot product the real step computes (recorded in
        deep_model's and latent_attention's dot and linear), at 1, 16 and 40 positions."""
        cases = [(deep_model.init_params(2, 4, kv_heads, 16, 0, positions), "cached")
                 for kv_heads in (4, 2, 1) for positions in ("learned", "rotary")]
        for positions, rotary_key in (("learned", None), ("rotary", None), ("rotary", 0)):
            params = deep_model.init_params(2, 4, 4, 16, 0, positions, 8, rotary_key)
            cases += [(params, "rebuilt"), (params, "absorbed")]
        for params, path in cases:
            folded = path == "absorbed" and latent_attention._fold(params)
            cache = deep_model.DeepCache(params)
            for position, token_id in enumerate(random_tokens(40)):
                def one_step():   # an exception names the model and the position
                    verdicts.step(f"the {path} path of {deep_label(params)}, at position "
                                      f"{position}")
                    if folded:
                        latent_attention.absorbed_step(folded, cache, token_id, position)
                    else:
                        deep_model.forward_step(params, cache, token_id, position)
                if position + 1 not in (1, 16, 40):
                    assert_none(self, one_step)   # it fills the cache; recorded: these three
                    continue
                with recording(deep_model, "dot", "linear") as calls, \
                        recording(latent_attention, "dot", "linear") as more:
                    assert_none(self, one_step)
                with self.subTest(shape=params["shape"], path=path, attended=position + 1):
                    self.assertEqual(latent_attention.products(calls + more),
                                     latent_attention.multiply_adds(params["shape"],
                                                                    position + 1, path),
                                     "the products the step computed (recorded), against "
                                     "multiply_adds's count")


def in_call_of(name, argument, replacement):
    """A mistake for plant: argument number argument of every call of name becomes
    replacement (an expression's source)."""
    def replaced(node):
        node.args[argument] = ast.parse(replacement, mode="eval").body
        return node
    return replacing(lambda node: is_call_of(node, name), replaced)


class Teeth(unittest.TestCase):

    def test_each_mistake_of_the_latent_cache_is_caught(self):
        """Planted in the real deep_model.forward_step: the rebuilding path differs."""
        params, ids = deep_model.init_params(2, 4, 4, 16, 0, "rotary", 8), random_tokens(12)
        assert_none(self, lambda: where_deep_rows_differ(params, ids))
        assert_each_mistake_is_caught(self, deep_model, "forward_step", {
            "the rotary key turned by the next position":
                in_call_of("compressed", 3, "position + 1"),
            "the latent cached before its layer norm":
                replacing(lambda node: isinstance(node, ast.Dict) and any(
                              isinstance(key, ast.Constant) and key.value == "latents"
                              for key in node.keys),
                          lambda node: ast.Dict(node.keys, [ast.parse(
                              'linear(h1, cols["Wdkv"])', mode="eval").body, node.values[1]])),
        }, lambda: where_deep_rows_differ(params, ids))

    def test_a_fold_in_the_wrong_order_is_caught(self):
        """Planted in the real latent_attention._fold: the folded rows stacked latent by
        latent instead of head by head, so a head's latent sum meets another's Wuv Wo."""
        params, ids = deep_model.init_params(2, 4, 4, 16, 0, "rotary", 8), random_tokens(12)
        assert_none(self, lambda: where_absorbed_strays(params, ids))

        def swapped(node):
            node.generators.reverse()
            return node
        assert_each_mistake_is_caught(self, latent_attention, "_fold", {
            "the folded rows stacked latent by latent, not head by head":
                replacing(lambda node: isinstance(node, ast.ListComp)
                          and len(node.generators) == 2, swapped),
        }, lambda: where_absorbed_strays(params, ids))


def a_position_on(call):
    """A call of compressed(h1, block, cols, position, ...) with position + 1."""
    call.args[3] = ast.BinOp(call.args[3], ast.Add(), ast.Constant(1))
    return call


OUT_FROM_WUK = replacing(   # block["Wuv"] becomes block["Wuk"] in the folded Wuv_h Wo_h
    lambda node: isinstance(node, ast.Constant) and node.value == "Wuv",
    lambda node: ast.Constant("Wuk"))
ROTARY_QUERY_DROPPED = replacing(   # linear(q_h[:d], ...) + q_h[d:] becomes linear(q_h[:d], ...)
    lambda node: (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
                  and is_call_of(node.left, "linear") and isinstance(node.right, ast.Subscript)
                  and isinstance(node.right.slice, ast.Slice)),
    lambda node: node.left)
ROTARY_KEY_A_POSITION_ON = replacing(lambda node: is_call_of(node, "compressed"), a_position_on)
POSITION_FORGOTTEN = replacing(   # embedded(params, token_id, position): at position 0
    lambda node: is_call_of(node, "embedded", 3),
    lambda node: ast.Call(node.func, [*node.args[:2], ast.Constant(0)], []))

LEARNED = r"the 2-layer latent model \(4 heads, 4 kv heads, learned positions, latent 8\)"
ROTARY = (r"the 2-layer latent model \(4 heads, 4 kv heads, rotary positions, latent 8, "
          r"rotary key 2\)")
ABSORBED = (r"the absorbed path's row \(read in latent space\), at position \d+, logit \d+: "
            r"\S+ from absorbed_step, \S+ expected \(\S+ apart, more than rounding, 1e-12\)")
REBUILT = (r"the cached row \(its keys and values rebuilt from the cached latents\), at "
           r"position \d+, logit \d+: \S+ from forward_step, \S+ expected")

WORK = (r"^the 2-layer {} model \(.*\), the {} path: the decode step at position 5 "
        r"\(attending to 6\) computes \d+ products, multiply_adds counts \d+$")


class QuickCheckTeeth(unittest.TestCase):
    """Each mistake planted in the real latent_attention.py (or in deep_model.forward_step's
    latent path) makes the layer's quick check fail with a line that names the model, the
    path, the layer, the position and the logit, with both numbers."""

    MISTAKES = [
        ("the folded output matrix made of Wuk, not Wuv", latent_attention, "_fold",
         OUT_FROM_WUK, LEARNED + r", wrong from layer 0 on: " + ABSORBED),
        ("the absorbed path's input embedded at position 0, whatever its position",
         latent_attention, "absorbed_step", POSITION_FORGOTTEN, LEARNED + r", wrong from layer 0 on: " + ABSORBED),
        ("the query's rotary part left out of the query in latent space", latent_attention,
         "absorbed_step", ROTARY_QUERY_DROPPED, ROTARY + r", wrong from layer 0 on: " + ABSORBED),
        ("the rotary key turned by the next position on the rebuilding path", deep_model,
         "forward_step", ROTARY_KEY_A_POSITION_ON,
         ROTARY + r", wrong from layer 0 on: " + REBUILT),
        ("the scores counted once a key-value head, not once a head", latent_attention,
         "multiply_adds", swapping("2 * heads * d * t", "2 * shape['kv_heads'] * d * t"),
         WORK.format("grouped-query", "cached")),
        ("the rotary part of the absorbed scores left out", latent_attention, "multiply_adds",
         swapping("heads * t * (2 * latent_width + r)", "heads * t * 2 * latent_width"),
         WORK.format("latent", "absorbed")),
        ("a latent cache's rotary key left out", latent_attention, "cache_floats",
         swapping("layers * (latent + rotary_key)", "layers * latent"),
         r"^the 2-layer latent model .*rotary key 2\): its cache keeps 20 numbers a position, "
         r"cache_floats counts 16$"),
    ]

    def test_the_quick_check_names_each_mistake_s_model_path_layer_and_position(self):
        verdicts.assert_verdicts(self, "latent_attention", self.MISTAKES)


class Refusals(unittest.TestCase):

    def test_shapes_a_latent_model_cannot_have_are_refused(self):
        for args, fragment in (((1, 4, 2, 16, 0, "learned", 8), "kv_heads must be heads 4"),
                               ((1, 4, 4, 16, 0, "learned", 0), "latent must be an int >= 2"),
                               ((1, 4, 4, 16, 0, "learned", 1), "a layer norm of one number"),
                               ((1, 4, 4, 16, 0, "learned", 8.0), "latent must be an int"),
                               ((1, 4, 4, 16, 0, "rotary", 8, 3), "rotary_key must be even"),
                               ((1, 4, 4, 16, 0, "rotary", 8, -2),
                                "rotary_key must be an int >= 0"),
                               ((1, 4, 4, 16, 0, "learned", 8, 2), "a rotary key of its own"),
                               ((1, 4, 4, 16, 0, "rotary", None, 2), "a rotary key of its own")):
            with self.subTest(args=args), self.assertRaisesRegex(ValueError, fragment):
                deep_model.init_params(*args)

    def test_the_absorbed_path_refuses_what_forward_step_refuses_and_changes_nothing(self):
        params = deep_model.init_params(2, 4, 4, 16, 0, "rotary", 8)
        with self.assertRaisesRegex(ValueError, "fold needs a latent model"):
            latent_attention.fold(deep_model.init_params(1, 4, 2, 16, 0))
        folded, cache = latent_attention.fold(params), deep_model.DeepCache(params)
        for position, token_id in enumerate(random_tokens(3)):
            latent_attention.absorbed_step(folded, cache, token_id, position)
        other = latent_attention.fold(deep_model.init_params(2, 4, 4, 16, 0, "rotary", 8))
        assert_each_refused(self, (
            (lambda: latent_attention.absorbed_step(params, cache, 5, 3),
             "needs latent_attention.fold"),
            (lambda: latent_attention.absorbed_step(other, cache, 5, 3), "different parameters"),
            (lambda: latent_attention.absorbed_step(folded, cache, 5, 2),
             "expected position 3, got 2"),
            (lambda: latent_attention.absorbed_step(folded, cache, 96, 3),
             "outside the vocabulary")), lambda: deep_snapshot(cache))

    def test_a_folded_not_made_by_fold_for_its_params_is_refused(self):
        """An empty Folded, one short of a layer, and one of another model's blocks (whose
        rows would be off by a whole unit): refused, the cache unchanged."""
        params = deep_model.init_params(2, 4, 4, 16, 0, "rotary", 8)
        blocks = latent_attention.fold(params).blocks
        other = latent_attention.fold(deep_model.init_params(2, 4, 4, 16, 1, "rotary", 8)).blocks
        cache = deep_model.DeepCache(params)
        assert_each_refused(self, tuple(
            (lambda made=made: latent_attention.absorbed_step(
                latent_attention.Folded(params, made), cache, 5, 0), fragment)
            for made, fragment in (([], "a block for each of its params' 2 layers"),
                                   (blocks[:1], "a block for each"),
                                   ([blocks[0], dict(blocks[1], of=blocks[1]["of"][:1])],
                                    "block 1 is not fold"),
                                   ([blocks[0], other[1]], "block 1 is not fold"),
                                   ([{}, blocks[1]], "block 0 is not fold"))),
            lambda: deep_snapshot(cache))

    def test_a_fold_taken_before_its_params_changed_in_place_is_refused(self):
        """A fold, then one weight of Wuk, Wuv or Wo changed in place (the rows 0.0289 from
        the full pass, silently): refused naming the layer and the matrix, the cache
        unchanged; a change to a matrix the fold did not take (W1), or a weight set to the
        value it had, leaves the fold good."""
        params = deep_model.init_params(2, 4, 4, 16, 0, "rotary", 8)
        folded, cache = latent_attention.fold(params), deep_model.DeepCache(params)
        for layer, name in ((1, "Wuv"), (0, "Wuk"), (1, "Wo")):
            row = params["blocks"][layer][name][2]
            kept = row[3]
            row[3] = kept + 0.5
            assert_each_refused(self, [(
                lambda: latent_attention.absorbed_step(folded, cache, 5, 0),
                rf"folded's block {layer} was folded before its params changed {name} in place: "
                rf"fold\(params\) again")], lambda: deep_snapshot(cache))
            row[3] = kept + 0.0   # the value it had, as another float
        params["blocks"][0]["W1"][0][0] += 0.5
        latent_attention.absorbed_step(folded, cache, 5, 0)
        self.assertEqual(len(cache), 1)

    def test_the_formulas_refuse_a_misspelt_path_and_negative_counts(self):
        latent = deep_model.init_params(1, 4, 4, 16, 0, "rotary", 8)["shape"]
        plain = deep_model.init_params(1, 4, 2, 16, 0)["shape"]
        for call, fragment in (
                ((latent, 16, "cashed"), 'path must be "cached", "rebuilt" or "absorbed"'),
                ((latent, -1, "rebuilt"), "attended must be an int >= 0"),
                ((plain, 3, "absorbed"), "reads a latent, and this shape has none"),
                ((latent, 3, "cached"), "this shape has a latent"),
                ((dict(plain, layers=0), 3, "cached"), "layers must be an int >= 1"),
                (({"width": 16}, 3, "cached"), "shape must be a deep_model shape")):
            with self.subTest(call=call), self.assertRaisesRegex(ValueError, fragment):
                latent_attention.multiply_adds(*call)
        for call, fragment in (((-1, 4, 4), "layers must be"), ((1, 4, 4, -160), "latent must be"),
                               ((1, 0, 4), "kv_heads must be"), ((1, 4, 4, 8, -2), "rotary_key")):
            with self.subTest(call=call), self.assertRaisesRegex(ValueError, fragment):
                latent_attention.cache_floats(*call)

class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of latent attention."""

    def test_rebuilt_rows_are_exact_and_absorbed_ones_within_rounding_but_the_controls(self):
        for shape in support.recorded("latent_attention")["shapes"]:
            coupled = shape["positions"] == "rotary" and not shape["rotary_key"]
            with self.subTest(positions=shape["positions"], latent=shape["latent"],
                              rotary_key=shape["rotary_key"], layers=shape["layers"]):
                self.assertEqual(shape["largest_gap_rebuilt"], 0.0,
                                 "the recorded largest gap of the rebuilt rows to the full pass's")
                self.assertEqual(shape["floats_per_position"], shape["formula"],
                                 "the recorded numbers a position, against the formula's")
                if coupled:   # a turn between the query and Wuk cannot be folded
                    self.assertGreater(shape["largest_gap_absorbed"], 0.1,
                                       "the coupled control's recorded absorbed gap")
                else:         # the same math in another order
                    self.assertLess(shape["largest_gap_absorbed"], ROUNDING,
                                    "the recorded largest gap of the absorbed rows")
                    self.assertIsNone(shape["continuation_parts_at"],
                                      "the recorded new token where the absorbed greedy "
                                      "continuation parts")


if __name__ == "__main__":
    unittest.main()
