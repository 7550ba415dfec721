"""The lab's experiment: run the uncached and the cached generator on the openings of
the 60 test stories, prove they agree bit for bit, and count the work each one does; then
the experiments of Parts 2 and 3, each a stage that the machine's cores share.

    python3 trace_kv.py              runs it (about 20 s on 2 cores, 45 s on 1): a summary
    python3 trace_kv.py --json       prints the whole record instead, as JSON
    python3 trace_kv.py --check      also fails if the record differs from kv-trace.json
    python3 trace_kv.py --write      rewrites kv-trace.json and kv-time.json (timing more)
    python3 trace_kv.py --workers N  shares the stages among N processes (the same record)

kv-trace.json holds only what any machine reproduces exactly (results and counts);
kv-time.json holds wall-clock times, which vary, and is never compared. Progress goes to
stderr, so the output stays clean when redirected.
"""
import argparse
import contextlib
import functools
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections import namedtuple
from concurrent.futures import ProcessPoolExecutor
from itertools import accumulate
from math import fsum
from operator import add
from types import SimpleNamespace

import deep_model
import kv_cache
import model
import serving
from checkpoint import LAB, add_folder_flag, run_command, write_atomically
from generate import Generation, generate, load_trained
from kv_cache import KVCache, feed, generate_cached, work
from serving import FORMATS, BlockPool, QuantizedCache, WindowCache, prefill_in_chunks
from train import positive_int, rounded_mean, split_stories, story_ids, story_quality

TRACE, TIMES = "kv-trace.json", "kv-time.json"
LENGTHS = (8, 16, 32, 64)
CHUNKS = (1, 2, 4, 8)             # one-pass prefill, tokens per call
BLOCK_SIZES = (4, 8, 16)          # paged cache, positions per block
# (window, sinks); 12 and 20 keep as many positions as 8 and 16 with 4 sinks
WINDOWS = ((8, 0), (8, 4), (12, 0), (16, 0), (16, 4), (20, 0), (32, 0), (32, 4))
PREFIX_CACHE_BLOCKS = 64          # Part 3: a pool far smaller than the 60 stories together
MAX_BATCH, SMALL_POOL = 8, 24     # Part 3: serving 120 requests, preempting in a small pool
# Part 3: speculative decoding, by drafter and tokens drafted at a time
DRAFTS = (("the story so far", 4), *(("training stories", n) for n in (1, 2, 4, 8)))


def openings(stories):
    """Each story's first sentence: the prompt the generators continue."""
    return [story.split(". ")[0] + "." for story in stories]


def largest_gap(rows, other_rows):
    """The largest difference between corresponding logits of two lists of rows, which
    must be equally long."""
    if len(rows) != len(other_rows):
        raise ValueError(f"{len(rows)} rows cannot be compared with {len(other_rows)}")
    return max(abs(a - b) for row, other in zip(rows, other_rows) for a, b in zip(row, other))


def _common_start(ids, other_ids):
    """How many positions two lists of token IDs share from the start (the last token
    chosen is never fed, so at most one less than the shorter)."""
    fed = min(len(ids), len(other_ids)) - 1
    return next((i for i in range(fed) if ids[i] != other_ids[i]), fed)


@contextlib.contextmanager
def replaced(module, name, stand_in):
    """Inside this block, module.name is stand_in(real), where real is the original."""
    real = getattr(module, name)
    setattr(module, name, stand_in(real))
    try:
        yield
    finally:
        setattr(module, name, real)


@contextlib.contextmanager
def recording(module, name):
    """Inside this block, every value module.name returns is also appended to the list it
    yields: what the code really computed, seen without running it again."""
    results = []

    def keeping_results(real):
        def wrapper(*args):
            results.append(real(*args))
            return results[-1]
        return wrapper
    with replaced(module, name, keeping_results):
        yield results


def compare_one(index):
    """Both generators on opening index, greedy and sampled (temperature 1.0, seed =
    index): for each, the uncached result, whether the cached one is identical, how many
    positions the cached path computed on the same input as the uncached path's last full
    pass and the largest gap between their logits, that full pass's rows and attention
    weights; and the greedy seconds of each path."""
    params, tok, prompt = _LAB.params, _LAB.tok, _LAB.prompts[index]
    one = {"seconds": {}}
    for kind, settings in (("greedy", {}), ("sampled", {"temperature": 1.0, "seed": index})):
        start = time.perf_counter()
        with recording(model, "forward") as full_passes:
            uncached = generate(params, tok, prompt, **settings)
        middle = time.perf_counter()
        with recording(kv_cache, "forward_step") as cached_rows:
            cached = generate_cached(params, tok, prompt, **settings)
        end = time.perf_counter()
        rows, saved = full_passes[-1]
        # The last full pass ran on every token the cache was fed, unless the two
        # stories part: then only the rows before that point had the same input.
        same = _common_start(story_ids(tok, prompt, cached), story_ids(tok, prompt, uncached))
        one[kind] = {"result": uncached, "identical": cached == uncached, "positions": same,
                     "gap": largest_gap(cached_rows[:same], rows[:same]),
                     "full_rows": rows, "weights": saved.weights}
        if kind == "greedy":
            one["seconds"] = {"uncached": middle - start, "cached": end - middle}
    return one


