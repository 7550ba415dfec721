"""Shifting a rotary cache (context_shift.py). Its quick check meets the shift itself:
the caches the experiment builds from kept keys and values go on exactly as caches fed
the same tokens, the kept keys turned back by the dropped positions are, within rounding,
those computed at the new positions, _shift records what one layer gives (a block moved
and a learned table too), and experiment gathers its cases; ten mistakes planted in the
real module make it name the quantity and the place. The figures
themselves are the record's (TheRecord here, and test_whole_trace)."""
import ast
import random
import unittest

import context_shift
import deep_model
import model
import support
import verdicts
from instruments import is_call_of, replacing
from support import STORIES, TOK, swapping, tear_down
from verdicts import (Layer, ROUNDING, Wrong, deep_label, differ, excerpt, quick_check_case,
                      set_up, step, strayed)


LAYER = Layer("context_shift", "the context shift (context_shift.py)", ("deep_model",))


def setUpModule():
    set_up("context_shift")   # waits if the deeper model is wrong


tearDownModule = tear_down
def where_held_differs(params, ids, kept):
    """None if a cache held (context_shift._held) from the keys and values of a cache fed
    the first kept of ids, fed the rest, gives the rows of the fed cache fed the rest;
    else a Wrong naming the model, the row and the logit."""
    label = deep_label(params)
    step(f"{label}: feeding {kept} tokens, and holding its keys and values in a new cache "
         f"(context_shift._held)")
    fed = deep_model.DeepCache(params)
    context_shift._fed(params, fed, ids[:kept])
    held = context_shift._held(params, fed.tokens, [(layer["keys"], layer["values"])
                                                    for layer in fed.layers])
    step(f"{label}: feeding the held cache the next {len(ids) - kept} tokens, which should "
         f"give the fed cache's rows")
    return differ(f"{label}, a cache held from the keys and values of the first {kept} "
                  f"tokens (context_shift._held) and fed the next {len(ids) - kept} (row r is "
                  f"position {kept} + r)", context_shift._fed(params, held, ids[kept:]),
                  context_shift._fed(params, fed, ids[kept:]), "the held cache",
                  names=("row", "logit"), fed=f"token IDs {ids}")


def where_shift_strays(seed=0):
    """None if the shift itself holds, within ROUNDING, else a Wrong naming the layer, the
    position and the number of the first kept key that strays.

    In a 1-layer rotary model (4 heads, 2 kv heads, seed) fed its SEQUENCE random tokens
    (context_shift._random_tokens), the keys of the kept positions turned back by DROPPED
    (context_shift._turned_back) are met with the keys that a new cache fed the kept
    tokens computes at their new positions."""
    from instruments import recording
    params = deep_model.init_params(1, 4, 2, model.WIDTH, seed, "rotary")
    dropped = context_shift.DROPPED
    ids = context_shift._random_tokens(seed)[:context_shift.SEQUENCE]
    label = deep_label(params)
    step(f"{label}: feeding {len(ids)} random tokens, and a new cache the last "
         f"{len(ids) - dropped} (the recompute)")
    fed, recomputed = deep_model.DeepCache(params), deep_model.DeepCache(params)
    with recording(deep_model, "rotate") as turns:
        context_shift._fed(params, fed, ids)
    context_shift._fed(params, recomputed, ids[dropped:])
    step(f"{label}: turning the kept keys back by {dropped} (context_shift._turned_back), "
         f"which should give the recompute's keys, within rounding")
    return strayed(f"{label}, its oldest {dropped} of {len(ids)} positions dropped: a kept "
                   f"key as context_shift._turned_back turns it (back by {dropped}: position "
                   f"p was position p + {dropped})",
                   context_shift._turned_back(fed, turns[0].args[2]),
                   [layer["keys"] for layer in recomputed.layers], "the shift",
                   names=("layer", "position", "number"),
                   fed=f"token IDs {ids}; expected: the keys of a new cache fed the kept "
                       f"{ids[dropped:]}, computed at their new positions")


