"""The deeper model's shapes and parameters (deep_model.py runs them): what a shape may
be, the shape of every parameter a model of that shape holds, random parameters of it,
and the check that refuses params of any other make. A shape is layers, heads, kv_heads,
width, positions ("learned" or "rotary"), latent (None or the latent width) and
rotary_key (the width of a latent model's rotary key, 0 without one).

A hybrid model (hybrid.py) may also hold the fields of HYBRID: each layer's window, sinks,
and the layer whose keys and values each layer reads. A shape without one has its default:
every layer full, no sinks, each layer its own cache.
"""
import math
import random

from model import CONTEXT, VOCAB_SIZE, check_int, check_seed, check_shape, check_values, excerpt

SHAPE = ("layers", "heads", "kv_heads", "width", "positions", "latent", "rotary_key")
HYBRID = {"windows": None, "sinks": False, "kv_from": None}   # and their defaults
MAX_NUMBERS = 10 ** 7   # in a model's params: about 300 MB of floats, seconds to make


def init_params(layers, heads, kv_heads, width, seed, positions="learned", latent=None,
                rotary_key=None, windows=None, sinks=False, kv_from=None):
    """Random params of a deeper model of this shape.

    Per layer ln1, Wq (width x width), Wk and Wv (width x kv_heads * head width), Wo, ln2
    and an MLP of 4 x width; embeddings and the output layer as model.py's, without pos_emb
    if positions is "rotary". With latent (an int), Wdkv (width x latent), lnc and Wuk and
    Wuv (latent x width) instead of Wk and Wv, every head its own key and value
    (kv_heads = heads); with rotary positions also Wqr (width x heads * rotary_key) and Wkr
    (width x rotary_key). rotary_key defaults to half a head, as DeepSeek-V2's 64 of 128
    (at least 2, even); 0 turns the rebuilt keys instead. windows, sinks and kv_from as
    HYBRID's fields (check_hybrid): with sinks, a block's "sinks" (heads, drawn with std
    1); a layer that reads another's cache has no Wk and Wv. The shape is kept in
    params["shape"], with each HYBRID field that is not its default."""
    if rotary_key is None:
        rotary_key = max(2, width // heads // 4 * 2) if latent and positions == "rotary" else 0
    shape = {"layers": layers, "heads": heads, "kv_heads": kv_heads, "width": width,
             "positions": positions, "latent": latent, "rotary_key": rotary_key}
    shape.update((name, value) for name, value in zip(HYBRID, (windows, sinks, kv_from))
                 if value is not HYBRID[name])
    check_model_shape(**shape)
    check_seed(seed)
    rng = random.Random(seed)

    def vector(name, entries):   # gains 1, biases 0; a sink a learned logit a head
        if name == "sinks":
            return [rng.gauss(0.0, 1.0) for _ in range(entries)]
        return [1.0 if name.endswith("_g") else 0.0] * entries
    return {"shape": shape, **drawn(param_shapes(shape), rng, vector)}


def drawn(wanted, rng, vector):
    """Parameters of the shapes wanted (as param_shapes gives them), in their order.

    A matrix of rows x columns drawn from rng with std 1 / sqrt(rows) (0.5 for an
    embedding); a vector as vector(name, entries) makes it."""
    def made(name, dims):
        if len(dims) == 1:
            return vector(name, dims[0])
        std = 0.5 if name.endswith("_emb") else dims[0] ** -0.5
        return [[rng.gauss(0.0, std) for _ in range(dims[1])] for _ in range(dims[0])]
    wanted = dict(wanted)
    blocks = [{name: made(name, dims) for name, dims in block.items()}
              for block in wanted.pop("blocks")]
    return {"blocks": blocks, **{name: made(name, dims) for name, dims in wanted.items()}}


def check_model_shape(layers, heads, kv_heads, width, positions, latent, rotary_key,
                      windows=None, sinks=False, kv_from=None):
    """Refuse a shape that cannot be built.

    Refused: counts that are not ints >= 1, heads that do not divide the width, key-value
    heads that do not divide the heads, positions other than "learned" or "rotary", or, for
    rotary, an odd head width; a latent that is not None or an int >= 2, or shared by
    grouped heads; a rotary key that is not an even int >= 0, or not 0 without a latent and
    rotary positions; what check_hybrid refuses; more than MAX_NUMBERS numbers."""
    for name, value in zip(SHAPE, (layers, heads, kv_heads, width)):
        check_int(name, value, 1)
    if width % heads:
        raise ValueError(f"width {width} must be a multiple of heads {heads}")
    if heads % kv_heads:
        raise ValueError(f"heads {heads} must be a multiple of kv_heads {kv_heads}: each "
                         f"key-value head serves the same number of query heads")
    if positions not in ("learned", "rotary"):
        raise ValueError(f"positions must be \"learned\" or \"rotary\", got {positions!r}")
    if positions == "rotary" and width // heads % 2:
        raise ValueError(f"rotary positions turn pairs of numbers: the head width "
                         f"{width // heads} (width {width} / heads {heads}) must be even")
    if latent is not None:
        check_int("latent", latent, 2, why=": a layer norm of one number is always its bias")
        if kv_heads != heads:
            raise ValueError(f"a latent model rebuilds a key and a value for every head: "
                             f"kv_heads must be heads {heads}, got {kv_heads}")
    check_int("rotary_key", rotary_key, 0)
    if rotary_key % 2:
        raise ValueError(f"the rotary key turns pairs of numbers: rotary_key must be even, "
                         f"got {rotary_key}")
    if rotary_key and (latent is None or positions != "rotary"):
        raise ValueError("a rotary key of its own (rotary_key > 0) is for a latent model "
                         "with rotary positions; give latent= and positions=\"rotary\", "
                         "or rotary_key=0")
    check_hybrid(layers, latent, windows, sinks, kv_from)
    one = param_shapes(dict(zip(SHAPE, (1, heads, kv_heads, width, positions, latent, rotary_key)),
                            sinks=sinks))
    numbers = layers * sum(map(math.prod, one.pop("blocks")[0].values())) + sum(
        map(math.prod, one.values()))
    if numbers > MAX_NUMBERS:
        raise ValueError(f"a model of this shape holds {numbers:,} numbers, more than "
                         f"{MAX_NUMBERS:,}: give fewer layers or a smaller width")


def check_hybrid(layers, latent, windows, sinks, kv_from):
    """Refuse HYBRID fields that a model of layers layers cannot have.

    windows: None, or a list of one entry a layer, None (a full layer) or an int from 1 to
    CONTEXT; sinks: a bool; kv_from: None, or a list of one entry a layer, the layer whose
    keys and values it reads: itself, or an earlier layer that keeps its own and has its
    window (as Gemma 3n's shared layers read the last earlier layer of their kind). None
    of them in a latent model."""
    for name, value in (("windows", windows), ("kv_from", kv_from)):
        if value is not None and (not isinstance(value, list) or len(value) != layers):
            raise ValueError(f"{name} must be None or a list of one entry a layer ({layers}), "
                             f"got {excerpt(value)}")
    if not isinstance(sinks, bool):
        raise ValueError(f"sinks must be True or False (a learned sink logit a head in every "
                         f"layer, or none), got {excerpt(sinks)}")
    if latent is not None and (windows is not None or sinks or kv_from is not None):
        raise ValueError("windows, sinks and kv_from are for a model of keys and values: a "
                         "latent model's layers are all alike here; give latent=None, or "
                         "none of them")
    for layer, window in enumerate(windows or []):
        if window is not None:
            check_int(f"windows[{layer}]", window, 1, CONTEXT,
                      " (the positions a row reads; None for a full layer)")

    def window_of(layer):
        return windows[layer] if windows else None
    for layer, read in enumerate(kv_from or []):
        check_int(f"kv_from[{layer}]", read, 0, layer, " (the layer itself, or an earlier one)")
        if kv_from[read] != read:
            raise ValueError(f"kv_from[{layer}] is {read}, a layer that keeps no cache of its "
                             f"own (it reads layer {kv_from[read]}'s): read that one")
        if window_of(read) != window_of(layer):
            raise ValueError(f"kv_from[{layer}] is {read}, a layer of window "
                             f"{window_of(read)}, and layer {layer}'s window is "
                             f"{window_of(layer)}: a layer reads the cache of a layer of its "
                             f"own window (None: full)")


def layer_windows(shape):
    """Each layer's window (an int) or None (a full layer), as shape["windows"] gives them."""
    return shape.get("windows") or [None] * shape["layers"]


def kv_layers(shape):
    """Each layer's source of keys and values: itself, or the earlier layer kv_from names."""
    return shape.get("kv_from") or list(range(shape["layers"]))


def param_shapes(shape):
    """The shape of every parameter of a model of this shape (params["shape"]).

    name -> (rows, columns), or (entries,) for a vector; per block under "blocks". A rotary
    model has no pos_emb; a layer that reads another's cache (kv_from) no Wk and Wv."""
    width, kv_width = shape["width"], shape["kv_heads"] * (shape["width"] // shape["heads"])
    latent, rotary_key = shape["latent"], shape["rotary_key"]
    if latent is None:
        attention = {"Wk": (width, kv_width), "Wv": (width, kv_width)}
    else:
        attention = {"Wdkv": (width, latent), "lnc_g": (latent,), "lnc_b": (latent,),
                     "Wuk": (latent, width), "Wuv": (latent, width)}
        if rotary_key:
            attention.update(Wqr=(width, shape["heads"] * rotary_key), Wkr=(width, rotary_key))
    block = {"ln1_g": (width,), "ln1_b": (width,), "Wq": (width, width), **attention,
             "Wo": (width, width), "ln2_g": (width,), "ln2_b": (width,),
             "W1": (width, 4 * width), "b1": (4 * width,), "W2": (4 * width, width),
             "b2": (width,), **({"sinks": (shape["heads"],)} if shape.get("sinks") else {})}
    reading = {name: dims for name, dims in block.items() if name not in ("Wk", "Wv")}
    blocks = [block if read == layer else reading for layer, read in enumerate(kv_layers(shape))]
    table = {"pos_emb": (CONTEXT, width)} if shape["positions"] == "learned" else {}
    return {"tok_emb": (VOCAB_SIZE, width), **table,
            "blocks": blocks, "lnf_g": (width,), "lnf_b": (width,),
            "W_out": (width, VOCAB_SIZE), "b_out": (VOCAB_SIZE,)}


def check_params(params):
    """Refuse anything but params of a consistent shape, as init_params makes them.

    Wanted: a shape that init_params accepts, and every matrix and vector of that shape,
    holding finite floats no larger than model.MAX_WEIGHT (as model.check_params refuses)."""
    if not isinstance(params, dict) or not isinstance(params.get("shape"), dict) \
            or not set(SHAPE) <= set(params["shape"]) <= {*SHAPE, *HYBRID}:
        raise ValueError(f"params must be deep_model.init_params(...)'s: a dict with a "
                         f"\"shape\" of {', '.join(SHAPE)} (and any of {', '.join(HYBRID)})")
    shape = params["shape"]
    check_model_shape(**shape)
    if shape["positions"] == "rotary" and "pos_emb" in params:
        raise ValueError("params: a rotary model has no pos_emb (it turns q and k by position "
                         "instead); drop it, or make the shape's positions \"learned\"")
    if shape["positions"] == "learned" and "pos_emb" not in params:
        raise ValueError("params: a model of learned positions needs its pos_emb table")
    wanted = param_shapes(shape)
    if set(params) - {"shape"} != set(wanted):
        raise ValueError(f"params must hold {sorted(wanted)} besides its shape")
    if not isinstance(params["blocks"], list) or len(params["blocks"]) != shape["layers"]:
        raise ValueError(f"params: blocks must be a list of {shape['layers']} blocks")
    for name, dims in wanted.items():
        if name != "blocks":
            check_shape(params[name], dims, name)
            check_values(name, params[name] if len(dims) == 2 else [params[name]])
    for layer, (block, dims) in enumerate(zip(params["blocks"], wanted["blocks"])):
        if not isinstance(block, dict) or set(block) != set(dims):
            raise ValueError(f"params: blocks[{layer}] must hold {sorted(dims)}")
        for name, wanted_dims in dims.items():
            where = f"blocks[{layer}][{name!r}]"
            check_shape(block[name], wanted_dims, where)
            check_values(where, block[name] if len(wanted_dims) == 2 else [block[name]])
