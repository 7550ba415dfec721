"""Hybrid models (Part 6): layers whose caches differ, in one model.

The models served now are not alike in every layer. gpt-oss alternates layers that read
only a window of recent positions with layers that read them all, and gives each head a
learned sink; Gemma 3 has five window layers to each full one; Gemma 3n's last layers,
like CLA's and YOCO's, read an earlier layer's keys and values instead of keeping their
own. The deeper model (deep_model.py) takes all three from its shape (deep_params.HYBRID):

- windows: a layer of window W reads model.band(W), itself and the W - 1 positions before
  it; a full layer reads every position. Its cache needs only those W, so an engine frees
  the rest; a DeepCache keeps them all and masks, which gives the same rows and saves
  nothing (as llama.cpp's --swa-full: https://github.com/ggml-org/llama.cpp/pull/13194).
- sinks: each head's learned logit, a score with no key and no value. It joins the
  softmax, takes a share of the weight, and is dropped, so a head may attend to little;
  it costs no position of the cache. Section 17's sinks are another thing: the first
  positions, kept in the cache as real keys and values (StreamingLLM, arXiv:2309.17453).
- kv_from: a layer that reads an earlier layer's cache has no Wk and Wv and keeps
  nothing, so a position costs 2 x the layers that keep one x kv_heads x head width
  numbers (numbers_per_position). Cross-layer attention (CLA, Brandon et al., 2024,
  arXiv:2405.12981) shares a cache between adjacent layers; YOCO (Sun et al., 2024,
  arXiv:2405.05254) gives the upper half of the layers one cache.

A kernel that reads a row's keys in parts (blockwise.py) merges their sums; a sink
belongs to no part, so its exp joins the sum once, at the merge (exact_with_sink, which
gives attend's bits at any count of parts). Added in every part, it would count as many
times as there are parts.
"""
from math import exp, fsum

import deep_model
from blockwise import exact_partials
from deep_model import DeepCache, deep_ids, forward, forward_step
from deep_params import HYBRID, SHAPE, check_model_shape, init_params, kv_layers
from instruments import largest_gap, recording
import svg
from documents import plain, shown, table
from model import WIDTH, check_int, dot, excerpt

PATTERNS = ("gpt-oss", "gemma-3")   # pattern_windows's names