def where_shift_record_wrong(seed=0):
    """None if context_shift._shift of a 1-layer rotary model (4 heads, 2 kv heads, seed;
    with the cases elsewhere) records what one layer gives: its cached rows the full
    pass's, its keys turned back within rounding of those turned once, those turned once
    the recompute's, and its shifted cache continued within rounding of the turned-once
    one and exactly as the recompute (in one layer the recompute is the turned-once
    cache); a block moved to another offset continued within rounding of the tokens fed
    there, with or without tokens before it; the learned table's old keys more than
    rounding from the recompute's; else a Wrong naming the entry of the record, and both
    values."""
    label = (f"context_shift._shift(1, 2, {seed}, True), of the 1-layer grouped-query model "
             f"(4 heads, 2 kv heads, rotary positions)")
    step(f"{label}: running it")
    case = context_shift._shift(1, 2, seed, True)
    rounding = case["rounding"]

    def within_rounding(entry):
        return entry["largest_logit_gap"] <= ROUNDING and entry["continuation_changed"] is False
    for name, holds, wanted in (
            ("largest_logit_gap", case["largest_logit_gap"] == 0.0,
             "0.0 (the cached rows are the full pass's)"),
            ("key_gap_rotated_back_vs_rotated_once",
             case["key_gap_rotated_back_vs_rotated_once"] <= ROUNDING,
             f"at most rounding, {ROUNDING:g}"),
            ("layer_1_keys_rotated_once_equal_recomputed",
             case["layer_1_keys_rotated_once_equal_recomputed"] is True,
             "True (a key turned once to its new position is the recompute's)"),
            ("rounding", within_rounding(rounding),
             f"a largest_logit_gap of at most {ROUNDING:g}, the continuation unchanged"),
            ("against_recompute", case["against_recompute"] == rounding,
             f"{rounding} (its rounding's: the recompute is the turned-once cache)"),
            ("offset_with_nothing_before", within_rounding(case["offset_with_nothing_before"]),
             f"a largest_logit_gap of at most {ROUNDING:g}, the continuation unchanged (a "
             f"key turned twice)"),
            ("offset_after_other_tokens", within_rounding(case["offset_after_other_tokens"]),
             f"a largest_logit_gap of at most {ROUNDING:g}, the continuation unchanged (in "
             f"one layer a key holds nothing of the tokens before it)"),
            ("learned_old_keys_against_recompute",
             case["learned_old_keys_against_recompute"]["largest_logit_gap"] > ROUNDING,
             f"a largest_logit_gap of more than {ROUNDING:g} (a learned table's old keys "
             f"keep their old positions)")):
        if not holds:
            return Wrong(f"{label}: its {name} is {case[name]!r}, where one layer gives {wanted}",
                         f"  fed: context_shift._shift(1, 2, {seed}, True)\n"
                         f"  _shift gave: {excerpt(case, 2000)}")
    return None


def made_up_case(layers, kv_heads, seed, elsewhere):
    """A stand-in for context_shift._shift: figures made up from its arguments, with the
    cases elsewhere if asked."""
    case = {"layers": layers, "kv_heads": kv_heads, "seed": seed,
            "key_gap_rotated_back_vs_rotated_once": seed / 64,
            "rounding": {"largest_logit_gap": (seed * 5 % 12) / 32,
                         "continuation_changed": seed % 3 == 0},
            "against_recompute": {"largest_logit_gap": (seed * 7 % 12) / 4,
                                  "continuation_changed": seed % 2 == 0}}
    if elsewhere:
        case["offset_with_nothing_before"] = {"largest_logit_gap": (seed * 5 % 12) / 8,
                                              "continuation_changed": seed % 4 == 1}
        case["learned_old_keys_against_recompute"] = {"largest_logit_gap": 12 - seed,
                                                      "continuation_changed": seed > 4}
    return case


