"""The instruments (instruments.py): what they record is what the code computed, they
leave the code as it was, and a planted mistake is the real function with that one
change."""
import ast
import math
import sys
import unittest

import model
from instruments import (Call, chosen_rows, largest_gap, plant, recording, replaced,
                         replacing, sums_in_another_order)


THIS = sys.modules[__name__]


def scaled(x, by=1):
    """A function of this module for the tests to watch and to plant mistakes in."""
    return [2.0 * by * value for value in x]


class Recording(unittest.TestCase):

    def test_every_call_is_recorded_with_its_arguments_and_result(self):
        with recording(THIS, "scaled") as calls:
            first = scaled([1.0, 2.0])
            second = scaled([1.0], by=3)
        self.assertEqual(calls, [Call("scaled", ([1.0, 2.0],), first),
                                 Call("scaled", ([1.0], {"by": 3}), second)])
        self.assertEqual((first, second), ([2.0, 4.0], [6.0]))
        self.assertIs(THIS.scaled, scaled)   # put back as it was

    def test_a_call_that_raises_is_not_recorded_and_the_function_is_put_back(self):
        real = model.check_token_id
        with self.assertRaises(ValueError), recording(model, "check_token_id") as calls:
            model.check_token_id(3)
            model.check_token_id(-1)
        self.assertEqual([call.args for call in calls], [(3,)])
        self.assertIs(model.check_token_id, real)

    def test_replaced_puts_the_real_function_back_even_after_an_error(self):
        real = model.relu
        with self.assertRaises(KeyError), replaced(model, "relu", lambda r: lambda z: z):
            self.assertEqual(model.relu([-1.0]), [-1.0])
            raise KeyError("inside")
        self.assertIs(model.relu, real)
        self.assertEqual(model.relu([-1.0]), [0.0])

    def test_chosen_rows_gives_each_choice_the_position_of_its_row(self):
        class Generation:   # what a generate.Generation is at the end: prompt, then steps
            ids, steps = [7, 8, 9, 1, 2], [{}, {}]
        story = Generation()
        calls = [Call("choose", (story, [0.1]), None), Call("choose", (story, [0.2]), None)]
        self.assertEqual(chosen_rows(calls), [(story, 2, [0.1]), (story, 3, [0.2])])


class Rows(unittest.TestCase):

    def test_largest_gap(self):
        self.assertEqual(largest_gap([[1.0, 2.0], [3.0, 4.0]], [[1.0, 2.5], [2.0, 4.0]]), 1.0)
        self.assertEqual(largest_gap([], []), 0.0)
        with self.assertRaisesRegex(ValueError, "2 rows cannot be compared with 1"):
            largest_gap([[1.0], [2.0]], [[1.0]])

    def test_sums_in_another_order_change_model_sums_only_inside_the_block(self):
        terms = [1.0, 1e100, 1.0, -1e100]
        self.assertEqual(model.fsum(terms), 2.0)
        with sums_in_another_order():
            self.assertEqual(model.fsum(terms), 1.0)   # last term first: one 1.0 is lost
            self.assertEqual(model.dot([1e100, 1.0], [1.0, 1.0]), 1e100)
        self.assertIs(model.fsum, math.fsum)


DOUBLE_BECOMES_TRIPLE = replacing(lambda node: isinstance(node, ast.Constant) and node.value == 2.0,
                                  lambda node: ast.Constant(3.0))


class Planting(unittest.TestCase):

    def test_a_planted_function_is_the_real_one_with_the_mistake(self):
        planted = plant(THIS, "scaled", DOUBLE_BECOMES_TRIPLE)
        self.assertEqual(planted([1.0]), [3.0])       # 2.0 became 3.0
        self.assertEqual(scaled([1.0]), [2.0])        # the real one is unchanged
        self.assertIs(planted.__globals__, globals())   # it reads this module's names
        self.assertEqual(planted.__code__.co_filename, __file__)

    def test_a_mistake_with_nowhere_to_go_plants_nothing(self):
        nowhere = replacing(lambda node: False, lambda node: node)
        self.assertIsNone(plant(THIS, "scaled", nowhere))

    def test_a_method_can_be_planted_too(self):
        planted = plant(Sized, "size", DOUBLE_BECOMES_TRIPLE)
        self.assertEqual((planted(Sized()), Sized().size()), (3.0, 2.0))


class Sized:
    """A class of this module, for planting a method."""

    def size(self):
        return 2.0


if __name__ == "__main__":
    unittest.main()