def sums_in_another_order():
    """Inside this block (a context manager) the model adds its terms one by one, last
    term first, instead of with one correctly rounded fsum: the same numbers, summed in
    another order."""
    return replaced(model, "fsum", lambda exact: lambda terms: functools.reduce(
        add, reversed(list(terms)), 0.0))


def share_prefixes(greedy, sampled):
    """Prefill each opening once and continue it three ways (greedy, sampled, top-k 3)
    from that cache; each must equal the run without a shared cache."""
    params, tok, prompts = _LAB.params, _LAB.tok, _LAB.prompts
    identical, without, shared = 0, 0, 0
    for index, prompt in enumerate(prompts):
        ids = tok.encode(prompt)
        cache = KVCache(params)
        feed(params, cache, ids)
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


def one_pass_prefill(greedy, full_rows):
    """The openings prefilled in chunks of 1, 2, 4 and 8 tokens, one pass per chunk, and
    the greedy stories generated with the whole prompt in one pass: every row against the
    uncached full pass, every result against the uncached one."""
    params, tok, prompts = _LAB.params, _LAB.tok, _LAB.prompts
    positions, gap = {}, 0.0
    for size in CHUNKS:
        positions[str(size)] = 0
        for prompt, rows in zip(prompts, full_rows):
            ids = tok.encode(prompt)
            chunked = prefill_in_chunks(params, KVCache(params), ids, size)
            gap = max(gap, largest_gap(chunked, rows[:len(ids)]))
            positions[str(size)] += len(ids)
    identical, positions["whole prompt"], prompt_calls = 0, 0, 0
    for prompt, result, rows in zip(prompts, greedy, full_rows):
        with recording(serving, "prefill") as calls:
            identical += serving.generate_one_pass(params, tok, prompt) == result
        fed = [logits for call in calls for logits in call]   # the prompt, then one per step
        gap = max(gap, largest_gap(fed, rows))
        positions["whole prompt"] += len(fed)
        prompt_calls += next(n for n, total in enumerate(accumulate(map(len, calls)), 1)
                             if total >= len(tok.encode(prompt)))
    return {"positions_compared_by_chunk": positions, "largest_logit_gap": gap,
            "greedy_identical": identical,
            "prompt_calls_one_token_at_a_time": sum(len(tok.encode(p)) for p in prompts),
            "prompt_calls_one_pass": prompt_calls}


