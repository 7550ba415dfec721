"""The lesson's experiment (Part 1), the first stages of trace_kv.py: both generators on
the openings of the 60 test stories, greedy and sampled, every cached row against the
uncached generator's last full pass; the lesson's figures (exactness, work, memory, how
well the model writes); one prefill shared by three continuations; and the sums of the
first test story added in another order. Then what --write also times (kv-time.json),
and the tables, figures and pictures the lesson's documents show of the record.
"""
import ast
import difflib
import functools
import inspect
import math
import sys
import time
from collections import namedtuple

import deep_shapes
import generate
import kv_cache
import model
import svg
from documents import TRACE, indented, shown, table
from instruments import (largest_gap, passes_by_input, recording, replaced, results, reusing,
                         sums_in_another_order)
from kv_cache import KVCache, feed, generate_cached, work
from stories import STORY_QUALITY, common_start, rounded_mean, story_ids, story_quality
from trace_records import TIMED, TIMING


LENGTHS = (8, 16, 32, 64)   # the record's cost_by_length: positions from a one-token prompt


KINDS = ("greedy", "sampled")


def both_generators(lab, index):
    """Both generators on opening index, greedy and sampled (temperature 1.0, seed = index).

    For each, the uncached result, whether the cached one is identical, how many positions
    the cached path computed on the same input as the uncached path's last full pass and
    the largest gap between their logits, that full pass's rows and attention weights; and
    the greedy seconds of each path. The sampled uncached run is given the greedy run's
    full passes on the tokens both chose (reusing), not the same computed again."""
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
        same = common_start(story_ids(tok, prompt, cached), story_ids(tok, prompt, uncached))
        one.update({kind: uncached, f"{kind}_identical": cached == uncached,
                    f"{kind}_positions": same,
                    f"{kind}_gap": largest_gap(results(steps)[:same], rows[:same]),
                    f"{kind}_rows": rows, f"{kind}_weights": saved.weights})
        if kind == "greedy":
            one["seconds"] = {"uncached": middle - start, "cached": end - middle}
    return one


Runs = namedtuple("Runs", [f"{kind}{what}" for what in ("", "_identical", "_positions",
                                                        "_gap", "_rows", "_weights")
                           for kind in KINDS] + ["seconds"])
Runs.__doc__ = """Both generators on every opening: for each kind (greedy, sampled), the
uncached results, whether the cached ones are identical, the positions compared and their
largest gap, each last full pass's rows and attention weights; and the greedy seconds."""


def gather_runs(lab, ones):
    """both_generators of every opening, as Runs: one list per field, in opening order."""
    return Runs(*([one[field] for one in ones] for field in Runs._fields))


WORK = dict.fromkeys(("uncached_rows", "cached_rows", "uncached_scores", "cached_scores"),
                     svg.COUNT)

# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "lesson": {
        "stories": svg.COUNT, "largest_logit_gap_first_story": svg.COUNT,
        "positions_checked": svg.COUNT,
        "every_row_of_every_story": {
            "stories": svg.COUNT, "positions": svg.COUNT, "largest_logit_gap": svg.COUNT},
        "greedy_identical": svg.COUNT, "sampled_identical": svg.COUNT,
        "greedy_ended_with_newline": svg.COUNT, "generated_tokens": svg.COUNT,
        "work": WORK,
        "rows_ratio": svg.COUNT, "scores_ratio": svg.COUNT,
        "cache_floats_per_position": svg.COUNT, "cache_floats_full_context": svg.COUNT,
        "greedy_examples": [str],
        "story_quality": dict.fromkeys(("greedy", "sampled"), STORY_QUALITY),
        "cost_by_length": [{"positions": svg.COUNT, **WORK}],
        "attention_to_position_0": {"mean_weight": svg.COUNT, "even_share": svg.COUNT}},
    "prefix_sharing": {
        "runs": svg.COUNT, "identical": svg.COUNT,
        "prompt_rows_without_sharing": svg.COUNT, "prompt_rows_with_sharing": svg.COUNT},
    "sums_in_another_order": {
        "largest_logit_gap_first_story": svg.COUNT,
        "largest_logit_gap_first_story_in_both_paths": svg.COUNT},
}


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
    """The mean attention weight position 0 gets from every later position, against an even share.

    Over the 60 greedy stories (weights: each story's rows of attention weights); an even
    share gives it 1 / (i + 1) at position i."""
    later = [row for story in weights for row in story[1:]]
    return {"mean_weight": rounded_mean([row[0] for row in later]),
            "even_share": rounded_mean([1 / len(row) for row in later])}


