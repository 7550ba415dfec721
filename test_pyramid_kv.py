"""PyramidKV in the deeper model (pyramid_kv.py): the budgets shrink with depth as
PyramidKV's code has them and add up to the uniform total; each layer keeps what SnapKV's
choice picks from its own window rows, and every decoded position; every row equals the
full pass masked by that row's reads, layer by layer, with ==; bad budgets are refused
by name, and a refused step leaves the cache as it was."""
import ast
import copy
import unittest
from math import fsum

import deep_model
import pyramid_kv
import support
import verdicts
from eviction import snapkv_choice
from instruments import is_call_of, replacing
from pyramid_kv import KINDS, PyramidKVCache
from random_models import random_tokens
from support import assert_each_refused
from verdicts import Layer, deep_label, differ, step, stepped_rows


LAYER = Layer("pyramid_kv", "PyramidKV's budgets by layer (pyramid_kv.py)", ("deep_model",))


def setUpModule():
    verdicts.set_up("pyramid_kv")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down
BUDGET_CASES = ((8, 4, 48, 4, 20), (24, 4, 48, 4, 20), (30, 4, 48, 4, 20), (6, 3, 12, 4, 20),
                (11, 5, 40, 2, 3))   # layer_budgets's budget, layers, prompt, window, beta
MODEL = (3, 4, 2, 16, 0)   # deep_model.init_params's: 3 layers of grouped-query attention
PROMPT, BUDGET, POSITIONS = 12, 7, 16


def budgets_by_the_paper(budget, layers, prompt_tokens, window, beta, kind):
    """layer_budgets's docstring worked out plainly: of the chosen part c = budget - window,
    the last layer c // beta and the first 2c less that, at most prompt - window (the last
    then what is left of 2c); the layers between in even steps, each rounded half to even."""
    if kind == "uniform" or layers == 1:
        return [budget] * layers
    chosen = budget - window
    first, last = 2 * chosen - chosen // beta, chosen // beta
    if first > prompt_tokens - window:
        first, last = prompt_tokens - window, 2 * chosen - (prompt_tokens - window)
    step_down = (first - last) / (layers - 1)
    return [window + round(first - layer * step_down) for layer in range(layers)]


def where_budgets_wrong():
    """None if layer_budgets gives budgets_by_the_paper's for each of BUDGET_CASES and both
    kinds, else a Wrong naming the case and the layer."""
    for args in BUDGET_CASES:
        for kind in KINDS:
            step(f"layer_budgets{args + (kind,)}")
            why = differ(f"layer_budgets{args} ({kind})", pyramid_kv.layer_budgets(*args, kind),
                         budgets_by_the_paper(*args, kind), "layer_budgets", names=("layer",),
                         fed="budget, layers, prompt_tokens, window, beta")
            if why:
                return why
    return None


class Told(deep_model.DeepCache):
    """A DeepCache that keeps everything, and every row's weights as the protocol tells
    them: told[layer][position], one list a head."""

    def __init__(self, params):
        super().__init__(params)
        self.told = [[] for _ in params["blocks"]]

    def attended(self, layer, weights_by_head):
        self.told[layer].append(weights_by_head)


def expected_kept(params, ids, budgets, window=4, kernel=3):
    """What each layer should keep of the prompt ids: snapkv_choice over the heads' mean
    weights of its own last window rows (read from a Told cache fed the prompt), then the
    window's positions; and the numbers a layer keeps a position."""
    told = Told(params)
    for position, token_id in enumerate(ids):
        deep_model.forward_step(params, told, token_id, position)
    kept = []
    for layer, budget in enumerate(budgets):
        rows = [[fsum(column) / len(heads) for column in zip(*heads)]
                for heads in told.told[layer][-window:]]
        kept.append(snapkv_choice(rows, budget - window, kernel)
                    + list(range(len(ids) - window, len(ids))))
    return kept, told.floats_per_position() / params["shape"]["layers"]


