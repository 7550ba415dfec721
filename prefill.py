"""One-pass prefill (Part 2, section 15): a prompt's tokens in one call instead of one
forward_step each, as servers prefill. The rows are computed together by
batched.forward_rows: every new position's key and value join the cache's own first; then
new position i attends to positions 0..i, the causal mask offset by what the cache already
held. The rows are forward_step's, bit for bit: each is still the same operations in the
same order.
"""
import sys
from itertools import accumulate

import batched
import generate
import model
import svg
from instruments import largest_gap, recording, results
from kv_cache import KVCache, check_cache, held_prefix

CHUNKS = (1, 4, 8)   # the experiment's chunk sizes, tokens per call (test_prefill: 2 too)


def prefill(params, cache, token_ids, start):
    """Compute the next-token logits for each of token_ids in one pass, as servers prefill.

    The positions are start, start + 1, ...; the rows are batched.forward_rows's, one item a
    token (each new position i attends to positions 0..i, the causal mask offset by the
    start). start must be the number of positions the cache holds."""
    check_cache(cache, params)
    if not model.is_int(start) or start != len(cache):
        raise ValueError(f"expected start {len(cache)}, got {start!r}: the cache holds "
                         f"{len(cache)} positions, so new tokens start at position "
                         f"{len(cache)} (an int)")
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        raise ValueError(f"token_ids must be a non-empty list of token IDs, got {token_ids!r}")
    if start + len(token_ids) > model.CONTEXT:
        raise ValueError(f"positions {start} to {start + len(token_ids) - 1} go beyond the "
                         f"{model.CONTEXT} positions of the model's table")
    for index, token_id in enumerate(token_ids):
        model.check_token_id(token_id, f"token_ids[{index}] =")
    if not cache.keeps_every_position:
        raise ValueError(f"prefill needs a cache that keeps every position, and a "
                         f"{type(cache).__name__} drops some; feed it one token at a time")
    if not cache.fixed_once_kept:
        raise ValueError(f"a {type(cache).__name__} changes the keys and values it holds "
                         f"when it quantizes a group, so rows prefilled together would read "
                         f"them otherwise than one at a time; feed it one token at a time")
    return batched.forward_rows(params, [(cache, token_id, i)
                                         for i, token_id in enumerate(token_ids, start)])


def prefill_in_chunks(params, cache, ids, size):
    """Feed the tokens of ids that the cache does not hold yet, size at a time.

    One prefill call per chunk (servers call it chunked prefill); gives the logits of each.
    A refused chunk (a pool out of blocks) leaves the chunks before it in the cache."""
    model.check_int("chunk size", size, 1)
    check_cache(cache, params)
    return [logits for first in range(held_prefix(cache, ids), len(ids), size)
            for logits in prefill(params, cache, ids[first:first + size], first)]


def generate_one_pass(params, tok, prompt, max_new_tokens=60, temperature=0.0, top_k=None,
                      seed=0):
    """Generate as generate_cached does, with the whole prompt prefilled in one call.

    One call of prefill for the prompt, then one token per call: the same arguments and
    result as generate.generate."""
    cache = KVCache(params)
    ids = generate.check_request(tok, prompt, max_new_tokens, temperature, top_k, seed)

    def next_logits(ids):
        return prefill_in_chunks(params, cache, ids, model.CONTEXT)[-1]
    return generate.generate_with(next_logits, tok, ids, max_new_tokens, temperature, top_k,
                                  seed)


# ---- the experiment (a stage of trace_kv.py) ---------------------------------------

# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "one_pass_prefill": {
        "positions_compared_by_chunk": dict.fromkeys(("1", "4", "8", "whole prompt"),
                                                     svg.COUNT),
        **dict.fromkeys(("largest_logit_gap", "greedy_identical",
                         "prompt_calls_one_token_at_a_time", "prompt_calls_one_pass"),
                        svg.COUNT)},
}


def experiment(lab, runs):
    """Check one-pass prefill: chunked prompts row by row, whole prompts story by story.

    The openings prefilled in chunks of CHUNKS tokens, one pass per chunk, and the greedy
    stories generated with the whole prompt in one pass: every row against the uncached full
    pass, every result against the uncached one."""
    params, tok, prompts = lab.params, lab.tok, lab.prompts
    positions, gap = {}, 0.0
    for size in CHUNKS:
        positions[str(size)] = 0
        for prompt, rows in zip(prompts, runs.greedy_rows):
            ids = tok.encode(prompt)
            chunked = prefill_in_chunks(params, KVCache(params), ids, size)
            gap = max(gap, largest_gap(chunked, rows[:len(ids)]))
            positions[str(size)] += len(ids)
    identical, positions["whole prompt"], prompt_calls = 0, 0, 0
    for prompt, result, rows in zip(prompts, runs.greedy, runs.greedy_rows):
        with recording(sys.modules[__name__], "prefill") as calls:
            identical += generate_one_pass(params, tok, prompt) == result
        fed = [logits for call in results(calls) for logits in call]   # prompt, then steps
        gap = max(gap, largest_gap(fed, rows))
        positions["whole prompt"] += len(fed)
        fed_by_call = accumulate(len(call.result) for call in calls)
        prompt_calls += next(n for n, total in enumerate(fed_by_call, 1)
                             if total >= len(tok.encode(prompt)))
    return {"positions_compared_by_chunk": positions, "largest_logit_gap": gap,
            "greedy_identical": identical,
            "prompt_calls_one_token_at_a_time": sum(len(tok.encode(p)) for p in prompts),
            "prompt_calls_one_pass": prompt_calls}
