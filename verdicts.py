"""The lab's layers, for the tests: each declared by its own test module, found as
unittest finds tests, checked at most once in a test run; what their quick checks share;
and what a layer's verdict makes the tests built on it do.

A layer is declared by the test module of its Part, near its top, in one line:
LAYER = Layer("lossy", "the lossy caches (lossy.py)", ("lesson", "prefill"))
(its name, what it is in words with its module, the layers its tests build on; its quick
check is quick_check() in that module). The layers are found by reading that line of
every test_*.py beside this file, without importing it: a Part that cannot even be
imported (a syntax error) is then its layer's verdict, and the layers beside it run.

A quick check feeds the cases where its module's mistakes show, and returns None if they
hold, else why not: a Wrong, whose one line names the quantity that differs and where
(story, position, block, request), and whose detail gives what was fed and both values.

A test module names its layer in its set-up (set_up). If a layer under it is wrong, its
tests skip, with one line naming that layer and the command that shows why, so that one
mistake gives one verdict, from the layer it is in. If its own layer is wrong, its tests
skip too, but for its QuickCheck (quick_check_case), which fails with the check's detail:
what it fed, what it compared, and both values.
"""
import ast
import glob
import importlib
import os
import sys
import unittest
from collections import namedtuple
from unittest import mock

from instruments import plant
from support import described, enter_another_folder, first_gap

__unittest = True   # unittest leaves this module's lines out of the tracebacks it prints

HERE = os.path.dirname(os.path.abspath(__file__))


class Layer(namedtuple("Layer", "name title builds_on shown_by module check",
                       defaults=("", "", None))):
    """One layer of the lab, as its test module declares it.

    Its name, what it is (with its module), the layers its tests build on, and the class of
    tests that shows why it is wrong (shown_by; all the module's tests if ""). Discovery
    adds the declaring test module; check is its quick check if given here, else
    quick_check() in that module."""

    @property
    def command(self):
        """The command that shows why the layer is wrong."""
        return f"python3 -m unittest {self.module}" + (f".{self.shown_by}" if self.shown_by
                                                       else "")


def declaration_line(name):
    """The line a test module writes to declare layer name, for a message."""
    return (f'LAYER = Layer("{name}", "what it is ({name}.py)", ("lesson",))   '
            f'# from verdicts import Layer')


def _declared(path):
    """The layer the test module at path declares (its line LAYER = Layer(...), read by
    its syntax tree, without importing it), or None if it declares none."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.find("\nLAYER = Layer(")
    if start < 0:
        return None
    lines = text[start + 1:].splitlines()
    for end in range(1, len(lines) + 1):   # the statement ends where its lines parse
        try:
            call = ast.parse("\n".join(lines[:end])).body[0].value
            break
        except SyntaxError:
            continue
    else:
        raise SyntaxError(f"{os.path.basename(path)}: its line LAYER = Layer(...) does not "
                          f"parse; write it as {declaration_line('name')}")
    module = os.path.basename(path)[:-3]
    return Layer(*map(ast.literal_eval, call.args),
                 **{word.arg: ast.literal_eval(word.value) for word in call.keywords},
                 module=module)


_found = {}


def layers():
    """Every layer the test modules beside this file declare, by name (found once).

    Also "every Part", built on all of them, shown by the whole suite."""
    if not _found:
        for path in sorted(glob.glob(os.path.join(HERE, "test_*.py"))):
            declared = _declared(path)
            if declared:
                _found[declared.name] = declared
        _found["every Part"] = Layer("every Part", "every Part", tuple(_found), module="",
                                     check=lambda: None)
    return _found


_verdicts, _told = {}, set()


def layer(name):
    """The layer name, or an error that says the line its test module needs."""
    if name not in layers():
        raise LookupError(
            f"no test module declares the layer {name!r}: a new Part's test module declares "
            f"its layer near its top, so write in test_{name}.py\n"
            f"{declaration_line(name)}\n"
            f"and its quick check, quick_check() in test_{name}.py (None if it holds, else "
            f"a verdicts.Wrong naming what differs and where)")
    return layers()[name]


def check_of(name):
    """Layer name's quick check: the one its Layer gives, else quick_check() in its test module.

    That module is imported now (a Part that cannot be imported fails here, as its
    verdict)."""
    if layer(name).check:
        return layer(name).check
    module = importlib.import_module(layer(name).module)
    if not hasattr(module, "quick_check"):
        raise LookupError(f"{layer(name).module}.py has no quick_check(), the quick check of "
                          f"layer {name!r}: a function that feeds the cases where its "
                          f"module's mistakes show and returns None, or a Wrong")
    return module.quick_check


def verdict(name):
    """None if layer name's own check holds, else why not (checked once in a run)."""
    if name not in _verdicts:
        layer(name)
        _verdicts[name] = checked(lambda: check_of(name)())
    return _verdicts[name]


