"""Latent attention read the way engines decode it (Part 5, section 28). A latent model
of deep_model.py caches one latent c_kv a position and layer (and a small rotary key
k_r), and deep_model.forward_step rebuilds every head's key and value from it at every
step: exact, and dear. Absorption reads the latents directly, with the same math in
another order:

    q_h . (c Wuk_h)          = (q_h Wuk_h^T) . c          the query moved into latent space
    (sum_j w_j c_j Wuv_h) Wo_h = (sum_j w_j c_j) (Wuv_h Wo_h)   one folded matrix per head

so no key or value is ever rebuilt (DeepSeek-V2, 2024, section 2.1.3; vLLM's MLA
backend runs the rebuilding path in prefill and this one in decode). The sums are taken
in another order, so the logits differ from the full pass's by rounding. A turn by each
key's position between q and Wuk_h^T cannot be folded into either: that is why the
rotary part is a separate key (k_r) that the heads share. A model that turns its
rebuilt keys instead (rotary_key=0) is exact on the rebuilding path, and this module
measures what absorption does to it.
"""
from collections import namedtuple

import svg
from deep_model import (DeepCache, angles, check_step, compressed, deep_ids, embedded,
                        forward, forward_step, heads_of, init_params, latent_query,
                        mlp_residual, output_logits)
from deep_params import SHAPE, check_model_shape, check_params
from documents import bold, shown, table
from instruments import largest_gap
from model import (VOCAB_SIZE, WIDTH, add, check_int, dot, excerpt, layernorm, linear,
                   softmax_row)

Folded = namedtuple("Folded", "params blocks")
Folded.__doc__ = """A latent model's weights folded for the absorbed path, once per model:
params, and per layer "to_latent" (each head's columns of Wuk, rows of its map from the
query to latent space), "out" (Wuv_h Wo_h for every head, stacked head by head, by
columns) and "of" (the params' block it was folded from, and a copy of the matrices it folded
as they were: absorbed_step checks that the block is its params', by identity, and that
they have not changed in place since, by ==)."""
FOLDED = ("Wuk", "Wuv", "Wo")   # what fold reads of each layer


def fold(params):
    """Fold a latent model's params for absorbed_step, into a Folded.

    Refuses a model that is not latent, and one whose rebuilt keys are turned by their
    positions (rotary_key 0 with rotary positions): a turn that depends on each key's
    position cannot be folded into the query."""
    check_params(params)
    shape = params["shape"]
    if not shape["latent"]:
        raise ValueError("fold needs a latent model: deep_model.init_params(..., latent=...)")
    if shape["positions"] == "rotary" and not shape["rotary_key"]:
        raise ValueError("this model turns its rebuilt keys (rotary_key=0): each key's turn "
                         "depends on its position, so it cannot be folded into the query; "
                         "give the model a rotary key of its own (rotary_key > 0)")
    return _fold(params)


def _fold(params):
    """fold without its refusals (the experiment folds the coupled control too)."""
    heads, d = params["shape"]["heads"], params["shape"]["width"] // params["shape"]["heads"]
    blocks = []
    for block in params["blocks"]:
        wo_columns = list(zip(*block["Wo"]))
        out = [[dot(row[h * d:(h + 1) * d], column[h * d:(h + 1) * d]) for column in wo_columns]
               for h in range(heads) for row in block["Wuv"]]   # row m of Wuv_h times Wo_h
        blocks.append({"to_latent": [[row[h * d:(h + 1) * d] for row in block["Wuk"]]
                                     for h in range(heads)],
                       "out": [list(column) for column in zip(*out)],
                       "of": (block, {name: [row[:] for row in block[name]] for name in FOLDED})})
    return Folded(params, blocks)


def _check_folded(folded):
    """Refuse a Folded that fold(folded.params) would not give: not one block of the right
    sizes for each layer, folded from that layer of its params (by identity, as a cache
    belongs to its params: a deep copy is another model), whose matrices it folded have
    not changed in place since (a list == a copy of it: a few microseconds a step)."""
    params, blocks = folded.params, folded.blocks
    heads = params["shape"]["heads"]
    if not isinstance(blocks, list) or len(blocks) != len(params["blocks"]):
        raise ValueError(f"folded must hold a block for each of its params' "
                         f"{len(params['blocks'])} layers; fold(params) makes them")
    for layer, (block, made) in enumerate(zip(params["blocks"], blocks)):
        try:
            fits = (len(made["to_latent"]) == heads and len(made["out"]) == len(block["Wo"])
                    and len(made["out"][0]) == heads * len(block["Wuv"])
                    and made["of"][0] is block)
            changed = [name for name in FOLDED if block[name] != made["of"][1][name]]
        except (TypeError, KeyError, IndexError):
            fits = False
        if not fits:
            raise ValueError(f"folded's block {layer} is not fold(params)'s for its params "
                             f"(another model's, or made by hand): fold(params) again")
        if changed:
            raise ValueError(f"folded's block {layer} was folded before its params changed "
                             f"{' and '.join(changed)} in place: fold(params) again")