def where_pyramid_wrong(kind, params, ids, prompt_tokens, budget):
    """None if a PyramidKVCache of kind fed ids keeps in each layer expected_kept's
    positions, each row reads in each layer every earlier position in the prompt and then
    the kept ones and every decoded one, it holds the numbers of those positions only,
    and its rows are the full pass's with its reads as the masks (==); else a Wrong
    naming the layer and position, or the logit."""
    label = f"{deep_label(params)}, a {prompt_tokens}-token prompt, budget {budget} ({kind})"
    step(f"{label}: making its PyramidKVCache")
    cache = PyramidKVCache(params, budget, prompt_tokens, kind)
    rows = stepped_rows(label, deep_model.forward_step, params, cache, ids)
    budgets = budgets_by_the_paper(budget, params["shape"]["layers"], prompt_tokens, 4, 20, kind)
    step(f"{label}: what each layer should keep (a DeepCache told what the prompt read)")
    kept, numbers = expected_kept(params, ids[:prompt_tokens], budgets)
    fed = f"token IDs {ids}, the first {prompt_tokens} the prompt"
    for layer, positions in enumerate(kept):
        reads = [list(range(i + 1)) for i in range(prompt_tokens)] + [
            positions + list(range(prompt_tokens, i + 1)) for i in range(prompt_tokens, len(ids))]
        why = (differ(f"{label}: the prompt positions layer {layer} keeps", cache.kept[layer],
                      positions, "PyramidKVCache", names=("entry",), fed=fed)
               or differ(f"{label}: the positions each row reads in layer {layer}",
                         cache.reads[layer], reads, "PyramidKVCache",
                         names=("position", "entry"), fed=fed))
        if why:
            return why
    held = sum(budgets) + params["shape"]["layers"] * (len(ids) - prompt_tokens)
    why = differ(f"{label}: the numbers the cache holds a position",
                 [cache.floats_per_position()], [held * numbers / len(ids)],
                 "PyramidKVCache", names=("entry",),
                 fed=f"{fed}; {held} positions held over the layers, {numbers:g} numbers each")
    if why:
        return why
    step(f"{label}: the full pass masked by its reads (deep_model.forward)")
    return differ(f"{label}: the cached row", rows,
                  deep_model.forward(params, ids, [r.__getitem__ for r in cache.reads]),
                  "forward_step", fed=f"{fed}; expected: the full pass with its reads as masks")


def quick_check():
    """PyramidKV's budgets, choices, reads and rows are what its docstrings say.

    Compares layer_budgets with the budgets worked out plainly for five cases, both kinds
    (where_budgets_wrong); then feeds 16 random tokens, 12 of them the prompt, through a
    PyramidKVCache of budget 7 of each kind on a 3-layer grouped-query model: what each
    layer keeps, what each row reads there, the numbers held and the rows against the
    full pass masked by the reads (where_pyramid_wrong)."""
    why = where_budgets_wrong()
    params, ids = deep_model.init_params(*MODEL), random_tokens(POSITIONS)
    for kind in KINDS:
        why = why or where_pyramid_wrong(kind, params, ids, PROMPT, BUDGET)
    return why


QuickCheck = verdicts.quick_check_case("pyramid_kv", __name__)


def expression(source):
    return ast.parse(source, mode="eval").body


PYRAMID = (r"the 3-layer grouped-query model \(4 heads, 2 kv heads, learned positions\), a "
           r"12-token prompt, budget 7 \(pyramid\)")


class QuickCheckTeeth(unittest.TestCase):
    """Each mistake planted in the real pyramid_kv.py makes the layer's quick check fail
    with a line naming the quantity and where: the case and layer, or the layer and
    position, with both numbers."""

    MISTAKES = [
        ("budgets that grow with depth (from the last layer's to the first's)", pyramid_kv,
         "layer_budgets",
         replacing(lambda node: (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)
                                 and ast.unparse(node.left) == "high"
                                 and is_call_of(node.right, "Fraction")),
                   lambda node: ast.BinOp(ast.Name("low", ast.Load()), ast.Add(), node.right)),
         r"layer_budgets\(8, 4, 48, 4, 20\) \(pyramid\), at layer 0: 4 from layer_budgets, 12 "
         r"expected"),
        ("each layer's choice scored by the first layer's window rows", PyramidKVCache,
         "attended",
         replacing(lambda node: is_call_of(node, "snapkv_choice"),
                   lambda node: ast.Call(node.func, [expression("self.window_rows[0]"),
                                                     *node.args[1:]], [])),
         PYRAMID + r": the prompt positions layer 1 keeps, at entry \d+: \d+ from "
         r"PyramidKVCache, \d+ expected"),
        ("a window of 5 rows scored, not 4", PyramidKVCache, "attended",
         replacing(lambda node: (isinstance(node, ast.Compare)
                                 and ast.unparse(node.left) == "self.prompt_tokens - self.window"),
                   lambda node: ast.Compare(ast.BinOp(node.left, ast.Sub(), ast.Constant(1)),
                                            node.ops, node.comparators)),
         PYRAMID + r": the prompt positions layer 0 keeps, at entry \d+: \d+ from "
         r"PyramidKVCache, \d+ expected"),
        ("a decoded row reads the kept prompt and itself, not every decoded position",
         PyramidKVCache, "_reads_of",
         replacing(lambda node: (is_call_of(node, "list") and is_call_of(node.args[0], "range")
                                 and ast.unparse(node.args[0].args[0]) == "self.prompt_tokens"),
                   lambda node: expression("[position]")),
         PYRAMID + r": the positions each row reads in layer 0, at position 13: 11 items from "
         r"PyramidKVCache, 12 items expected"),
        ("the dropped positions' keys and values left in the cache", PyramidKVCache,
         "attended",
         replacing(lambda node: isinstance(node, ast.For)
                   and ast.unparse(node.target) == "dropped", lambda node: ast.Pass()),
         PYRAMID + r": the numbers the cache holds a position, at entry 0: \S+ from "
         r"PyramidKVCache, \S+ expected"),
    ]

    def test_the_quick_check_names_each_mistake_and_where(self):
        verdicts.assert_verdicts(self, "pyramid_kv", self.MISTAKES)


