"""What one GPU does with a model (Part 5, sections 30 and 31): how long its first token
takes, and how many requests its memory holds.

A prefill runs a prompt of n tokens in one pass, so each weight it reads serves n rows;
a decode step computes one row and reads every weight and the whole cache for it
(section 29). A pass takes at least as long as its arithmetic at the GPU's peak rate, and
at least as long as its reading at the memory's bandwidth (the roofline):

    seconds >= max(FLOPs / rate, bytes read / bandwidth)

Which of the two binds is said by the pass's arithmetic intensity, its FLOPs per byte
read, against the GPU's ridge point, rate / bandwidth: a decode step does about one FLOP a
byte, a prefill of n tokens about n. What the memory holds besides the weights is cache:

    tokens   = (utilization x memory - weight bytes) // cache bytes a token
    requests = tokens // tokens each

The lab's model is counted from the rows and scores its prefill and decode compute
(kv_cache.work, latent_attention.multiply_adds, bandwidth.floats_read); real models from
the shapes in their config.json, with bandwidth.py's formulas.
"""
import math
import svg

from bandwidth import (A100_BYTES_PER_SECOND, CONTEXT_WINDOWS, LESSON, LLAMA_2_7B,
                       cache_bytes_per_token, floats_read, llama_parameters,
                       weight_bytes_read)
from documents import table
from kv_cache import work
from latent_attention import multiply_adds
from model import check_int, excerpt

# NVIDIA's A100 data sheet, the 80 GB SXM card: 312 TFLOPS of dense 16-bit (BF16 or FP16)
# tensor arithmetic (624 with 2:4 sparsity, which a dense model does not use), 2,039 GB/s,
# 80 GB of HBM2e (nvidia-smi shows 81,920 MiB: 80 GiB).
A100 = {"gpu": "A100 80GB SXM", "flops_per_second": 312e12,
        "bytes_per_second": A100_BYTES_PER_SECOND, "memory_bytes": 80 * 2 ** 30}
# Hugging Face's config.json of meta-llama/Llama-3.1-8B: 32 layers of width 4,096 (32
# query heads of 128), 8 key-value heads, an MLP 14,336 wide, 128,256 tokens, input and
# output embeddings apart, a context of 131,072 tokens (max_position_embeddings), bf16:
# 8,030,261,248 parameters (the model card's 8.03 billion). Llama-2-7B: bandwidth.py's.
LLAMA_3_1_8B = {"model": "Llama-3.1-8B", "layers": 32, "width": 4096, "kv_heads": 8,
                "mlp_width": 14336, "vocab": 128256, "bytes_per_number": 2,
                "context_window": 131072}
LLAMA_3_1_8B["weight_bytes_read"] = weight_bytes_read(LLAMA_3_1_8B)
MODELS = ({**LLAMA_2_7B, "context_window": CONTEXT_WINDOWS["Llama-2-7B"]}, LLAMA_3_1_8B)
VLLM_UTILIZATION = 0.9   # vLLM's default gpu_memory_utilization


# ---- the lab's model: what a pass computes and reads --------------------------------

def prefill_multiply_adds(shape, prompt_tokens):
    """Products summed by a one-pass prefill of prompt_tokens tokens into an empty cache.

    The prefill is prefill.prefill's; the cache, of a deep_model shape that caches keys and
    values. Counted: kv_cache.work's rows, each what a decode step attending to no position
    computes, and its scores, each a query's products with one key and one value
    (latent_attention.multiply_adds)."""
    check_int("prompt_tokens", prompt_tokens, 1)
    fed = work(prompt_tokens, 1)   # the cached generator feeds the prompt, chooses one token
    per_row = multiply_adds(shape, 0, "cached")
    per_score = multiply_adds(shape, 1, "cached") - per_row
    return fed["cached_rows"] * per_row + fed["cached_scores"] * per_score


def pass_numbers_read(shape, new_tokens, held=0):
    """The distinct numbers a pass of new_tokens tokens reads, held positions cached before it.

    bandwidth.floats_read's (every weight once, and the held keys and values), and the
    embedding row (and position row) of each token after the first. The keys and values it
    computes itself it does not read."""
    check_int("new_tokens", new_tokens, 1)
    read = floats_read(shape, held)
    rows = shape["width"] * (2 if shape["positions"] == "learned" else 1)
    return read["weights"] + (new_tokens - 1) * rows + read["cache"]


