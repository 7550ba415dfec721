"""Shifting a rotary cache (context_shift.py). Its quick check meets the shift itself:
the caches the experiment builds from kept keys and values go on exactly as caches fed
the same tokens, the kept keys turned back by the dropped positions are, within rounding,
those computed at the new positions, and _shift records what one layer gives; five
mistakes planted in the real module make it name the quantity and the place. The figures
themselves are the record's (TheRecord here, and test_trace_kv)."""
import ast
import random
import unittest

import context_shift
import deep_model
import support
import verdicts
from instruments import replacing
from verdicts import quick_check_case, set_up
from support import tear_down


def setUpModule():
    set_up("context_shift")   # waits if the deeper model is wrong


tearDownModule = tear_down
QuickCheck = quick_check_case("context_shift", __name__)


class HeldCaches(unittest.TestCase):

    def test_a_turn_by_no_position_leaves_a_key_as_it_is(self):
        rng = random.Random(1)
        key = [rng.gauss(0.0, 1.0) for _ in range(16)]
        thetas = [deep_model.BASE ** (-c / 4) for c in (0, 2)] * 4
        self.assertEqual(deep_model.rotate(key, 0, thetas), key, "a key turned by position 0")


def is_call_of(node, name):
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == name)


def is_minus(node):
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)


TURNED_FORWARD = replacing(is_minus, lambda node: node.operand)   # -DROPPED becomes DROPPED
ONE_POSITION_SHORT = replacing(   # -DROPPED becomes -(DROPPED - 1)
    is_minus, lambda node: ast.UnaryOp(ast.USub(), ast.BinOp(node.operand, ast.Sub(),
                                                             ast.Constant(1))))
BY_OLD_POSITION = replacing(   # position - DROPPED becomes position: each key's old position
    lambda node: (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)
                  and isinstance(node.right, ast.Name) and node.right.id == "DROPPED"),
    lambda node: node.left)
KEYS_AND_VALUES_SWAPPED = replacing(   # for keys, values in layers becomes for values, keys
    lambda node: (isinstance(node, ast.comprehension) and isinstance(node.target, ast.Tuple)
                  and len(node.target.elts) == 2),
    lambda node: ast.comprehension(ast.Tuple(node.target.elts[::-1], ast.Store()), node.iter,
                                   node.ifs, node.is_async))


def values_turned_too(tree):
    """A mistake for plant in _shift: the kept values turned back by DROPPED as the keys
    are (with the angles _shift gives _turned_back)."""
    thetas = next((node.args[1] for node in ast.walk(tree) if is_call_of(node, "_turned_back")),
                  None)
    if thetas is None:
        return 0
    return replacing(
        lambda node: (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice)
                      and isinstance(node.value, ast.Subscript)
                      and isinstance(node.value.slice, ast.Constant)
                      and node.value.slice.value == "values"),
        lambda node: ast.ListComp(
            ast.Call(ast.Name("rotate", ast.Load()), [ast.Name("value", ast.Load()),
                     ast.UnaryOp(ast.USub(), ast.Name("DROPPED", ast.Load())), thetas], []),
            [ast.comprehension(ast.Name("value", ast.Store()), node, [], 0)]))(tree)


HELD = (r"the 2-layer grouped-query model \(4 heads, 2 kv heads, learned positions\), a "
        r"cache held from the keys and values of the first 6 tokens \(context_shift._held\) "
        r"and fed the next 4 \(row r is position 6 \+ r\), at row \d+, logit \d+: \S+ from "
        r"the held cache, \S+ expected")
KEY = (r"the 1-layer grouped-query model \(4 heads, 2 kv heads, rotary positions\), its "
       r"oldest 6 of 12 positions dropped: a kept key as context_shift._turned_back turns it "
       r"\(back by 6: position p was position p \+ 6\), at layer 0, "
       r"position \d+, number \d+: \S+ from the shift, \S+ expected \(\S+ apart, more than "
       r"rounding, 1e-12\)")
RECORD = (r"context_shift._shift\(1, 2, 0, False\), of the 1-layer grouped-query model "
          r"\(4 heads, 2 kv heads, rotary positions\): its {} is {}, where one layer gives")


class QuickCheckTeeth(unittest.TestCase):
    """Each mistake planted in the real context_shift.py makes the layer's quick check fail
    with a line that names the model and the quantity that differs, and where: the row,
    the kept key's layer, position and number, or the entry of _shift's record."""

    MISTAKES = [
        ("the kept keys turned forward by the dropped positions, not back", context_shift,
         "_turned_back", TURNED_FORWARD, KEY),
        ("the kept keys turned back by one position fewer than were dropped", context_shift,
         "_turned_back", ONE_POSITION_SHORT, KEY),
        ("the kept values turned back too", context_shift, "_shift", values_turned_too,
         RECORD.format("against_recompute", r"\{'largest_logit_gap': \S+, "
                                            r"'continuation_changed': \w+\}")),
        ("the keys turned once by their old positions, not their new ones", context_shift,
         "_turned_once", BY_OLD_POSITION,
         RECORD.format("key_gap_rotated_back_vs_rotated_once", r"\S+")),
        ("a held cache's keys and values swapped", context_shift, "_held",
         KEYS_AND_VALUES_SWAPPED, HELD),
    ]

    def test_the_quick_check_names_each_mistake_s_quantity_and_place(self):
        verdicts.assert_verdicts(self, "context_shift", self.MISTAKES)


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of the rotary cache and its shift."""

    def test_rotary_rows_are_exact_and_a_shift_differs_by_rounding_then_by_content(self):
        rotary = support.recorded("rotary")
        learned = support.recorded("deep_models")["shapes"]
        for shape, twin in zip(rotary["shapes"], learned):
            with self.subTest(layers=shape["layers"], kv_heads=shape["kv_heads"]):
                self.assertEqual(shape["largest_logit_gap"], 0.0,
                                 "the recorded largest gap of the rotary model's cached rows "
                                 "to its full pass's")
                self.assertEqual(shape["floats_per_position"], twin["floats_per_position"],
                                 "the rotary cache's numbers a position, against the learned "
                                 "twin's (a turn adds none)")
                self.assertTrue(shape["layer_1_keys_rotated_once_equal_recomputed"],
                                "the recorded layer_1_keys_rotated_once_equal_recomputed")
                if shape["layers"] == 1:   # a recompute differs from the shift by rounding alone
                    self.assertEqual(shape["against_recompute"], shape["rounding"],
                                     "in one layer, the shifted cache continued against the "
                                     "recompute, and against the keys turned once")
        self.assertEqual(rotary["rounding"]["continuations_changed"], 0,
                         "the recorded continuations that rounding alone changes (the shifted "
                         "cache against the keys turned once), over every shape")
        self.assertLess(rotary["rounding"]["largest_logit_gap"], 1e-12,
                        "the recorded largest logit gap that rounding alone makes")
        for deeper in rotary["against_recompute_by_layers"][1:]:   # content from layer 2 on
            with self.subTest(layers=deeper["layers"]):
                self.assertGreater(deeper["continuations_changed"], 0,
                                   "the recorded continuations a shift changes against a "
                                   "recompute, from layer 2 on")


if __name__ == "__main__":
    unittest.main()
