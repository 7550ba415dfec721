"""Prefill in chunks under a token budget, measured (Part 7, section 39's stage): the 60
greedy openings served with whole prompts and under a budget of rows a step
(serving.serve's budget, token_budget.BudgetedSteps), the decode rows that wait in the
steps over the budget, the steps to each first token, and section 39's table and
picture.
"""
import math
import os

import generate
import svg
from documents import LAB, bold, shown, table
from paged import BlockPool
from model import CONTEXT
from serving import serve
from stories import openings, split_stories


def stalls(counts, budget):
    """Decode rows that waited: those of steps computing more than budget rows."""
    return sum(decodes for rows, decodes in zip(counts["rows_by_step"],
                                                 counts["decodes_by_step"]) if rows > budget)


# ---- the experiment (a stage of trace_kv.py) ---------------------------------------

BUDGETS = (8,)       # rows a step, with batches of up to BATCH: a decode row each, and 4 more
BATCH = 4
WHOLE = BATCH * CONTEXT   # a budget no step reaches: every prompt prefilled whole in a step

# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "token_budget": {
        "requests": svg.COUNT, "max_batch": svg.COUNT, "blocks": svg.COUNT,
        "runs": [{
            "budget": svg.COUNT, "steps": svg.COUNT, "rows": svg.COUNT,
            "chunks": svg.COUNT, "largest_step": svg.COUNT,
            "stalled_decodes": [svg.COUNT], "mean_steps_to_first_token": svg.COUNT,
            "identical": svg.COUNT}]},
}


def experiment(lab, runs):
    """Serve the 60 greedy openings with whole prompts, then under each of BUDGETS.

    Batches of up to BATCH, from an ample pool; whole prompts under a budget of WHOLE,
    which no step reaches (so that both runs are serve's steps under a budget, each step
    one batch, and differ only in the budget). For each run: steps, rows, prefill chunks,
    the most rows a step computed, the decode rows that waited in steps of more rows than
    each of BUDGETS (stalls), the mean steps from a request's admission to the step it
    chose its first token in, and the results identical to generate's."""
    requests = [{"prompt": prompt} for prompt in lab.prompts]
    blocks = len(requests) * 16
    record = {"requests": len(requests), "max_batch": BATCH, "blocks": blocks, "runs": []}
    for budget in (WHOLE, *BUDGETS):
        events = {}
        served, counts = serve(lab.params, lab.tok, requests, BlockPool(lab.params, blocks, 4),
                               BATCH, lambda step, index, event: events.setdefault(
                                   (index, event), step), budget=budget)
        record["runs"].append(measured(budget, served, counts, events, runs.greedy))
    return record


def measured(budget, served, counts, first, expected):
    """Give a run's figures, section 39's row, from serve's results, counts and log.

    first[(request index, event)] is the first step the log was told each event in; the
    run was under budget, its results expected as expected. A request's steps to its
    first token run from the step it was admitted in to the first it decoded in (or
    finished in, if its first token ended it)."""
    waits = [min(first.get((index, "decode"), math.inf),
                 first.get((index, "finished"), math.inf)) - first[(index, "admitted")]
             for index in range(len(served))]
    return {"budget": budget, "steps": counts["steps"], "rows": counts["rows"],
            "chunks": counts["chunks"], "largest_step": counts["largest_step"],
            "stalled_decodes": [stalls(counts, limit) for limit in BUDGETS],
            "mean_steps_to_first_token": round(sum(waits) / len(waits), 2),
            "identical": sum(a == b for a, b in zip(served, expected))}


# ---- what Part 7 shows of it (documents.py fills its marks) --------------------------

def budgets_table(record, timing):
    """Section 39's table: the greedy openings served with whole prompts and under budgets."""
    b = svg.checked(record, {"token_budget": RECORDS["token_budget"]})["token_budget"]
    for i, run in enumerate(b["runs"]):
        if len(run["stalled_decodes"]) != len(BUDGETS):
            raise ValueError(f"the record's token_budget.runs[{i}].stalled_decodes must hold "
                             f"{len(BUDGETS)} counts, one for each of {BUDGETS}")
    return table(["rows a step at most", "steps", "rows", "prefill chunks",
                  "most rows in a step",
                  *(f"decode rows waiting in steps of more than {limit}" for limit in BUDGETS),
                  "steps from admission to the first token, mean", "identical to `generate`"],
                 [[f"{shown(run['budget'])}: whole prompts" if run["budget"] >= WHOLE
                   else shown(run["budget"]),
                   shown(run["steps"]), shown(run["rows"]), shown(run["chunks"]),
                   shown(run["largest_step"]), *map(shown, run["stalled_decodes"]),
                   shown(run["mean_steps_to_first_token"]),
                   bold(f"{run['identical']} of {b['requests']}")] for run in b["runs"]])


def timeline(record=None, timing=None, folder=LAB):
    """Draw section 39's picture from real runs, with whole prompts and under a budget.

    A line per request, the budget 6 rows a step. Not from the record: on folder's model
    and corpus, four openings, batches of up to four, a pool of 64 blocks of 4, at most 12
    new tokens each. One character per step: P a chunk of its prompt computed, . a decode
    row, * finished, - waiting (or admitted with no row this step)."""
    params, tok = generate.load_trained(folder)
    with open(os.path.join(folder, "corpus.txt"), encoding="utf-8") as f:
        prompts = openings(split_stories(f.read())[2])[:4]
    requests = [{"prompt": prompt, "max_new_tokens": 12} for prompt in prompts]
    lines = ["```text"]
    for title, budget in ((f"whole prompts (at most {WHOLE} rows a step)", WHOLE),
                          ("at most 6 rows a step", 6)):
        events = {}
        _, counts = serve(params, tok, requests, BlockPool(params, 64, 4), 4,
                          lambda step, index, event: events.setdefault(
                              (index, step), set()).add(event), budget=budget)
        lines.append(f"{title}: {counts['steps']} steps, at most {counts['largest_step']} "
                     f"rows in one")
        for index, prompt in enumerate(prompts):
            marks, finished = "", False
            for step in range(1, counts["steps"] + 1):
                happened = events.get((index, step), set())
                marks += ("*" if "finished" in happened else "P" if "prefill" in happened
                          else "." if "decode" in happened else " " if finished else "-")
                finished = finished or "finished" in happened
            lines.append(f"  {prompt:<{max(map(len, prompts))}}  {marks.rstrip()}")
    return lines + ["```"]