# ---- a real model on a GPU: the first token ----------------------------------------

def prefill_flops(model, prompt_tokens):
    """FLOPs (2 a multiply-add) of a prefill of prompt_tokens tokens.

    Each token multiplies every matrix of every layer; the output layer runs for the last
    token only (its scores choose the next token); in each layer, the token at position i
    scores i + 1 keys and sums as many values, width products each. Norms, turns and
    softmax are not counted."""
    _check_model(model)
    check_int("prompt_tokens", prompt_tokens, 1)
    layers, width, n = model["layers"], model["width"], prompt_tokens
    output = model["vocab"] * width
    matrices = llama_parameters(model) - 2 * output - (2 * layers + 1) * width   # no norms
    return 2 * (n * matrices + output + layers * width * n * (n + 1))


def pass_bytes(model, prompt_tokens):
    """Bytes a prefill of prompt_tokens tokens reads.

    What a decode step reads of the weights (bandwidth.weight_bytes_read), and the
    embedding rows of its other tokens."""
    _check_model(model)
    check_int("prompt_tokens", prompt_tokens, 1)
    return model["weight_bytes_read"] + (prompt_tokens - 1) * model["width"] * model[
        "bytes_per_number"]


def ridge_point(gpu=A100):
    """The FLOPs a byte read from which a pass is bound by arithmetic: rate / bandwidth."""
    _check_gpu(gpu)
    return gpu["flops_per_second"] / gpu["bytes_per_second"]


def prefill_seconds(model, prompt_tokens, gpu=A100):
    """The least a prefill of prompt_tokens tokens takes on gpu.

    Its FLOPs at the peak rate, or its bytes at the bandwidth, whichever is longer."""
    _check_gpu(gpu)
    return max(prefill_flops(model, prompt_tokens) / gpu["flops_per_second"],
               pass_bytes(model, prompt_tokens) / gpu["bytes_per_second"])


def decode_seconds(model, context, gpu=A100):
    """The least a decode step with context tokens cached takes on gpu.

    The weights it reads and its cache at the bandwidth (section 29's bound at batch 1)."""
    _check_model(model)
    check_int("context", context, 0)
    _check_gpu(gpu)
    return ((model["weight_bytes_read"] + context * cache_bytes_per_token(model))
            / gpu["bytes_per_second"])


def tokens_to_the_ridge(model, gpu=A100):
    """The shortest prompt whose prefill does at least the ridge point's FLOPs a byte."""
    ridge, n = ridge_point(gpu), 1
    while prefill_flops(model, n) < ridge * pass_bytes(model, n):
        n += 1
    return n


# ---- a real model on a GPU: the requests its memory holds ---------------------------

def weight_bytes(model):
    """The bytes of all of a model's weights: llama_parameters at its bytes a number."""
    _check_model(model)
    return llama_parameters(model) * model["bytes_per_number"]


def bytes_left(model, gpu=A100, utilization=VLLM_UTILIZATION):
    """The bytes left for the cache: utilization of the GPU's memory, less the weights.

    Negative if they do not fit; activations, CUDA graphs and the CUDA context are not
    counted."""
    _check_gpu(gpu)
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) \
            or not 0 < utilization <= 1:
        raise ValueError(f"utilization must be a fraction of the memory, > 0 and <= 1, got "
                         f"{excerpt(utilization)}")
    return math.floor(utilization * gpu["memory_bytes"]) - weight_bytes(model)


