"""Shifting a rotary cache (context_shift.py): the caches the experiment builds from
kept keys and values go on exactly as caches fed the same tokens, so its figures measure
the shift and nothing else. The figures themselves are the record's (test_trace_kv)."""
import random
import unittest

import context_shift
import deep_model
import support
from verdicts import quick_check_case, set_up
from model import VOCAB_SIZE
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
        self.assertEqual(deep_model.rotate(key, 0, thetas), key)


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of the rotary cache and its shift."""

    def test_rotary_rows_are_exact_and_a_shift_differs_by_rounding_then_by_content(self):
        rotary = support.recorded("rotary")
        learned = support.recorded("deep_models")["shapes"]
        for shape, twin in zip(rotary["shapes"], learned):
            with self.subTest(layers=shape["layers"], kv_heads=shape["kv_heads"]):
                self.assertEqual(shape["largest_logit_gap"], 0.0)
                self.assertEqual(shape["floats_per_position"], twin["floats_per_position"])
                self.assertTrue(shape["layer_1_keys_rotated_once_equal_recomputed"])
                if shape["layers"] == 1:   # a recompute differs from the shift by rounding alone
                    self.assertEqual(shape["against_recompute"], shape["rounding"])
        self.assertEqual(rotary["rounding"]["continuations_changed"], 0)
        self.assertLess(rotary["rounding"]["largest_logit_gap"], 1e-12)
        for deeper in rotary["against_recompute_by_layers"][1:]:   # content from layer 2 on
            with self.subTest(layers=deeper):
                self.assertGreater(deeper["continuations_changed"], 0)


if __name__ == "__main__":
    unittest.main()
