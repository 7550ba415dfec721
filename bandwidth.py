"""What a decode step reads (Part 5, section 29). Each generated token reads every weight
of the model once, the embedding rows of its token and position, and every cached key
and value (or latent) of every layer; on a GPU that reading, not the arithmetic, sets
the speed of decoding. So

    seconds per step >= (weight bytes + cache bytes) / memory bandwidth

and a batch of B requests shares the weights: each of its tokens costs weights / B plus
its own cache. floats_read counts a step's reads by formula for any deep_model shape (the
lesson's model is the shape LESSON); the tests count them in the real steps with
instruments.count_reads. The bound for real models comes from their published shapes.
"""
import math

import svg
import deep_shapes
from deep_model import DEEP_SHAPES, heads_of, init_params
from documents import plain, shown, table
from latent_attention import LATENT_SHAPES, cache_floats, check_formula, real_cache_bytes
from model import CONTEXT, VOCAB_SIZE, WIDTH, check_int, excerpt

LESSON = {"layers": 1, "heads": 1, "kv_heads": 1, "width": WIDTH, "positions": "learned",
          "latent": None, "rotary_key": 0}   # model.py's model (its MLP 4 x width wide too)


def floats_read(shape, held, path="cached"):
    """The distinct numbers one decode step reads, with held positions cached before it.

    Given as {"weights": ..., "cache": ...}. Weights: the embedding rows of its token (and
    position), every matrix and vector of every layer that the path uses, and the output
    layer. Cache: every held key and value, or latent and rotary key (its own new ones it
    computes, and does not read). path as latent_attention.multiply_adds takes it:
    "cached", "rebuilt" or "absorbed" (and refuses what it refuses)."""
    check_formula(shape, "held", held, path)
    heads, d, _, _, _ = heads_of(shape)
    width, latent, r = shape["width"], shape["latent"], shape["rotary_key"]
    layer = (2 * width + width * width + width * width     # ln1, Wq, Wo
             + 2 * width + 8 * width * width + 5 * width)  # ln2, W1 and b1, W2 and b2
    if path == "cached":
        kv_width = shape["kv_heads"] * d
        layer += 2 * width * kv_width                      # Wk, Wv
        cache = 2 * kv_width
    else:
        layer += width * latent + 2 * latent + width * (heads + 1) * r   # Wdkv, lnc, Wqr, Wkr
        if path == "rebuilt":
            layer += 2 * latent * width                    # Wuk, Wuv
        else:                                              # Wuk; the folded Wuv_h Wo_h for Wo
            layer += latent * width + heads * latent * width - width * width
        cache = latent + r
    embeddings = width * (2 if shape["positions"] == "learned" else 1)
    return {"weights": embeddings + shape["layers"] * layer + 2 * width + (width + 1) * VOCAB_SIZE,
            "cache": shape["layers"] * cache * held}


def llama_parameters(model):
    """A Llama's parameters, counted from its shapes.

    Per layer Wq and Wo (width x width), Wk and Wv (width x kv_heads heads of 128), the
    MLP's three matrices (width x mlp_width) and two norms; then the final norm, the input
    embedding and the output layer (vocab x width each, apart)."""
    width, kv_width = model["width"], model["kv_heads"] * 128
    layer = 2 * width * width + 2 * width * kv_width + 3 * width * model["mlp_width"] + 2 * width
    return model["layers"] * layer + width + 2 * model["vocab"] * width


def weight_bytes_read(model):
    """The bytes of weights one decode step reads.

    Every parameter but the input embedding's, of which only the new token's row (a
    position table it has none)."""
    unread = (model["vocab"] - 1) * model["width"]
    return (llama_parameters(model) - unread) * model["bytes_per_number"]


