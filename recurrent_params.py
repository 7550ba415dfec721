"""The shapes and parameters of a hybrid of recurrent and attention layers (recurrent.py
runs them), as deep_params.py is deep_model.py's: the kinds a layer may be and the
patterns of real hybrids, the shape of every parameter, random parameters, the check that
refuses any other make; what a cache of such a model holds, by formula, and the check
that refuses a checkpoint (a copy of what a cache held) it could not hold; and real
hybrids' caches, from their public configs, with the table of them that Part 6 shows.

A shape is deep_model's (heads, kv_heads, width; rotary positions) with kinds: one
"recurrent" or "attention" a layer. An attention layer's block is deep_model's; a
recurrent layer's has every head its own key and value (Wk and Wv of width x width) and
its gates' Wg (width x heads) and bg (heads).
"""
import math
import random
from collections import namedtuple

import svg
from deep_params import check_model_shape, drawn, param_shapes as deep_shapes
from documents import plain, table
from model import check_ids, check_int, check_shape, check_values, excerpt

KINDS = ("recurrent", "attention")
PATTERNS = ("qwen3-next", "jamba")
FIELDS = ("layers", "heads", "kv_heads", "width", "positions", "latent", "rotary_key", "kinds")


def pattern_kinds(pattern, layers):
    """Each layer's kind in a real hybrid's pattern, by its name, for a model of layers layers.

    "qwen3-next": every fourth layer attention, the others recurrent (transformers'
    Qwen3NextConfig: "linear_attention" if (i + 1) % full_attention_interval, which is 4).
    "jamba": attention where the layer's index % 8 is 4, the others recurrent (Mamba in
    Jamba: ai21labs/Jamba-v0.1's config.json, attn_layer_period 8, attn_layer_offset 4)."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be \"qwen3-next\" or \"jamba\", got {excerpt(pattern)}")
    check_int("layers", layers, 1)
    if pattern == "qwen3-next":
        return ["attention" if (layer + 1) % 4 == 0 else "recurrent" for layer in range(layers)]
    return ["attention" if layer % 8 == 4 else "recurrent" for layer in range(layers)]


def shape_of(kinds, heads, kv_heads, width):
    """The shape params["shape"] keeps: deep_model's fields, with rotary positions, and kinds.

    Refused: kinds that are not a non-empty list of "recurrent" or "attention"; heads,
    kv_heads and width that deep_params.check_model_shape refuses."""
    if not isinstance(kinds, list) or not kinds or any(kind not in KINDS for kind in kinds):
        raise ValueError(f"kinds must be a list of \"recurrent\" or \"attention\", one a "
                         f"layer, got {excerpt(kinds)}")
    check_model_shape(len(kinds), heads, kv_heads, width, "rotary", None, 0)
    return dict(zip(FIELDS, (len(kinds), heads, kv_heads, width, "rotary", None, 0,
                             list(kinds))))


def param_shapes(shape):
    """The shape of every parameter of a hybrid of this shape: name -> (rows, columns).

    Per block under "blocks": deep_model's attention block, or a recurrent one."""
    width, heads = shape["width"], shape["heads"]
    wanted = deep_shapes(dict(shape, layers=1))
    attention = wanted["blocks"][0]
    recurrent = dict(attention, Wk=(width, width), Wv=(width, width), Wg=(width, heads),
                     bg=(heads,))
    wanted["blocks"] = [recurrent if kind == "recurrent" else attention
                        for kind in shape["kinds"]]
    return wanted


def init_params(kinds, heads, kv_heads, width, seed):
    """Random params of a hybrid of recurrent and attention layers (kinds, one a layer).

    As deep_model.init_params makes them (std 1 / sqrt(rows), 0.5 for tok_emb, gains 1,
    biases 0), but bg 2.0: gates near sigmoid(2) = 0.88, a memory of a few positions."""
    shape = shape_of(kinds, heads, kv_heads, width)
    return {"shape": shape, **drawn(param_shapes(shape), random.Random(seed), lambda name,
            entries: [1.0 if name.endswith("_g") else 2.0 if name == "bg" else 0.0] * entries)}