def absorbed_step(folded, cache, token_id, position):
    """Next-token logits for token_id at position, reading a latent model's cache in latent space.

    Each head's query times Wuk_h^T, its scores against the cached latents (and rotary
    keys), and its weights summing the latents; the heads' sums go through the folded
    Wuv_h Wo_h. Keeps in the cache what deep_model.forward_step keeps, and refuses what it
    refuses."""
    if not isinstance(folded, Folded):
        raise ValueError("absorbed_step needs latent_attention.fold(params)")
    params = folded.params
    check_step(params, cache, token_id, position)
    _check_folded(folded)
    shape = params["shape"]
    heads, d, d_key, _, scale = heads_of(shape)
    thetas, r_thetas = angles(shape)
    x0 = embedded(params, token_id, position)
    new, weights_read = [], []
    for block, cols, folded_block, layer, attended in zip(
            params["blocks"], cache.block_columns, folded.blocks, cache.layers,
            cache.positions_read(position)):
        h1 = layernorm(x0, block["ln1_g"], block["ln1_b"])
        q = latent_query(linear(h1, cols["Wq"]), h1, cols, position, thetas, r_thetas, heads)
        c_kv, k_r = compressed(h1, block, cols, position, r_thetas)
        held_latents = layer["latents"] + [c_kv]
        held_rotary_keys = layer["rotary_keys"] + [k_r]
        latents = [held_latents[j] for j in attended]
        read = [held_latents[j] + held_rotary_keys[j] for j in attended]   # what a score reads
        mixed = []
        weights_read.append([])
        for head in range(heads):
            q_h = q[head * d_key:(head + 1) * d_key]
            # the query in latent space, q_h Wuk_h^T, then its rotary part
            q_latent = linear(q_h[:d], folded_block["to_latent"][head]) + q_h[d:]
            scores = [dot(q_latent, c_j) * scale for c_j in read]
            weights = softmax_row(scores)
            weights_read[-1].append(weights)
            mixed += [dot(weights, column) for column in zip(*latents)]
        x0 = mlp_residual(add(x0, linear(mixed, folded_block["out"])), block, cols)
        new.append({"latents": c_kv, "rotary_keys": k_r})
    logits = output_logits(params, x0, cache.out_columns)
    cache.keep(token_id, new)
    for layer, weights_by_head in enumerate(weights_read):   # as forward_step tells it
        cache.attended(layer, weights_by_head)
    return logits


# ---- work and memory, by formula ----------------------------------------------------

PATHS = ("cached", "rebuilt", "absorbed")   # a decode step's ways through the attention


def check_formula(shape, count_name, count, path):
    """Refuse what a formula of one decode step cannot count.

    Refused: a shape deep_model.init_params would refuse, a count of positions (named
    count_name) that is not an int >= 0, and a path not in PATHS or not its shape's:
    "cached" keys and values, "rebuilt" and "absorbed" a latent model's."""
    if not isinstance(shape, dict) or set(shape) != set(SHAPE):
        raise ValueError(f"shape must be a deep_model shape, as params[\"shape\"] holds it: "
                         f"a dict of {', '.join(SHAPE)}")
    check_model_shape(**shape)
    check_int(count_name, count, 0)
    if path not in PATHS:
        raise ValueError(f"path must be \"cached\", \"rebuilt\" or \"absorbed\", got "
                         f"{excerpt(path)}")
    if path == "cached" and shape["latent"]:
        raise ValueError("path \"cached\" is a cache of keys and values, and this shape has a "
                         "latent: give path \"rebuilt\" or \"absorbed\"")
    if path != "cached" and not shape["latent"]:
        raise ValueError(f"path {path!r} reads a latent, and this shape has none (latent "
                         f"None): give path \"cached\"")


def cache_floats(layers, kv_heads, head_width, latent=None, rotary_key=0):
    """The numbers a cache keeps per position.

    Per layer a latent and a rotary key, or a key (head_width + rotary_key wide, as in a
    latent model's keys rebuilt) and a value (head_width) for each key-value head. Refuses
    counts that are not ints >= 1 (the rotary key >= 0)."""
    check_int("layers", layers, 1)
    check_int("rotary_key", rotary_key, 0)
    if latent is not None:
        check_int("latent", latent, 1)
        return layers * (latent + rotary_key)
    check_int("kv_heads", kv_heads, 1)
    check_int("head_width", head_width, 1)
    return layers * kv_heads * (2 * head_width + rotary_key)


