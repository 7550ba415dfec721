"""The lesson's tests have teeth: each one-line mistake, planted in the real source of
kv_cache.forward_step or model.forward (by its syntax tree), is caught by the comparison
of every cached row with the full pass, and each harmless edit is not."""
import ast
import inspect
import io
import random
import textwrap
import unittest
from contextlib import redirect_stdout
from unittest import mock

import kv_cache
import model
import random_models
import support
from instruments import is_call_of, plant, replacing, sums_in_another_order
from support import (PARAMS, STORIES, TOK, UNCHANGED, assert_changed, assert_every_row_equal,
                     cached_rows)
from verdicts import skip_unless_sound


def setUpModule():
    """Built on the lesson: if its check fails, these tests skip (python3 -m unittest
    test_kv_cache.Exactness says why); then they run from another folder than the lab's."""
    skip_unless_sound("lesson")
    support.enter_another_folder()


tearDownModule = support.tear_down


def parameter(node, key):
    """node is params[key]."""
    return (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
            and node.value.id == "params" and isinstance(node.slice, ast.Constant)
            and node.slice.value == key)


def call(name, *args):
    return ast.Call(ast.Name(name, ast.Load()), list(args), [])


def append_after_attention(tree):
    """The statement cache.append(...) moved from before attention to the end of the row."""
    body = tree.body[0].body
    appends = [s for s in body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
               and isinstance(s.value.func, ast.Attribute) and s.value.func.attr == "append"]
    if len(appends) != 1 or not isinstance(body[-1], ast.Return):
        return 0
    body.remove(appends[0])
    body.insert(len(body) - 1, appends[0])
    return 1


def is_scaled_score(node):
    """dot(...) * SCALE, or anything else done to a dot product: dot(...) / 4.0."""
    return isinstance(node, ast.BinOp) and is_call_of(node.left, "dot")


NO_SCALE = replacing(is_scaled_score, lambda node: node.left)
PREVIOUS_POSITION = replacing(
    lambda node: isinstance(node, ast.Subscript) and parameter(node.value, "pos_emb"),
    lambda node: ast.Subscript(node.value, ast.BinOp(node.slice, ast.Sub(), ast.Constant(1)),
                               ast.Load()))
NO_RELU = replacing(lambda node: is_call_of(node, "relu"), lambda node: node.args[0])
SKIP_BEFORE_BIAS = replacing(   # add(x1, add(mlp, b2)) becomes add(add(x1, mlp), b2)
    lambda node: is_call_of(node, "add") and is_call_of(node.args[1], "add"),
    lambda node: call("add", call("add", node.args[0], node.args[1].args[0]),
                      node.args[1].args[1]))
POSITION_0_DROPPED = replacing(   # mask(i) becomes mask(i)[min(1, i):]
    lambda node: is_call_of(node, "mask"),
    lambda node: ast.Subscript(node, ast.Slice(call("min", ast.Constant(1), node.args[0])),
                               ast.Load()))
DIVIDE_BY_4 = replacing(
    lambda node: (is_scaled_score(node) and isinstance(node.op, ast.Mult)
                  and isinstance(node.right, ast.Name) and node.right.id == "SCALE"),
    lambda node: ast.BinOp(node.left, ast.Div(), ast.Constant(4.0)))
EMBEDDINGS_SWAPPED = replacing(
    lambda node: (is_call_of(node, "add") and isinstance(node.args[0], ast.Subscript)
                  and parameter(node.args[0].value, "tok_emb")),
    lambda node: call("add", node.args[1], node.args[0]))


