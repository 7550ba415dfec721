"""The layers of the lab, for the tests (LAYERS): the lesson's cache first, then each Part
on the layers it builds on; and what their quick checks share. Each layer's quick check
is quick_check() in its own test module, beside the mistakes its tests plant: it feeds
the cases where its module's mistakes show, and returns None if they hold, else why not,
a Wrong, whose one line names the quantity that differs and where (story, position,
block, request), and whose detail gives what was fed and both values. verdicts.py runs
each at most once in a test run and decides what the tests built on it do.

A check's module is imported when the check first runs (check_of): a Part that cannot
even be imported (a syntax error) is then that layer's verdict, and the layers beside it
run.
"""
import importlib
from collections import namedtuple

from support import first_gap



class Wrong(str):
    """A check's verdict when it fails: one line (the str itself), naming the quantity that
    differs and where; and its detail, for the layer's own QuickCheck: what was fed, and
    both values."""

    def __new__(cls, line, detail=""):
        wrong = super().__new__(cls, line)
        wrong.detail = detail
        return wrong


STEPS = []   # what the running check is doing now (step), so that an exception can say it


def step(what):
    """Say what the running check does next ("finding the prefix again"): an exception it
    raises from here on is named with it."""
    STEPS[:] = [what]


def excerpt(values, width=100):
    """A list of numbers (or anything) as a line of at most width characters."""
    text = repr(values)
    return text if len(text) <= width else text[:width - 5] + " ...]"


def differ(what, got, expected, source, names=("position", "logit"), fed="", within=None):
    """None if got == expected (given within, if each number of got is within that of
    expected's), else a Wrong naming the first number that differs by its indices (names:
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
    """None if cache holds the tokens, keys and values reference holds, else a Wrong
    naming the first part and position that differ, with both numbers."""
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
    """A deep_model model's shape in words: "the 2-layer grouped-query model (4 heads,
    2 kv heads, rotary positions)", with its latent and rotary key if it has them."""
    shape = params["shape"]
    heads, kv_heads = shape["heads"], shape["kv_heads"]
    kind = ("latent" if shape["latent"] else "multi-head" if kv_heads == heads
            else "multi-query" if kv_heads == 1 else "grouped-query")
    latent = ""
    if shape["latent"]:
        latent = f", latent {shape['latent']}" + (f", rotary key {shape['rotary_key']}"
                                                  if shape["rotary_key"] else "")
    return (f"the {shape['layers']}-layer {kind} model ({heads} head{'s' * (heads > 1)}, "
            f"{kv_heads} kv head{'s' * (kv_heads > 1)}, {shape['positions']} positions{latent})")


def cut(params, layers):
    """A deep_model model's params with only its first layers (the same weights)."""
    return dict(params, shape=dict(params["shape"], layers=layers),
                blocks=params["blocks"][:layers])


def by_layer(params, compare):
    """compare(params), None or a Wrong, for a deep_model model; if it fails, again for
    the model cut after each layer in turn, so as to name the first layer whose rows go
    wrong: a Wrong that names the model and that layer, then the cut model's line."""
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
    """The rows of step_function(weights, cache, token_id, position) for each of ids in
    turn, each call a step (step), so that an exception names the model and the position."""
    rows = []
    for position, token_id in enumerate(ids):
        step(f"{label}: {step_function.__name__} of token {token_id} at position {position}, "
             f"which should give the full pass's row")
        rows.append(step_function(weights, cache, token_id, position))
    return rows


def deep_rows(params, ids, mask=None, label=None):
    """The rows of a deep_model fed ids one token at a time through a new cache (with
    mask, causal unless given), and the cache; each step named with label (the model's
    deep_label unless given)."""
    import deep_model
    cache = deep_model.DeepCache(params, mask or deep_model.causal)
    return stepped_rows(label or deep_label(params), deep_model.forward_step, params, cache,
                        ids), cache


def where_deep_rows_differ(params, ids, mask=None):
    """None if every row of a deep_model fed ids through its cache (deep_rows) equals its
    full pass's, else a Wrong naming the model, the first layer whose rows differ, the
    position and the logit, with both numbers (by_layer); mask may be a list, a mask a
    layer."""
    import deep_model
    mask = mask or deep_model.causal
    rebuilt = " (its keys and values rebuilt from the cached latents)"

    def compare(weights):
        layers = weights["shape"]["layers"]   # a mask a layer: those of the layers kept
        masks = mask[:layers] if isinstance(mask, list) else mask
        rows, _ = deep_rows(weights, ids, masks)
        step(f"{deep_label(weights)}: its full pass (deep_model.forward)")
        return differ("the cached row" + (rebuilt if weights["shape"]["latent"] else ""),
                      rows, deep_model.forward(weights, ids, masks), "forward_step",
                      fed=f"token IDs {ids}, one at a time through a new DeepCache"
                          + ("" if mask is deep_model.causal else ", with a mask"))
    return by_layer(params, compare)