def where_experiment_sums_wrong():
    """None if context_shift.experiment, given made-up cases for _shift (made_up_case),
    runs one a shape of DEEP_SHAPES, with the cases elsewhere for the grouped-query ones,
    and gathers their largest gaps and changed continuations as worked out plainly here;
    else a Wrong naming the entry of its record, and both values."""
    from unittest import mock
    shapes = deep_model.DEEP_SHAPES
    cases = [made_up_case(layers, kv_heads, seed, kv_heads == 2)
             for seed, (layers, kv_heads) in enumerate(shapes)]

    def over(name, chosen):
        return {"models": len(chosen),
                "largest_logit_gap": max(c[name]["largest_logit_gap"] for c in chosen),
                "continuations_changed": sum(c[name]["continuation_changed"] for c in chosen)}
    grouped = [c for c in cases if c["kv_heads"] == 2]
    expected = {"shapes": cases,
                "key_gap_rotated_back_vs_rotated_once": (len(shapes) - 1) / 64,
                "rounding": over("rounding", cases),
                "against_recompute_by_layers": [
                    {"layers": layers, **over("against_recompute",
                                              [c for c in cases if c["layers"] == layers])}
                    for layers in (1, 2, 3, 4)],
                "offset_with_nothing_before": over("offset_with_nothing_before", grouped),
                "learned_old_keys_against_recompute":
                    over("learned_old_keys_against_recompute", grouped)}
    label = "context_shift.experiment, given made-up cases for its shapes"
    step(f"{label}: running it")
    with mock.patch.object(context_shift, "_shift", made_up_case):
        record = context_shift.experiment(None)
    for name, wanted in expected.items():
        got = record.get(name)
        if (name == "shapes" and got != wanted and isinstance(got, list)
                and len(got) == len(wanted)):
            name, (got, wanted) = next((f"shapes[{index}]", pair) for index, pair
                                       in enumerate(zip(got, wanted)) if pair[0] != pair[1])
        if got != wanted:
            return Wrong(f"{label}: its {name} is {excerpt(got, 300)}, {excerpt(wanted, 300)} "
                         f"worked out plainly (_shift(layers, kv_heads, seed, kv_heads == 2))")
    return None


def quick_check():
    """A held cache goes on as the fed one; a shifted key is the one at its new position.

    Feeds 2-layer models of learned and of rotary positions the first 10 tokens of the
    first test story: a cache held from the keys and values of the first 6
    (context_shift._held) goes on as the cache it was kept from (where_held_differs). Then
    a 1-layer rotary model random tokens: its kept keys turned back by the dropped
    positions are within rounding of those computed at the new positions
    (where_shift_strays), and context_shift._shift records what one layer gives
    (where_shift_record_wrong). First of all, experiment gathers made-up cases as worked
    out plainly (where_experiment_sums_wrong)."""
    why = where_experiment_sums_wrong()   # first: it runs no model
    if why:
        return why
    ids = TOK.encode(STORIES[0])[:10]
    for positions in ("learned", "rotary"):
        why = where_held_differs(deep_model.init_params(2, 4, 2, 16, 0, positions), ids, 6)
        if why:
            return why
    return where_shift_strays() or where_shift_record_wrong()


QuickCheck = quick_check_case("context_shift", __name__)


class HeldCaches(unittest.TestCase):

    def test_a_turn_by_no_position_leaves_a_key_as_it_is(self):
        rng = random.Random(1)
        key = [rng.gauss(0.0, 1.0) for _ in range(16)]
        thetas = [deep_model.BASE ** (-c / 4) for c in (0, 2)] * 4
        self.assertEqual(deep_model.rotate(key, 0, thetas), key, "a key turned by position 0")


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
RECORD = (r"context_shift._shift\(1, 2, 0, True\), of the 1-layer grouped-query model "
          r"\(4 heads, 2 kv heads, rotary positions\): its {} is {}, where one layer gives")
EXPERIMENT = (r"^context_shift\.experiment, given made-up cases for its shapes: its {} is .*, "
              r".* worked out plainly")


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
        ("a block moved to another offset turned back, not on", context_shift,
         "_block_elsewhere", swapping("rotate(k, DROPPED, thetas)", "rotate(k, -DROPPED, thetas)"),
         RECORD.format("offset_with_nothing_before", r"\{'largest_logit_gap': \S+, "
                                                     r"'continuation_changed': \w+\}")),
        ("the last shape's gap, not the largest", context_shift, "experiment",
         swapping("max((c[name]['largest_logit_gap'] for c in chosen))",
                  "chosen[-1][name]['largest_logit_gap']"), EXPERIMENT.format("rounding")),
        ("every shape's gaps against the recompute, whatever its layers", context_shift,
         "experiment", swapping("[c for c in cases if c['layers'] == layers]", "cases"),
         EXPERIMENT.format("against_recompute_by_layers")),
        ("the multi-query shapes taken for the grouped ones", context_shift, "experiment",
         swapping("c['kv_heads'] == 2", "c['kv_heads'] == 1"),
         r"^context_shift\.experiment, given made-up cases .*: (its offset_with_nothing_before"
         r"|running it: raised KeyError)"),
        ("the cases elsewhere run for every shape", context_shift, "experiment",
         swapping("kv_heads == 2", "True"), EXPERIMENT.format(r"shapes\[0\]")),
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