class Teeth(unittest.TestCase):
    """Each one-line mistake, planted in the real source of kv_cache.forward_step or
    model.forward (by its syntax tree), is caught by the lab's comparison of every cached
    row with the full pass; each harmless edit is not.

    Harmless, because they give the same bits for every float: the scale is
    1 / sqrt(16) = 0.25 exactly, so multiplying by it and dividing by 4.0 are both the
    correctly rounded x / 4; and one addition is commutative, so tok_emb[t] + pos_emb[i]
    and pos_emb[i] + tok_emb[t] agree. It is regrouping three or more terms that changes
    last bits."""

    # (mistake, module, function, how it is planted, how it is caught)
    MISTAKES = [
        ("no attention scale", kv_cache, "forward_step", NO_SCALE, "rows differ"),
        ("no attention scale", model, "forward", NO_SCALE, "rows differ"),
        ("one position too few (position 0 dropped once there are two)", model, "forward",
         POSITION_0_DROPPED, "rows differ"),
        ("the position embedding of the previous position", kv_cache, "forward_step",
         PREVIOUS_POSITION, "rows differ"),
        ("the position embedding of the previous position", model, "forward",
         PREVIOUS_POSITION, "rows differ"),
        ("no ReLU", kv_cache, "forward_step", NO_RELU, "rows differ"),
        ("no ReLU", model, "forward", NO_RELU, "rows differ"),
        ("the MLP's skip path added before its bias", kv_cache, "forward_step",
         SKIP_BEFORE_BIAS, "rows differ"),
        ("the MLP's skip path added before its bias", model, "forward", SKIP_BEFORE_BIAS,
         "rows differ"),
        ("the new key and value appended after attention", kv_cache, "forward_step",
         append_after_attention, "raises"),   # position 0 then has nothing to attend to
    ]
    HARMLESS = [
        ("dividing by 4.0 instead of multiplying by 0.25", kv_cache, "forward_step",
         DIVIDE_BY_4),
        ("the position embedding added first", kv_cache, "forward_step", EMBEDDINGS_SWAPPED),
    ]

    @classmethod
    def setUpClass(cls):
        cls.ids = TOK.encode(STORIES[0])
        cls.models = {"trained": PARAMS,
                      "random, seed 6": random_models.random_model(random.Random(6), 1.0, 1.0)}
        # Each path's rows as shipped, once: a mistake is planted in one path at a time.
        cls.shipped = {name: {kv_cache: cached_rows(params, cls.ids),
                              model: model.forward(params, cls.ids)[0]}
                       for name, params in cls.models.items()}

    def verdict(self, what, module, function, mistake):
        """What the lab's comparison says of the code with the mistake planted, on each
        model: "equal", "rows differ", or "raises" (when the code cannot run). Skips,
        saying so, when an edit has removed the spot the mistake is planted in."""
        planted = plant(module, function, mistake)
        if planted is None:
            self.skipTest(f"the planting site of {what!r} is gone from "
                          f"{module.__name__}.{function}: an edit removed the code it changes, "
                          f"so this mistake is not tried")
        verdicts = {}
        other = model if module is kv_cache else kv_cache   # the path left as shipped
        with mock.patch.object(module, function, planted):
            for name, params in self.models.items():
                try:   # the comparison of assert_every_row_equal, without its message
                    rows = (cached_rows(params, self.ids) if module is kv_cache
                            else model.forward(params, self.ids)[0])
                    equal = rows == self.shipped[name][other]
                    verdicts[name] = "equal" if equal else "rows differ"
                except (ValueError, IndexError):
                    verdicts[name] = "raises"
        return verdicts

    def test_each_one_line_mistake_is_caught(self):
        for function in ("forward_step", "forward"):
            module = kv_cache if function == "forward_step" else model
            with self.subTest(unchanged=function):   # the harness itself is right
                self.assertEqual(set(self.verdict("nothing", module, function, UNCHANGED)
                                     .values()), {"equal"})
        for mistake, module, function, planting, caught in self.MISTAKES:
            with self.subTest(mistake=mistake, planted_in=f"{module.__name__}.{function}"):
                self.assertEqual(set(self.verdict(mistake, module, function, planting)
                                     .values()), {caught})

    def test_the_same_order_is_what_makes_the_rows_equal(self):
        """With every sum a plain left-to-right addition (last term first) in both paths,
        the rows change, and the cached ones still equal the full pass's: the two paths
        agree because they add the same terms in the same order (README section 13)."""
        exact = model.forward(PARAMS, self.ids)[0]
        with sums_in_another_order():
            full = model.forward(PARAMS, self.ids)[0]
            assert_changed(self, full, exact, "the full pass with plain sums")
            assert_every_row_equal(self, PARAMS, self.ids, "plain sums in both paths")

    def test_harmless_edits_are_not_mistakes(self):
        for edit, module, function, planting in self.HARMLESS:
            with self.subTest(edit=edit):
                self.assertEqual(set(self.verdict(edit, module, function, planting).values()),
                                 {"equal"})

    def test_renaming_any_local_of_forward_step_changes_nothing(self):
        """Each local variable of the real forward_step renamed (by its syntax tree), one at
        a time: --show prints the same lines, and every row still equals the full pass."""
        source = ast.parse(textwrap.dedent(inspect.getsource(kv_cache.forward_step)))
        names = sorted({node.id for node in ast.walk(source)
                        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)})
        self.assertGreaterEqual(len(names), 10, names)   # x0, h1, q, k, v, ...

        def show():
            out = io.StringIO()
            with redirect_stdout(out):
                kv_cache.show_steps(PARAMS, TOK, "mia was sad.", (6, 0.0, None, 0))
            return out.getvalue()
        shown = show()
        for name in names:
            renamed = replacing(lambda node, name=name: isinstance(node, ast.Name)
                                and node.id == name,
                                lambda node: ast.Name("renamed_" + node.id, node.ctx))
            with self.subTest(renamed=name), \
                    mock.patch.object(kv_cache, "forward_step",
                                      plant(kv_cache, "forward_step", renamed)):
                self.assertEqual(show(), shown)
                if cached_rows(PARAMS, self.ids) != self.shipped["trained"][model]:
                    assert_every_row_equal(self, PARAMS, self.ids)   # names what differs

    def test_show_says_in_one_line_what_it_cannot_find(self):
        """forward_step calling model.softmax_row instead of the softmax_row --show
        watches: the rows are the same, and --show says once that it has no weights."""
        elsewhere = replacing(lambda node: is_call_of(node, "softmax_row"),
                              lambda node: ast.Call(ast.Attribute(ast.Name("model", ast.Load()),
                                                                  "softmax_row", ast.Load()),
                                                    node.args, []))
        out = io.StringIO()
        with mock.patch.object(kv_cache, "forward_step",
                               plant(kv_cache, "forward_step", elsewhere)), redirect_stdout(out):
            assert_every_row_equal(self, PARAMS, self.ids)
            kv_cache.show_steps(PARAMS, TOK, "mia was sad.", (3, 0.0, None, 0))
        lines = out.getvalue().splitlines()
        self.assertEqual([line for line in lines if "cannot find" in line],
                         ["(--show cannot find the attention weights: forward_step did not "
                          "call softmax_row once a step)"])
        self.assertIn("  0 'mia'       ?        -      1           ", lines)

    def test_each_mistake_is_planted_in_one_place_whatever_the_comments_and_local_names(self):
        """Planting reads the syntax tree: the real source with its comments gone, its
        lines rewrapped and its local variables renamed plants each mistake in the same
        number of places (one, or two for the keys and the values)."""
        def renamed(tree):
            for node in ast.walk(tree):
                if isinstance(node, ast.Name) and node.id in {"k_j", "mixed", "keys", "h2"}:
                    node.id = "renamed_" + node.id
            return tree
        for mistake, module, function, planting, _ in self.MISTAKES + [
                (*edit, None) for edit in self.HARMLESS]:
            source = textwrap.dedent(inspect.getsource(getattr(module, function)))
            places = planting(ast.parse(source))
            with self.subTest(mistake=mistake, planted_in=f"{module.__name__}.{function}"):
                if not places:
                    self.skipTest(f"the planting site of {mistake!r} is gone from "
                                  f"{module.__name__}.{function}: an edit removed it")
                self.assertIn(places, (1, 2))
                self.assertEqual(planting(renamed(ast.parse(ast.unparse(ast.parse(source))))),
                                 places)

    def test_a_mistake_whose_spot_is_gone_is_skipped_not_passed(self):
        nowhere = replacing(lambda node: is_call_of(node, "no_such_function"), lambda node: node)
        self.assertIsNone(plant(kv_cache, "forward_step", nowhere))
        with self.assertRaises(unittest.SkipTest) as skipped:
            self.verdict("a call that is not there", kv_cache, "forward_step", nowhere)
        self.assertIn("the planting site of 'a call that is not there' is gone from "
                      "kv_cache.forward_step", str(skipped.exception))


if __name__ == "__main__":
    unittest.main()
