"""Time on paper (Part 7, section 41): the time to a new request's first token and the
time between the running requests' tokens, on a GPU, for whole-prompt prefill, prefill in
chunks under a token budget, and prefill and decode on two servers.

The lab's steps count rows on this machine, where every row costs the same Python work;
a GPU's step does not. Its time is bounded below as in section 30 (the roofline): its
FLOPs at the peak rate, or the bytes it reads at the memory's bandwidth, whichever is
longer. A step that decodes B requests reads every weight once and each request's cache;
a step that also prefills adds the prompt's FLOPs, and soon the arithmetic binds. So:

    step seconds >= max(FLOPs / rate, (weight bytes + cache bytes read) / bandwidth)

These are bounds at peak rates for one stated workload, not measurements: no kernel
reaches its peak, and a real server queues, schedules and copies besides.
"""
import math

import svg
from bandwidth import cache_bytes_per_token
from documents import shown, table
from model import check_int
from one_gpu import A100, LLAMA_3_1_8B, prefill_flops

# The workload: Llama-3.1-8B on an A100 (section 30's), 16 requests decoding with 2,048
# tokens cached each, when a request with a prompt of 8,192 tokens arrives; a budget of
# 2,048 tokens a step; the two servers joined by a 200 Gb/s network link (25 GB/s each
# way, an HDR InfiniBand port's rate).
WORKLOAD = {"running": 16, "context": 2048, "prompt": 8192, "budget": 2048}
LINK_BYTES_PER_SECOND = 25e9


def step_seconds(model, rows, gpu=A100):
    """Give the least time a step of rows takes on gpu.

    rows holds, for each request in the step, (tokens it computes, tokens it had cached):
    (1, C) for a decode at context C, (c, h) for a chunk of c prompt tokens after h. The
    step's FLOPs are each request's share of one_gpu.prefill_flops (its tokens' rows and
    attention, and the output layer for its last token); it reads every weight once and
    each request's cached tokens."""
    flops = sum(prefill_flops(model, held + new) - prefill_flops(model, held) + 2 * model[
        "vocab"] * model["width"] if held else prefill_flops(model, new) for new, held in rows)
    read = model["weight_bytes_read"] + sum(held for _, held in rows) * cache_bytes_per_token(
        model)
    return max(flops / gpu["flops_per_second"], read / gpu["bytes_per_second"])


def chunks(prompt, budget, running):
    """The prompt's chunks under budget tokens a step beside running decode rows."""
    check_int("budget", budget, running + 1, None, " (a decode row a running request, and "
              "at least one prompt token)")
    size = budget - running
    return [min(size, prompt - start) for start in range(0, prompt, size)]


def times(model=LLAMA_3_1_8B, workload=WORKLOAD, gpu=A100, link=LINK_BYTES_PER_SECOND):
    """Give each way's time to the new request's first token and between the others' tokens.

    In seconds; between tokens usually and at worst. Whole prompt: one step computes the
    prompt beside the decodes. Chunks: the prompt goes in chunks(...) steps, each beside
    the decodes. Two servers: the prompt alone on a prefill GPU, then its cache over the
    link; the decode GPU's steps stay decode steps."""
    running, context, prompt = workload["running"], workload["context"], workload["prompt"]
    decodes = [(1, context)] * running
    usual = step_seconds(model, decodes, gpu)
    whole = step_seconds(model, [(prompt, 0)] + decodes, gpu)
    pieces = chunks(prompt, workload["budget"], running)
    chunked = [step_seconds(model, [(size, sum(pieces[:at]))] + decodes, gpu)
               for at, size in enumerate(pieces)]
    sent = prompt * cache_bytes_per_token(model) / link
    alone = step_seconds(model, [(prompt, 0)], gpu)
    return {"whole prompt": {"first_token": whole, "between_tokens": usual,
                             "between_tokens_at_worst": whole},
            "chunks": {"first_token": sum(chunked), "between_tokens": usual,
                       "between_tokens_at_worst": max(chunked)},
            "two servers": {"first_token": alone + sent, "between_tokens": usual,
                            "between_tokens_at_worst": usual}}


# ---- the experiment (a stage of trace_kv.py) ---------------------------------------

# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
_MS = {"first_token_ms": svg.COUNT, "between_tokens_ms": svg.COUNT,
       "between_tokens_at_worst_ms": svg.COUNT}
RECORDS = {"paper_times": {"workload": {"running": svg.COUNT, "context": svg.COUNT,
                                        "budget": svg.COUNT},
                           "chunk_steps": svg.COUNT, "transfer_ms": svg.COUNT,
                           "ways": {"whole prompt": _MS, "chunks": _MS, "two servers": _MS}}}


def experiment(lab):
    """The times of WORKLOAD's new request and running requests, each way, in milliseconds."""
    return {"workload": {key: WORKLOAD[key] for key in ("running", "context", "budget")},
            "chunk_steps": len(chunks(WORKLOAD["prompt"], WORKLOAD["budget"],
                                      WORKLOAD["running"])),
            "transfer_ms": 1e3 * WORKLOAD["prompt"] * cache_bytes_per_token(LLAMA_3_1_8B)
            / LINK_BYTES_PER_SECOND,
            "ways": {way: {f"{key}_ms": 1e3 * seconds for key, seconds in figures.items()}
                     for way, figures in times().items()}}


# ---- what Part 7 shows of it (documents.py fills its marks) --------------------------

def times_table(record, timing):
    """Section 41's table: the new request's first token and the others' tokens, each way."""
    ways = svg.checked(record, {"paper_times": RECORDS["paper_times"]})["paper_times"]["ways"]
    labels = {"whole prompt": "whole prompt, one GPU",
              "chunks": f"chunks of {WORKLOAD['budget'] - WORKLOAD['running']:,} tokens "
                        f"beside the decodes, one GPU",
              "two servers": "two servers: a prefill GPU, a decode GPU"}
    return table(["prefill", "new request's first token, ms", "others' time between tokens "
                  "in a step of decodes alone, ms", "others' longest wait between two tokens, "
                  "ms"],
                 [[labels[way], shown(w["first_token_ms"]), shown(w["between_tokens_ms"]),
                   shown(w["between_tokens_at_worst_ms"])] for way, w in ways.items()])
