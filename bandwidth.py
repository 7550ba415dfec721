"""What a decode step reads (Part 4, section 26). Each generated token reads every weight
of the model once, the embedding rows of its token and position, and every cached key
and value (or latent) of every layer; on a GPU that reading, not the arithmetic, sets
the speed of decoding. So

    seconds per step >= (weight bytes + cache bytes) / memory bandwidth

and a batch of B requests shares the weights: each of its tokens costs weights / B plus
its own cache. floats_read counts a step's reads by formula for any deep_model shape (the
lesson's model is the shape LESSON); the tests count them in the real steps with
instruments.count_reads. The bound for real models comes from their published sizes.
"""
from deep_model import DEEP_SHAPES, heads_of, init_params
from latent_attention import LATENT_SHAPES, cache_floats
from model import CONTEXT, VOCAB_SIZE, WIDTH

LESSON = {"layers": 1, "heads": 1, "kv_heads": 1, "width": WIDTH, "positions": "learned",
          "latent": None, "rotary_key": 0}   # model.py's model (its MLP 4 x width wide too)


def floats_read(shape, held, path="cached"):
    """The distinct numbers one decode step reads from memory with held positions
    cached before it: {"weights": ..., "cache": ...}. Weights: the embedding rows of its
    token (and position), every matrix and vector of every layer that the path uses, and
    the output layer. Cache: every held key and value, or latent and rotary key (its own
    new ones it computes, and does not read). path as latent_attention.multiply_adds
    takes it: "cached", "rebuilt" or "absorbed"."""
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


# Published sizes, for the bound (2 bytes a number unless said):
# Llama-2-7B: 6.74 billion parameters (Touvron et al., 2023), 32 layers of 32 key-value
# heads of 128. Llama-2-70B: 69 billion, 80 layers of 8 key-value heads of 128; gpt-fast
# ran it with 8-bit weights. An A100-80GB (SXM) reads 2,039 GB/s (NVIDIA's data sheet).
# gpt-fast's README measured, on an A100-80GB at batch 1: Llama-2-7B 104.9 tokens/s at
# 1,397.31 GB/s achieved, Llama-2-70B (8-bit) 19.13 tokens/s at 1,322.58 GB/s.
A100_BYTES_PER_SECOND = 2039e9
LLAMA_2_7B = {"model": "Llama-2-7B", "weight_bytes": 6.74e9 * 2, "layers": 32, "kv_heads": 32,
              "measured_tokens_per_second": 104.9, "measured_gb_per_s": 1397.31}
LLAMA_2_70B_8_BIT = {"model": "Llama-2-70B, 8-bit weights", "weight_bytes": 69e9 * 1,
                     "layers": 80, "kv_heads": 8, "measured_tokens_per_second": 19.13,
                     "measured_gb_per_s": 1322.58}
# Llama-2-7B's weights with other caches (heads of 128, 32 layers): grouped-query with 8
# key-value heads (as Llama-3-8B's), multi-query, and DeepSeek-V2's latent of 512 and
# rotary key of 64.
DESIGNS = (("multi-head, 32 key-value heads (its own)", {"kv_heads": 32}),
           ("grouped-query, 8 key-value heads", {"kv_heads": 8}),
           ("multi-query, 1 key-value head", {"kv_heads": 1}),
           ("latent 512 + rotary key 64", {"latent": 512, "rotary_key": 64}))


def cache_bytes_per_token(model):
    """A model's cache in bytes a token, 2 a number: a key and a value of 128 numbers per
    key-value head and layer, or a latent and a rotary key per layer."""
    return 2 * cache_floats(model["layers"], model.get("kv_heads"), 128, model.get("latent"),
                            model.get("rotary_key", 0))


def bound(model, context, batch=1, bandwidth=A100_BYTES_PER_SECOND):
    """The most tokens a second that a batch of batch requests, each at this context,
    can decode in all: bandwidth / (weights / batch + one request's cache), since a step
    reads the weights once for the batch and each request's own cache."""
    return bandwidth / (model["weight_bytes"] / batch + context * cache_bytes_per_token(model))


def cache_outweighs_weights(model, batch):
    """The shortest context at which a request's cache outweighs its share of the weights
    in a batch of batch requests."""
    return int(model["weight_bytes"] / batch // cache_bytes_per_token(model)) + 1


# ---- the experiment (a stage of trace_kv.py) ---------------------------------------

HELD = (0, 16, CONTEXT - 1)


def experiment(lab):
    """Numbers read by one decode step: the lesson's model at HELD cached positions, and
    every deep_model and latent shape of Part 4 with a full context held, with the batch
    size at which each one's cache outweighs its share of the weights."""
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