class Budgets(unittest.TestCase):

    def test_pyramid_budgets_shrink_with_depth_and_add_up_to_the_uniform_total(self):
        """For 1 to 5 and 8 layers, prompts of 5 to 61, windows of 1 to 4, betas of 1 and
        20 and every budget above the window: each layer keeps at least the window and at
        most the prompt, no layer more than the one above it, the first at least the
        budget, and the layers layers x budget in all, as uniform budgets do."""
        for layers in (1, 2, 3, 4, 5, 8):
            for prompt in range(5, 65, 7):
                for window in range(1, 5):
                    for beta in (1, 20):
                        for budget in range(window + 1, prompt + 1):
                            budgets = pyramid_kv.layer_budgets(budget, layers, prompt, window, beta)
                            case = (budget, layers, prompt, window, beta)
                            self.assertEqual(sum(budgets), layers * budget, case)
                            self.assertTrue(prompt >= budgets[0] >= budget, case)
                            self.assertTrue(all(a >= b >= window for a, b in
                                                zip(budgets, budgets[1:] + [window])), case)
                            self.assertEqual(pyramid_kv.layer_budgets(*case, "uniform"),
                                             [budget] * layers)


class Exactness(unittest.TestCase):

    def test_every_row_is_the_full_pass_masked_by_its_reads_for_shapes_and_budgets(self):
        """Multi-head, grouped-query, multi-query and latent attention, learned and rotary
        positions, 1 to 3 layers, prompts of 6 to 14 and budgets from the window + 1 to
        the prompt, both kinds: what where_pyramid_wrong checks holds."""
        cases = ((1, 4, 4, "learned", None, 6, 5), (2, 4, 1, "rotary", None, 10, 7),
                 (3, 4, 2, "rotary", None, 14, 9), (2, 2, 2, "learned", None, 8, 8),
                 (2, 4, 4, "rotary", 8, 9, 6))
        for layers, heads, kv_heads, positions, latent, prompt, budget in cases:
            params = deep_model.init_params(layers, heads, kv_heads, 16, 1, positions, latent)
            ids = random_tokens(prompt + 3, seed=layers)
            for kind in KINDS:
                with self.subTest(layers=layers, kv_heads=kv_heads, positions=positions,
                                  latent=latent, kind=kind):
                    why = verdicts.checked(
                        lambda: where_pyramid_wrong(kind, params, ids, prompt, budget))
                    if why:
                        self.fail(why)