# Published shapes, for the bound, from Hugging Face's config.json of meta-llama's models
# (Touvron et al., 2023): Llama-2-7B: 32 layers of width 4,096, 32 key-value heads of 128,
# an MLP 11,008 wide, 32,000 tokens: 6,738,415,616 parameters (the paper's 6.74 billion),
# 2 bytes each. Llama-2-70B: 80 layers of width 8,192, 8 key-value heads of 128, an MLP
# 28,672 wide, 32,000 tokens: 68,976,648,192 (69 billion); gpt-fast ran it with 8-bit
# weights. An A100-80GB (SXM) reads 2,039 GB/s (NVIDIA's data sheet). gpt-fast's README
# measured, on an A100-80GB at batch 1: Llama-2-7B 104.9 tokens/s at 1,397.31 GB/s
# achieved, Llama-2-70B (8-bit) 19.13 tokens/s at 1,322.58 GB/s.
A100_BYTES_PER_SECOND = 2039e9
LLAMA_2_7B = {"model": "Llama-2-7B", "layers": 32, "width": 4096, "kv_heads": 32,
              "mlp_width": 11008, "vocab": 32000, "bytes_per_number": 2,
              "measured_tokens_per_second": 104.9, "measured_gb_per_s": 1397.31}
LLAMA_2_70B_8_BIT = {"model": "Llama-2-70B, 8-bit weights", "layers": 80, "width": 8192,
                     "kv_heads": 8, "mlp_width": 28672, "vocab": 32000, "bytes_per_number": 1,
                     "measured_tokens_per_second": 19.13, "measured_gb_per_s": 1322.58}
LLAMA_2_7B["weight_bytes_read"] = weight_bytes_read(LLAMA_2_7B)
LLAMA_2_70B_8_BIT["weight_bytes_read"] = weight_bytes_read(LLAMA_2_70B_8_BIT)
# Llama-2-7B's weights with other caches (heads of 128, 32 layers): grouped-query with 8
# key-value heads (as Llama-3-8B's), multi-query, and DeepSeek-V2's latent of 512 and
# rotary key of 64.
DESIGNS = (("multi-head, 32 key-value heads (its own)", {"kv_heads": 32}),
           ("grouped-query, 8 key-value heads", {"kv_heads": 8}),
           ("multi-query, 1 key-value head", {"kv_heads": 1}),
           ("latent 512 + rotary key 64", {"latent": 512, "rotary_key": 64}))


def cache_bytes_per_token(model):
    """A model's cache in bytes a token, 2 a number.

    A key and a value of 128 numbers per key-value head and layer, or a latent and a rotary
    key per layer. Refuses a model without them (_check_model)."""
    _check_model(model)
    return 2 * cache_floats(model["layers"], model.get("kv_heads"), 128, model.get("latent"),
                            model.get("rotary_key", 0))


def bound(model, context, batch=1, bandwidth=A100_BYTES_PER_SECOND):
    """The most tokens a second that batch requests, each at this context, can decode in all.

    bandwidth / (weights / batch + one request's cache), since a step reads the weights
    once for the batch and each request's own cache."""
    _check_request(model, batch)
    check_int("context", context, 0)
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) \
            or not 0 < bandwidth < math.inf:
        raise ValueError(f"bandwidth must be a number of bytes a second > 0, got "
                         f"{excerpt(bandwidth)}")
    return bandwidth / (model["weight_bytes_read"] / batch
                        + context * cache_bytes_per_token(model))


