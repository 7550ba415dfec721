"""The lesson's experiment (Part 1), the first stages of trace_kv.py: both generators on
the openings of the 60 test stories, greedy and sampled, every cached row against the
uncached generator's last full pass; the lesson's figures (exactness, work, memory, how
well the model writes); one prefill shared by three continuations; and the sums of the
first test story added in another order.
"""
import contextlib
import time
from collections import namedtuple

import generate
import kv_cache
import model
from instruments import largest_gap, recording, replaced, results, sums_in_another_order
from kv_cache import KVCache, feed, generate_cached, work
from stories import rounded_mean, story_ids, story_quality


LENGTHS = (8, 16, 32, 64)   # the record's cost_by_length: positions from a one-token prompt


def _common_start(ids, other_ids):
    """How many positions two lists of token IDs share from the start (the last token
    chosen is never fed, so at most one less than the shorter)."""
    fed = min(len(ids), len(other_ids)) - 1
    return next((i for i in range(fed) if ids[i] != other_ids[i]), fed)


KINDS = ("greedy", "sampled")


def both_generators(lab, index):
    """Both generators on opening index, greedy and sampled (temperature 1.0, seed =
    index): for each, the uncached result, whether the cached one is identical, how many
    positions the cached path computed on the same input as the uncached path's last full
    pass and the largest gap between their logits, that full pass's rows and attention
    weights; and the greedy seconds of each path. The sampled uncached run is given the
    greedy run's full passes on the tokens both chose (reusing), not the same computed
    again."""
    params, tok, prompt = lab.params, lab.tok, lab.prompts[index]
    one, greedy_passes = {}, {}
    for kind, settings in zip(KINDS, ({}, {"temperature": 1.0, "seed": index})):
        start = time.perf_counter()
        with reusing(params, greedy_passes), recording(model, "forward") as full_passes:
            uncached = generate.generate(params, tok, prompt, **settings)
        middle = time.perf_counter()
        if kind == "greedy":
            greedy_passes.update(passes_by_input(story_ids(tok, prompt, uncached), full_passes))
        with recording(kv_cache, "forward_step") as steps:
            cached = generate_cached(params, tok, prompt, **settings)
        end = time.perf_counter()
        rows, saved = full_passes[-1].result
        # The last full pass ran on every token the cache was fed, unless the two
        # stories part: then only the rows before that point had the same input.
        same = _common_start(story_ids(tok, prompt, cached), story_ids(tok, prompt, uncached))
        one.update({kind: uncached, f"{kind}_identical": cached == uncached,
                    f"{kind}_positions": same,
                    f"{kind}_gap": largest_gap(results(steps)[:same], rows[:same]),
                    f"{kind}_rows": rows, f"{kind}_weights": saved.weights})
        if kind == "greedy":
            one["seconds"] = {"uncached": middle - start, "cached": end - middle}
    return one


def reusing(params, passes):
    """Inside this block (a context manager), model.forward on params and token IDs that
    passes holds (a tuple of token IDs -> forward's result) gives that result instead of
    computing it again; with passes empty, nothing changes. forward's result depends on
    its arguments alone (test_model), so the sampled run, wherever its story has chosen
    the greedy one's tokens so far, is given the very full passes the greedy run made."""
    if not passes:
        return contextlib.nullcontext()

    def stand_in(real):
        def forward(given, ids, *rest, **named):
            found = passes.get(tuple(ids)) if given is params and not (rest or named) else None
            return real(given, ids, *rest, **named) if found is None else found
        return forward
    return replaced(model, "forward", stand_in)


def passes_by_input(story, full_passes):
    """The recorded full passes of one uncached generation of story (its token IDs), by
    the token IDs each read (reusing's passes): pass n, the prompt and n chosen tokens."""
    return {tuple(story[:len(story) - len(full_passes) + n]): call.result
            for n, call in enumerate(full_passes)}


Runs = namedtuple("Runs", [f"{kind}{what}" for what in ("", "_identical", "_positions",
                                                        "_gap", "_rows", "_weights")
                           for kind in KINDS] + ["seconds"])
Runs.__doc__ = """Both generators on every opening: for each kind (greedy, sampled), the
uncached results, whether the cached ones are identical, the positions compared and their
largest gap, each last full pass's rows and attention weights; and the greedy seconds."""


def gather_runs(lab, ones):
    """both_generators of every opening, as Runs: one list per field, in opening order."""
    return Runs(*([one[field] for one in ones] for field in Runs._fields))