class Refusals(unittest.TestCase):

    def test_bad_budgets_and_settings_are_refused_naming_them(self):
        params = deep_model.init_params(2, 4, 2, 16, 0)
        for args, fragment in (((4, 12), r"budget must be an int from 5 to 12 \(more than the "
                                         r"window, at most the prompt's positions\), got 4"),
                               ((13, 12), "budget must be an int from 5 to 12"),
                               ((6.0, 12), r"budget must be an int from 5 to 12 \(.*\), got 6.0"),
                               ((True, 12), "budget must be an int"),
                               ((6, 4), r"prompt_tokens must be an int from 5 to 64 \(more "
                                        r"than the window"),
                               ((6, 65), "prompt_tokens must be an int from 5 to 64"),
                               ((6, 12, "pyramids"),
                                "kind must be \"pyramid\" or \"uniform\", got 'pyramids'"),
                               ((6, 12, "pyramid", 0), "window must be an int from 1"),
                               ((6, 12, "pyramid", 4, 0), "kernel must be an int >= 1"),
                               ((6, 12, "pyramid", 4, 2), r"kernel must be odd .*, got 2: an "
                                                          r"even one would pool 3 positions"),
                               ((6, 12, "pyramid", 4, 3, 0), "beta must be an int >= 1")):
            with self.subTest(args=args), self.assertRaisesRegex(ValueError, fragment):
                PyramidKVCache(params, *args)
        with self.assertRaisesRegex(ValueError, "params must be deep_model.init_params"):
            PyramidKVCache(None, 6, 12)

    def test_layer_budgets_refuses_what_the_cache_refuses_naming_it(self):
        """The budgets alone refuse what PyramidKVCache refuses of them, each named: a beta
        of 0 (a division by zero) or -1 (a negative budget), a misspelt kind (taken for
        "pyramid"), a budget beyond the prompt (a layer would keep more than it has), no
        layer."""
        for args, fragment in (((16, 4, 48, 4, 0), "beta must be an int >= 1, got 0"),
                               ((16, 4, 48, 4, -1), "beta must be an int >= 1, got -1"),
                               ((16, 4, 48, 4, 20.0), "beta must be an int >= 1, got 20.0"),
                               ((16, 4, 48, 4, 20, "pyramdi"),
                                "kind must be \"pyramid\" or \"uniform\", got 'pyramdi'"),
                               ((60, 4, 48, 4, 20), r"budget must be an int from 5 to 48 \(more "
                                                    r"than the window, at most the prompt's "
                                                    r"positions\), got 60"),
                               ((16, 0, 48, 4, 20), "layers must be an int >= 1, got 0"),
                               ((16, 4, 48, 0, 20), "window must be an int from 1 to 63"),
                               ((16, 4, 65, 4, 20), "prompt_tokens must be an int from 5 to 64")):
            with self.subTest(args=args), self.assertRaisesRegex(ValueError, fragment):
                pyramid_kv.layer_budgets(*args)

    def test_a_refused_step_leaves_the_cache_as_it_was(self):
        """After the prompt (its choice made), a step with other params, out of order or
        with a token outside the vocabulary is refused, and one that fails part-way (a
        spoiled weight) keeps nothing: tokens, lists, reads, choices all as they were."""
        params = deep_model.init_params(2, 4, 2, 16, 0)
        spoiled = copy.deepcopy(params)
        cache = PyramidKVCache(spoiled, 6, 8)
        for position, token_id in enumerate(random_tokens(9)):
            deep_model.forward_step(spoiled, cache, token_id, position)
        snapshot = lambda: copy.deepcopy((support.deep_snapshot(cache), cache.reads,
                                          cache.kept, cache.window_rows))
        assert_each_refused(self, (
            (lambda: deep_model.forward_step(params, cache, 5, 9), "different parameters"),
            (lambda: deep_model.forward_step(spoiled, cache, 5, 3), "expected position 9"),
            (lambda: deep_model.forward_step(spoiled, cache, 96, 9), "outside the vocabulary")),
            snapshot)
        before = snapshot()
        spoiled["blocks"][1]["b2"][0] = "x"
        with self.assertRaises(TypeError):
            deep_model.forward_step(spoiled, cache, 5, 9)
        self.assertEqual(snapshot(), before)


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of PyramidKV."""

    def test_every_row_is_the_masked_pass_s_and_both_kinds_hold_the_same(self):
        record = support.recorded("pyramid")
        by_budget = {}
        for run in record["runs"]:
            with self.subTest(budget=run["budget"], kind=run["kind"]):
                self.assertEqual((run["rows_compared_with_the_masked_pass"],
                                  run["rows_equal_to_the_masked_pass"]),
                                 (record["positions"], record["positions"]),
                                 "the rows compared with the masked pass, and equal to it")
                self.assertEqual(run["prompt_positions_kept"], record["layers"] * run["budget"])
                self.assertGreater(run["largest_logit_gap_of_the_decoded_rows"], 0.0,
                                   "what the dropped positions would have added")
                by_budget.setdefault(run["budget"], {})[run["kind"]] = run
        for budget, kinds in by_budget.items():
            with self.subTest(budget=budget):
                self.assertEqual(kinds["uniform"]["layer_budgets"], [budget] * record["layers"])
                shrinking = kinds["pyramid"]["layer_budgets"]
                self.assertEqual(shrinking, sorted(shrinking, reverse=True))
                self.assertGreater(shrinking[0], shrinking[-1])
                self.assertEqual(kinds["pyramid"]["floats_per_position"],
                                 kinds["uniform"]["floats_per_position"])

    def test_the_prompt_is_too_long_for_pyramid_kv_s_code_to_fall_back(self):
        """PyramidKV's code (PyramidKVCluster.update_kv) keeps a prompt shorter than the
        budget whole, and gives every layer the same budget to a prompt shorter than twice
        the budget less the window: Part 5 says that never happens here."""
        record = support.recorded("pyramid")
        for run in record["runs"]:
            self.assertGreaterEqual(record["prompt_tokens"], max(
                run["budget"], 2 * (run["budget"] - record["window"])), run)


if __name__ == "__main__":
    unittest.main()