def pattern_windows(pattern, layers, window):
    """Each layer's window in a real model's pattern, by its name, for a model of layers layers.

    "gpt-oss": a window in layers 0, 2, 4, ..., the others full (gpt-oss's reference,
    https://github.com/openai/gpt-oss/blob/main/gpt_oss/torch/model.py: sliding_window
    128 where layer_idx % 2 == 0, its mask the last 128 positions; 24 layers in
    gpt-oss-20b, 36 in gpt-oss-120b). "gemma-3": five window layers, then a full one, from
    the first layer on (Gemma 3 Technical Report, https://arxiv.org/abs/2503.19786: 5
    local layers of a 1,024-token span for each global layer). Llama 4's local layers
    read chunks of 8,192 positions (transformers' Llama4TextConfig, attention_chunk_size;
    every fourth layer global): a chunk reaches back to its own start, not a window, and
    is not built here. Here window is scaled down (4 for stories of 16 or 64 tokens)."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be \"gpt-oss\" or \"gemma-3\", got {excerpt(pattern)}")
    check_int("layers", layers, 1)
    check_int("window", window, 1, None, " (the positions a window layer's row reads)")
    if pattern == "gpt-oss":
        return [window if layer % 2 == 0 else None for layer in range(layers)]
    return [None if (layer + 1) % 6 == 0 else window for layer in range(layers)]


def shared_tail(windows, shared):
    """kv_from for a model whose last shared layers read earlier layers' caches, as Gemma 3n's.

    Each of them reads the last layer before the tail that has its window (transformers'
    models/gemma3n/modeling_gemma3n.py: kv_shared_layer_index, for the last
    num_kv_shared_layers layers, the last earlier layer of the same type); the others read
    their own. windows is a list of one window or None a layer. Refuses a tail layer whose
    window no layer before the tail has."""
    if not isinstance(windows, list) or not windows:
        raise ValueError(f"windows must be a list of one window or None a layer, got "
                         f"{excerpt(windows)}")
    check_int("shared", shared, 0, len(windows) - 1, " (at least one layer keeps a cache)")
    first = len(windows) - shared
    kv_from = list(range(first))
    for layer in range(first, len(windows)):
        kind = [earlier for earlier in range(first) if windows[earlier] == windows[layer]]
        if not kind:
            raise ValueError(f"layer {layer}'s window is {windows[layer]}, and no layer "
                             f"before the shared tail (layers 0 to {first - 1}) has it: it "
                             f"would have no cache of its kind to read")
        kv_from.append(kind[-1])
    return kv_from


def numbers_per_position(shape):
    """The numbers a DeepCache of a model of this shape keeps a position, by formula.

    2 (a key and a value) x the layers that keep their own (kv_from) x kv_heads x head
    width. A sink has no key and no value; a window saves nothing here, since a DeepCache
    keeps every position and masks. Refuses what is not a shape of keys and values."""
    if not isinstance(shape, dict) or not set(SHAPE) <= set(shape) <= {*SHAPE, *HYBRID}:
        raise ValueError(f"shape must be a deep_model shape, as params[\"shape\"] holds it, "
                         f"got {excerpt(shape)}")
    check_model_shape(**shape)
    if shape["latent"]:
        raise ValueError("a latent model keeps latents, not keys and values: its numbers "
                         "are latent_attention.cache_floats'")
    keeping = sum(read == layer for layer, read in enumerate(kv_layers(shape)))
    return 2 * keeping * shape["kv_heads"] * (shape["width"] // shape["heads"])


def exact_with_sink(parts):
    """Give an attention with attend's arguments whose parts merge exactly, sink once.

    As blockwise.exact, over parts as even as positions allow (1 to the number of keys):
    first the row's maximum, of each part's scores and of the sink; then each part's exps
    from it, as exact partials of their sum (blockwise.exact_partials), to which the
    sink's exp is added once, at the merge (it has no key, so it is in no part); then each
    part's weights times its values, as exact partials of each column's sum. fsum of them
    all is attend's mixed values, bit for bit."""
    check_int("parts", parts, 1)

    def attention(q_h, sink, scale, keys, values):
        check_int("parts", parts, 1, len(keys), f" (the row's {len(keys)} keys)")
        ends = [len(keys) * part // parts for part in range(parts + 1)]
        cuts = [(keys[a:b], values[a:b]) for a, b in zip(ends, ends[1:])]
        scores = [[dot(q_h, k_j) * scale for k_j in part_keys] for part_keys, _ in cuts]
        sinks = [] if sink is None else [sink]   # a score in no part
        top = max([max(part) for part in scores] + sinks)
        total = fsum([x for part in scores for x in exact_partials(exp(s - top) for s in part)]
                     + [exp(s - top) for s in sinks])
        columns = [[] for _ in values[0]]
        for part, (_, part_values) in zip(scores, cuts):
            weights = [exp(s - top) / total for s in part]
            for column, part_column in zip(columns, zip(*part_values)):
                column += exact_partials(w * v for w, v in zip(weights, part_column))
        return [fsum(column) for column in columns]
    return attention


# ---- real models' caches, by formula ---------------------------------------------------

# Hugging Face config.json figures. openai/gpt-oss-20b: 24 layers, 8 key-value heads of
# 64, sliding_window 128 in every other layer (layer_types); gpt-oss-120b: 36 such layers.
# google/gemma-3-27b-it: 62 layers, 16 key-value heads of 128, sliding_window 1,024, five
# window layers to each full one. Keys and values in bf16, 2 bytes a number.
REAL_MODELS = (
    {"model": "gpt-oss-20b", "kv_heads": 8, "head_width": 64,
     "windows": pattern_windows("gpt-oss", 24, 128)},
    {"model": "gpt-oss-120b", "kv_heads": 8, "head_width": 64,
     "windows": pattern_windows("gpt-oss", 36, 128)},
    {"model": "Gemma 3 27B", "kv_heads": 16, "head_width": 128,
     "windows": pattern_windows("gemma-3", 62, 1024)})
BYTES_PER_NUMBER = 2
# (tokens each, requests): hf-mem issue #70's gpt-oss-20b case (8,192 tokens, 32
# sequences: https://github.com/alvarobartt/hf-mem/issues/70), and one long request
WORKLOADS = ((8192, 32), (32768, 1))


def cache_bytes(model, tokens, requests=1, windows_as_full=False):
    """The bytes of the caches of requests requests of tokens positions each, by formula.

    Each layer keeps 2 x kv_heads x head_width numbers a position it holds: a full layer
    every position, a window layer at most its window (positions, not blocks: an engine
    rounds up to whole blocks). windows_as_full counts every layer as full, as an engine
    or estimator that ignores the windows does."""
    check_int("tokens", tokens, 1)
    check_int("requests", requests, 1)
    held = sum(tokens if window is None or windows_as_full else min(tokens, window)
               for window in model["windows"])
    return requests * held * 2 * model["kv_heads"] * model["head_width"] * BYTES_PER_NUMBER


def real_caches():
    """Give the bytes of each of REAL_MODELS' caches at each of WORKLOADS, two ways.

    Windows kept as windows, and every layer counted full."""
    return [{"model": model["model"],
             "bytes_as_windows": [cache_bytes(model, *workload) for workload in WORKLOADS],
             "bytes_as_full": [cache_bytes(model, *workload, windows_as_full=True)
                               for workload in WORKLOADS]}
            for model in REAL_MODELS]


# ---- the experiment (for a stage of trace_kv.py) --------------------------------------

WINDOW = 4   # gpt-oss's 128 and Gemma 3's 1,024, scaled down to stories of 16 or 64 tokens


def tried_models():
    """The experiment's models, as (name, params): 4 heads, 2 kv heads, rotary, seed 0.

    "gpt-oss": its pattern on 4 layers, with sinks; "gemma-3": its pattern on 6 layers;
    "shared": gpt-oss's pattern on 6 layers whose last 2 read earlier layers' caches
    (shared_tail). Every window WINDOW."""
    gpt_oss = pattern_windows("gpt-oss", 6, WINDOW)
    return [("gpt-oss", init_params(4, 4, 2, WIDTH, 0, "rotary", windows=gpt_oss[:4],
                                    sinks=True)),
            ("gemma-3", init_params(6, 4, 2, WIDTH, 0, "rotary",
                                    windows=pattern_windows("gemma-3", 6, WINDOW))),
            ("shared", init_params(6, 4, 2, WIDTH, 0, "rotary", windows=gpt_oss,
                                   kv_from=shared_tail(gpt_oss, 2)))]


def fed(params, ids):
    """The rows of a deep_model fed ids one token at a time, and its DeepCache."""
    cache = DeepCache(params)
    return [forward_step(params, cache, token_id, position)
            for position, token_id in enumerate(ids)], cache


def without_sinks(params):
    """The same model with no sinks: its shape's and its blocks' removed."""
    return dict(params, shape={name: value for name, value in params["shape"].items()
                               if name != "sinks"},
                blocks=[{name: value for name, value in block.items() if name != "sinks"}
                        for block in params["blocks"]])


def head_reads(params, ids):
    """What each head reads in the row of ids' last position, fed after the others.

    One (layer, head, attend's arguments, its mixed values) a call of deep_model.attend
    that the row's forward_step makes (q_h, sink, scale, keys, values)."""
    _, cache = fed(params, ids[:-1])
    with recording(deep_model, "attend") as calls:
        forward_step(params, cache, ids[-1], len(ids) - 1)
    heads = params["shape"]["heads"]
    return [(*divmod(index, heads), call.args, call.result[0])
            for index, call in enumerate(calls)]


def sink_merges(params, ids):
    """The head_reads of the row of ids' last position, each merged again at every count.

    Each read is merged by exact_with_sink in 1 to its keys' parts. Gives the reads, the
    mergings compared and those equal to attend's mixed values, bit for bit."""
    reads = head_reads(params, ids)
    merged = [exact_with_sink(parts)(*args) == mixed for _, _, args, mixed in reads
              for parts in range(1, len(args[3]) + 1)]
    return {"reads": len(reads), "mergings_compared": len(merged), "mergings_equal": sum(merged)}


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "hybrid_models": {
        "positions": svg.COUNT, "window": svg.COUNT,
        "models": [{
            "model": str, "layers": svg.COUNT, "windows": [(*svg.COUNT, None)],
            "sinks": bool, "kv_from": [svg.COUNT], "rows_compared": svg.COUNT,
            "largest_logit_gap": svg.COUNT, "positions_held": svg.COUNT,
            "numbers_per_position": svg.COUNT, "formula": svg.COUNT}],
        "sinks": {
            "model": str, "positions_held": [svg.COUNT],
            "numbers_per_position": [svg.COUNT], "largest_logit_change": svg.COUNT,
            "reads": svg.COUNT, "mergings_compared": svg.COUNT,
            "mergings_equal": svg.COUNT},
        "real_models": [{
            "model": str, "bytes_as_windows": [svg.COUNT], "bytes_as_full": [svg.COUNT]}]},
}


