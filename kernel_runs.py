"""An engine's kernels in the server (Part 4, sections 22 and 23): the 60 sampled openings
served with each kernel of KERNELS (batched.py's products, blockwise.py's split-KV
attention), in batches of 1 and of up to 8, against the kernel's own batches of 1 and the
uncached generator; the stage of trace_kv.py that records it, and the tables and the
picture the Part draws from that record.
"""
import blockwise
import generate
import svg
from batched import batch_invariant, by_batch, by_batch_float32
from documents import plain, shown, table
from instruments import chosen_rows, largest_gap, recording
from paged import BlockPool
from serving import SMALL_POOL, all_openings, serve
from stories import story_ids

KERNELS = {"batch-dependent": {"product": by_batch},              # serve's keywords
           "32-bit batch-dependent": {"product": by_batch_float32},
           "batch-invariant": {"product": batch_invariant},
           "split-KV attention": {"attention": blockwise.heuristic}}
KERNEL_RUNS = (("batch-dependent", 1, "ample"), ("batch-dependent", 8, "ample"),
               ("batch-dependent", 8, "small"),
               *((kernel, batch, "ample") for kernel in ("32-bit batch-dependent",
                                                         "batch-invariant")
                 for batch in (1, 8)),
               *(("split-KV attention", batch, "ample") for batch in (1, 8)))
GREEDY_TOO = (("batch-dependent", 8, "ample"),   # kernel_run says why
              ("32-bit batch-dependent", 8, "ample"))
SPLIT_KV = "split-KV attention"   # KERNELS' name for blockwise.heuristic


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "batched_decode": {
        "requests": svg.COUNT,
        "runs": [{
            "kernel": str, "max_batch": svg.COUNT, "pool": str,
            **dict.fromkeys(("blocks", "steps", "preemptions", "prefix_hits",
                             "stories_identical_to_generate"), svg.COUNT),
            "greedy_stories_identical_to_generate": (*svg.COUNT, None),
            "largest_logit_gap_against_exact": svg.COUNT,
            "stories_identical_to_batches_of_1": svg.COUNT,
            "first_position_parting_from_batches_of_1": (*svg.COUNT, None),
            "choosing_rows_compared_with_batches_of_1": svg.COUNT,
            "choosing_rows_unlike_batches_of_1": svg.COUNT,
            "logits_as_with_batches_of_1": bool}]},
}


def kernel_run(lab, case, runs):
    """Serve the 60 sampled openings with the engine's kernel of KERNEL_RUNS[case].

    The kernel does every matrix product or every row's attention (prefill and decode rows
    alike). Gives what serving did, each story's token IDs, how many are generate's, the
    largest gap between a logit a token was chosen with and the uncached full pass's for the
    same tokens, and every such choosing row (its tokens, its logits). A run that is in
    GREEDY_TOO then serves the 60 greedy openings the same way, from the same pool (their
    prompts' blocks are found there): how many of those stories are generate's (None for the
    other runs)."""
    kernel, max_batch, pool = KERNEL_RUNS[case]
    openings = all_openings(lab)
    requests = openings[len(lab.prompts):]
    blocks = SMALL_POOL if pool == "small" else len(requests) * 16
    pool_of_blocks = BlockPool(lab.params, blocks, 4)
    with recording(generate.Generation, "choose") as choices:
        served, counts = serve(lab.params, lab.tok, requests, pool_of_blocks, max_batch,
                               **KERNELS[kernel])
    greedy = None
    if KERNEL_RUNS[case] in GREEDY_TOO:
        served_greedy, _ = serve(lab.params, lab.tok, openings[:len(lab.prompts)],
                                 pool_of_blocks, max_batch, **KERNELS[kernel])
        greedy = sum(a == b for a, b in zip(served_greedy, runs.greedy))
    exact_stories = [story_ids(lab.tok, request["prompt"], result)
                     for request, result in zip(requests, runs.sampled)]
    exact_rows = {tuple(ids[:position + 1]): row
                  for ids, rows in zip(exact_stories, runs.sampled_rows)
                  for position, row in enumerate(rows)}
    stories = [story_ids(lab.tok, request["prompt"], result)
               for request, result in zip(requests, served)]
    chosen = sorted((tuple(generation.ids[:position + 1]), logits)
                    for generation, position, logits in chosen_rows(choices))
    return {"kernel": kernel, "max_batch": max_batch, "pool": pool, "blocks": blocks,
            "steps": counts["steps"], "preemptions": counts["preemptions"],
            "prefix_hits": counts["prefix_hits"], "stories": stories,
            "stories_identical_to_generate": sum(a == b for a, b in zip(stories,
                                                                        exact_stories)),
            "greedy_stories_identical_to_generate": greedy,
            "largest_logit_gap_against_exact": max(largest_gap([logits], [exact_rows[ids]])
                                                   for ids, logits in chosen
                                                   if ids in exact_rows),
            "chosen": chosen}