def multiply_adds(shape, attended, path):
    """Products summed by one decode step of a deep_model shape attending to attended positions.

    Counted in every dot product: linear layers, turns, scores, weighted sums. shape is
    params["shape"]; path "cached" for a model that caches keys and values, "rebuilt"
    (deep_model.forward_step) or "absorbed" (absorbed_step) for a latent model. Refuses
    what check_formula refuses."""
    check_formula(shape, "attended", attended, path)
    heads, width, r = shape["heads"], shape["width"], shape["rotary_key"]
    d, latent_width, t = width // heads, shape["latent"], attended
    turned = shape["positions"] == "rotary"
    layer = width * width + 8 * width * width + width * width   # Wq; the MLP; Wo
    if path == "cached":
        kv_width = shape["kv_heads"] * d
        layer += 2 * width * kv_width + 2 * heads * d * t              # Wk, Wv; scores, sums
        layer += 2 * (width + kv_width) if turned else 0               # q and k turned
    else:
        layer += width * latent_width                                  # Wdkv
        layer += width * (heads + 1) * r + 2 * (heads + 1) * r         # Wqr, Wkr, their turns
        coupled = turned and not r
        layer += 2 * width if coupled else 0                           # q turned
        if path == "rebuilt":
            layer += t * 2 * latent_width * width + heads * t * (2 * d + r)   # keys, values
            layer += t * 2 * width if coupled else 0                   # every rebuilt key turned
        else:
            layer += heads * d * latent_width + heads * t * (2 * latent_width + r)   # Wuk_h^T
            layer += heads * latent_width * width - width * width      # folded, instead of Wo
    return shape["layers"] * layer + width * VOCAB_SIZE


def products(calls):
    """The products summed by recorded calls of dot and linear."""
    return sum(len(call.args[0]) * (len(call.args[1]) if call.name == "linear" else 1)
               for call in calls)


# Cache sizes of real latent and grouped models, from their published configurations:
# DeepSeek-V2 (arXiv 2405.04434, its config.json) and V3 (arXiv 2412.19437): 128 heads,
# keys of 128 + a rotary 64, values of 128, a latent of 512; V2 60 layers, V3 61.
# Llama-3-70B: 80 layers, 8 key-value heads of 128.
REAL_MODELS = (
    {"model": "DeepSeek-V2", "layers": 60, "heads": 128, "head_width": 128, "latent": 512,
     "rotary_key": 64},
    {"model": "DeepSeek-V3", "layers": 61, "heads": 128, "head_width": 128, "latent": 512,
     "rotary_key": 64},
    {"model": "Llama-3-70B", "layers": 80, "kv_heads": 8, "head_width": 128},
)


# ---- the experiment (a stage of trace_kv.py) ---------------------------------------

LATENT_SHAPES = tuple((layers, positions, latent_width, None)
                      for positions in ("learned", "rotary") for latent_width in (4, 8)
                      for layers in (1, 2))
COUPLED = tuple((layers, "rotary", 8, 0) for layers in (1, 2))   # the rebuilt keys turned
WORK_AT = (16, 64, 128)   # positions a decode step attends to


def _greedy(row):
    return max(range(VOCAB_SIZE), key=row.__getitem__)