def experiment(lab):
    """Run each of tried_models() along deep_ids(lab): rows, cache, and sinks.

    For each: its cached rows against its full pass (deep_model.forward, each layer its
    own mask), the positions its cache holds, and its numbers a position counted and by
    formula. For the one with sinks: the same without them (the cache alike, the rows
    not), and its last row's sink merge at every count of parts (sink_merges)."""
    ids, models = deep_ids(lab), []
    for name, params in tried_models():
        rows, cache = fed(params, ids)
        shape = params["shape"]
        models.append({"model": name, "layers": shape["layers"], "windows": shape["windows"],
                       "sinks": shape.get("sinks", False), "kv_from": kv_layers(shape),
                       "rows_compared": len(rows),
                       "largest_logit_gap": largest_gap(rows, forward(params, ids)),
                       "positions_held": len(cache),
                       "numbers_per_position": cache.floats_per_position(),
                       "formula": numbers_per_position(shape)})
        if shape.get("sinks"):
            plain_rows, plain = fed(without_sinks(params), ids)
            sinks = {"model": name, "positions_held": [len(cache), len(plain)],
                     "numbers_per_position": [cache.floats_per_position(),
                                              plain.floats_per_position()],
                     "largest_logit_change": largest_gap(rows, plain_rows),
                     **sink_merges(params, ids)}
    return {"positions": len(ids), "window": WINDOW, "models": models, "sinks": sinks,
            "real_models": real_caches()}


