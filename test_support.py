"""The tests' own frame (support.py, verdicts.py): a failing case names
itself and the command that reruns it alone; an exception in a case names the lab's lines
it came through; a layer whose check fails makes the layers built on it skip, saying
which, and its own module's QuickCheck fail with the check's detail; a generation that
parts from generate's names the new token, counted from 1."""
import io
import os
import unittest
from contextlib import redirect_stderr
from unittest import mock

import generate
import model
import support
import verdicts
from verdicts import Layer, Wrong

REAL_LAYERS = dict(verdicts.layers())   # before the tests below put made-up ones in its place


class Cases(unittest.TestCase):

    def failure_of(self, run):
        """The message of the failure run(test) gives a throwaway test."""
        test = unittest.FunctionTestCase(lambda: None)
        self.test_id = test.id()
        with self.assertRaises(AssertionError) as failed:
            run(test)
        return str(failed.exception)

    def test_a_failing_random_case_names_its_seed_and_the_command_that_reruns_it(self):
        with mock.patch.dict(os.environ):
            for name in ("KV_LAB_CASE", "KV_LAB_RANDOM_CASES"):
                os.environ.pop(name, None)
            message = self.failure_of(lambda test: support.check_random_cases(
                test, 10, lambda n: f"odd number {n}" if n % 2 else None))
        self.assertEqual(message.splitlines(), [
            "5 of 10 random cases fail; the first, case 1 (drawn from random.Random(1)): "
            "odd number 1",
            "rerun it alone: KV_LAB_CASE=1 python3 -m unittest " + self.test_id])
        with mock.patch.dict(os.environ, {"KV_LAB_CASE": "7"}):
            message = self.failure_of(lambda test: support.check_random_cases(
                test, 10, lambda n: f"odd number {n}" if n % 2 else None))
        self.assertIn("1 of 1 random cases fail; the first, case 7", message)

    def test_an_exception_in_a_case_is_its_failure_naming_the_lab_s_lines(self):
        why = support.described(model.check_int, "blocks", 0, 1)
        self.assertRegex(why, r"^raised ValueError: blocks must be an int >= 1, got 0 "
                              r"\(in model\.py line \d+, check_int\)$")
        message = self.failure_of(lambda test: support.check_every_case(
            test, [("first", 1), ("second", 0)], lambda n: 1 / n and None))
        self.assertEqual(message, "1 of 2 cases fail; the first, second: raised "
                                  "ZeroDivisionError: division by zero")