def checked(check):
    """check(): None, or why it fails.

    An exception it raises is its failure, named with the step it was at (step) and the
    lab's lines it came through."""
    STEPS.clear()
    why = described(check)
    if why and not isinstance(why, Wrong) and STEPS:
        return Wrong(f"{STEPS[-1]}: {why}")
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
    """A layer's own test module's set-up.

    Skip if a layer under it is wrong; if it is wrong itself, skip every test of the module
    but its QuickCheck, which says why; then run from another folder, as a learner might
    run the commands."""
    wrong = wrong_below(name)
    if wrong:
        _wait_for(wrong)
    if verdict(name):
        reason = (f"{layer(name).title} is wrong (its QuickCheck says why), so the tests "
                  f"built on it skip")
        module = layer(name).module
        for case in vars(sys.modules[module]).values():   # its own classes, not imported ones
            if (isinstance(case, type) and issubclass(case, unittest.TestCase)
                    and case.__module__ == module and case.__name__ != "QuickCheck"):
                case.setUpClass = classmethod(lambda cls: _skip(reason))
    enter_another_folder()


def _skip(reason):
    raise unittest.SkipTest(reason)


def quick_check_case(name, module):
    """The TestCase class QuickCheck of layer name's own test module (named module).

    It runs the layer's quick check, and fails with its verdict and its detail. A test
    module that does not declare its layer fails here, at its import, naming the line to
    write."""
    declared = layer(name)
    if declared.module != module:
        raise LookupError(f"the layer {name!r} is declared by {declared.module}.py, not by "
                          f"{module}.py: a layer has one test module")

    def test_the_layer_s_quick_check(self):
        why = verdict(name)
        if why:
            detail = getattr(why, "detail", "")
            self.fail(f"{layer(name).title} is wrong: {why}" + (f"\n{detail}" if detail else "")
                      + f"\nThis check alone: python3 -m unittest {module}.QuickCheck")
    test_the_layer_s_quick_check.__doc__ = check_of(name).__doc__
    return type("QuickCheck", (unittest.TestCase,),
                {"__module__": module, "__qualname__": "QuickCheck",
                 "__doc__": f"The quick check of {declared.title}, first.",
                 "test_the_layer_s_quick_check": test_the_layer_s_quick_check})


def assert_verdicts(test, name, mistakes):
    """Assert that layer name's quick check names each of mistakes, planted in turn.

    A mistake is (what it is, the class or module and the function it is planted in, the
    planting for instruments.plant, a pattern): planted in the real code, the quick check
    then fails with a line that matches the pattern: the quantity that differs and where.
    First, that it holds with none planted. A mistake whose planting site an edit removed
    is skipped, named."""
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


# ---- what quick checks share ----------------------------------------------------

class Wrong(str):
    """A check's verdict when it fails: one line, the str itself.

    The line names the quantity that differs and where; its detail, for the layer's own
    QuickCheck: what was fed, and both values."""

    def __new__(cls, line, detail=""):
        wrong = super().__new__(cls, line)
        wrong.detail = detail
        return wrong


STEPS = []   # what the running check is doing now (step), so that an exception can say it


def step(what):
    """Say what the running check does next ("finding the prefix again").

    An exception it raises from here on is named with it."""
    STEPS[:] = [what]


def excerpt(values, width=100):
    """A list of numbers (or anything) as a line of at most width characters."""
    text = repr(values)
    return text if len(text) <= width else text[:width - 5] + " ...]"


def differ(what, got, expected, source, names=("position", "logit"), fed="", within=None):
    """None if got == expected, else a Wrong naming the first number that differs.

    Given within, got need only have each number within that of expected's. The Wrong
    names the number by its indices (names:
    what each level of nesting counts, "position 9, logit 3"), with both numbers; its
    detail shows what was fed and the two vectors that hold the difference."""
    if got == expected:
        return None
    found = first_gap(got, expected, within)
    if found is None:
        return None
    indices, mine, wanted, numbers = found
    place = ", ".join(f"{name} {i}" for name, i in zip(names, indices)) or "the lists"
    outer_got, outer_wanted = got, expected
    for i in (indices[:-1] if numbers else indices):
        outer_got, outer_wanted = outer_got[i], outer_wanted[i]
    gap = (f" ({abs(mine - wanted):.3g} apart, more than rounding, {within:g})"
           if numbers and within is not None else "")
    return Wrong(f"{what}, at {place}: {mine} from {source}, {wanted} expected{gap}",
                 (f"  fed: {fed}\n" if fed else "") + f"  {source} gave: {excerpt(outer_got)}\n"
                 f"  expected:  {excerpt(outer_wanted)}")


ROUNDING = 1e-12   # far above the absorbed path's gaps (about 1e-15), far below a mistake's


def strayed(what, got, expected, source, names=("position", "logit"), fed=""):
    """differ within ROUNDING."""
    return differ(what, got, expected, source, names, fed, within=ROUNDING)


