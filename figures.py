"""The README's figures, written from the record, so that each lives in one place: the
record (kv-trace.json, and kv-time.json for times). python3 trace_kv.py --write rewrites
them along with the two files, on any machine; test_readme checks them all in one loop.
The tables and text blocks are tables.py's; the pictures drawn from the code, diagrams.py's.

The README marks each figure it quotes from the record, in comments a reader does not see:

    <!--fig PATH-->20,509<!--/-->      one figure, the entry PATH of the record
    <!--block NAME-->                   on a line of its own: the lines after it, up to
    | ... |                             the next blank line, are BLOCKS[NAME]'s (a table,
                                        a text block or a diagram)

PATH is the record's keys joined by dots (kv-trace.json's; time.KEY for kv-time.json's;
derived.NAME for one of DERIVED, a figure computed from several); an item of a list is
picked by its number or by its fields (rungs.cache=int4, runs.drafter=x&lookahead=4).
PATH:SPEC formats the figure with that format spec (tables.shown says how it is printed
without one).
"""
import functools
import re

import bandwidth
import blockwise
import tables
from tables import real_cache_bytes, shown

README, TRACE, TIMES = "README.md", "kv-trace.json", "kv-time.json"
FULL_RECORD = "The full record: {} (or python3 trace_kv.py --json)"
FIGURE = re.compile(r"<!--fig ([^>\n]*?)-->([^<\n]*)<!--/-->")   # within one line
BLOCK = re.compile(r"^<!--block (\w+)-->\n(.*?)(?=^$)", re.M | re.S)


def entry(path, record, timing):
    """The value at PATH (without its :SPEC) in the record, the timing, or DERIVED."""
    root, _, rest = path.partition(".")
    if root == "derived":
        return DERIVED[rest](record, timing)
    value, keys = (timing, rest.split(".")) if root == "time" else (record, path.split("."))
    for key in keys:
        if isinstance(value, list):
            wanted = dict(pair.split("=", 1) for pair in key.split("&")) if "=" in key else None
            matches = ([item for item in value if all(str(item.get(field)) == text
                                                      for field, text in wanted.items())]
                       if wanted else [value[int(key)]])
            if len(matches) != 1:
                raise KeyError(f"{key!r} picks {len(matches)} items of the list, not one")
            value = matches[0]
        else:
            value = value[key]
    return value


def figure(mark, record, timing):
    """What the mark PATH[:SPEC] stands for, as the README prints it."""
    path, _, spec = mark.partition(":")
    return shown(entry(path, record, timing), spec)


def rendered(text, record, timing):
    """text with every marked figure and block written from the record and the timing."""
    text = FIGURE.sub(lambda m: f"<!--fig {m[1]}-->{figure(m[1], record, timing)}<!--/-->",
                      text)
    return BLOCK.sub(lambda m: "".join(line + "\n" for line in (
        f"<!--block {m[1]}-->", *BLOCKS[m[1]](record, timing))), text)


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


# ---- figures computed from several entries ------------------------------------------

def _speed_against_rows(record, timing):
    """How the recorded speed-ups of cost_by_length stand against their rows ratios."""
    below = [run["speedup"] < length["positions"] // 2
             for run, length in zip(timing["cost_by_length"], record["cost_by_length"])]
    return ("each lands a little below its rows ratio" if all(below) else
            "not every one lands below its rows ratio")


def _deeper_grouped(record):
    """The rotary stage's grouped-query shapes of two layers or more."""
    return [s for s in record["rotary"]["shapes"] if s["kv_heads"] == 2 and s["layers"] > 1]


def _latent_shapes_of(record, coupled):
    """The latent stage's shapes: the coupled controls (rotary, no rotary key), or the rest."""
    return [s for s in record["latent_attention"]["shapes"]
            if (s["positions"] == "rotary" and not s["rotary_key"]) == coupled]


def _per_position(record, timing, path):
    """What one more attended position adds to a decode step's products on path."""
    first, *_, last = record["latent_attention"]["work_per_step"]["steps"]
    return (last[path] - first[path]) // (last["attended"] - first["attended"])


def _times(ratio):
    """A ratio in words: "more than twice", "nearly twice" and so on."""
    return ("more than three times" if ratio > 3 else "more than twice" if ratio > 2
            else "nearly twice" if ratio > 1.8 else f"{ratio:.1f} times")


def _split_kv_as_generate(record, timing):
    """How many of the split-KV runs' stories are generate's, batch by batch, in words."""
    requests = record["batched_decode"]["requests"]
    same = [run["stories_identical_to_generate"] for run in record["batched_decode"]["runs"]
            if run["kernel"] == "split-KV attention"]
    return (f"all {requests}" if set(same) == {requests}
            else ", ".join(map(str, same)) + f" of {requests}")