def tokens_that_fit(model, gpu=A100, utilization=VLLM_UTILIZATION):
    """The tokens of cache the bytes left hold, 2 bytes a number.

    0 if the weights do not fit."""
    return max(0, bytes_left(model, gpu, utilization) // cache_bytes_per_token(model))


def requests_that_fit(model, tokens_each, gpu=A100, utilization=VLLM_UTILIZATION):
    """How many requests of tokens_each tokens the cache holds at once.

    None if that is beyond the model's context window."""
    check_int("tokens_each", tokens_each, 1)
    tokens = tokens_that_fit(model, gpu, utilization)
    return None if tokens_each > model.get("context_window", math.inf) else tokens // tokens_each


def _check_model(model):
    """Refuse a model that is not a dict of a Llama's shape as LLAMA_3_1_8B."""
    keys = {"layers", "width", "kv_heads", "mlp_width", "vocab", "bytes_per_number",
            "weight_bytes_read"}
    if not isinstance(model, dict) or not keys <= set(model):
        raise ValueError(f"model must be a dict as one_gpu.LLAMA_3_1_8B: its "
                         f"{', '.join(sorted(keys))}")


def _check_gpu(gpu):
    """Refuse a gpu that is not a dict as A100, of rates and sizes > 0."""
    keys = ("flops_per_second", "bytes_per_second", "memory_bytes")
    if not isinstance(gpu, dict) or not all(
            not isinstance(gpu.get(key), bool) and isinstance(gpu.get(key), (int, float))
            and 0 < gpu[key] < math.inf for key in keys):
        raise ValueError(f"gpu must be a dict as one_gpu.A100: its {', '.join(keys)}, each a "
                         f"number > 0")


# ---- the experiment (a stage of trace_kv.py) ---------------------------------------

PROMPTS = (1000, 10000)          # tokens, for the first token
REQUEST_LENGTHS = (4096, 32768)  # tokens each request holds, for the memory


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "one_gpu": {
        "lesson": dict.fromkeys(
            ("prompts", "prompt_tokens", "prefill_multiply_adds", "prefill_numbers_read",
             "decode_multiply_adds", "decode_numbers_read"), svg.COUNT),
        "models": [{
            "model": str, "kv_heads": svg.COUNT,
            **dict.fromkeys(("prefill_seconds", "decode_seconds", "requests"),
                            [(*svg.COUNT, None)]),
            **dict.fromkeys(("tokens_to_the_ridge", "weight_bytes", "bytes_left",
                             "cache_kib_per_token", "tokens_that_fit"), svg.COUNT)}]},
}


def experiment(lab):
    """Measure prefill against decode for the lab's model, and the real models on an A100.

    The lab's model: the 60 openings' prompts prefilled one pass each, against the first
    decode step after each, in multiply-adds and numbers read. The real models on an A100:
    the least their prefill of PROMPTS and the decode step after it take, the prompt from
    which a prefill is bound by arithmetic, and the requests of REQUEST_LENGTHS their cache
    holds (None beyond a model's context)."""
    lengths = [len(lab.tok.encode(prompt)) for prompt in lab.prompts]
    lesson = {"prompts": len(lengths), "prompt_tokens": sum(lengths),
              "prefill_multiply_adds": sum(prefill_multiply_adds(LESSON, p) for p in lengths),
              "prefill_numbers_read": sum(pass_numbers_read(LESSON, p) for p in lengths),
              "decode_multiply_adds": sum(multiply_adds(LESSON, p + 1, "cached")
                                          for p in lengths),
              "decode_numbers_read": sum(pass_numbers_read(LESSON, 1, p) for p in lengths)}
    models = []
    for model in MODELS:
        within = [n <= model["context_window"] for n in PROMPTS]
        models.append({
            "model": model["model"], "kv_heads": model["kv_heads"],
            "prefill_seconds": [prefill_seconds(model, n) if ok else None
                                for n, ok in zip(PROMPTS, within)],
            "decode_seconds": [decode_seconds(model, n) if ok else None
                               for n, ok in zip(PROMPTS, within)],
            "tokens_to_the_ridge": tokens_to_the_ridge(model),
            "weight_bytes": weight_bytes(model), "bytes_left": bytes_left(model),
            "cache_kib_per_token": cache_bytes_per_token(model) // 1024,
            "tokens_that_fit": tokens_that_fit(model),
            "requests": [requests_that_fit(model, n) for n in REQUEST_LENGTHS]})
    return {"lesson": lesson, "models": models}


# ---- what Part 5 shows of it (documents.py fills its marks) --------------------------

def _model(entry):
    return next(model for model in MODELS if model["model"] == entry["model"])