Layer = namedtuple("Layer", "title builds_on command check", defaults=(None,))
Layer.__doc__ = """One layer of the lab: what it is, the layers it builds on, the command
that shows why it is wrong; its quick check is quick_check() in that command's test
module (check_of), unless one is given here."""

LAYERS = {
    "lesson": Layer("the lesson (kv_cache.forward_step against model.forward)", (),
                    "python3 -m unittest test_kv_cache.Exactness"),
    "prefill": Layer("one-pass prefill (prefill.py)", ("lesson",), "python3 -m unittest test_prefill"),
    "paged": Layer("the paged cache (paged.py)", ("lesson", "prefill"), "python3 -m unittest test_paged"),
    "forks": Layer("parallel sampling from forks (forks.py)", ("lesson", "paged"),
                   "python3 -m unittest test_forks"),
    "lossy": Layer("the lossy caches (lossy.py)", ("lesson", "prefill"), "python3 -m unittest test_lossy"),
    "eviction": Layer("the evicting caches (eviction.py)", ("lesson", "lossy"),
                      "python3 -m unittest test_eviction"),
    "batched": Layer("batched rows (batched.py)", ("lesson", "paged", "lossy"),
                     "python3 -m unittest test_batched"),
    "serving": Layer("serving (serving.py)", ("prefill", "paged", "batched"),
                     "python3 -m unittest test_serving"),
    "speculative": Layer("speculative decoding (speculative.py)", ("prefill", "lossy"),
                         "python3 -m unittest test_speculative"),
    "cache_files": Layer("cache files (cache_files.py)", ("lesson", "paged", "lossy"),
                         "python3 -m unittest test_cache_files"),
    "deep_params": Layer("the deeper model's shapes and parameters (deep_params.py)", (),
                         "python3 -m unittest test_deep_params"),
    "deep_model": Layer("the deeper model (deep_model.py)", ("lesson", "deep_params"),
                        "python3 -m unittest test_deep_model"),
    "context_shift": Layer("the context shift (context_shift.py)", ("deep_model",),
                           "python3 -m unittest test_context_shift"),
    "latent_attention": Layer("latent attention read in latent space (latent_attention.py)",
                              ("deep_model",), "python3 -m unittest test_latent_attention"),
}
LAYERS["bandwidth"] = Layer("the numbers a step reads (bandwidth.py)",
                            ("lesson", "deep_model", "latent_attention"),
                            "python3 -m unittest test_bandwidth")
LAYERS["blockwise"] = Layer("attention read block by block (blockwise.py)",
                            ("lesson", "batched", "serving"), "python3 -m unittest test_blockwise")
LAYERS["quantization"] = Layer("keys by channel, values by token (quantization.py)",
                               ("lesson", "prefill", "lossy"),
                               "python3 -m unittest test_quantization")
LAYERS["pyramid_kv"] = Layer("PyramidKV's budgets by layer (pyramid_kv.py)", ("deep_model",),
                             "python3 -m unittest test_pyramid_kv")
LAYERS["one_gpu"] = Layer("what one GPU does with a model (one_gpu.py)",
                          ("lesson", "prefill", "bandwidth"), "python3 -m unittest test_one_gpu")
LAYERS["every Part"] = Layer("every Part", tuple(LAYERS), "python3 -m unittest", lambda: None)


def module_of(name):
    """The test module of layer name (from its command: python3 -m unittest test_x)."""
    return LAYERS[name].command.split()[-1].split(".")[0]


def check_of(name):
    """Layer name's quick check: the one LAYERS gives, else quick_check() in its test
    module, imported now (a Part that cannot be imported fails here, as its verdict)."""
    if LAYERS[name].check:
        return LAYERS[name].check
    module = importlib.import_module(module_of(name))
    if not hasattr(module, "quick_check"):
        raise LookupError(f"{module_of(name)}.py has no quick_check(), the quick check of "
                          f"layer {name!r}: a function that feeds the cases where its "
                          f"module's mistakes show and returns None, or a Wrong")
    return module.quick_check