def _latent_case(layers, positions, latent_width, rotary_key, prompt, continued):
    """A latent model (4 heads, the lab's width, seed 0) that feeds prompt and continues
    greedily for continued tokens through deep_model.forward_step: its rows against the
    full pass's; then absorbed_step fed the same tokens: its largest gap, and the first
    continued token where its greedy choice would part (None if it never does)."""
    params = init_params(layers, 4, 4, WIDTH, 0, positions, latent_width, rotary_key)
    cache, rows, ids = DeepCache(params), [], list(prompt)
    for position in range(len(prompt) + continued - 1):
        rows.append(forward_step(params, cache, ids[position], position))
        if position >= len(prompt) - 1:
            ids.append(_greedy(rows[-1]))
    folded, other = _fold(params), DeepCache(params)
    absorbed = [absorbed_step(folded, other, token_id, position)
                for position, token_id in enumerate(ids[:-1])]
    # fed the same tokens, its greedy continuation is the same until its choice differs
    parts = [n for n, (a, b) in enumerate(zip(absorbed[len(prompt) - 1:], ids[len(prompt):]))
             if _greedy(a) != b]
    full = forward(params, ids[:-1])
    return {"layers": layers, "positions": positions, "latent": latent_width,
            "rotary_key": params["shape"]["rotary_key"],
            "largest_gap_rebuilt": largest_gap(rows, full),
            "largest_gap_absorbed": largest_gap(absorbed, full),
            "continuation_parts_at": parts[0] if parts else None,
            "floats_per_position": cache.floats_per_position()}


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "latent_attention": {
        "prompt": svg.COUNT, "continued": svg.COUNT,
        "shapes": [{
            "layers": svg.COUNT, "positions": str, "latent": svg.COUNT,
            "rotary_key": svg.COUNT, "largest_gap_rebuilt": svg.COUNT,
            "largest_gap_absorbed": svg.COUNT, "continuation_parts_at": (*svg.COUNT, None),
            "floats_per_position": svg.COUNT, "formula": svg.COUNT,
            "against": {
                "multi-head": svg.COUNT, "grouped-query": svg.COUNT,
                "multi-query": svg.COUNT}}],
        "work_per_step": {
            "shape": {
                "layers": svg.COUNT, "heads": svg.COUNT, "kv_heads": svg.COUNT,
                "width": svg.COUNT, "positions": str, "latent": svg.COUNT,
                "rotary_key": svg.COUNT},
            "steps": [{
                "attended": svg.COUNT, "rebuilt": svg.COUNT, "absorbed": svg.COUNT,
                "multi-head": svg.COUNT, "multi-query": svg.COUNT}]}},
}