def kernel_table(lab, runs_of_kernels):
    """Compare each kernel run with its kernel in batches of 1, and with the uncached generator.

    Against both: stories identical, the first position where a story parts, how many
    choosing rows for the same tokens have other logits, and whether every choosing row is
    bit for bit the same."""
    alone = {run["kernel"]: run for run in runs_of_kernels if run["max_batch"] == 1}
    table = []
    for run in runs_of_kernels:
        first = alone[run["kernel"]]
        parted = [next(position for position, (a, b) in enumerate(zip(story + [None],
                                                                       other + [None]))
                       if a != b)
                  for story, other in zip(run["stories"], first["stories"]) if story != other]
        rows_alone = {}   # tokens -> the logits batches of 1 chose with (openings may repeat)
        for ids, logits in first["chosen"]:
            rows_alone.setdefault(ids, []).append(logits)
        compared = [(ids, logits) for ids, logits in run["chosen"] if ids in rows_alone]
        table.append({**{key: value for key, value in run.items()
                         if key not in ("stories", "chosen")},
                      "stories_identical_to_batches_of_1": sum(
                          a == b for a, b in zip(run["stories"], first["stories"])),
                      "first_position_parting_from_batches_of_1": min(parted, default=None),
                      "choosing_rows_compared_with_batches_of_1": len(compared),
                      "choosing_rows_unlike_batches_of_1": sum(
                          logits not in rows_alone[ids] for ids, logits in compared),
                      "logits_as_with_batches_of_1": run["chosen"] == first["chosen"]})
    return {"requests": len(runs_of_kernels[0]["stories"]), "runs": table}


# ---- what Part 4 shows of it (documents.py fills its marks) --------------------------

def kernels_table(record, timing):
    """Section 22's table: the 60 sampled openings served with each product kernel, by batch.

    The split-KV attention's runs are section 23's split_kv_table."""
    k = _decode(record)
    of = f" of {k['requests']}"
    return table(["kernel", "batches of up to", "pool", "steps", "preemptions",
                  "stories as with batches of 1",
                  "first position (prompt included) where one parts",
                  "choosing rows unlike batches of 1 (same tokens)", "stories as `generate`'s",
                  "largest logit gap against the exact rows"],
                 [[plain(run["kernel"]), run["max_batch"],
                   f"{plain(run['pool'])} ({shown(run['blocks'])} blocks)",
                   run["steps"], run["preemptions"],
                   f"{run['stories_identical_to_batches_of_1']}{of}",
                   shown(run["first_position_parting_from_batches_of_1"]),
                   f"{run['choosing_rows_unlike_batches_of_1']} of "
                   f"{shown(run['choosing_rows_compared_with_batches_of_1'])}",
                   f"{run['stories_identical_to_generate']}{of}",
                   shown(run["largest_logit_gap_against_exact"])]
                  for run in k["runs"] if run["kernel"] != SPLIT_KV])