def check_params(params):
    """Refuse anything but params as init_params makes them: its shape, each weight of it."""
    shape = params.get("shape") if isinstance(params, dict) else None
    if not isinstance(shape, dict) or set(shape) != set(FIELDS):
        raise ValueError(f"params must be recurrent_params.init_params(...)'s: a dict with a "
                         f"\"shape\" of {', '.join(FIELDS)}")
    if shape != shape_of(shape["kinds"], shape["heads"], shape["kv_heads"], shape["width"]):
        raise ValueError(f"params: the shape must be shape_of's, got {excerpt(shape)}")
    wanted = param_shapes(shape)
    blocks = params.get("blocks")
    if set(params) - {"shape"} != set(wanted) or not isinstance(blocks, list) \
            or len(blocks) != shape["layers"]:
        raise ValueError(f"params must hold {sorted(wanted)} besides its shape, "
                         f"{shape['layers']} blocks")
    weights = [(name, params[name], dims) for name, dims in wanted.items() if name != "blocks"]
    for layer, (block, dims) in enumerate(zip(blocks, wanted["blocks"])):
        if not isinstance(block, dict) or set(block) != set(dims):
            raise ValueError(f"params: blocks[{layer}] must hold {sorted(dims)}")
        weights += [(f"blocks[{layer}][{name!r}]", block[name], each)
                    for name, each in dims.items()]
    for where, value, dims in weights:
        check_shape(value, dims, where)
        check_values(where, value if len(dims) == 2 else [value])


def zero_state(shape):
    """A recurrent layer's state before any position: a head width x head width zeros a head."""
    heads, d = shape["heads"], shape["width"] // shape["heads"]
    return [[[0.0] * d for _ in range(d)] for _ in range(heads)]


def state_numbers(shape):
    """The numbers a hybrid's states hold, by formula: recurrent layers x heads x d x d."""
    d = shape["width"] // shape["heads"]
    return shape["kinds"].count("recurrent") * shape["heads"] * d * d


def kv_numbers(shape, positions):
    """The numbers its attention layers' keys and values hold after positions positions.

    Attention layers x positions x 2 x kv_heads x head width."""
    d = shape["width"] // shape["heads"]
    return shape["kinds"].count("attention") * positions * 2 * shape["kv_heads"] * d


Checkpoint = namedtuple("Checkpoint", "tokens layers")
Checkpoint.__doc__ = """What a cache held after len(tokens) positions: its tokens, and a
dict a layer, {"state": a list a head} or {"keys": [...], "values": [...]}."""


def _form(value):
    """value's nesting of dicts and lists, float for each finite float: a shape to compare."""
    if isinstance(value, dict):
        return {key: _form(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_form(item) for item in value]
    return float if type(value) is float and math.isfinite(value) else repr(value)


def check_checkpoint(params, checkpoint):
    """Refuse a checkpoint that a cache of these params could not hold, naming the layer.

    Wanted: a Checkpoint of token IDs, and a layer for each of the model's as its kind
    holds it: a state of heads lists of head width x head width finite floats, or a key
    and a value a token, each of kv_heads x head width finite floats."""
    if not isinstance(checkpoint, Checkpoint) or not isinstance(checkpoint.tokens, tuple) \
            or not isinstance(checkpoint.layers, list):
        raise ValueError(f"checkpoint must be a recurrent_params.Checkpoint (a cache's, or a "
                         f"CheckpointStore's), got {excerpt(checkpoint)}")
    if checkpoint.tokens:
        check_ids(list(checkpoint.tokens))
    shape, n = params["shape"], len(checkpoint.tokens)
    heads, d, kv = shape["heads"], shape["width"] // shape["heads"], shape["kv_heads"]
    if len(checkpoint.layers) != shape["layers"]:
        raise ValueError(f"checkpoint: its layers must be {shape['layers']}, one a layer of "
                         f"the model, got {len(checkpoint.layers)}")
    for layer, (kind, held) in enumerate(zip(shape["kinds"], checkpoint.layers)):
        wanted = ({"state": zero_state(shape)} if kind == "recurrent" else
                  {part: [[0.0] * kv * d] * n for part in ("keys", "values")})
        if _form(held) != _form(wanted):
            what = (f"a state of {heads} heads of {d} x {d} finite floats"
                    if kind == "recurrent" else f"{n} keys and {n} values (one a token) of "
                                                f"{kv * d} finite floats")
            raise ValueError(f"checkpoint: layer {layer} is {kind}, and must hold {what}, "
                             f"got {excerpt(held)}")


# Real hybrids, from their Hugging Face config.json, 16-bit numbers (vLLM keeps a state in
# the model's dtype unless told: vllm/model_executor/layers/mamba/mamba_utils.py, which
# gives each layer's state shapes). Qwen/Qwen3-Next-80B-A3B-Instruct: 48 layers, every
# fourth attention with 2 key-value heads of 256; a Gated DeltaNet layer keeps 32 value
# heads x 128 x 128, and its short convolution's last 3 inputs of 2 x 16 x 128 + 32 x 128
# numbers. ai21labs/Jamba-v0.1: 32 layers, attention where index % 8 is 4, 8 key-value
# heads of 128; a Mamba layer keeps 8,192 channels (mamba_expand 2 x hidden_size 4,096) x
# mamba_d_state 16, and its convolution's last 3 inputs of 8,192.
REAL_MODELS = (
    {"model": "Qwen3-Next-80B-A3B", "kinds": pattern_kinds("qwen3-next", 48), "kv_heads": 2,
     "head_width": 256, "state_numbers": 32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)},
    {"model": "Jamba-v0.1", "kinds": pattern_kinds("jamba", 32), "kv_heads": 8,
     "head_width": 128, "state_numbers": 8192 * 16 + 3 * 8192})