def lesson_figures(lab, runs):
    """The lesson's figures, at the top of the record: exactness, work and memory."""
    params, tok, prompts = lab.params, lab.tok, lab.prompts
    first_story = tok.encode(lab.test[0])
    total = dict.fromkeys(work(1, 1), 0)
    for prompt, result in zip(prompts, runs.greedy):
        for key, count in work(len(tok.encode(prompt)), len(result["steps"])).items():
            total[key] += count
    return {
        "stories": len(prompts),
        "largest_logit_gap_first_story": largest_gap(model.forward(params, first_story)[0],
                                                     feed(params, KVCache(params),
                                                          first_story)),
        "positions_checked": len(first_story),
        "every_row_of_every_story": {
            "stories": len(KINDS) * len(prompts),
            "positions": sum(runs.greedy_positions + runs.sampled_positions),
            "largest_logit_gap": max(runs.greedy_gap + runs.sampled_gap)},
        "greedy_identical": sum(runs.greedy_identical),
        "sampled_identical": sum(runs.sampled_identical),
        "greedy_ended_with_newline": sum(r["stopped"] == "end of story" for r in runs.greedy),
        "generated_tokens": sum(len(r["steps"]) for r in runs.greedy),
        "work": total,
        "rows_ratio": round(total["uncached_rows"] / total["cached_rows"], 2),
        "scores_ratio": round(total["uncached_scores"] / total["cached_scores"], 2),
        "cache_floats_per_position": 2 * model.WIDTH,
        "cache_floats_full_context": 2 * model.WIDTH * model.CONTEXT,
        "greedy_examples": [r["text"] for r in runs.greedy[:3]],
        "story_quality": story_quality(tok, lab.corpus, prompts, {
            "greedy": runs.greedy, "sampled": runs.sampled,
            "weights": {"greedy": runs.greedy_weights, "sampled": runs.sampled_weights}}),
        "cost_by_length": [{"positions": length, **work(1, length - 1)} for length in LENGTHS],
        "attention_to_position_0": attention_to_position_0(runs.greedy_weights),
    }


def attention_to_position_0(weights):
    """The mean attention weight position 0 gets from every later position of the 60
    greedy stories (weights: each story's rows of attention weights), against what an
    even share, 1 / (i + 1) at position i, would give it."""
    later = [row for story in weights for row in story[1:]]
    return {"mean_weight": rounded_mean([row[0] for row in later]),
            "even_share": rounded_mean([1 / len(row) for row in later])}


def share_prefixes(lab, runs):
    """Prefill each opening once and continue it three ways (greedy, sampled, top-k 3)
    from that cache; each must equal the run without a shared cache."""
    params, tok = lab.params, lab.tok
    identical, without, shared = 0, 0, 0
    for index, prompt in enumerate(lab.prompts):
        ids = tok.encode(prompt)
        cache = KVCache(params)
        feed(params, cache, ids)
        top_k = {"temperature": 1.0, "top_k": 3, "seed": index}
        identical += generate_cached(params, tok, prompt, cache=cache) == runs.greedy[index]
        identical += generate_cached(params, tok, prompt, temperature=1.0, seed=index,
                                     cache=cache) == runs.sampled[index]
        identical += (generate_cached(params, tok, prompt, cache=cache, **top_k)
                      == generate_cached(params, tok, prompt, **top_k))
        without += 3 * len(ids)       # each run prefills the whole opening
        shared += len(ids) + 3        # one prefill, then each run feeds the last token again
    return {"runs": 3 * len(lab.prompts), "identical": identical,
            "prompt_rows_without_sharing": without, "prompt_rows_with_sharing": shared}


def reordered_sums(lab):
    """Every sum added term by term, last term first, instead of with one fsum, on the
    first test story: the largest logit gap in the cached path alone, and in both paths.
    (The ladder, lossy.py, does the cached path alone on every story.)"""
    params, first_story = lab.params, lab.tok.encode(lab.test[0])
    full, _ = model.forward(params, first_story)
    with sums_in_another_order():
        reordered = feed(params, KVCache(params), first_story)
        reordered_full, _ = model.forward(params, first_story)
    return {"largest_logit_gap_first_story": largest_gap(full, reordered),
            "largest_logit_gap_first_story_in_both_paths": largest_gap(reordered_full,
                                                                       reordered)}
