"""The deeper model at twelve shapes (deep_shapes.py): a shape's figures and a window's reach
against what is worked out plainly, mistakes planted in them named by the quick check, and
what the recorded run says of every shape."""
import unittest

import deep_shapes
import support
import verdicts
from random_models import random_tokens
from support import swapping
from verdicts import Layer, Wrong, step


LAYER = Layer("deep_shapes", "the deeper model at twelve shapes (deep_shapes.py)",
              ("deep_model",))


def setUpModule():
    verdicts.set_up("deep_shapes")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down

IDS = random_tokens(24)   # enough for 2 layers of a window of 8 to reach position 14
SHAPES = ((1, 4), (2, 2), (3, 1))


def quick_check():
    """A shape's figures and a window's reach, as worked out plainly.

    For SHAPES along IDS: the cached rows are the full pass's (gap 0.0) and the numbers a
    position are 2 x layers x kv_heads x 4 (the head width), counted and by formula. With
    a window of 8 in each of 2 layers, a change of the first token reaches position 14 (7
    a layer) and no further, and the cached rows are the masked pass's. None, or a Wrong
    naming the shape and the figure."""
    for layers, kv_heads in SHAPES:
        where = f"deep_shapes.shape_entry({layers} layers, {kv_heads} kv heads) along 24 tokens"
        step(where)
        entry = deep_shapes.shape_entry(layers, kv_heads, IDS)
        wanted = {"largest_logit_gap": 0.0, "floats_per_position": 2 * layers * kv_heads * 4,
                  "formula": 2 * layers * kv_heads * 4}
        for key, value in wanted.items():
            if entry[key] != value:
                return Wrong(f"{where}: its {key} is {entry[key]!r}, {value!r} worked out "
                             f"plainly", f"  fed: token IDs {IDS}")
    where = "deep_shapes.window_reach(2 layers) along 24 tokens, a window of 8"
    step(where)
    reach = deep_shapes.window_reach(2, IDS)
    for key, value in (("cached_equals_full_pass", True), ("last_position_token_0_reaches", 14)):
        if reach[key] != value:
            return Wrong(f"{where}: its {key} is {reach[key]!r}, {value!r} worked out plainly",
                         f"  fed: token IDs {IDS}")
    return None


QuickCheck = verdicts.quick_check_case("deep_shapes", __name__)


class Teeth(unittest.TestCase):
    """Each mistake, planted in the real deep_shapes.py (by its syntax tree), makes the
    layer's quick check fail, naming the shape and the figure."""

    MISTAKES = [
        ("the formula counting keys alone, not keys and values", deep_shapes, "shape_entry",
         swapping("2 * layers * kv_heads * (WIDTH // 4)", "layers * kv_heads * (WIDTH // 4)"),
         r"^deep_shapes\.shape_entry\(1 layers, 4 kv heads\) along 24 tokens: its formula is "
         r"16, 32 worked out plainly$"),
        ("every shape built with 4 key-value heads", deep_shapes, "shape_entry",
         swapping("fed_deep_model(layers, kv_heads, ids)", "fed_deep_model(layers, 4, ids)"),
         r"^deep_shapes\.shape_entry\(2 layers, 2 kv heads\) along 24 tokens: its "
         r"floats_per_position is 64\.0, 32 worked out plainly$"),
        ("the first position reached, not the last", deep_shapes, "window_reach",
         swapping("reached[-1]", "reached[0]"),
         r"^deep_shapes\.window_reach\(2 layers\) along 24 tokens, a window of 8: its "
         r"last_position_token_0_reaches is 0, 14 worked out plainly$"),
        ("a window one wider than WINDOW", deep_shapes, "window_reach",
         swapping("band(WINDOW)", "band(WINDOW + 1)"),
         r"^deep_shapes\.window_reach\(2 layers\) along 24 tokens, a window of 8: its "
         r"last_position_token_0_reaches is 16, 14 worked out plainly$"),
    ]

    def test_the_quick_check_names_each_mistake_and_where(self):
        verdicts.assert_verdicts(self, "deep_shapes", self.MISTAKES)


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of the deeper model's shapes."""

    def test_every_shape_s_cached_rows_are_its_full_pass_s(self):
        for shape in support.recorded("deep_models")["shapes"]:
            with self.subTest(layers=shape["layers"], kv_heads=shape["kv_heads"]):
                self.assertEqual(shape["largest_logit_gap"], 0.0,
                                 "the recorded largest gap of the cached rows to the full pass's")
                self.assertEqual(shape["floats_per_position"], shape["formula"],
                                 "the recorded numbers a position, against the formula's")


if __name__ == "__main__":
    unittest.main()