def paged(greedy):
    """Slots a cache reserves for the 60 greedy stories: one per position held, a whole
    context per story (a static cache), or whole blocks; then the openings prefilled into
    one pool of blocks of 4, sharing the full blocks of common prefixes, each continued
    greedily from its sequence."""
    params, tok, prompts = _LAB.params, _LAB.tok, _LAB.prompts
    # A story's cache holds every position but the last chosen token, never fed back.
    held = [len(story_ids(tok, p, r)) - 1 for p, r in zip(prompts, greedy)]
    reserved = {"static, 64 per story": model.CONTEXT * len(held)}
    reserved.update({f"blocks of {size}": sum(math.ceil(n / size) * size for n in held)
                     for size in BLOCK_SIZES})
    pool = BlockPool(params, model.CONTEXT * len(prompts) // 4, 4)
    rows_without = rows_with = shared = identical = 0
    for prompt, result in zip(prompts, greedy):
        ids = tok.encode(prompt)
        seq = pool.sequence(ids)
        shared += len(seq.table)
        rows_without += len(ids)
        rows_with += len(feed(params, seq, ids))
        identical += generate_cached(params, tok, prompt, cache=seq) == result
    return {"positions_held": sum(held), "slots_reserved": reserved,
            "wasted_share": {way: round(1 - sum(held) / slots, 3)
                             for way, slots in reserved.items()},
            "prefix_sharing_blocks_of_4": {
                "blocks_shared": shared, "prompt_rows_without_sharing": rows_without,
                "prompt_rows_with_sharing": rows_with, "greedy_identical": identical}}


RUNGS = (("float64 array", "float64"), ("exact lists, sums in another order", "reordered"),
         *((fmt, fmt) for fmt in FORMATS[1:]),
         *((f"window {w}, sinks {s}", (w, s)) for w, s in WINDOWS))


def ladder_rung(rung, greedy, sampled, full_rows):
    """One way of keeping the cache (RUNGS[rung]), on every opening: its bytes per
    position (measured, for the compact formats) or the positions it keeps (for a
    window), the largest logit gap against the exact rows over every position of the
    greedy stories (their tokens fed through that cache), and how many greedy and sampled
    stories change their text (a greedy story changes where a fed row's best token is not
    the next one; a sampled one is generated again through that cache)."""
    params, tok, prompts = _LAB.params, _LAB.tok, _LAB.prompts
    name, kind = RUNGS[rung]

    def make():
        if kind == "reordered":
            return KVCache(params)
        if isinstance(kind, tuple):
            return WindowCache(params, *kind)
        return QuantizedCache(params, kind)
    gap = 0.0
    greedy_changed = sampled_changed = 0
    with sums_in_another_order() if kind == "reordered" else contextlib.nullcontext():
        for index, (prompt, result, rows) in enumerate(zip(prompts, greedy, full_rows)):
            ids = story_ids(tok, prompt, result)
            cache = make()
            fed = feed(params, cache, ids[:-1])
            gap = max(gap, largest_gap(fed, rows))
            chosen = range(len(tok.encode(prompt)) - 1, len(fed))   # rows that chose
            greedy_changed += any(fed[p].index(max(fed[p])) != ids[p + 1] for p in chosen)
            again = generate_cached(params, tok, prompt, temperature=1.0, seed=index,
                                    cache=make())
            sampled_changed += again["text"] != sampled[index]["text"]
    return {"cache": name,
            "bytes_per_position": cache.bytes_per_position()
            if isinstance(cache, QuantizedCache) else None,
            "positions_kept": sum(kind) if isinstance(kind, tuple) else None,
            "largest_logit_gap": gap, "greedy_stories_changed": greedy_changed,
            "sampled_stories_changed": sampled_changed}


def attention_to_position_0(weights):
    """The mean attention weight position 0 gets from every later position of the 60
    greedy stories (weights: each story's rows of attention weights), against what an
    even share, 1 / (i + 1) at position i, would give it."""
    later = [row for story in weights for row in story[1:]]
    return {"mean_weight": rounded_mean([row[0] for row in later]),
            "even_share": rounded_mean([1 / len(row) for row in later])}


def never_ending(params, tok):
    """A copy of params whose newline score is so low that no story ever ends."""
    changed = dict(params, b_out=list(params["b_out"]))
    changed["b_out"][tok.ids["\n"]] = -1e9
    return changed


def seconds_by_length(params, tok, repeats=2):
    """Seconds of both generators from a one-token prompt ("mia") to 8, 16, 32 and 64
    positions, with a copy of the model that never ends a story: the faster of repeats
    runs of each, taken in turns, so that a busy moment of the machine counts less."""
    never_ends = never_ending(params, tok)
    seconds = []
    for length in LENGTHS:
        uncached = cached = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            generate(never_ends, tok, "mia", max_new_tokens=length - 1)
            middle = time.perf_counter()
            generate_cached(never_ends, tok, "mia", max_new_tokens=length - 1)
            uncached = min(uncached, middle - start)
            cached = min(cached, time.perf_counter() - middle)
        seconds.append({"positions": length, "uncached_seconds": round(uncached, 4),
                        "cached_seconds": round(cached, 4),
                        "speedup": round(uncached / cached, 1)})
    return seconds


def fsum_share(params, stories):
    """Seconds for forward_step over every position of the stories (lists of token IDs),
    and for only the math.fsum calls those steps make, on the same terms: each story is
    first run once to record its calls' terms, then both are timed, story by story."""
    step_seconds = sum_seconds = 0.0
    for ids in stories:
        calls = []

        def keeping_terms(exact):
            def wrapper(terms):
                calls.append(list(terms))
                return exact(calls[-1])
            return wrapper
        with replaced(model, "fsum", keeping_terms):
            feed(params, KVCache(params), ids)
        cache = KVCache(params)
        start = time.perf_counter()
        feed(params, cache, ids)
        middle = time.perf_counter()
        for terms in calls:
            model.fsum(terms)
        step_seconds += middle - start
        sum_seconds += time.perf_counter() - middle
    return step_seconds, sum_seconds


def cache_bytes(params, ids):
    """Bytes CPython uses for a cache holding ids: the lists and every float object."""
    cache = KVCache(params)
    feed(params, cache, ids)
    rows = cache.keys + cache.values
    return (sys.getsizeof(cache.keys) + sys.getsizeof(cache.values)
            + sum(sys.getsizeof(r) + sum(sys.getsizeof(x) for x in r) for r in rows))


def reordered_sums(greedy):
    """The cached path with every sum added term by term, last term first: the largest
    logit gap on the first test story, and the greedy stories still identical."""
    params, tok, first_story = _LAB.params, _LAB.tok, _LAB.tok.encode(_LAB.test[0])
    full, _ = model.forward(params, first_story)
    with sums_in_another_order():
        reordered = feed(params, KVCache(params), first_story)
        identical = sum(generate_cached(params, tok, prompt) == result
                        for prompt, result in zip(_LAB.prompts, greedy))
    return {"largest_logit_gap_first_story": largest_gap(full, reordered),
            "greedy_identical": identical}


@contextlib.contextmanager
def recording_choices():
    """Inside this block, every token a generate.Generation chooses is recorded, in the
    list it yields: (the generation, the position of the row whose logits chose it, those
    logits)."""
    chosen = []

    def keeping(real):
        def choose(generation, logits):
            chosen.append((generation, len(generation.ids) - 1, logits))
            return real(generation, logits)
        return choose
    with replaced(Generation, "choose", keeping):
        yield chosen


def choosing_rows(requests, results, full_rows, pool, max_batch):
    """serving.serve on the requests (each result expected in results, each with the rows
    of its uncached last full pass in full_rows), recording the logits every request
    chose a token with: (counts, the results identical, the largest gap between those
    logits and the full pass's row for the same position)."""
    with recording_choices() as chosen:
        served, counts = serving.serve(_LAB.params, _LAB.tok, requests, pool, max_batch)
    rows = {tuple(story_ids(_LAB.tok, request["prompt"], result)): full
            for request, result, full in zip(requests, results, full_rows)}
    gap = max((largest_gap([logits], [rows[tuple(generation.ids)][position]])
               for generation, position, logits in chosen if tuple(generation.ids) in rows),
              default=None)   # None: no story came out as the uncached one
    return counts, sum(s == r for s, r in zip(served, results)), gap


def prefix_cache(greedy, full_rows):
    """The greedy openings served one after another, each freed when done: the full
    blocks of finished requests stay cached until a block is needed, and a later request
    that begins with the same tokens takes them instead of computing those rows again.
    From a pool of PREFIX_CACHE_BLOCKS blocks of 4, far fewer than the stories hold
    together, and from one large enough never to evict."""
    requests = [{"prompt": prompt} for prompt in _LAB.prompts]
    record = {"positions_held_in_all": sum(len(story_ids(_LAB.tok, p, r)) - 1
                                           for p, r in zip(_LAB.prompts, greedy))}
    for name, blocks in (("small pool", PREFIX_CACHE_BLOCKS),
                         ("ample pool", len(requests) * 16)):
        pool = BlockPool(_LAB.params, blocks, 4)
        counts, identical, gap = choosing_rows(requests, greedy, full_rows, pool, 1)
        record[name] = {"blocks": blocks, "prefix_hits": counts["prefix_hits"],
                        "rows_saved": 4 * counts["prefix_hits"], "rows": counts["rows"],
                        "evictions": pool.evictions, "identical": identical,
                        "largest_logit_gap_of_choosing_rows": gap}
    return record


def many_requests(greedy, sampled, full_rows):
    """The 60 greedy and the 60 sampled openings as 120 requests, served in that order
    with batches of up to MAX_BATCH: from a pool of SMALL_POOL blocks of 4, which forces
    preemptions, and from an ample one; and the steps static batching takes for the same
    requests (each batch of MAX_BATCH starts together and waits for its longest)."""
    requests = ([{"prompt": prompt} for prompt in _LAB.prompts]
                + [{"prompt": prompt, "temperature": 1.0, "seed": index}
                   for index, prompt in enumerate(_LAB.prompts)])
    results = greedy + sampled
    record = {"requests": len(requests), "max_batch": MAX_BATCH}
    for name, blocks in (("small pool", SMALL_POOL), ("ample pool", len(requests) * 16)):
        counts, identical, gap = choosing_rows(requests, results, full_rows,
                                               BlockPool(_LAB.params, blocks, 4), MAX_BATCH)
        record[name] = dict(counts, blocks=blocks, identical=identical,
                            largest_logit_gap_of_choosing_rows=gap)
    lengths = [len(result["steps"]) for result in results]
    record["static_batching_steps"] = sum(max(lengths[first:first + MAX_BATCH])
                                          for first in range(0, len(lengths), MAX_BATCH))
    return record


def speculative(drafter, lookahead, greedy, sampled, full_rows):
    """serving.generate_speculative with this lookahead on every opening, greedy and
    sampled: the stories identical to the uncached ones, the largest gap between the
    logits each token was chosen with and the uncached full pass's row for the same
    position, the prefill calls and the rows they computed (rejected ones included)
    against one call per generated token, and how many drafted tokens were accepted."""
    params, tok, prompts = _LAB.params, _LAB.tok, _LAB.prompts
    if drafter == "training stories":
        train, _, _ = split_stories(_LAB.corpus)
        chosen_drafter = serving.NgramDrafter([tok.encode(story) for story in train])
    else:
        chosen_drafter = serving.PromptLookup()
    counts = {"drafter": drafter, "lookahead": lookahead, "identical": 0, "model_calls": 0,
              "model_calls_one_per_token": 0, "rows": 0, "rows_one_at_a_time": 0,
              "drafted": 0, "accepted": 0}
    gap = 0.0
    for index, prompt in enumerate(prompts):
        for settings, result, rows in (({}, greedy[index], full_rows[index]),
                                       ({"temperature": 1.0, "seed": index}, sampled[index],
                                        full_rows[len(prompts) + index])):
            calls = []

            def keeping_calls(real):
                def prefill(params, cache, token_ids, start):
                    calls.append((list(token_ids), start))
                    return real(params, cache, token_ids, start)
                return prefill
            with recording_choices() as chosen, replaced(serving, "prefill", keeping_calls):
                again = serving.generate_speculative(params, tok, prompt, lookahead=lookahead,
                                                     drafter=chosen_drafter, **settings)
            story = story_ids(tok, prompt, result)
            counts["identical"] += again == result
            if again == result:
                gap = max([gap] + [largest_gap([logits], [rows[position]])
                                   for _, position, logits in chosen])
            for token_ids, start in calls[1:]:    # the first call is the prompt's
                counts["drafted"] += len(token_ids) - 1
                counts["accepted"] += next((j for j, token in enumerate(token_ids[1:])
                                            if story[start + 1 + j:start + 2 + j] != [token]),
                                           len(token_ids) - 1)
            counts["model_calls"] += len(calls)
            counts["model_calls_one_per_token"] += len(result["steps"])
            counts["rows"] += sum(len(token_ids) for token_ids, _ in calls)
            counts["rows_one_at_a_time"] += len(story) - 1
    counts["largest_logit_gap_of_choosing_rows"] = gap
    return counts


def cache_files(greedy):
    """The bytes of serving.save_cache's files for the caches of the greedy stories (every
    position fed), per position: exact floats written as JSON text."""
    params, tok, prompts = _LAB.params, _LAB.tok, _LAB.prompts
    positions = written = 0
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "cache.json")
        for prompt, result in zip(prompts, greedy):
            cache = KVCache(params)
            feed(params, cache, story_ids(tok, prompt, result)[:-1])
            serving.save_cache(cache, path)
            positions += len(cache)
            written += os.path.getsize(path)
    return {"positions": positions, "bytes": written,
            "bytes_per_position": round(written / positions, 2)}