# ---- what Part 6 shows of it (documents.py fills its marks) --------------------------

def models_table(record, timing):
    """Section 32's table: each hybrid model's cached rows against its full pass, its cache."""
    entry = svg.checked(record, {"hybrid_models": svg.picked(
        RECORDS["hybrid_models"], "positions", "models")})["hybrid_models"]
    rows = []
    for model in entry["models"]:
        windows = ", ".join("full" if w is None else str(w) for w in model["windows"])
        reading = [f"{layer} reads {read}" for layer, read in enumerate(model["kv_from"])
                   if read != layer]
        rows.append([plain(model["model"]), windows, ", ".join(reading) or "its own",
                     f"{model['rows_compared']:,}", shown(model["largest_logit_gap"]),
                     f"{shown(model['numbers_per_position'], 'g')} ({model['formula']})"])
    return table(["model", "each layer's window", "layer whose keys and values it reads",
                  "rows compared with the full pass", "largest gap",
                  "numbers a position, counted (by formula)"], rows)


def real_models_table(record, timing):
    """Section 32's table of real models: their caches with windows kept and counted full."""
    entries = svg.checked(record, {"hybrid_models": svg.picked(
        RECORDS["hybrid_models"], "real_models")})["hybrid_models"]["real_models"]
    rows = []
    for i, (model, entry) in enumerate(zip(REAL_MODELS, entries)):
        if entry["model"] != model["model"] or {len(entry["bytes_as_full"]),
                                                len(entry["bytes_as_windows"])} != {len(WORKLOADS)}:
            raise ValueError(f"the record's hybrid_models.real_models[{i}] must be "
                             f"{model['model']}'s, at {len(WORKLOADS)} workloads")
        windows = model["windows"]
        cells = [model["model"], f"{windows.count(None)} full, "
                 f"{len(windows) - windows.count(None)} of {max(filter(None, windows)):,}"]
        for full, kept in zip(entry["bytes_as_full"], entry["bytes_as_windows"]):
            cells += [f"{full / 2 ** 30:.2f} GiB", f"{kept / 2 ** 30:.2f} GiB"]
        rows.append(cells)
    header = ["model, 16-bit", "layers"]
    for tokens, requests in WORKLOADS:
        header += [f"{requests} x {tokens:,} tokens, all layers full", "windows kept"]
    return table(header, rows)


def gpt_oss_20b_gib(record, timing, kind):
    """gpt-oss-20b's cache at the first workload, in GiB to 2 decimals: windows or full."""
    real_models_table(record, timing)   # the record's shape, checked
    entry = record["hybrid_models"]["real_models"][0]
    if kind not in ("windows", "full"):
        raise ValueError(f"kind must be \"windows\" or \"full\", got {excerpt(kind)}")
    return f"{entry['bytes_as_' + kind][0] / 2 ** 30:.2f}"