def share_prefixes(lab, runs):
    """Prefill each opening once and continue it three ways from that cache.

    The ways: greedy, sampled, top-k 3; each must equal the run without a shared cache."""
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
    """The largest logit gap when every sum is added term by term, last term first.

    Instead of with one fsum, on the first test story: in the cached path alone, and in
    both paths. (The ladder, lossy.py, does the cached path alone on every story.)"""
    params, first_story = lab.params, lab.tok.encode(lab.test[0])
    full, _ = model.forward(params, first_story)
    with sums_in_another_order():
        reordered = feed(params, KVCache(params), first_story)
        reordered_full, _ = model.forward(params, first_story)
    return {"largest_logit_gap_first_story": largest_gap(full, reordered),
            "largest_logit_gap_first_story_in_both_paths": largest_gap(reordered_full,
                                                                       reordered)}


# ---- what --write also times, in this process alone (kv-time.json) ------------------

def timings(lab, runs):
    """What --write also times, in this process alone.

    A row's share of fsum, each length's seconds, and the bytes CPython uses for the cache
    and Part 5's caches."""
    params, tok = lab.params, lab.tok
    fed = [story_ids(tok, prompt, r)[:-1]              # the last chosen token is never fed
           for prompt, r in zip(lab.prompts, runs.greedy)]
    step_seconds, sum_seconds = fsum_share(params, fed)
    full_context = [t for story in lab.test for t in tok.encode(story)][:model.CONTEXT]
    memory = cache_bytes(params, full_context)
    return {
        "forward_step_over_its_fsum_calls": round(step_seconds / sum_seconds, 2),
        "cost_by_length": seconds_by_length(params, tok),
        "cache_bytes_full_context": memory,
        "cache_bytes_per_position": round(memory / model.CONTEXT, 2),
        "cache_bytes_as_8_byte_floats": 8 * 2 * model.WIDTH * model.CONTEXT,
        "deep_model_cache_bytes_as_cpython_objects": deep_shapes.deep_cache_bytes(lab),
    }


def seconds_by_length(params, tok, repeats=2):
    """Seconds of both generators from a one-token prompt ("mia") to 8, 16, 32 and 64 positions.

    With a copy of the model that never ends a story: the faster of repeats runs of each,
    taken in turns, so that a busy moment of the machine counts less."""
    never_ends = generate.never_ending(params, tok)
    seconds = []
    for length in LENGTHS:
        uncached = cached = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            generate.generate(never_ends, tok, "mia", max_new_tokens=length - 1)
            middle = time.perf_counter()
            generate_cached(never_ends, tok, "mia", max_new_tokens=length - 1)
            uncached = min(uncached, middle - start)
            cached = min(cached, time.perf_counter() - middle)
        seconds.append({"positions": length, "uncached_seconds": round(uncached, 4),
                        "cached_seconds": round(cached, 4),
                        "speedup": round(uncached / cached, 1)})
    return seconds


def fsum_share(params, stories):
    """Seconds for forward_step over every position of the stories, and for its fsums alone.

    stories are lists of token IDs. The math.fsum calls those steps make are timed on the
    same terms: each story is first run once to record its calls' terms, then both are
    timed, story by story."""
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


# ---- what the lesson's documents show of it (documents.py fills their marks) ---------

FULL_RECORD = "The full record: {} (or python3 trace_kv.py --json)"


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


def summary_block(record, timing):
    """What python3 trace_kv.py prints, as the README shows it.

    The record and the timing checked first against their declarations (the timing's:
    trace_records.TIMING)."""
    svg.checked(record, svg.picked(RECORDS["lesson"], "stories", "every_row_of_every_story",
                                   "greedy_identical", "sampled_identical", "generated_tokens",
                                   "work", "rows_ratio", "scores_ratio"))
    if timing:
        svg.checked(timing, svg.picked(TIMING, "uncached_seconds", "cached_seconds", "speedup"),
                    "time")
    return ["```", *summary(record, timing).splitlines(), FULL_RECORD.format(TRACE), "```"]


def work_table(record, timing):
    """The table of rows and attention scores computed without and with the cache."""
    w = svg.checked(record, svg.picked(RECORDS["lesson"], "work", "rows_ratio",
                                       "scores_ratio"))["work"]
    return table(["", "without the cache", "with the cache", "ratio"], [
        ["rows (positions run through the model)", shown(w["uncached_rows"]),
         shown(w["cached_rows"]), f"{record['rows_ratio']}x"],
        ["attention scores", shown(w["uncached_scores"]), shown(w["cached_scores"]),
         f"{record['scores_ratio']}x"]])