class Layers(unittest.TestCase):
    """Made-up layers: a foundation whose check fails, one built on it, one beside it."""

    FAKE = {"ground": Layer("ground", "the ground", (), module="test_support",
                            check=lambda: Wrong("it cracked", "  at its foot: 1.0, 2.0 expected")),
            "house": Layer("house", "the house", ("ground",), module="test_house",
                           check=lambda: None),
            "shed": Layer("shed", "the shed", (), module="test_shed", check=lambda: None)}

    def setUp(self):
        patches = [mock.patch.object(verdicts, "_found", self.FAKE),
                   mock.patch.object(verdicts, "_verdicts", {}),
                   mock.patch.object(verdicts, "_told", set())]
        for patch in patches:
            patch.start()
            self.addCleanup(patch.stop)

    def test_what_is_built_on_a_wrong_layer_skips_and_says_so_once(self):
        said = io.StringIO()
        with redirect_stderr(said):
            for _ in range(2):
                with self.assertRaises(unittest.SkipTest) as skipped:
                    verdicts.set_up("house")
                self.assertEqual(str(skipped.exception),
                                 "the ground is wrong, so the tests built on it skip; "
                                 "python3 -m unittest test_support shows why")
        self.assertEqual(said.getvalue(), "\nthe ground is wrong, so the tests built on it "
                                          "skip; python3 -m unittest test_support shows why: "
                                          "it cracked\n")

    def test_a_wrong_layer_s_own_module_skips_all_but_its_quick_check_which_shows_why(self):
        """(On this module's classes, put back as they were afterwards.)"""
        cases = [Cases, Layers, Messages]
        for case in cases:
            self.addCleanup(setattr, case, "setUpClass", case.setUpClass)
        self.addCleanup(support.tear_down)
        verdicts.set_up("ground")
        for case in cases:
            with self.assertRaises(unittest.SkipTest) as skipped:
                case.setUpClass()
            self.assertEqual(str(skipped.exception), "the ground is wrong (its QuickCheck "
                                                     "says why), so the tests built on it skip")
        check = verdicts.quick_check_case("ground", "test_support")("test_the_layer_s_quick_check")
        with self.assertRaises(AssertionError) as failed:
            check.test_the_layer_s_quick_check()
        self.assertEqual(str(failed.exception).splitlines(), [
            "the ground is wrong: it cracked", "  at its foot: 1.0, 2.0 expected",
            "This check alone: python3 -m unittest test_support.QuickCheck"])

    def test_a_layer_no_test_module_declares_says_the_line_to_write(self):
        for attempt in (lambda: verdicts.set_up("eviction"),
                        lambda: verdicts.quick_check_case("eviction", "test_eviction")):
            with self.assertRaises(LookupError) as missing:
                attempt()
            self.assertIn("no test module declares the layer 'eviction'", str(missing.exception))
            self.assertIn('write in test_eviction.py\nLAYER = Layer("eviction", "what it is '
                          '(eviction.py)", ("lesson",))', str(missing.exception))
            self.assertIn("quick_check() in test_eviction.py", str(missing.exception))

    def test_a_test_module_declares_its_layer_in_one_line_found_without_importing_it(self):
        """The lab's layers are those its test modules declare, read from their files (no
        test module imports another): test_forks.py's is its line LAYER = Layer(...)."""
        self.assertEqual(REAL_LAYERS["forks"], Layer("forks", "parallel sampling from forks "
                                                     "(forks.py)", ("lesson", "paged"),
                                                     module="test_forks"))
        self.assertEqual(REAL_LAYERS["lesson"].command,
                         "python3 -m unittest test_kv_cache.Exactness")
        self.assertEqual(REAL_LAYERS["every Part"].builds_on,
                         tuple(name for name in REAL_LAYERS if name != "every Part"))

    def test_a_record_entry_no_stage_writes_says_the_line_to_add(self):
        with self.assertRaises(AssertionError) as missing:
            support.recorded("idea")
        self.assertIn("kv-trace.json has no entry 'idea'", str(missing.exception))
        self.assertIn("Stage(PART, 'idea', MODULE.experiment", str(missing.exception))
        self.assertEqual(support.recorded("stories"), 60)

    def test_a_sound_layer_runs_from_another_folder(self):
        verdicts.set_up("shed")
        self.addCleanup(support.tear_down)
        self.assertNotEqual(os.getcwd(), support.HERE)

    def test_each_layer_of_the_lab_builds_on_declared_ones_and_names_its_tests(self):
        """(Each layer's check itself runs in its module's set-up.) No layer builds, through
        others, on itself."""
        def under(name, path=()):
            self.assertNotIn(name, path, f"layers built on themselves: {path + (name,)}")
            for below in REAL_LAYERS[name].builds_on:
                under(below, path + (name,))
        for name, layer in REAL_LAYERS.items():
            with self.subTest(layer=name):
                self.assertLessEqual(set(layer.builds_on), set(REAL_LAYERS))
                under(name)
                self.assertTrue(name == "every Part" or os.path.exists(
                    os.path.join(support.HERE, layer.module + ".py")), layer.command)


class Messages(unittest.TestCase):

    def test_a_parting_generation_names_its_new_token_counted_from_1(self):
        """New token 1 is the first token generated, chosen by the row at the prompt's last
        position (positions count from 0): the numbering of every message and text."""
        prompt = support.OPENINGS[0]
        last = len(support.TOK.encode(prompt)) - 1
        uncached = generate.generate(support.PARAMS, support.TOK, prompt, max_new_tokens=3)
        for index in (0, 2):
            with self.subTest(index=index):
                parted = {**uncached, "steps": list(uncached["steps"])}
                parted["steps"][index] = {"token": "zz", "probability": 0.5}
                message = support.generation_difference(support.PARAMS, prompt, {}, parted,
                                                        uncached)
                self.assertIn(f"new token {index + 1} (chosen by the row at position "
                              f"{last + index}) is 'zz'", message)
        shorter = {**uncached, "steps": uncached["steps"][:2], "stopped": "end of story"}
        self.assertIn("after 2 new tokens (end of story), where generate stopped after 3",
                      support.generation_difference(support.PARAMS, prompt, {}, shorter,
                                                    uncached))


if __name__ == "__main__":
    unittest.main()
