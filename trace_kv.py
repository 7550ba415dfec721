"""The lab's experiment: run the uncached and the cached generator on the openings of
the 60 test stories, prove they agree bit for bit, and count the work each one does.

    python3 trace_kv.py            runs it and prints the record
    python3 trace_kv.py --check    also fails if the record differs from kv-trace.json
    python3 trace_kv.py --write    rewrites kv-trace.json and kv-time.json

kv-trace.json holds only what any machine reproduces exactly (results and counts);
kv-time.json holds wall-clock times, which vary, and is never compared.
"""
import argparse
import json
import platform
import sys
import time
from math import fsum
from operator import mul

import model
from checkpoint import write_atomically
from generate import generate, load_trained
from kv_cache import KVCache, forward_step, generate_cached
from train import split_stories

TRACE, TIMES = "kv-trace.json", "kv-time.json"


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


def largest_gap(params, ids):
    """The largest difference between any logit of the full forward pass and the cached one."""
    full, _ = model.forward(params, ids)
    cache = KVCache(params)
    cached = [forward_step(params, cache, t, i) for i, t in enumerate(ids)]
    return max(abs(a - b) for full_row, cached_row in zip(full, cached)
               for a, b in zip(full_row, cached_row))


def _bare_sum_pairs(params, ids):
    """The operand pairs of every fsum a cached pass over ids does: each matrix column,
    each attention score and mixing sum, and the two sums of each layer norm."""
    _, saved = model.forward(params, ids)
    cols = KVCache(params).columns
    pairs, keys, values = [], [], []
    for x0, h1, q, k, v, weights, mixed, x1, h2, a, x2, hf in saved:
        keys.append(k)
        values.append(v)
        for x, matrices in ((h1, ("Wq", "Wk", "Wv")), (mixed, ("Wo",)), (h2, ("W1",)),
                            (a, ("W2",)), (hf, ("W_out",))):
            pairs += [(x, col) for name in matrices for col in cols[name]]
        pairs += [(q, key) for key in keys]
        pairs += [(weights, list(column)) for column in zip(*values)]
        pairs += [(x, x) for x in (x0, x0, x1, x1, x2, x2)]
    return pairs


def speed_of_a_row(params, ids, repeats=20):
    """Seconds for forward_step over ids, and for only the fsum calls those rows need."""
    pairs = _bare_sum_pairs(params, ids)
    start = time.perf_counter()
    for _ in range(repeats):
        cache = KVCache(params)
        for position, token_id in enumerate(ids):
            forward_step(params, cache, token_id, position)
    steps = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(repeats):
        for a, b in pairs:
            fsum(map(mul, a, b))
    return steps, time.perf_counter() - start


def run():
    """Both generators on the 60 test openings: (record, timing)."""
    params, tok = load_trained()
    with open("corpus.txt", encoding="utf-8") as f:
        _, _, test = split_stories(f.read())
    prompts = openings(test)
    first_story = tok.encode(test[0])

    greedy = {"identical": 0, "ended": 0, "generated": 0, "examples": [],
              "seconds": {"uncached": 0.0, "cached": 0.0}}
    total = dict.fromkeys(work(1, 1), 0)
    for prompt in prompts:
        start = time.perf_counter()
        uncached = generate(params, tok, prompt)
        middle = time.perf_counter()
        cached = generate_cached(params, tok, prompt)
        greedy["seconds"]["uncached"] += middle - start
        greedy["seconds"]["cached"] += time.perf_counter() - middle
        greedy["identical"] += uncached == cached
        greedy["ended"] += uncached["stopped"] == "end of story"
        greedy["generated"] += len(uncached["steps"])
        for key, count in work(len(tok.encode(prompt)), len(uncached["steps"])).items():
            total[key] += count
        if len(greedy["examples"]) < 3:
            greedy["examples"].append(uncached["text"])
    sampled_identical = sum(
        generate(params, tok, prompt, temperature=1.0, seed=index)
        == generate_cached(params, tok, prompt, temperature=1.0, seed=index)
        for index, prompt in enumerate(prompts))

    record = {
        "stories": len(prompts),
        "largest_logit_gap_first_story": largest_gap(params, first_story),
        "positions_checked": len(first_story),
        "greedy_identical": greedy["identical"],
        "sampled_identical": sampled_identical,
        "greedy_ended_with_newline": greedy["ended"],
        "generated_tokens": greedy["generated"],
        "work": total,
        "rows_ratio": round(total["uncached_rows"] / total["cached_rows"], 2),
        "scores_ratio": round(total["uncached_scores"] / total["cached_scores"], 2),
        "cache_floats_per_position": 2 * model.WIDTH,
        "cache_floats_full_context": 2 * model.WIDTH * model.CONTEXT,
        "greedy_examples": greedy["examples"],
    }
    seconds = greedy["seconds"]
    step_seconds, bare_seconds = speed_of_a_row(params, first_story)
    timing = {
        "uncached_seconds": round(seconds["uncached"], 3),
        "cached_seconds": round(seconds["cached"], 3),
        "speedup": round(seconds["uncached"] / seconds["cached"], 2),
        "uncached_microseconds_per_row": round(seconds["uncached"] / total["uncached_rows"] * 1e6, 1),
        "cached_microseconds_per_row": round(seconds["cached"] / total["cached_rows"] * 1e6, 1),
        "forward_step_over_bare_fsum": round(step_seconds / bare_seconds, 2),
        "machine": f"{platform.system()} {platform.machine()}, {platform.processor() or 'unknown CPU'}",
        "python": platform.python_version(),
    }
    return record, timing


def _dumps(data):
    return json.dumps(data, indent=2) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Run the uncached and cached generators on the 60 test openings.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help=f"exit non-zero if the record differs from {TRACE}")
    mode.add_argument("--write", action="store_true", help=f"rewrite {TRACE} and {TIMES}")
    args = parser.parse_args(argv)
    try:
        record, timing = run()
    except (OSError, ValueError) as e:
        sys.exit(f"trace_kv.py: error: {e}")
    print(_dumps(record), end="")
    print(f"time: uncached {timing['uncached_seconds']} s, cached {timing['cached_seconds']} s "
          f"(speed-up {timing['speedup']}x; rows ratio {record['rows_ratio']}x); "
          f"forward_step takes {timing['forward_step_over_bare_fsum']}x its bare fsum calls; "
          f"{timing['machine']}, Python {timing['python']}")
    if args.write:
        write_atomically(TRACE, _dumps(record))
        write_atomically(TIMES, _dumps(timing))
        print(f"wrote {TRACE} and {TIMES}")
    elif args.check:
        try:
            with open(TRACE, encoding="utf-8") as f:
                recorded = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"trace_kv.py: error: cannot read {TRACE} ({e}); "
                     f"run python3 trace_kv.py --write to record it")
        differ = sorted(k for k in set(record) | set(recorded) if record.get(k) != recorded.get(k))
        if differ:
            sys.exit(f"trace_kv.py: {TRACE} differs from this run in: {', '.join(differ)}")
        print(f"{TRACE} matches this run")


if __name__ == "__main__":
    main()
