"""What the lab's layers say of themselves, for the tests: each layer of quick_checks.LAYERS
is checked at most once in a test run, and its verdict decides what runs.

A test module names its layer in its set-up (set_up). If a layer under it is wrong, its
tests skip, with one line naming that layer and the command that shows why, so that one
mistake gives one verdict, from the layer it is in. If its own layer is wrong, its tests
skip too, but for its QuickCheck (quick_check_case), which fails with the check's detail:
what it fed, what it compared, and both values.
"""
import sys
import unittest
from unittest import mock

import quick_checks
from instruments import plant
from quick_checks import LAYERS, Wrong, check_of, module_of
from support import described, enter_another_folder

__unittest = True   # unittest leaves this module's lines out of the tracebacks it prints

_verdicts, _told = {}, set()


def layer(name):
    """LAYERS[name], or an error that says the line a new Part's layer needs there."""
    if name not in LAYERS:
        raise LookupError(
            f"quick_checks.LAYERS has no layer {name!r}: a new Part's test module names its "
            f"layer, so add its line before LAYERS[\"every Part\"], for instance\n"
            f"LAYERS[{name!r}] = Layer(\"what it is ({name}.py)\", (\"lesson\",), "
            f"\"python3 -m unittest test_{name}\")\n"
            f"and its quick check, quick_check() in test_{name}.py (None if it holds, else "
            f"a quick_checks.Wrong naming what differs and where)")
    return LAYERS[name]


def verdict(name):
    """None if layer name's own check holds, else why not (checked once in a run)."""
    if name not in _verdicts:
        layer(name)
        _verdicts[name] = checked(lambda: check_of(name)())
    return _verdicts[name]


def checked(check):
    """check(): None, or why it fails; an exception it raises is its failure, named with
    the step it was at (quick_checks.step) and the lab's lines it came through."""
    quick_checks.STEPS.clear()
    why = described(check)
    if why and not isinstance(why, Wrong) and quick_checks.STEPS:
        return Wrong(f"{quick_checks.STEPS[-1]}: {why}")
    return why


def wrong_below(name):
    """The first layer under name (foundations first) whose check fails, or None."""
    for below in layer(name).builds_on:
        found = wrong_below(below) or (below if verdict(below) else None)
        if found:
            return found
    return None


def _wait_for(wrong):
    """Skip, since layer wrong fails its check; the first time, say so on stderr, in one
    line (unittest shows the reasons of skips only with -v)."""
    reason = (f"{layer(wrong).title} is wrong, so the tests built on it skip; "
              f"{layer(wrong).command} shows why")
    if wrong not in _told:
        _told.add(wrong)
        print(f"\n{reason}: {verdict(wrong)}", file=sys.stderr)
    raise unittest.SkipTest(reason)


def skip_unless_sound(name):
    """For the tests built on layer name: skip unless it and every layer under it hold."""
    wrong = wrong_below(name) or (name if verdict(name) else None)
    if wrong:
        _wait_for(wrong)


def set_up(name):
    """A layer's own test module's set-up: skip if a layer under it is wrong; if it is
    wrong itself, skip every test of the module but its QuickCheck, which says why; then
    run from another folder, as a learner might run the commands."""
    wrong = wrong_below(name)
    if wrong:
        _wait_for(wrong)
    if verdict(name):
        reason = (f"{layer(name).title} is wrong (its QuickCheck says why), so the tests "
                  f"built on it skip")
        module = module_of(name)
        for case in vars(sys.modules[module]).values():   # its own classes, not imported ones
            if (isinstance(case, type) and issubclass(case, unittest.TestCase)
                    and case.__module__ == module and case.__name__ != "QuickCheck"):
                case.setUpClass = classmethod(lambda cls: _skip(reason))
    enter_another_folder()


def _skip(reason):
    raise unittest.SkipTest(reason)


def quick_check_case(name, module):
    """The TestCase class QuickCheck of layer name's own test module (named module): it
    runs the layer's quick check, and fails with its verdict and its detail."""
    def test_the_layer_s_quick_check(self):
        why = verdict(name)
        if why:
            detail = getattr(why, "detail", "")
            self.fail(f"{layer(name).title} is wrong: {why}" + (f"\n{detail}" if detail else "")
                      + f"\nThis check alone: python3 -m unittest {module}.QuickCheck")
    test_the_layer_s_quick_check.__doc__ = check_of(name).__doc__
    return type("QuickCheck", (unittest.TestCase,),
                {"__module__": module, "__qualname__": "QuickCheck",
                 "__doc__": f"The quick check of {layer(name).title}, first.",
                 "test_the_layer_s_quick_check": test_the_layer_s_quick_check})


def assert_verdicts(test, name, mistakes):
    """Plant each of mistakes, (what it is, the class or module and the function it is
    planted in, the planting for instruments.plant, a pattern), in the real code in turn,
    and assert that layer name's quick check then fails with a line that matches the
    pattern: the quantity that differs and where. First, that it holds with none planted.
    A mistake whose planting site an edit removed is skipped, named."""
    test.assertIsNone(verdict(name), "the check fails with no mistake planted")
    check = check_of(name)
    for what, owner, function, planting, pattern in mistakes:
        with test.subTest(mistake=what):
            planted = plant(owner, function, planting)
            if planted is None:
                test.skipTest(f"the planting site of {what!r} is gone from "
                              f"{owner.__name__}.{function}")
            with mock.patch.object(owner, function, planted):
                why = checked(check)
            test.assertRegex(why or "", pattern, f"with {what}, the check said {why!r}")