def cost_table(record, timing):
    """The table of rows, scores and seconds to reach each length, without and with the cache."""
    svg.checked(record, svg.picked(RECORDS["lesson"], "cost_by_length"))
    svg.checked(timing, svg.picked(TIMED, "cost_by_length"), "time")
    return table(["positions", "rows without", "rows with", "scores without", "scores with",
                  "seconds without", "seconds with", "speed-up", "rows ratio"],
                 [[e["positions"], shown(e["uncached_rows"]), shown(e["cached_rows"]),
                   shown(e["uncached_scores"]), shown(e["cached_scores"]),
                   f"{s['uncached_seconds']:.4f}", f"{s['cached_seconds']:.4f}",
                   f"{s['speedup']}x", f"{e['positions'] // 2}x"]
                  for e, s in zip(record["cost_by_length"], timing["cost_by_length"])])


def cost_chart(record, timing):
    """A text chart of the rows computed to reach each length, without and with the cache."""
    lengths = svg.checked(record, svg.picked(RECORDS["lesson"], "cost_by_length"))[
        "cost_by_length"]
    width, most = 48, max(1, *(e["uncached_rows"] for e in lengths))   # the longest bar
    lines = ["rows computed to reach each length (# without the cache, = with it)"]
    for e in lengths:
        for label, rows, mark in ((e["positions"], e["uncached_rows"], "#"),
                                  ("", e["cached_rows"], "=")):
            lines.append(f"{label:>3} {mark * min(width, max(1, round(rows / most * width)))} "
                         f"{rows:,}")
    return ["```text", *lines, "```"]


def greedy_examples(record, timing):
    """The first three greedy stories, indented."""
    return indented(svg.checked(record, svg.picked(RECORDS["lesson"], "greedy_examples"))[
        "greedy_examples"])


def rows_saved_by_sharing(record, timing):
    """How many prompt rows prefilling each opening once for its three runs saves."""
    sharing = record["prefix_sharing"]
    return sharing["prompt_rows_without_sharing"] - sharing["prompt_rows_with_sharing"]


def cpython_over_8_byte_floats(record, timing):
    """How many times the bytes of 8-byte floats CPython uses for a full context's cache."""
    return round(timing["cache_bytes_full_context"] / timing["cache_bytes_as_8_byte_floats"], 1)


@functools.lru_cache(maxsize=None)   # of the code alone: the same in a run
def _the_row_side_by_side():
    def body_lines(function, statements):
        lines = inspect.getsource(function).splitlines()
        return [lines[line - 1].strip() for s in statements
                for line in range(s.lineno, s.end_lineno + 1)]
    forward = ast.parse(inspect.getsource(model.forward)).body[0]
    loops = [s for s in forward.body if isinstance(s, ast.For)]
    step = ast.parse(inspect.getsource(kv_cache.forward_step)).body[0]
    after_checks = next(i for i, s in enumerate(step.body) if isinstance(s, ast.Assign))
    for_each_position = body_lines(model.forward, [s for loop in loops for s in loop.body])
    one_position = body_lines(kv_cache.forward_step, step.body[after_checks:])
    diff = list(difflib.unified_diff(for_each_position, one_position, lineterm="",
                                     n=len(one_position)))
    return ["```diff", "--- model.forward: the body of its loops, for each position",
            "+++ kv_cache.forward_step: after its checks, for one position", *diff[3:], "```"]


def the_row_side_by_side(record=None, timing=None):
    """model.forward's two loops over positions against kv_cache.forward_step after its checks.

    A diff generated from their real source (not from the record): the lines they share,
    and those that differ (what each keeps, where keys and values come from)."""
    return list(_the_row_side_by_side())


def rows_picture(record, timing):
    """Section 8's picture: rows and attention scores computed to reach each length.

    With and without the cache (the record's cost_by_length)."""
    lengths = svg.checked(record, {"cost_by_length": [{**WORK, "positions": (1, svg.LARGEST)}]}
                          )["cost_by_length"]
    body = []
    for left, kind, unit in ((90, "rows", "rows computed"),
                             (450, "scores", "attention scores computed")):
        most = max(4, *(e[f"uncached_{kind}"] for e in lengths))   # 4 ticks, a whole step
        step = 10 ** math.floor(math.log10(most))
        top = math.ceil(most / step) * step
        panel = svg.Panel((left, 50, 250, 270), (0, lengths[-1]["positions"]), (0, top))
        body += panel.axes([0] + [e["positions"] for e in lengths],
                           range(0, top + 1, top // 4), "positions reached", unit)
        for prefix, color, label in (("uncached", svg.COLORS[0], "without the cache"),
                                     ("cached", svg.COLORS[1], "with the cache")):
            body += panel.line([(e["positions"], e[f"{prefix}_{kind}"],
                                 f"{e['positions']} positions: {e[f'{prefix}_{kind}']:,} "
                                 f"{kind} {label}") for e in lengths], color)
    return svg.page("What the cache saves: work to reach each length (one-token prompt)",
                    body + svg.legend(100, 380, [("without the cache", svg.COLORS[0])])
                    + svg.legend(300, 380, [("with the cache", svg.COLORS[1])]))