def cache_outweighs_weights(model, batch):
    """The shortest context at which a request's cache outweighs its share of the weights.

    Its share: the weights a step reads, split among a batch of batch requests."""
    _check_request(model, batch)
    return int(model["weight_bytes_read"] / batch // cache_bytes_per_token(model)) + 1


def _check_request(model, batch):
    """Refuse a model that is not a dict as LLAMA_2_7B (_check_model, with its
    weight_bytes_read), or a batch that is not an int >= 1."""
    _check_model(model, ("layers", "weight_bytes_read"))
    check_int("batch", batch, 1)


def _check_model(model, needed=("layers",)):
    """Refuse a model that is not a dict as LLAMA_2_7B, naming what it lacks of needed and
    of kv_heads (or latent and rotary_key)."""
    if not isinstance(model, dict):
        raise ValueError(f"model must be a dict as bandwidth.LLAMA_2_7B, got {excerpt(model)}")
    missing = [key for key in needed if key not in model]
    if not {"kv_heads", "latent"} & set(model):
        missing.append("kv_heads (or latent and rotary_key)")
    if missing:
        raise ValueError(f"model must be a dict as bandwidth.LLAMA_2_7B; this one has no "
                         f"{', '.join(missing)}")


# ---- the experiment (a stage of trace_kv.py) ---------------------------------------

HELD = (0, 16, CONTEXT - 1)


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "bytes_read": {
        "lesson": [{"held": svg.COUNT, "weights": svg.COUNT, "cache": svg.COUNT}],
        "lesson_cache_outweighs_weights_from_batch": svg.COUNT,
        "shapes": [{
            "layers": svg.COUNT, "kv_heads": svg.COUNT, "positions": str,
            "latent": (*svg.COUNT, None), "rotary_key": svg.COUNT, "path": str,
            "weights": svg.COUNT, "cache_full_context": svg.COUNT,
            "cache_outweighs_weights_from_batch": svg.COUNT}]},
}