def _entries(record):
    """The record's one_gpu.models, checked as declared, each one of MODELS' with its figures.

    As many figures for each of PROMPTS and of REQUEST_LENGTHS as they hold."""
    entries = svg.checked(record, RECORDS)["one_gpu"]["models"]
    for i, entry in enumerate(entries):
        where = f"the record's one_gpu.models[{i}]"
        if entry["model"] not in [model["model"] for model in MODELS]:
            raise ValueError(f"{where}.model is {entry['model'][:100]!r}, not one of MODELS'")
        for key, count in (("prefill_seconds", len(PROMPTS)), ("decode_seconds", len(PROMPTS)),
                           ("requests", len(REQUEST_LENGTHS))):
            if len(entry[key]) != count:
                raise ValueError(f"{where}.{key} holds {len(entry[key])} figures, not {count}")
    return entries


def _name(entry):
    heads = _model(entry)["width"] // 128
    kind = "multi-head" if entry["kv_heads"] == heads else f"grouped-query, {entry['kv_heads']}"
    return f"{entry['model']} ({kind})"


def _beyond(entry):
    return f"beyond its {_model(entry)['context_window']:,}-token context"


def first_token_table(record, timing):
    """Section 30's table: the real models' least prefill and decode step, and their ridge."""
    rows = []
    for entry in _entries(record):
        cells = [_name(entry)]
        for prefill, decode in zip(entry["prefill_seconds"], entry["decode_seconds"]):
            cells += ([f"{prefill * 1e3:,.1f} ms", f"{decode * 1e3:.2f} ms"]
                      if None not in (prefill, decode) else [_beyond(entry), "—"])
        rows.append(cells + [f"{entry['tokens_to_the_ridge']} tokens"])
    header = [f"model, on an {A100['gpu']}"]
    for n in PROMPTS:
        header += [f"prefill of {n:,} tokens", "a decode step after it"]
    return table(header + ["a prefill bound by arithmetic from"], rows)


def fit_table(record, timing):
    """Section 31's table: each real model's weights, memory left, and requests that fit."""
    rows = []
    for entry in _entries(record):
        rows.append([_name(entry), f"{entry['weight_bytes'] / 2 ** 30:.2f} GiB",
                     f"{entry['bytes_left'] / 2 ** 30:.2f} GiB",
                     f"{entry['cache_kib_per_token']} KiB", f"{entry['tokens_that_fit']:,}",
                     *(f"{n:,}" if n is not None else _beyond(entry)
                       for n in entry["requests"])])
    return table(["model, 16-bit", "weights",
                  f"left at {VLLM_UTILIZATION} of {A100['memory_bytes'] // 2 ** 30} GiB",
                  "cache a token", "tokens that fit",
                  *(f"requests of {n:,} tokens" for n in REQUEST_LENGTHS)], rows)


def _by_kv_heads(record, kv_heads):
    return next(m for m in record["one_gpu"]["models"] if m["kv_heads"] == kv_heads)


def lesson_prefill_rate(record, timing):
    """The lab's prefills' multiply-adds for each number they read."""
    lesson = record["one_gpu"]["lesson"]
    return f"{lesson['prefill_multiply_adds'] / lesson['prefill_numbers_read']:.1f}"


def lesson_decode_rate(record, timing):
    """The lab's first decode steps' multiply-adds for each number they read."""
    lesson = record["one_gpu"]["lesson"]
    return f"{lesson['decode_multiply_adds'] / lesson['decode_numbers_read']:.2f}"


def ridge(record, timing):
    """The A100's ridge point, in FLOPs a byte."""
    return f"{ridge_point():.0f}"


def decode_steps_a_prefill_takes(record, timing):
    """How many of Llama-3.1-8B's decode steps last as long as its prefill of each of PROMPTS."""
    grouped = _by_kv_heads(record, 8)
    return " and ".join(f"{prefill / decode:.0f}" for prefill, decode
                        in zip(grouped["prefill_seconds"], grouped["decode_seconds"]))


def attention_share_of_the_longest_prefill(record, timing):
    """Attention's share of the FLOPs of Llama-3.1-8B's longest prefill of PROMPTS."""
    n, model = PROMPTS[-1], LLAMA_3_1_8B
    return format(2 * model["layers"] * model["width"] * n * (n + 1) / prefill_flops(model, n),
                  ".0%")


def grouped_tokens_over_multi_head(record, timing):
    """How many times as many tokens of cache an A100 holds for Llama-3.1-8B as for Llama-2-7B."""
    grouped, multi_head = _by_kv_heads(record, 8), _by_kv_heads(record, 32)
    return f"{grouped['tokens_that_fit'] / multi_head['tokens_that_fit']:.1f}"