def _deep_ids():
    """The first 64 tokens of the test stories (24 in a run of fewer openings)."""
    positions = model.CONTEXT if len(_LAB.prompts) == len(_LAB.test) else 24
    return [t for story in _LAB.test for t in _LAB.tok.encode(story)][:positions]


def _deep_cache(layers, kv_heads, ids, mask=deep_model.causal):
    """A deep_model of layers and kv_heads (4 query heads, the lab's width, seed 0), and
    its rows and cache after feeding ids one token at a time."""
    params = deep_model.init_params(layers, 4, kv_heads, model.WIDTH, 0)
    cache = deep_model.DeepCache(params, mask)
    return params, [deep_model.forward_step(params, cache, token_id, position)
                    for position, token_id in enumerate(ids)], cache


DEEP_SHAPES = tuple((layers, kv_heads) for layers in (1, 2, 3, 4) for kv_heads in (4, 2, 1))


def deep_models():
    """deep_model for 1 to 4 layers of multi-head (4 key-value heads), grouped-query (2)
    and multi-query (1) attention: the largest gap between the cached rows and the full
    pass's, and the numbers its cache keeps per position; then, with a window of 8 on
    every layer, which positions changing token 0 reaches."""
    ids = _deep_ids()
    shapes = []
    for layers, kv_heads in DEEP_SHAPES:
        params, rows, cache = _deep_cache(layers, kv_heads, ids)
        floats = cache.floats_per_position()
        shapes.append({"layers": layers, "heads": 4, "kv_heads": kv_heads,
                       "largest_logit_gap": largest_gap(rows, deep_model.forward(params, ids)),
                       "floats_per_position": floats,
                       "formula": 2 * layers * kv_heads * (model.WIDTH // 4),
                       "bytes_per_position_as_8_byte_floats": 8 * floats})
    window = []
    band, changed = model.band(8), [(ids[0] + 1) % model.VOCAB_SIZE] + ids[1:]
    for layers in (1, 2, 3):
        params, rows, _ = _deep_cache(layers, 2, ids, band)
        full = deep_model.forward(params, ids, band)
        other = deep_model.forward(params, changed, band)
        reached = [p for p, (a, b) in enumerate(zip(full, other)) if a != b]
        window.append({"layers": layers, "window": 8,
                       "cached_equals_full_pass": rows == full,
                       "last_position_token_0_reaches": reached[-1],
                       "largest_logit_change_at_position_14": largest_gap([full[14]],
                                                                          [other[14]])})
    return {"positions": len(ids), "shapes": shapes, "window_through_layers": window}


def deep_cache_bytes():
    """Bytes CPython uses per position for each deep_model shape's cache of _deep_ids():
    the lists and every float object (it depends on the Python, so it is timing's)."""
    ids = _deep_ids()
    measured = []
    for layers, kv_heads in DEEP_SHAPES:
        _, _, cache = _deep_cache(layers, kv_heads, ids)
        objects = sum(sys.getsizeof(vectors) + sum(sys.getsizeof(vector)
                                                    + sum(map(sys.getsizeof, vector))
                                                    for vector in vectors)
                      for layer in cache.layers for vectors in layer.values())
        measured.append({"layers": layers, "kv_heads": kv_heads,
                         "bytes_per_position": round(objects / len(ids), 2)})
    return measured


_LAB = None   # what every stage reads, loaded once in each process by _load


def _load(folder, stories=None):
    """Load the model, the tokenizer and the test openings (the first stories of them,
    if given) from folder into _LAB."""
    global _LAB
    params, tok = load_trained(folder)
    with open(os.path.join(folder, "corpus.txt"), encoding="utf-8") as f:
        corpus = f.read()
    _, _, test = split_stories(corpus)
    _LAB = Lab(params, tok, corpus, test, openings(test)[:stories])
    return _LAB


Lab = namedtuple("Lab", "params tok corpus test prompts")


class _Here:
    """Runs every task in this process, in order, as a process pool would (--workers 1)."""

    def __init__(self, folder, stories):
        _load(folder, stories)

    def map(self, function, items):
        return map(function, items)

    def submit(self, function, *args):
        result = function(*args)
        return SimpleNamespace(result=lambda: result)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _workers(count, folder, stories):
    """Where the stages run: count processes (each loads the lab once), or this one."""
    if count == 1:
        return _Here(folder, stories)
    return ProcessPoolExecutor(count, initializer=_load, initargs=(folder, stories))


def run(full_timing=False, folder=LAB, progress=None, workers=None, stories=None):
    """Both generators on the 60 test openings (or the first stories of them, for a
    quick run), then every other experiment, each a stage of its own that workers
    processes share (default: one per core): (record, timing). The record is the same
    for any number of workers. The timing holds the seconds of both generators; with
    full_timing (what --write records) also a row's share of fsum, each length's seconds
    and the cache's bytes, timed afterwards in this process alone. progress(stage, done,
    total), if given, is told how far the run is."""
    progress = progress or (lambda stage, done, total: None)
    workers = workers or os.cpu_count() or 1
    lab = _load(folder, stories)
    params, tok, prompts = lab.params, lab.tok, lab.prompts
    with _workers(workers, folder, stories) as pool:
        deep = pool.submit(deep_models)            # needs nothing from the generators
        compared = []
        for one in pool.map(compare_one, range(len(prompts))):
            compared.append(one)
            progress("both generators", len(compared), len(prompts))
        greedy, sampled = ([one[kind]["result"] for one in compared]
                           for kind in ("greedy", "sampled"))
        full_rows = {kind: [one[kind]["full_rows"] for one in compared]
                     for kind in ("greedy", "sampled")}
        stages = {
            "prefix_sharing": pool.submit(share_prefixes, greedy, sampled),
            "sums_in_another_order": pool.submit(reordered_sums, greedy),
            "one_pass_prefill": pool.submit(one_pass_prefill, greedy, full_rows["greedy"]),
            "paged": pool.submit(paged, greedy),
            "prefix_cache": pool.submit(prefix_cache, greedy, full_rows["greedy"]),
            "many_requests": pool.submit(many_requests, greedy, sampled,
                                         full_rows["greedy"] + full_rows["sampled"]),
            "speculative_decoding": [
                pool.submit(speculative, drafter, lookahead, greedy, sampled,
                            full_rows["greedy"] + full_rows["sampled"])
                for drafter, lookahead in DRAFTS],
            "cache_files": pool.submit(cache_files, greedy),
            "deep_models": deep,
            "ladder": [pool.submit(ladder_rung, rung, greedy, sampled, full_rows["greedy"])
                       for rung in range(len(RUNGS))]}
        done = {}
        for name, stage in stages.items():
            done[name] = ({"stories": len(prompts), "rungs": [s.result() for s in stage]}
                          if name == "ladder" else [s.result() for s in stage]
                          if isinstance(stage, list) else stage.result())
            progress("the other experiments: Parts 2, 3 and 4", len(done), len(stages))
    first_story = tok.encode(lab.test[0])
    total = dict.fromkeys(work(1, 1), 0)
    for prompt, result in zip(prompts, greedy):
        for key, count in work(len(tok.encode(prompt)), len(result["steps"])).items():
            total[key] += count
    record = {
        "stories": len(prompts),
        "largest_logit_gap_first_story": largest_gap(model.forward(params, first_story)[0],
                                                     feed(params, KVCache(params),
                                                          first_story)),
        "positions_checked": len(first_story),
        "every_row_of_every_story": {
            "stories": 2 * len(prompts),
            "positions": sum(one[kind]["positions"] for one in compared
                             for kind in ("greedy", "sampled")),
            "largest_logit_gap": max(one[kind]["gap"] for one in compared
                                     for kind in ("greedy", "sampled"))},
        "greedy_identical": sum(one["greedy"]["identical"] for one in compared),
        "sampled_identical": sum(one["sampled"]["identical"] for one in compared),
        "greedy_ended_with_newline": sum(r["stopped"] == "end of story" for r in greedy),
        "generated_tokens": sum(len(r["steps"]) for r in greedy),
        "work": total,
        "rows_ratio": round(total["uncached_rows"] / total["cached_rows"], 2),
        "scores_ratio": round(total["uncached_scores"] / total["cached_scores"], 2),
        "cache_floats_per_position": 2 * model.WIDTH,
        "cache_floats_full_context": 2 * model.WIDTH * model.CONTEXT,
        "greedy_examples": [r["text"] for r in greedy[:3]],
        "story_quality": story_quality(tok, lab.corpus, prompts, {
            "greedy": greedy, "sampled": sampled,
            "weights": {kind: [one[kind]["weights"] for one in compared]
                        for kind in ("greedy", "sampled")}}),
        "cost_by_length": [{"positions": length, **work(1, length - 1)} for length in LENGTHS],
        "attention_to_position_0": attention_to_position_0(
            [one["greedy"]["weights"] for one in compared]),
        **done,
    }
    seconds = {path: fsum(one["seconds"][path] for one in compared)
               for path in ("uncached", "cached")}
    timing = {
        "uncached_seconds": round(seconds["uncached"], 3),
        "cached_seconds": round(seconds["cached"], 3),
        "speedup": round(seconds["uncached"] / seconds["cached"], 2),
        "uncached_microseconds_per_row":
            round(seconds["uncached"] / total["uncached_rows"] * 1e6, 1),
        "cached_microseconds_per_row": round(seconds["cached"] / total["cached_rows"] * 1e6, 1),
        "workers": workers,
        "machine": f"{platform.platform()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
    }
    if full_timing:
        progress("timing a row's sums and each length", 0, 1)
        fed = [story_ids(tok, prompt, r)[:-1]              # the last chosen token is never fed
               for prompt, r in zip(prompts, greedy)]
        step_seconds, sum_seconds = fsum_share(params, fed)
        full_context = [t for story in lab.test for t in tok.encode(story)][:model.CONTEXT]
        memory = cache_bytes(params, full_context)
        timing.update({
            "forward_step_over_its_fsum_calls": round(step_seconds / sum_seconds, 2),
            "cost_by_length": seconds_by_length(params, tok),
            "cache_bytes_full_context": memory,
            "cache_bytes_per_position": round(memory / model.CONTEXT, 2),
            "cache_bytes_as_8_byte_floats": 8 * 2 * model.WIDTH * model.CONTEXT,
            "deep_model_cache_bytes_as_cpython_objects": deep_cache_bytes(),
        })
        progress("timing a row's sums and each length", 1, 1)
    return record, timing


def _dumps(data):
    return json.dumps(data, indent=2) + "\n"


def summary(record, timing):
    """The run for a person: the exactness verdicts, the work saved, the speed-up."""
    every, work_done = record["every_row_of_every_story"], record["work"]
    stories = record["stories"]

    def verdict(ok):
        return "yes" if ok else "NO"
    lines = [
        "Exactness",
        f"  every row's logits equal, bit for bit: "
        f"{verdict(every['largest_logit_gap'] == 0.0)} (largest gap "
        f"{every['largest_logit_gap']!r} over {every['positions']:,} positions of "
        f"{every['stories']} stories)",
        f"  greedy stories identical:  {verdict(record['greedy_identical'] == stories)} "
        f"({record['greedy_identical']} of {stories})",
        f"  sampled stories identical: {verdict(record['sampled_identical'] == stories)} "
        f"({record['sampled_identical']} of {stories}, temperature 1.0)",
        f"Work, over the {stories} greedy stories ({record['generated_tokens']} tokens "
        f"generated)",
        f"  {'':18}{'without the cache':>18}{'with it':>10}{'ratio':>9}",
        f"  {'rows':18}{work_done['uncached_rows']:>18,}{work_done['cached_rows']:>10,}"
        f"{record['rows_ratio']:>8}x",
        f"  {'attention scores':18}{work_done['uncached_scores']:>18,}"
        f"{work_done['cached_scores']:>10,}{record['scores_ratio']:>8}x",
    ]
    if timing:
        lines += [
            "Time, this run (it varies; the ratio measured side by side is what to compare)",
            f"  {'60 greedy stories':18}{timing['uncached_seconds']:>16.3f} s"
            f"{timing['cached_seconds']:>8.3f} s{timing['speedup']:>8}x faster "
            f"(rows ratio {record['rows_ratio']}x)"]
    return "\n".join(lines) + "\n"


def save_records(record, timing, folder=LAB):
    """Write kv-trace.json and kv-time.json in folder, each atomically."""
    write_atomically(os.path.join(folder, TRACE), _dumps(record))
    write_atomically(os.path.join(folder, TIMES), _dumps(timing))


def read_record(path):
    """The recorded trace in path, or a ValueError that says how to make one."""
    folder = os.path.dirname(os.path.abspath(path))
    write = "python3 trace_kv.py --write" + ("" if folder == LAB else f" --folder {folder}")
    try:
        with open(path, encoding="utf-8") as f:
            recorded = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} ({e}); run {write} to record it") from None
    if not isinstance(recorded, dict):
        raise ValueError(f"{path} does not hold a record (a JSON object); "
                         f"run {write} to record it")
    return recorded