def experiment(lab):
    """Count the numbers one decode step reads, for the lesson's model and Part 5's shapes.

    The lesson's model at HELD cached positions, and every deep_model and latent shape of
    Part 5 with a full context held, with the batch size at which each one's cache
    outweighs its share of the weights."""
    def entry(shape, path):
        full = floats_read(shape, CONTEXT - 1, path)
        return {**{key: shape[key] for key in ("layers", "kv_heads", "positions", "latent",
                                                "rotary_key")},
                "path": path, "weights": full["weights"], "cache_full_context": full["cache"],
                "cache_outweighs_weights_from_batch": full["weights"] // full["cache"] + 1}
    deep = [entry(init_params(layers, 4, kv_heads, WIDTH, 0)["shape"], "cached")
            for layers, kv_heads in DEEP_SHAPES]
    latent = [entry(init_params(layers, 4, 4, WIDTH, 0, positions, width, rotary_key)["shape"],
                    path)
              for layers, positions, width, rotary_key in LATENT_SHAPES
              for path in ("rebuilt", "absorbed")]
    return {"lesson": [{"held": held, **floats_read(LESSON, held)} for held in HELD],
            "lesson_cache_outweighs_weights_from_batch": entry(LESSON, "cached")[
                "cache_outweighs_weights_from_batch"],
            "shapes": deep + latent}


# ---- what Part 5 shows of it (documents.py fills its marks) --------------------------

def bytes_read_table(record, timing):
    """Section 29's table of the numbers one decode step reads, for the lab's models."""
    entry = svg.checked(record, RECORDS)["bytes_read"]
    shapes, lesson = entry["shapes"], entry["lesson"][-1]
    rows = [["the lesson's model (1 layer, 1 head)", shown(lesson["weights"]),
             shown(lesson["cache"]),
             entry["lesson_cache_outweighs_weights_from_batch"]]]
    for s in shapes:
        kind = ({4: "multi-head", 2: "grouped-query (2)", 1: "multi-query"}.get(
                    s["kv_heads"], f"grouped-query ({s['kv_heads']})")
                if s["path"] == "cached" else f"latent 8 + rotary key 2, {plain(s['path'])}")
        if (s["layers"] in (1, 4) and s["path"] == "cached"
                or (s["latent"], s["positions"], s["layers"]) == (8, "rotary", 1)):
            rows.append([f"{kind}, {s['layers']} layer{'s' * (s['layers'] > 1)}",
                         shown(s["weights"]), shown(s["cache_full_context"]),
                         s["cache_outweighs_weights_from_batch"]])
    return table(["model (4 heads of 4, but the lesson's)", "weights read a step",
                  f"cache read, {lesson['held']} positions held",
                  "batch from which the cache outweighs each request's share of the weights"],
                 rows)


def bound_table(record, timing):
    """Section 29's table of Llama-2-7B's bound in tokens a second, with each design of cache."""
    rows = []
    for label, design in DESIGNS:
        shape = {**LLAMA_2_7B, "kv_heads": None, **design}
        rows.append([label, f"{cache_bytes_per_token(shape) // 1024:,} KiB",
                     f"{bound(shape, 0):.0f} / {bound(shape, 4096):.0f}",
                     f"{bound(shape, 4096, 16):,.0f}",
                     f"{cache_outweighs_weights(shape, 16):,} tokens"])
    return table([f"Llama-2-7B's weights ({LLAMA_2_7B['weight_bytes_read'] / 1e9:.2f} GB "
                  f"read a step) with this cache", "cache a token",
                  "tokens/s, batch 1: a short context / 4,096",
                  "tokens/s in all, batch 16 of 4,096", "cache outweighs the weights, batch 16"],
                 rows)


def _times(ratio):
    """A ratio in words: "more than twice", "nearly twice" and so on."""
    return ("more than three times" if ratio > 3 else "more than twice" if ratio > 2
            else "nearly twice" if ratio > 1.8 else f"{ratio:.1f} times")


def share_lost_at_4096(record, timing):
    """The share of Llama-2-7B's speed at batch 1 that 4,096 tokens of its cache cost."""
    return format(1 - bound(LLAMA_2_7B, 4096) / bound(LLAMA_2_7B, 0), ".0%")


def cache_outweighs_at_batch_16(record, timing):
    """The context from which Llama-2-7B's cache outweighs its share of the weights, batch 16."""
    return cache_outweighs_weights(LLAMA_2_7B, 16)


def grouped_query_over_multi_head_at_batch_16(record, timing):
    """How much faster Llama-2-7B decodes, batch 16 of 4,096, with 8 key-value heads, in words."""
    return _times(bound({**LLAMA_2_7B, "kv_heads": 8}, 4096, 16) / bound(LLAMA_2_7B, 4096, 16))


def llama_70b_bound(record, timing):
    """The bound for Llama-2-70B with 8-bit weights at batch 1, in tokens a second."""
    return round(bound(LLAMA_2_70B_8_BIT, 0), 1)


# Where each real model's line ends: its context window in tokens (Llama 2: 4,096;
# Llama 3: 8,192; DeepSeek-V3: 128K). Section 9's 7B-class model runs to 8,192 tokens:
# 4 GiB of cache.
CONTEXT_WINDOWS = {"Llama-2-7B": 4096, "Llama-3-70B": 8192, "DeepSeek-V3": 131072}
SECTION_9_TOKENS = 8192


def _lesson_line(record):
    """(name, bytes a position, positions the line runs to, dashed) for the lesson's model:
    8-byte floats, to its 64 positions."""
    svg.checked(record, {"cache_floats_per_position": (1, svg.LARGEST)})
    return ("the lesson's model", record["cache_floats_per_position"] * 8, CONTEXT, False)


def cache_bytes_picture(record, timing):
    """Section 9's picture: a sequence's cache in bytes against the positions it holds.

    For the lesson's model (to its 64 positions) and section 9's 7B-class model in fp16 (to
    8,192 tokens), on log scales: both lines are straight, of slope one, and the model sets
    how high each lies. Nothing a later Part introduces."""
    return _cache_lines(
        "The cache grows with the sequence; the model sets by how much",
        [_lesson_line(record), ("a 7B-class model in fp16", cache_bytes_per_token(LLAMA_2_7B),
                                SECTION_9_TOKENS, True)],
        (1, 2 * SECTION_9_TOKENS), (2 ** 7, 2 ** 34), [1, CONTEXT, SECTION_9_TOKENS],
        ["after each name, its bytes a position;",
         f"solid: 8 bytes a number, to its {CONTEXT} positions;",
         f"dashed: 2 bytes a number, {LLAMA_2_7B['layers']} layers of",
         f"width {LLAMA_2_7B['width']:,}, to {SECTION_9_TOKENS:,} positions;"])


def cache_bytes_by_design_picture(record, timing):
    """Section 28's picture: a sequence's cache in bytes, for the lab's deep models and real ones.

    The same as section 9's, for the lab's 4-layer models of section 26 (to their 64
    positions) and real ones (to their context windows), DeepSeek-V3 also as if it cached
    its heads' own keys and values: fewer key-value heads, or a latent, move a line down."""
    declared = deep_shapes.RECORDS["deep_models"]   # with the counts a log scale needs above 0
    svg.checked(record, {"deep_models": {**declared, "positions": (1, svg.LARGEST), "shapes": [{
        **declared["shapes"][0], "bytes_per_position_as_8_byte_floats": (1, svg.LARGEST)}]}})
    lines = [_lesson_line(record)]
    for shape in record["deep_models"]["shapes"]:
        if shape["layers"] == 4 and shape["kv_heads"] > 1:
            kind = ("multi-head" if shape["kv_heads"] == shape["heads"]
                    else f"grouped-query {shape['kv_heads']}")
            lines.append((f"4 layers, {kind}", shape["bytes_per_position_as_8_byte_floats"],
                          record["deep_models"]["positions"], False))
    kept, plain = real_cache_bytes()["DeepSeek-V3"]
    lines += [("Llama-2-7B, multi-head", cache_bytes_per_token(LLAMA_2_7B),
               CONTEXT_WINDOWS["Llama-2-7B"], True),
              ("Llama-3-70B, grouped-query 8", real_cache_bytes()["Llama-3-70B"][0],
               CONTEXT_WINDOWS["Llama-3-70B"], True),
              ("DeepSeek-V3, latent", kept, CONTEXT_WINDOWS["DeepSeek-V3"], True),
              ("DeepSeek-V3 as multi-head", plain, CONTEXT_WINDOWS["DeepSeek-V3"], True)]
    return _cache_lines(
        "The cache grows with the sequence; the design sets by how much", lines,
        (1, 2 ** 17), (2 ** 6, 2 ** 40), [1, 64, 4096, 2 ** 17],
        ["after each name, its bytes a position;", "solid: the lab's, 8 bytes a number, to",
         f"their {record['deep_models']['positions']:,} positions; dashed: real models,",
         "2 bytes a number, to each one's", "context window; 4 layers of multi-query:",
         "256 B, hidden under the lesson's line;"])


def _cache_lines(title, lines, xs, ys, xticks, notes):
    """A sequence's cache in bytes against the positions it holds, on log scales: a line
    for each (name, bytes a position, positions it runs to, dashed) of lines, each in a
    colour and marker of its own; the legend and notes (and the binary unit) at the right."""
    notes = [*notes, "1 KiB = 1,024 B"]
    panel = svg.Panel((100, 50, 330, 290), xs, ys, xlog=True, ylog=True)
    body = panel.axes(xticks, [1024 ** p for p in range(1, 5) if ys[0] <= 1024 ** p <= ys[1]],
                      "positions (tokens) held", "bytes of one sequence's cache",
                      ylabels=svg.bytes_label)
    entries = []
    for i, (name, per, last, dashed) in enumerate(lines):
        color, marker = svg.style(i)
        body += panel.line([(n, per * n, f"{name}: {svg.bytes_label(per * n)} at {n:,} "
                                         f"position{'s' * (n > 1)}") for n in (1, last)],
                           color, dashed, marker)
        entries.append((f"{name}: {svg.bytes_label(per)}", color, marker, dashed))
    below = 70 + 18 * len(entries) + 4
    return svg.page(title, body + svg.legend(450, 70, entries, 11)
                    + [svg.text(450, below + 18 * i, note, 11) for i, note in enumerate(notes)],
                    height=max(svg.HEIGHT, below + 18 * len(notes)))
