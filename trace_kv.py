"""The lab's experiment: run the uncached and the cached generator on the openings of
the 60 test stories, prove they agree bit for bit, and count the work each one does.

    python3 trace_kv.py            runs it and prints the record
    python3 trace_kv.py --check    also fails if the record differs from kv-trace.json
    python3 trace_kv.py --write    rewrites kv-trace.json and kv-time.json

kv-trace.json holds only what any machine reproduces exactly (results and counts);
kv-time.json holds wall-clock times, which vary, and is never compared.
"""
import argparse
import contextlib
import functools
import json
import os
import platform
import sys
import time
from math import fsum
from operator import add, mul

import model
from checkpoint import write_atomically
from generate import generate, load_trained
from kv_cache import KVCache, forward_step, generate_cached
from train import split_stories

TRACE, TIMES = "kv-trace.json", "kv-time.json"
LENGTHS = (8, 16, 32, 64)


def work(prompt_tokens, generated_tokens):
    """Rows and attention scores each generator computes for a prompt of prompt_tokens
    tokens and generated_tokens chosen tokens (one model call per chosen token)."""
    for name, value in (("prompt_tokens", prompt_tokens), ("generated_tokens", generated_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    # Without the cache, call s runs the model on all n = prompt_tokens + s tokens in hand.
    calls = range(prompt_tokens, prompt_tokens + generated_tokens)
    # With it, every position is fed once, except the last chosen token (never fed back).
    fed = prompt_tokens + generated_tokens - 1 if generated_tokens else 0
    return {
        "uncached_rows": sum(calls),
        "cached_rows": fed,
        "uncached_scores": sum(n * (n + 1) // 2 for n in calls),   # row i has i + 1 scores
        "cached_scores": fed * (fed + 1) // 2,
    }


def openings(stories):
    """Each story's first sentence: the prompt the generators continue."""
    return [story.split(". ")[0] + "." for story in stories]


def prefill(params, ids):
    """A new cache holding the keys and values of ids."""
    cache = KVCache(params)
    for position, token_id in enumerate(ids):
        forward_step(params, cache, token_id, position)
    return cache


def cached_rows(params, ids, step=forward_step):
    """The logits of every position of ids, fed one at a time through a new cache."""
    cache = KVCache(params)
    return [step(params, cache, t, i) for i, t in enumerate(ids)]


def largest_gap(rows, other_rows):
    """The largest difference between any two corresponding logits."""
    return max(abs(a - b) for row, other in zip(rows, other_rows) for a, b in zip(row, other))


def _bare_sum_pairs(params, ids):
    """The operand pairs of every fsum a cached pass over ids does: each matrix column,
    each attention score, the softmax's sum, each mixing sum, and the two sums of each
    layer norm (the softmax and layer-norm sums stood for by sums of products as long)."""
    _, saved = model.forward(params, ids)
    cols = KVCache(params).columns
    pairs, keys, values = [], [], []
    for x0, h1, q, k, v, weights, mixed, x1, h2, a, x2, hf in saved:
        keys.append(k)
        values.append(v)
        for x, matrices in ((h1, ("Wq", "Wk", "Wv")), (mixed, ("Wo",)), (h2, ("W1",)),
                            (a, ("W2",)), (hf, ("W_out",))):
            pairs += [(x, col) for name in matrices for col in cols[name]]
        pairs += [(q, key) for key in keys] + [(weights, weights)]
        pairs += [(weights, list(column)) for column in zip(*values)]
        pairs += [(x, x) for x in (x0, x0, x1, x1, x2, x2)]
    return pairs


def speed_of_a_row(params, ids, repeats=20):
    """Seconds for forward_step over ids, and for only the fsum calls those rows need,
    measured in turns so that both see the same machine."""
    pairs = _bare_sum_pairs(params, ids)
    steps = bare = 0.0
    for cache in [KVCache(params) for _ in range(repeats)]:
        start = time.perf_counter()
        for position, token_id in enumerate(ids):
            forward_step(params, cache, token_id, position)
        middle = time.perf_counter()
        for a, b in pairs:
            fsum(map(mul, a, b))
        steps += middle - start
        bare += time.perf_counter() - middle
    return steps, bare


def compare_on_openings(params, tok, prompts):
    """Both generators on every prompt, greedy and sampled (temperature 1.0, seed = the
    prompt's index): the uncached results, how many cached ones are identical, the work
    and the greedy seconds of each path."""
    greedy, sampled, identical = [], [], {"greedy": 0, "sampled": 0}
    seconds = {"uncached": 0.0, "cached": 0.0}
    total = dict.fromkeys(work(1, 1), 0)
    for index, prompt in enumerate(prompts):
        start = time.perf_counter()
        uncached = generate(params, tok, prompt)
        middle = time.perf_counter()
        cached = generate_cached(params, tok, prompt)
        seconds["uncached"] += middle - start
        seconds["cached"] += time.perf_counter() - middle
        greedy.append(uncached)
        identical["greedy"] += cached == uncached
        for key, count in work(len(tok.encode(prompt)), len(uncached["steps"])).items():
            total[key] += count
        sampled.append(generate(params, tok, prompt, temperature=1.0, seed=index))
        identical["sampled"] += sampled[-1] == generate_cached(params, tok, prompt,
                                                               temperature=1.0, seed=index)
    return greedy, sampled, identical, total, seconds


@contextlib.contextmanager
def sums_in_another_order():
    """Inside this block the model adds its terms one by one, last term first, instead of
    with one correctly rounded fsum: the same numbers, summed in another order."""
    exact = model.fsum
    model.fsum = lambda terms: functools.reduce(add, reversed(list(terms)), 0.0)
    try:
        yield
    finally:
        model.fsum = exact


def share_prefixes(params, tok, prompts, greedy, sampled):
    """Prefill each opening once and continue it three ways (greedy, sampled, top-k 3)
    from that cache; each must equal the run without a shared cache."""
    identical, without, shared = 0, 0, 0
    for index, prompt in enumerate(prompts):
        ids = tok.encode(prompt)
        cache = prefill(params, ids)
        top_k = {"temperature": 1.0, "top_k": 3, "seed": index}
        identical += generate_cached(params, tok, prompt, cache=cache) == greedy[index]
        identical += generate_cached(params, tok, prompt, temperature=1.0, seed=index,
                                     cache=cache) == sampled[index]
        identical += (generate_cached(params, tok, prompt, cache=cache, **top_k)
                      == generate_cached(params, tok, prompt, **top_k))
        without += 3 * len(ids)       # each run prefills the whole opening
        shared += len(ids) + 3        # one prefill, then each run feeds the last token again
    return {"runs": 3 * len(prompts), "identical": identical,
            "prompt_rows_without_sharing": without, "prompt_rows_with_sharing": shared}


def never_ending(params, tok):
    """A copy of params whose newline score is so low that no story ever ends."""
    changed = dict(params, b_out=list(params["b_out"]))
    changed["b_out"][tok.ids["\n"]] = -1e9
    return changed


def cost_by_length(params, tok):
    """Rows, scores and seconds of both generators from a one-token prompt ("mia") to
    8, 16, 32 and 64 positions, with a copy of the model that never ends a story."""
    never_ends = never_ending(params, tok)
    counts, seconds = [], []
    for length in LENGTHS:
        start = time.perf_counter()
        generate(never_ends, tok, "mia", max_new_tokens=length - 1)
        middle = time.perf_counter()
        generate_cached(never_ends, tok, "mia", max_new_tokens=length - 1)
        end = time.perf_counter()
        counts.append({"positions": length, **work(1, length - 1)})
        seconds.append({"positions": length, "uncached_seconds": round(middle - start, 4),
                        "cached_seconds": round(end - middle, 4),
                        "speedup": round((middle - start) / (end - middle), 1)})
    return counts, seconds


def cache_bytes(params, ids):
    """Bytes CPython uses for a cache holding ids: the lists and every float object."""
    cache = prefill(params, ids)
    rows = cache.keys + cache.values
    return (sys.getsizeof(cache.keys) + sys.getsizeof(cache.values)
            + sum(sys.getsizeof(r) + sum(sys.getsizeof(x) for x in r) for r in rows))


def run():
    """Both generators on the 60 test openings: (record, timing)."""
    params, tok = load_trained()
    with open("corpus.txt", encoding="utf-8") as f:
        _, _, test = split_stories(f.read())
    prompts = openings(test)
    first_story = tok.encode(test[0])
    full_context = [t for story in test for t in tok.encode(story)][:model.CONTEXT]

    greedy, sampled, identical, total, seconds = compare_on_openings(params, tok, prompts)
    full, _ = model.forward(params, first_story)
    with sums_in_another_order():
        reordered = cached_rows(params, first_story)
        reordered_identical = sum(generate_cached(params, tok, prompt) == result
                                  for prompt, result in zip(prompts, greedy))
    by_length, seconds_by_length = cost_by_length(params, tok)
    record = {
        "stories": len(prompts),
        "largest_logit_gap_first_story": largest_gap(full, cached_rows(params, first_story)),
        "positions_checked": len(first_story),
        "greedy_identical": identical["greedy"],
        "sampled_identical": identical["sampled"],
        "greedy_ended_with_newline": sum(r["stopped"] == "end of story" for r in greedy),
        "generated_tokens": sum(len(r["steps"]) for r in greedy),
        "work": total,
        "rows_ratio": round(total["uncached_rows"] / total["cached_rows"], 2),
        "scores_ratio": round(total["uncached_scores"] / total["cached_scores"], 2),
        "cache_floats_per_position": 2 * model.WIDTH,
        "cache_floats_full_context": 2 * model.WIDTH * model.CONTEXT,
        "greedy_examples": [r["text"] for r in greedy[:3]],
        "prefix_sharing": share_prefixes(params, tok, prompts, greedy, sampled),
        "cost_by_length": by_length,
        "sums_in_another_order": {"largest_logit_gap_first_story": largest_gap(full, reordered),
                                  "greedy_identical": reordered_identical},
    }
    step_seconds, bare_seconds = speed_of_a_row(params, first_story)
    memory = cache_bytes(params, full_context)
    timing = {
        "uncached_seconds": round(seconds["uncached"], 3),
        "cached_seconds": round(seconds["cached"], 3),
        "speedup": round(seconds["uncached"] / seconds["cached"], 2),
        "uncached_microseconds_per_row":
            round(seconds["uncached"] / total["uncached_rows"] * 1e6, 1),
        "cached_microseconds_per_row": round(seconds["cached"] / total["cached_rows"] * 1e6, 1),
        "forward_step_over_bare_fsum": round(step_seconds / bare_seconds, 2),
        "cost_by_length": seconds_by_length,
        "cache_bytes_full_context": memory,
        "cache_bytes_per_position": memory // model.CONTEXT,
        "cache_bytes_as_8_byte_floats": 8 * 2 * model.WIDTH * model.CONTEXT,
        "machine": f"{platform.platform()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
    }
    return record, timing


def _dumps(data):
    return json.dumps(data, indent=2) + "\n"


def save_records(record, timing):
    """Write kv-trace.json and kv-time.json in the current folder, each atomically."""
    write_atomically(TRACE, _dumps(record))
    write_atomically(TIMES, _dumps(timing))


def read_record(path=TRACE):
    """The recorded trace in path, or a ValueError that says how to make one."""
    try:
        with open(path, encoding="utf-8") as f:
            recorded = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} ({e}); "
                         f"run python3 trace_kv.py --write to record it") from None
    if not isinstance(recorded, dict):
        raise ValueError(f"{path} does not hold a record (a JSON object); "
                         f"run python3 trace_kv.py --write to record it")
    return recorded


def differing_keys(record, recorded):
    """The keys whose values differ between two records, sorted."""
    return sorted(k for k in set(record) | set(recorded) if record.get(k) != recorded.get(k))


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Run the uncached and cached generators on the 60 test openings.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help=f"exit non-zero if the record differs from {TRACE}")
    mode.add_argument("--write", action="store_true", help=f"rewrite {TRACE} and {TIMES}")
    args = parser.parse_args(argv)
    try:
        recorded = read_record() if args.check else None   # fail before the long run
        record, timing = run()
    except (OSError, ValueError) as e:
        sys.exit(f"trace_kv.py: error: {e}")
    print(_dumps(record), end="")
    print(f"time: uncached {timing['uncached_seconds']} s, cached {timing['cached_seconds']} s "
          f"(speed-up {timing['speedup']}x; rows ratio {record['rows_ratio']}x); "
          f"forward_step takes {timing['forward_step_over_bare_fsum']}x its bare fsum calls; "
          f"{timing['machine']}, Python {timing['python']}")
    if args.write:
        save_records(record, timing)
        print(f"wrote {TRACE} and {TIMES}")
    elif args.check:
        differ = differing_keys(record, recorded)
        if differ:
            sys.exit(f"trace_kv.py: {TRACE} differs from this run in: {', '.join(differ)}")
        print(f"{TRACE} matches this run")


if __name__ == "__main__":
    main()
