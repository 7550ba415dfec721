"""Prefill in chunks under a token budget (Part 7, section 39): a server whose every step
computes at most budget rows, so that a long prompt is prefilled over several steps, in
chunks, beside the running requests' decodes, which then never wait for it.

serving.serve prefills an admitted request's whole prompt inside one step: a step that
admits a long prompt computes all its rows, and every running request's next token waits
for them (a stall). Sarathi-Serve and vLLM's scheduler (max_num_batched_tokens) cap a
step's rows instead. Here each step gives a row to every running request that has chosen
a token first, then what is left of the budget to the prompts being prefilled, in the
order they were admitted, a chunk each. A prompt's chunks are one-pass prefill's chunks,
exact (section 15), so each result is generate.generate's at any budget; what the budget
changes is how the rows are spread over the steps.
"""
import math
import os
from collections import deque

import generate
import model
import svg
from batched import ItemRefused, exact, exact_attention, forward_rows
from documents import LAB, bold, shown, table
from paged import BlockPool
from serving import _Served, _checked_settings, run_steps
from stories import openings, split_stories


def serve(params, tok, requests, pool, max_batch, budget, log=None):
    """Run requests to completion from one pool, each step computing at most budget rows.

    As serving.serve (its requests, pool, max_batch and log; the exact product), but an
    admitted request's rows (its prompt, or a readmitted request's tokens so far, after the
    full blocks the pool still caches) are computed over as many steps as the budget
    needs: each step, one decode row for every running request that chose a token, then
    chunks of the prompts being prefilled, oldest admission first, while the budget lasts.
    A request chooses its first token the step after its last chunk. budget None prefills
    every prompt whole, in the step after its admission. Returns (results, counts): each
    result exactly generate.generate's; counts as serve's, with chunks (prefill pieces
    computed), largest_step (the most rows a step computed), and rows_by_step and
    decodes_by_step (each step's rows, and its decode rows)."""
    log = _checked_settings(params, tok, requests, pool, max_batch, log, exact, exact_attention)
    if budget is not None:
        model.check_int("budget", budget, 1, None, " (rows a step)")
        if budget < max_batch:
            raise ValueError(f"budget {budget} is smaller than max_batch {max_batch}: every "
                             f"running request decodes a row at each step; give a budget "
                             f"of at least max_batch rows")
    served = [_Served(params, tok, index, request, pool)
              for index, request in enumerate(requests)]    # every request checked first
    steps = _Steps(params, pool, max_batch, budget, log,
                   [request for request in served if not request.generation.stopped])
    return run_steps(steps, served)


class _Steps:
    """The budgeted server's steps: the waiting requests, the running ones (in the order
    they were admitted), what it counted, and the parts of a step."""

    def __init__(self, params, pool, max_batch, budget, log, waiting):
        self.params, self.pool, self.max_batch, self.log = params, pool, max_batch, log
        self.budget = math.inf if budget is None else budget
        self.waiting, self.running, self.chose = deque(waiting), [], set()
        self.counts = dict.fromkeys(("steps", "request_steps", "rows", "recomputed_rows",
                                     "preemptions", "prefix_hits", "chunks", "largest_step"),
                                    0)
        self.counts.update(rows_by_step=[], decodes_by_step=[])

    def step(self):
        """One step: choose, admit, plan the rows within the budget (preempting for room),
        compute them in one batch."""
        self.counts["steps"] += 1
        self.choose()
        self.admit()
        plan = self.plan()
        while not self.pool.room_for([(request.seq, rows) for request, rows in plan]):
            self.preempt(self.running[-1])
            plan = self.plan()
        self.compute(plan)

    def choose(self):
        """Every running request whose last row is computed chooses a token; a finished one
        leaves."""
        for request in list(self.running):
            if request.logits is None:
                continue
            request.generation.choose(request.logits)
            request.logits = None
            self.counts["request_steps"] += 1
            if request.generation.stopped:
                self.running.remove(request)
                request.seq.free()
                request.seq = None
                self.log(self.counts["steps"], request.index, "finished")
            else:
                self.chose.add(request.index)

    def admit(self):
        """Admit waiting requests in order, each on its cached prefix (no row computed yet),
        while the batch has room and the pool holds its tokens; refuse a first one that
        cannot be admitted with nothing running."""
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            ids = request.generation.ids
            if not self.pool.room_for_sequence(ids[:-1], len(ids)):
                break
            request.seq = self.pool.sequence(ids[:-1])
            self.counts["prefix_hits"] += len(request.seq.table)
            self.running.append(self.waiting.popleft())
            self.log(self.counts["steps"], request.index, "admitted")
        if self.waiting and not self.running:
            raise ValueError(f"request {self.waiting[0].index} cannot be admitted and "
                             f"nothing runs: {self.waiting[0].seq_room()}")

    def plan(self):
        """The step's rows: [(request, rows)], a decode row for each request that chose,
        then chunks of the others' tokens not yet computed, within the budget."""
        plan = [(request, 1) for request in self.running if request.index in self.chose]
        left = self.budget - len(plan)
        for request in self.running:
            if request.index not in self.chose and left > 0:
                rows = min(left, len(request.generation.ids) - len(request.seq))
                plan.append((request, rows))
                left -= rows
        return plan

    def preempt(self, victim):
        """Give the victim's blocks back and put it first in line (its tokens kept)."""
        if len(self.running) == 1:
            raise ValueError(f"request {victim.index} alone has no room for its rows: "
                             f"{victim.seq.room_left()}")
        self.running.remove(victim)
        self.chose.discard(victim.index)
        victim.preempt()
        self.waiting.appendleft(victim)
        self.counts["preemptions"] += 1
        self.log(self.counts["steps"], victim.index, "preempted")

    def compute(self, plan):
        """Compute the planned rows in one batch; a request whose rows reach its last token
        keeps that row's logits."""
        items, owners = [], []
        for request, rows in plan:
            ids, start = request.generation.ids, len(request.seq)
            items += [(request.seq, ids[at], at) for at in range(start, start + rows)]
            owners += [request.index] * rows
        try:
            logits = forward_rows(self.params, items) if items else []
        except ItemRefused as refused:   # name the request
            raise ValueError(f"request {owners[refused.item]}: {refused.why}") from None
        counts, done = self.counts, 0
        for request, rows in plan:
            done += rows
            end = len(request.seq)
            counts["recomputed_rows"] += max(0, min(end, request.computed) - (end - rows))
            request.computed = max(request.computed, end)
            decoding = request.index in self.chose
            counts["chunks"] += not decoding
            if end == len(request.generation.ids):
                request.logits = logits[done - 1]
            self.log(counts["steps"], request.index, "decode" if decoding else "prefill")
        counts["rows"] += len(items)
        counts["largest_step"] = max(counts["largest_step"], len(items))
        counts["rows_by_step"].append(len(items))
        counts["decodes_by_step"].append(len(self.chose))
        self.chose.clear()