def _against(figure, reference, close, below, above):
    """Words for how figure stands against reference: within 10% of it, or not."""
    return close if abs(figure / reference - 1) <= 0.1 else below if figure < reference else above


DERIVED = {
    "speedup_against_rows": lambda r, t: _against(t["speedup"], r["rows_ratio"], "close to",
                                                  "below", "above"),
    "cached_row_cost": lambda r, t: _against(t["cached_microseconds_per_row"],
                                             t["uncached_microseconds_per_row"], "about what",
                                             "less than", "more than"),
    "fsum_share_of_a_row": lambda r, t: (
        "Most of a row is the correctly rounded sums" if t["forward_step_over_its_fsum_calls"] < 2
        else f"The correctly rounded sums are "
             f"{1 / t['forward_step_over_its_fsum_calls']:.0%} of a row"),
    "cpython_over_8_byte_floats": lambda r, t: round(t["cache_bytes_full_context"]
                                                     / t["cache_bytes_as_8_byte_floats"], 1),
    "rows_saved_by_sharing": lambda r, t: (r["prefix_sharing"]["prompt_rows_without_sharing"]
                                           - r["prefix_sharing"]["prompt_rows_with_sharing"]),
    "speed_against_rows": _speed_against_rows,
    "rotary_largest_gap": lambda r, t: max(s["largest_logit_gap"] for s in r["rotary"]["shapes"]),
    "rotary_later_layers_gaps": lambda r, t: ", ".join(
        shown(e["largest_logit_gap"]) for e in r["rotary"]["against_recompute_by_layers"][1:]),
    "rotary_later_layers_changed": lambda r, t: ", ".join(
        str(e["continuations_changed"]) for e in r["rotary"]["against_recompute_by_layers"][1:]),
    "rotary_offset_gaps": lambda r, t: ", ".join(
        shown(s["offset_after_other_tokens"]["largest_logit_gap"]) for s in _deeper_grouped(r)),
    "rotary_offset_changed": lambda r, t: (
        f"{sum(s['offset_after_other_tokens']['continuation_changed'] for s in _deeper_grouped(r))}"
        f" of {len(_deeper_grouped(r))}"),
    "latent_absorbed_largest_gap": lambda r, t: max(
        s["largest_gap_absorbed"] for s in _latent_shapes_of(r, coupled=False)),
    "latent_control_gaps": lambda r, t: " and ".join(
        shown(s["largest_gap_absorbed"]) for s in _latent_shapes_of(r, coupled=True)),
    "latent_control_parts_at": lambda r, t: " and ".join(
        str(s["continuation_parts_at"] + 1) for s in _latent_shapes_of(r, coupled=True)),
    **{f"latent_{path}_per_position": functools.partial(_per_position, path=path)
       for path in ("rebuilt", "absorbed", "multi-head")},
    "deepseek_v3_ratio": lambda r, t: round(real_cache_bytes()["DeepSeek-V3"][1]
                                            / real_cache_bytes()["DeepSeek-V3"][0]),
    "llama_share_lost_at_4096": lambda r, t: format(
        1 - bandwidth.bound(bandwidth.LLAMA_2_7B, 4096)
        / bandwidth.bound(bandwidth.LLAMA_2_7B, 0), ".0%"),
    "llama_cache_outweighs_at_batch_16": lambda r, t: bandwidth.cache_outweighs_weights(
        bandwidth.LLAMA_2_7B, 16),
    "grouped_query_over_multi_head_at_batch_16": lambda r, t: _times(
        bandwidth.bound({**bandwidth.LLAMA_2_7B, "kv_heads": 8}, 4096, 16)
        / bandwidth.bound(bandwidth.LLAMA_2_7B, 4096, 16)),
    "llama_70b_bound": lambda r, t: round(bandwidth.bound(bandwidth.LLAMA_2_70B_8_BIT, 0), 1),
    "split_counts": lambda r, t: "{}, {}, {} and {}".format(
        *(blockwise.split_count(rows, 64) for rows in (1, 2, 4, 8))),
    "blockwise_stories_changed": lambda r, t: sum(
        k["greedy_stories_changed"] + k["sampled_stories_changed"]
        for k in r["blockwise"]["kinds"]),
    "split_kv_as_generate": _split_kv_as_generate,
    "split_kv_largest_gap": lambda r, t: max(
        run["largest_logit_gap_against_exact"] for run in r["batched_decode"]["runs"]
        if run["kernel"] == "split-KV attention"),
    "last_dropped_position": lambda r, t: r["rotary"]["dropped"] - 1,
    "last_position": lambda r, t: r["rotary"]["positions"] - 1,
}


def _summary(r, t):
    return ["```", *summary(r, t).splitlines(), FULL_RECORD.format(TRACE), "```"]


BLOCKS = {"summary": _summary, **tables.BLOCKS}   # every block the README may hold