def where_cache_differs(label, cache, reference, source):
    """None if cache holds the tokens, keys and values reference holds, else a Wrong.

    The Wrong names the first part and position that differ, with both numbers."""
    for part in ("tokens", "keys", "values"):
        why = differ(f"{label}: its {part}", list(getattr(cache, part)),
                     list(getattr(reference, part)), source,
                     names=("position", "number"), fed=f"token IDs {list(reference.tokens)}")
        if why:
            return why
    return None


def story_name(index):
    """The name a check gives test story index (0: "the first test story")."""
    return f"the {('first', 'second', 'third', 'fourth')[index]} test story"


def deep_label(params):
    """A deep_model model's shape in words.

    As "the 2-layer grouped-query model (4 heads, 2 kv heads, rotary positions)", with its
    latent and rotary key, and its hybrid fields (windows [4, None], sinks, kv_from [0, 0]),
    if it has them."""
    from deep_params import HYBRID
    shape = params["shape"]
    heads, kv_heads = shape["heads"], shape["kv_heads"]
    kind = ("latent" if shape["latent"] else "multi-head" if kv_heads == heads
            else "multi-query" if kv_heads == 1 else "grouped-query")
    latent = ""
    if shape["latent"]:
        latent = f", latent {shape['latent']}" + (f", rotary key {shape['rotary_key']}"
                                                  if shape["rotary_key"] else "")
    hybrid = "".join(f", {name}" if value is True else f", {name} {value}"
                     for name, value in shape.items() if name in HYBRID and value)
    return (f"the {shape['layers']}-layer {kind} model ({heads} head{'s' * (heads > 1)}, "
            f"{kv_heads} kv head{'s' * (kv_heads > 1)}, {shape['positions']} positions{latent}"
            f"{hybrid})")


def cut(params, layers):
    """A deep_model model's params with only its first layers (the same weights).

    Its fields of one entry a layer (windows, kv_from) cut alike."""
    shape = params["shape"]
    return dict(params, shape=dict(shape, layers=layers, **{
        name: shape[name][:layers] for name in ("windows", "kv_from") if shape.get(name)}),
        blocks=params["blocks"][:layers])


def by_layer(params, compare):
    """compare(params), None or a Wrong, for a deep_model model, naming the first wrong layer.

    If it fails, compare runs again for the model cut after each layer in turn, so as to
    name the first layer whose rows go wrong: a Wrong that names the model and that layer,
    then the cut model's line."""
    why = compare(params)
    if why is None:
        return None
    layers = params["shape"]["layers"]
    wrong = layers - 1
    for layer in range(layers - 1):
        earlier = compare(cut(params, layer + 1))
        if earlier:
            why, wrong = earlier, layer
            break
    below = ("" if wrong == 0 else " (layer 0 alone agrees)" if wrong == 1
             else f" (layers 0 to {wrong - 1} alone agree)")
    return Wrong(f"{deep_label(params)}, wrong from layer {wrong} on{below}: {why}", why.detail)


def stepped_rows(label, step_function, weights, cache, ids):
    """The rows of step_function(weights, cache, token_id, position) for each of ids in turn.

    Each call is a step (step), so that an exception names the model and the position."""
    rows = []
    for position, token_id in enumerate(ids):
        step(f"{label}: {step_function.__name__} of token {token_id} at position {position}, "
             f"which should give the full pass's row")
        rows.append(step_function(weights, cache, token_id, position))
    return rows


def deep_rows(params, ids, mask=None, label=None):
    """The rows of a deep_model fed ids one token at a time through a new cache, and the cache.

    With mask (the model's own unless given); each step is named with label (the model's
    deep_label unless given)."""
    import deep_model
    cache = deep_model.DeepCache(params, mask)
    return stepped_rows(label or deep_label(params), deep_model.forward_step, params, cache,
                        ids), cache


def where_deep_rows_differ(params, ids, mask=None):
    """None if every row of a deep_model fed ids through its cache equals its full pass's.

    The rows are deep_rows', else a Wrong naming the model, the first layer whose rows
    differ, the position and the logit, with both numbers (by_layer); mask may be a list, a
    mask a layer."""
    import deep_model
    rebuilt = " (its keys and values rebuilt from the cached latents)"

    def compare(weights):
        layers = weights["shape"]["layers"]   # a mask a layer: those of the layers kept
        masks = mask[:layers] if isinstance(mask, list) else mask
        rows, _ = deep_rows(weights, ids, masks)
        step(f"{deep_label(weights)}: its full pass (deep_model.forward)")
        return differ("the cached row" + (rebuilt if weights["shape"]["latent"] else ""),
                      rows, deep_model.forward(weights, ids, masks), "forward_step",
                      fed=f"token IDs {ids}, one at a time through a new DeepCache"
                          + ("" if mask is None else ", with a mask"))
    return by_layer(params, compare)