def stalls(counts, budget):
    """Decode rows that waited: those of steps computing more than budget rows."""
    return sum(decodes for rows, decodes in zip(counts["rows_by_step"],
                                                 counts["decodes_by_step"]) if rows > budget)


# ---- the experiment (a stage of trace_kv.py) ---------------------------------------

BUDGETS = (8,)       # rows a step, with batches of up to BATCH: a decode row each, and 4 more
BATCH = 4

# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "token_budget": {
        "requests": svg.COUNT, "max_batch": svg.COUNT, "blocks": svg.COUNT,
        "runs": [{
            "budget": (*svg.COUNT, None), "steps": svg.COUNT, "rows": svg.COUNT,
            "chunks": svg.COUNT, "largest_step": svg.COUNT,
            "stalled_decodes": [svg.COUNT], "mean_steps_to_first_token": svg.COUNT,
            "identical": svg.COUNT}]},
}


def experiment(lab, runs):
    """Serve the 60 greedy openings with whole prompts, then under each of BUDGETS.

    Batches of up to BATCH, from an ample pool. For each run: steps, rows, prefill chunks,
    the most rows a step computed, the decode rows that waited in steps of more rows than
    each of BUDGETS (stalls), the mean steps from a request's admission to the step it
    chose its first token in, and the results identical to generate's."""
    requests = [{"prompt": prompt} for prompt in lab.prompts]
    blocks = len(requests) * 16
    record = {"requests": len(requests), "max_batch": BATCH, "blocks": blocks, "runs": []}
    for budget in (None, *BUDGETS):
        events = {}
        served, counts = serve(lab.params, lab.tok, requests, BlockPool(lab.params, blocks, 4),
                               BATCH, budget, lambda step, index, event: events.setdefault(
                                   (index, event), step))
        waits = [min(events.get((index, "decode"), math.inf),
                     events.get((index, "finished"), math.inf)) - events[(index, "admitted")]
                 for index in range(len(requests))]
        record["runs"].append({
            "budget": budget, "steps": counts["steps"], "rows": counts["rows"],
            "chunks": counts["chunks"], "largest_step": counts["largest_step"],
            "stalled_decodes": [stalls(counts, limit) for limit in BUDGETS],
            "mean_steps_to_first_token": round(sum(waits) / len(waits), 2),
            "identical": sum(a == b for a, b in zip(served, runs.greedy))})
    return record


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
                 [["no budget: whole prompts" if run["budget"] is None else shown(run["budget"]),
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
    for title, budget in (("whole prompts", None), ("at most 6 rows a step", 6)):
        events = {}
        _, counts = serve(params, tok, requests, BlockPool(params, 64, 4), 4, budget,
                          lambda step, index, event: events.setdefault(
                              (index, step), set()).add(event))
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
