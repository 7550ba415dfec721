"""Fewer positions in deeper layers (Part 5, section 26): PyramidKV (Cai et al., 2024)
in the deeper model. The prompt is read whole, every row attending to every earlier
position; then, once, each layer keeps budgets[L] of the prompt's positions and drops
the rest: the last window ones, and those SnapKV would choose from what the window's
rows of that layer attended to (eviction.snapkv_choice, over the mean of the layer's
heads). Every position decoded after the prompt is kept, as PyramidKV keeps them.

PyramidKV's budgets shrink with depth, an arithmetic sequence from the first layer to
the last, because deeper layers attend to fewer positions; uniform budgets keep the same
number in every layer (SnapKV in each). Both keep the same total: layers x budget of the
prompt's positions. So the two can be compared at equal memory.

The cache keeps, for every layer and every row, the positions that row read there
(reads[L][i]); deep_model.forward with those reads as its masks, one a layer, gives the
same rows bit for bit. So what the budgets change is what the dropped positions would
have added, and nothing else.
"""
from fractions import Fraction
from math import fsum

from deep_model import DeepCache, deep_ids, forward, forward_step
from deep_params import check_params, init_params
from documents import bold, plain, shown, table
from eviction import check_kernel, snapkv_choice
from instruments import largest_gap
from model import CONTEXT, WIDTH, check_int, excerpt
import svg

KINDS = ("pyramid", "uniform")


def layer_budgets(budget, layers, prompt_tokens, window, beta, kind="pyramid"):
    """How many of the prompt's positions each layer keeps, for budget a layer on average.

    Each keeps its last window ones among them. Uniform: budget in every layer. Pyramid, as
    PyramidKV's code: of the chosen part (budget - window on average) the last layer gets a
    beta-th (rounded down) and the first the rest of twice the average, at most all
    prompt_tokens - window; the layers between, the arithmetic sequence from one to the
    other, each rounded half to even, so that the layers add up to layers x budget.

    Refuses a kind not in KINDS, and counts that are not ints in range: layers and beta at
    least 1, a window below the prompt's positions, a budget above the window and at most
    the prompt's positions (a layer cannot keep more), the prompt within the model's."""
    if kind not in KINDS:
        raise ValueError(f"kind must be \"pyramid\" or \"uniform\", got {excerpt(kind)}")
    check_int("layers", layers, 1)
    check_int("window", window, 1, CONTEXT - 1)
    check_int("prompt_tokens", prompt_tokens, window + 1, CONTEXT,
              " (more than the window, within the model's positions)")
    check_int("budget", budget, window + 1, prompt_tokens,
              " (more than the window, at most the prompt's positions)")
    check_int("beta", beta, 1)
    if kind == "uniform" or layers == 1:
        return [budget] * layers
    chosen = budget - window
    low = chosen // beta
    high = min(2 * chosen - low, prompt_tokens - window)
    low = 2 * chosen - high
    return [window + round(high - Fraction(layer * (high - low), layers - 1))
            for layer in range(layers)]


class PyramidKVCache(DeepCache):
    """A DeepCache that, at the prompt's end, keeps only budgets[L] prompt positions in layer L.

    The end of the prompt is its prompt_tokens-th row; budgets are layer_budgets', of this
    kind: the last window, and snapkv_choice's from the window's rows, pooled over kernel
    neighbours. A dropped position's key and value become None in that layer's lists, so
    that a read of one fails. kept[L] is what layer L keeps of the prompt; reads[L][i], the
    positions row i read in layer L."""

    def __init__(self, params, budget, prompt_tokens, kind="pyramid", window=4, kernel=3,
                 beta=20):
        check_params(params)
        layers = range(params["shape"]["layers"])
        budgets = layer_budgets(budget, len(layers), prompt_tokens, window, beta, kind)
        check_kernel(kernel)
        super().__init__(params, [lambda i, layer=layer: self._reads_of(layer, i)
                                  for layer in layers])
        self.prompt_tokens, self.window, self.kernel = prompt_tokens, window, kernel
        self.budgets = budgets
        self.kept = [None] * len(layers)
        self.reads = [[] for _ in layers]
        self.window_rows = [[] for _ in layers]   # per layer, the heads' mean weights

    def _reads_of(self, layer, position):
        if position < self.prompt_tokens:
            return range(position + 1)
        return self.kept[layer] + list(range(self.prompt_tokens, position + 1))

    def attended(self, layer, weights_by_head):
        """Note the newest row's reads in layer; at the prompt's last row, choose what it keeps.

        The row read them with these weights, a list a head. In the prompt's last window
        rows, keep the heads' mean weights; at the prompt's last row, choose what the layer
        keeps, and drop the rest."""
        position = len(self) - 1
        self.reads[layer].append(list(self._reads_of(layer, position)))
        if self.prompt_tokens - self.window <= position < self.prompt_tokens:
            self.window_rows[layer].append([fsum(at_position) / len(weights_by_head)
                                            for at_position in zip(*weights_by_head)])
        if position == self.prompt_tokens - 1:
            window = list(range(self.prompt_tokens - self.window, self.prompt_tokens))
            self.kept[layer] = snapkv_choice(self.window_rows[layer],
                                             self.budgets[layer] - self.window,
                                             self.kernel) + window
            for dropped in set(range(self.prompt_tokens)) - set(self.kept[layer]):
                for vectors in self.layers[layer].values():
                    vectors[dropped] = None