def experiment(lab):
    """Measure latent models on both paths, their caches, and a decode step's products.

    Latent models of 1 and 2 layers, learned and rotary positions, latents of 4 and 8 (and
    the coupled control: rotary, no rotary key), each fed the first tokens of the test
    stories and continued greedily: the rebuilding path's gap to the full pass, the
    absorbed path's gap and whether its continuation parts; the numbers cached per position
    against multi-head, grouped-query and multi-query caches of the same heads; and the
    products of one decode step at WORK_AT positions, by formula (the tests count them)."""
    ids = deep_ids(lab)
    prompt = ids[:len(ids) // 4]
    head = WIDTH // 4
    shapes = [_latent_case(*shape, prompt, len(prompt)) for shape in LATENT_SHAPES + COUPLED]
    for case in shapes:
        case["formula"] = cache_floats(case["layers"], 4, head, case["latent"], case["rotary_key"])
        case["against"] = {kind: cache_floats(case["layers"], kv_heads, head)
                           for kind, kv_heads in (("multi-head", 4), ("grouped-query", 2),
                                                  ("multi-query", 1))}
    shape = dict(init_params(1, 4, 4, WIDTH, 0, "rotary", 8)["shape"])
    work = [{"attended": t,
             "rebuilt": multiply_adds(shape, t, "rebuilt"),
             "absorbed": multiply_adds(shape, t, "absorbed"),
             **{kind: multiply_adds(dict(shape, kv_heads=kv_heads, latent=None, rotary_key=0),
                                    t, "cached")
                for kind, kv_heads in (("multi-head", 4), ("multi-query", 1))}}
            for t in WORK_AT]
    return {"prompt": len(prompt), "continued": len(prompt), "shapes": shapes,
            "work_per_step": {"shape": shape, "steps": work}}


# ---- what Part 5 shows of it (documents.py fills its marks) --------------------------

def shapes_table(record, timing):
    """Section 28's table of latent shapes: numbers cached, both paths' gaps, continuations."""
    entry = svg.checked(record, RECORDS)["latent_attention"]
    rows = []
    for positions, latent, rotary_key in (("learned", 4, 0), ("learned", 8, 0), ("rotary", 4, 2),
                                          ("rotary", 8, 2), ("rotary", 8, 0)):
        shapes = svg.found(entry["shapes"], "latent_attention.shapes", positions=positions,
                           latent=latent, rotary_key=rotary_key)
        against = shapes[0]["against"]
        rows.append([f"{positions} positions, latent {latent}"
                     + (f", rotary key {rotary_key}" if rotary_key else
                        ", rebuilt keys turned (the control)" if positions == "rotary" else ""),
                     " / ".join(f"{s['floats_per_position']:g}" for s in shapes),
                     f"{against['multi-head']} / {against['grouped-query']} / "
                     f"{against['multi-query']}",
                     bold(" / ".join(shown(s["largest_gap_rebuilt"]) for s in shapes)),
                     " / ".join(shown(s["largest_gap_absorbed"]) for s in shapes),
                     " / ".join("the same" if s["continuation_parts_at"] is None else
                                f"parts at new token {s['continuation_parts_at'] + 1}"
                                for s in shapes)])
    return table(["latent model (4 heads of 4)", "numbers cached per position, 1 / 2 layers",
                  "multi-head / grouped-query (2) / multi-query, 1 layer",
                  "rebuilt keys: largest gap, 1 / 2 layers",
                  "absorbed: largest gap, 1 / 2 layers",
                  f"absorbed greedy continuation ({entry['continued']} "
                  f"tokens)"], rows)


def work_table(record, timing):
    """Section 28's table of one decode step's products on each path, by positions attended."""
    work = svg.checked(record, RECORDS)["latent_attention"]["work_per_step"]
    shape, steps = work["shape"], work["steps"]
    try:
        floats = cache_floats(1, 4, 4, shape["latent"], shape["rotary_key"])
    except ValueError as e:
        raise ValueError(f"the record's latent_attention.work_per_step.shape: {e}") from None
    latent = f"latent {shape['latent']} + rotary key {shape['rotary_key']} ({floats})"
    return table(["one decode step, 1 layer, 4 heads", *(f"attending to {s['attended']}"
                                                          for s in steps)],
                 [[label, *(shown(s[path]) for s in steps)]
                  for path, label in (("multi-head", f"multi-head cache ({cache_floats(1, 4, 4)} "
                                                     f"numbers a position)"),
                                      ("multi-query", f"multi-query cache ({cache_floats(1, 1, 4)})"),
                                      ("rebuilt", f"{latent}, keys rebuilt"),
                                      ("absorbed", f"{latent}, absorbed"))])


def real_cache_bytes():
    """The cache bytes a token of each real model of REAL_MODELS, 2 a number, by its name.

    Each a pair: those bytes, and for a latent model the bytes of its heads' own keys and
    values (None for the others)."""
    return {m["model"]: (2 * cache_floats(m["layers"], m.get("kv_heads"), m["head_width"],
                                          m.get("latent"), m.get("rotary_key", 0)),
                         m.get("latent") and 2 * cache_floats(m["layers"], m["heads"],
                                                              m["head_width"], None,
                                                              m["rotary_key"]))
            for m in REAL_MODELS}


def real_models_table(record, timing):
    """Section 28's table of the real models' caches, in bytes a token."""
    rows = []
    for m in REAL_MODELS:
        kept, plain = real_cache_bytes()[m["model"]]
        rows.append([m["model"], m["layers"], f"latent {m['latent']} + rotary key "
                     f"{m['rotary_key']}" if plain else f"{m['kv_heads']} key-value heads",
                     f"{kept:,}", f"{plain:,} ({plain / kept:.0f}x)" if plain else "—"])
    return table(["model", "layers", "cache", "bytes a token (2-byte numbers)",
                  "its heads' keys and values cached instead"], rows)


def _shapes_of(record, coupled):
    """The recorded shapes: the coupled controls (rotary, no rotary key), or the rest."""
    return [s for s in record["latent_attention"]["shapes"]
            if (s["positions"] == "rotary" and not s["rotary_key"]) == coupled]


def absorbed_largest_gap(record, timing):
    """The largest gap of the absorbed path to the full pass, the coupled controls aside."""
    return max(s["largest_gap_absorbed"] for s in _shapes_of(record, coupled=False))


def control_gaps(record, timing):
    """The absorbed path's largest gap in each coupled control (rotary, no rotary key)."""
    return " and ".join(shown(s["largest_gap_absorbed"]) for s in _shapes_of(record, coupled=True))


def control_parts_at(record, timing):
    """The new token at which each coupled control's absorbed continuation parts."""
    return " and ".join(str(s["continuation_parts_at"] + 1)
                        for s in _shapes_of(record, coupled=True))


def _per_position(record, path):
    """What one more attended position adds to a decode step's products on path."""
    first, *_, last = record["latent_attention"]["work_per_step"]["steps"]
    return (last[path] - first[path]) // (last["attended"] - first["attended"])


def rebuilt_per_position(record, timing):
    """The products one more attended position adds to the rebuilding step."""
    return _per_position(record, "rebuilt")


def absorbed_per_position(record, timing):
    """The products one more attended position adds to the absorbed step."""
    return _per_position(record, "absorbed")


def multi_head_per_position(record, timing):
    """The products one more attended position adds to a multi-head cache's step."""
    return _per_position(record, "multi-head")


def deepseek_v3_ratio(record, timing):
    """How many times smaller DeepSeek-V3's latent cache is than its heads' keys and values."""
    kept, plain = real_cache_bytes()["DeepSeek-V3"]
    return round(plain / kept)