def split_kv_table(record, timing):
    """Section 23's table: the 60 sampled openings served with split-KV attention, by batch.

    The attention is blockwise.heuristic's split; the product is exact."""
    of = f" of {_decode(record)['requests']}"
    return table(["batches of up to", "steps", "choosing rows unlike batches of 1 (same tokens)",
                  "stories as `generate`'s", "largest logit gap against the exact rows"],
                 [[run["max_batch"], run["steps"],
                   f"{run['choosing_rows_unlike_batches_of_1']} of "
                   f"{shown(run['choosing_rows_compared_with_batches_of_1'])}",
                   f"{run['stories_identical_to_generate']}{of}",
                   shown(run["largest_logit_gap_against_exact"])] for run in _split_kv_runs(record)])


def _decode(record):
    """The record's batched_decode, checked as RECORDS declares it."""
    return svg.checked(record, svg.picked(RECORDS, "batched_decode"))["batched_decode"]


def _split_kv_runs(record):
    return [run for run in record["batched_decode"]["runs"] if run["kernel"] == SPLIT_KV]


def split_kv_as_generate(record, timing):
    """How many of the split-KV runs' stories are generate's, batch by batch, in words."""
    requests = record["batched_decode"]["requests"]
    same = [run["stories_identical_to_generate"] for run in _split_kv_runs(record)]
    return (f"all {requests}" if set(same) == {requests}
            else ", ".join(map(str, same)) + f" of {requests}")


def split_kv_largest_gap(record, timing):
    """The largest logit gap against the exact rows of any split-KV run."""
    return max(run["largest_logit_gap_against_exact"] for run in _split_kv_runs(record))


def stories_picture(record, timing):
    """Draw section 22's picture: the stories each kernel changes, by batch.

    For the 60 sampled openings in the ample pool, the stories each kernel makes other than
    generate's, and other than its own with batches of 1."""
    decode = _decode(record)
    runs = [run for run in decode["runs"] if run["pool"] == "ample"]
    if not runs:
        raise ValueError("the record's batched_decode.runs has no run of the ample pool to draw")
    kernels = list(dict.fromkeys(run["kernel"] for run in runs))
    if len(kernels) > len(svg.COLORS):   # a bar has its colour alone to tell its kernel
        raise ValueError(f"the record's batched_decode.runs has {len(kernels)} kernels, more "
                         f"than the {len(svg.COLORS)} colours that tell the bars apart")
    requests = decode["requests"]
    batches = sorted({run["max_batch"] for run in runs})
    yticks = svg.ticks(max(4, *(requests - run["stories_identical_to_generate"] for run in runs)))
    top = yticks[-1]
    body, not_run = [], False
    for left, key, label, kept in (
            (80, "stories_identical_to_generate", "not generate's", "are generate's"),
            (440, "stories_identical_to_batches_of_1", "not as with batches of 1",
             "are as with batches of 1")):
        panel = svg.Panel((left, 50, 250, 270), (0, len(batches)), (0, top))
        body += panel.axes([], yticks, "batches of up to", f"stories {label} "
                           f"(of {requests})")
        for b, batch in enumerate(batches):
            body.append(svg.text(panel.x(b + 0.5), panel.y(0) + 16, str(batch), 11, "middle"))
            for k, kernel in enumerate(kernels):
                run = next((run for run in runs if (run["kernel"], run["max_batch"]) ==
                            (kernel, batch)), None)
                x = b + 0.1 + 0.8 * k / len(kernels)
                if run is None:   # a cross at the axis, not an empty place
                    body.append(panel.dot(x + 0.4 / len(kernels), 0, f"{kernel}, batches of up "
                                          f"to {batch}: not run", "#888", "cross"))
                    not_run = True
                    continue
                count = requests - run[key]
                body.append(panel.bar(x, 0, x + 0.8 / len(kernels), max(count, 0.04),
                                      svg.COLORS[k], f"{kernel}, batches of up to {batch}: "
                                      f"{run[key]} of {requests} stories {kept}"))
    entries = list(zip(kernels, svg.COLORS)) + [("not run", "#888", "cross", False)] * not_run
    return svg.page(f"Batched decode: the stories a kernel changes ({requests} sampled openings)",
                    body + svg.legend(90, 370, entries, columns=2, width=350),
                    height=max(svg.HEIGHT, 370 + 18 * svg.legend_rows(entries, 2)))