BYTES_PER_NUMBER = 2
TOKENS = (4096, 131072)
REAL_CACHE = {   # the shape (svg.checked's) of one of real_caches(), in recurrent's record
    "model": str, **dict.fromkeys(("recurrent_layers", "attention_layers", "state_bytes",
                                   "tokens_as_large"), svg.COUNT),
    **dict.fromkeys(("attention_layer_bytes", "model_bytes", "every_layer_attention_bytes"),
                    [svg.COUNT])}


def real_caches():
    """Each of REAL_MODELS' cache bytes for one request, by formula, at each of TOKENS.

    A recurrent layer's state, an attention layer's keys and values, the whole model's
    cache, and the cache were every layer an attention layer; and the tokens from which
    an attention layer holds at least a state's bytes."""
    found = []
    for model in REAL_MODELS:
        layers, recurrent = len(model["kinds"]), model["kinds"].count("recurrent")
        state = model["state_numbers"] * BYTES_PER_NUMBER
        layer = [tokens * 2 * model["kv_heads"] * model["head_width"] * BYTES_PER_NUMBER
                 for tokens in TOKENS]
        found.append({"model": model["model"], "recurrent_layers": recurrent,
                      "attention_layers": layers - recurrent, "state_bytes": state,
                      "attention_layer_bytes": layer,
                      "model_bytes": [recurrent * state + (layers - recurrent) * each
                                      for each in layer],
                      "every_layer_attention_bytes": [layers * each for each in layer],
                      "tokens_as_large": math.ceil(state / (layer[0] / TOKENS[0]))})
    return found


def real_models_table(record, timing):
    """Section 36's table of real hybrids: a state against an attention layer, and the model."""
    models = svg.checked(record, {"recurrent": {"real_models": [REAL_CACHE]}})
    rows = []
    for i, model in enumerate(models["recurrent"]["real_models"]):
        if len(model["attention_layer_bytes"]) != len(TOKENS):
            raise ValueError(f"the record's recurrent.real_models[{i}].attention_layer_bytes "
                             f"must give its bytes at {len(TOKENS)} lengths, {TOKENS}")
        rows.append([plain(model["model"]), f"{model['recurrent_layers']} recurrent, "
                     f"{model['attention_layers']} attention",
                     svg.bytes_label(model["state_bytes"]),
                     *map(svg.bytes_label, model["attention_layer_bytes"]),
                     svg.bytes_label(model["model_bytes"][-1]),
                     svg.bytes_label(model["every_layer_attention_bytes"][-1])])
    return table(["model, 16-bit", "layers", "a recurrent layer's state, at any length",
                  *(f"an attention layer's keys and values, {tokens:,} tokens"
                    for tokens in TOKENS),
                  f"the model's cache, {TOKENS[-1]:,} tokens",
                  "the same were every layer attention"], rows)