def differing_keys(record, recorded):
    """The keys whose values differ between two records, sorted."""
    return sorted(k for k in set(record) | set(recorded) if record.get(k) != recorded.get(k))


def _shown(path):
    """path as a person would type it from here: relative, unless it is on another drive."""
    try:
        return os.path.relpath(path)
    except ValueError:
        return path


def show_progress(stage, done, total):
    """Progress on stderr: on a terminal, one line per stage rewritten as it goes;
    elsewhere (a log file), one line when a stage is done."""
    finished = done == total
    if sys.stderr.isatty():
        status = "done" if finished else f"{done} of {total}" if total > 1 else "..."
        print(f"\r  {stage}: {status:<12}", end="\n" if finished else "", file=sys.stderr,
              flush=True)
    elif finished:
        print(f"  {stage}: done", file=sys.stderr, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Run the uncached and the cached generator on the openings of the 60 "
                    "test stories (about 20 s on 2 cores, 45 s on 1): prove they agree bit "
                    "for bit, count the work each does, and print a summary.")
    parser.add_argument("--json", action="store_true",
                        help="print the whole record as JSON instead of the summary")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help=f"exit non-zero if the record differs from {TRACE}")
    mode.add_argument("--write", action="store_true", help=f"rewrite {TRACE} and {TIMES}")
    parser.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1,
                        help="processes to share the experiments (default: one per core, "
                             f"{os.cpu_count() or 1} here); the record is the same for any")
    add_folder_flag(parser)
    args = parser.parse_args(argv)
    trace, times = (_shown(os.path.join(args.folder, name)) for name in (TRACE, TIMES))
    try:
        # Read the record first, so that a missing one fails before the long run.
        recorded = read_record(os.path.join(args.folder, TRACE)) if args.check else None
        print("Running both generators on the openings of the 60 test stories, greedy and "
              "sampled, and comparing every row's logits (about 20 s on 2 cores, 45 s on 1):",
              file=sys.stderr)
        record, timing = run(args.write, args.folder, show_progress, args.workers)
    except (OSError, ValueError) as e:
        sys.exit(f"trace_kv.py: error: {e}")
    print(_dumps(record) if args.json else summary(record, timing), end="")
    if args.write:
        save_records(record, timing, args.folder)
        print(f"wrote {trace} and {times}")
    elif args.check:
        differ = differing_keys(record, recorded)
        if differ:
            sys.exit(f"trace_kv.py: {trace} differs from this run in: {', '.join(differ)}")
        print(f"{trace} matches this run")
    elif not args.json:
        print(f"The full record: {trace} (or python3 trace_kv.py --json)")


if __name__ == "__main__":
    run_command(main)