# ---- the experiment (a stage of trace_kv.py) ---------------------------------------

BUDGETS = (8, 16, 24)   # of the 48-token prompt: a sixth, a third, a half
LAYERS, HEADS, KV_HEADS, WINDOW, KERNEL, BETA = 4, 4, 2, 4, 3, 20


def pyramid_run(params, ids, prompt_tokens, budget, kind, full):
    """Feed ids one at a time through a PyramidKVCache of budget and kind, and measure it.

    Gives its budgets, the prompt positions it keeps in all and the numbers it holds a
    position, the largest gap of the decoded rows to full (the unmasked pass's), and every
    row compared with deep_model.forward's with the cache's reads as its masks, one a
    layer."""
    cache = PyramidKVCache(params, budget, prompt_tokens, kind, WINDOW, KERNEL, BETA)
    rows = [forward_step(params, cache, token_id, position)
            for position, token_id in enumerate(ids)]
    masked = forward(params, ids, [reads.__getitem__ for reads in cache.reads])
    return {"budget": budget, "kind": kind, "layer_budgets": cache.budgets,
            "prompt_positions_kept": sum(map(len, cache.kept)),
            "floats_per_position": cache.floats_per_position(),
            "largest_logit_gap_of_the_decoded_rows":
                largest_gap(rows[prompt_tokens:], full[prompt_tokens:]),
            "rows_compared_with_the_masked_pass": len(rows),
            "rows_equal_to_the_masked_pass": sum(a == b for a, b in zip(rows, masked))}


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "pyramid": {
        "layers": svg.COUNT, "heads": svg.COUNT, "kv_heads": svg.COUNT,
        "positions": svg.COUNT, "prompt_tokens": svg.COUNT, "window": svg.COUNT,
        "kernel": svg.COUNT, "beta": svg.COUNT,
        "runs": [{
            "budget": svg.COUNT, "kind": str, "layer_budgets": [svg.COUNT],
            "prompt_positions_kept": svg.COUNT, "floats_per_position": svg.COUNT,
            "largest_logit_gap_of_the_decoded_rows": svg.COUNT,
            "rows_compared_with_the_masked_pass": svg.COUNT,
            "rows_equal_to_the_masked_pass": svg.COUNT}]},
}


def experiment(lab):
    """Compare pyramid and uniform budgets on a 4-layer grouped-query deep_model.

    The model (4 heads, 2 key-value heads, the lab's width, seed 0) reads the first three
    quarters of deep_ids (48 of 64 tokens) as its prompt and decodes the rest: for each
    budget, pyramid and uniform (pyramid_run)."""
    ids = deep_ids(lab)
    prompt_tokens = len(ids) * 3 // 4
    params = init_params(LAYERS, HEADS, KV_HEADS, WIDTH, 0)
    full = forward(params, ids)
    return {"layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "positions": len(ids),
            "prompt_tokens": prompt_tokens, "window": WINDOW, "kernel": KERNEL, "beta": BETA,
            "runs": [pyramid_run(params, ids, prompt_tokens, budget, kind, full)
                     for budget in BUDGETS if budget <= prompt_tokens for kind in KINDS]}


# ---- what Part 5 shows of it (documents.py fills its marks) --------------------------

def budgets_table(record, timing):
    """Section 26's table of pyramid and uniform budgets: kept by layer, gaps, rows equal."""
    pyramid = svg.checked(record, {"pyramid": {**RECORDS["pyramid"], "layers": (
        1, svg.MOST_ITEMS)}})["pyramid"]   # a layer each, in the header
    rows = [[run["budget"], plain(run["kind"]), " / ".join(map(str, run["layer_budgets"])),
             bold(shown(run["largest_logit_gap_of_the_decoded_rows"])),
             f"{run['rows_equal_to_the_masked_pass']} of "
             f"{run['rows_compared_with_the_masked_pass']}"] for run in pyramid["runs"]]
    return table([f"positions a layer keeps of the {pyramid['prompt_tokens']}-token prompt, "
                  f"on average", "budgets", "kept by layer "
                  + " / ".join(map(str, range(round(pyramid["layers"])))),
                  f"largest logit gap of the {pyramid['positions'] - pyramid['prompt_tokens']} "
                  f"decoded rows to the full pass", "rows equal (==) to the pass masked by "
                  "their reads"], rows)


def _budgets_where(record, pyramid_closer):
    """The budgets at which the pyramid's largest gap is smaller (or, if not
    pyramid_closer, not smaller) than uniform's, in words: "8 and 24", or "none"."""
    gaps = {}
    for run in record["pyramid"]["runs"]:
        gap = run["largest_logit_gap_of_the_decoded_rows"]
        gaps.setdefault(run["budget"], {})[run["kind"]] = gap
    found = [str(budget) for budget, kinds in gaps.items()
             if (kinds["pyramid"] < kinds["uniform"]) == pyramid_closer]
    return " and ".join(filter(None, [", ".join(found[:-1]), found[-1]])) if found else "none"


def closer_with_the_pyramid(record, timing):
    """The budgets at which the pyramid comes closer to the full pass than uniform."""
    return _budgets_where(record, True)


def not_closer_with_the_pyramid(record, timing):
    """The budgets at which the pyramid does not come closer than uniform."""
    return _budgets_where(record, False)
