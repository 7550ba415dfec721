"""Prefill in chunks under a token budget (Part 7, section 39): the steps of a server
whose every step computes at most budget rows, so that a long prompt is prefilled over
several steps, in chunks, beside the running requests' decodes, which then never wait
for it. serving.serve(..., budget=rows) runs them.

Without a budget, serving.serve prefills an admitted request's whole prompt inside one
step: a step that admits a long prompt computes all its rows, and every running
request's next token waits for them (a stall). Sarathi-Serve and vLLM's scheduler
(max_num_batched_tokens) cap a step's rows instead. Here each step is one batch: a row
for every running request that has chosen a token first, then what is left of the
budget to the prompts being prefilled, in the order they were admitted, a chunk each. A
prompt's chunks are one-pass prefill's chunks, exact (section 15), so each result is
generate.generate's at any budget; what the budget changes is how the rows are spread
over the steps.
"""
from collections import deque

import model
from batched import ItemRefused, computed_by, forward_rows


def check_budget(budget, max_batch):
    """Refuse a budget that is not an int of at least max_batch rows (and at least 1)."""
    model.check_int("budget", budget, 1, None, " (rows a step)")
    if budget < max_batch:
        raise ValueError(f"budget {budget} is smaller than max_batch {max_batch}: every "
                         f"running request decodes a row at each step; give a budget "
                         f"of at least max_batch rows")


class BudgetedSteps:
    """The steps of serving.serve under a budget: each step one batch of at most budget rows.

    The waiting requests (serving.Served), the running ones (in the order they were
    admitted), those that chose a token this step, what it counted (serve's counts, and
    chunks, largest_step, rows_by_step and decodes_by_step), and the parts of a step."""

    def __init__(self, params, pool, max_batch, log, product, attention, waiting, budget):
        self.params, self.pool, self.max_batch, self.log = params, pool, max_batch, log
        self.product, self.attention, self.budget = product, attention, budget
        self.waiting, self.running, self.chose = deque(waiting), [], set()
        self.counts = dict.fromkeys(("steps", "request_steps", "rows", "recomputed_rows",
                                     "readmitted_positions", "readmitted_prefix_hits",
                                     "preemptions", "peak_blocks", "prefix_hits", "chunks",
                                     "largest_step"), 0)
        self.counts.update(rows_by_step=[], decodes_by_step=[])

    def step(self):
        """Take one step: choose, admit, plan the rows, preempt for room, compute them.

        The rows planned within the budget, computed in one batch."""
        self.counts["steps"] += 1
        self.choose()
        self.admit()
        plan = self.plan()
        while not self.pool.room_for([(request.seq, rows) for request, rows in plan]):
            self.preempt(self.running[-1])
            plan = self.plan()
        self.compute(plan)

    def choose(self):
        """Let every running request whose last row is computed choose a token.

        A finished one leaves."""
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
        """Admit waiting requests in order, each on its cached prefix, while there is room.

        No row is computed yet; room in the batch, and in the pool for its tokens. A first
        one that cannot be admitted with nothing running is refused."""
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            ids = request.generation.ids
            kernel = computed_by(self.product)   # a block is found by the kernel's rows
            if not self.pool.room_for_sequence(ids[:-1], len(ids), kernel):
                break
            request.seq = self.pool.sequence(ids[:-1], kernel)
            found = len(request.seq.table)
            self.counts["prefix_hits"] += found
            if request.computed:   # readmitted: it held every position but its last token's
                self.counts["readmitted_positions"] += request.computed
                self.counts["readmitted_prefix_hits"] += found
            self.running.append(self.waiting.popleft())
            self.log(self.counts["steps"], request.index, "admitted")
        if self.waiting and not self.running:
            raise ValueError(f"request {self.waiting[0].index} cannot be admitted and "
                             f"nothing runs: {self.waiting[0].seq_room()}")

    def plan(self):
        """Plan the step's rows within the budget: [(request, rows)].

        A decode row for each request that chose, then chunks of the others' tokens not
        yet computed."""
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
        """Compute the planned rows in one batch, and count them.

        A request whose rows reach its last token keeps that row's logits."""
        items, owners = [], []
        for request, rows in plan:
            ids, start = request.generation.ids, len(request.seq)
            items += [(request.seq, ids[at], at) for at in range(start, start + rows)]
            owners += [request.index] * rows
        try:
            logits = (forward_rows(self.params, items, self.product, self.attention)
                      if items else [])
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
        counts["peak_blocks"] = max(counts["peak_blocks"],
                                    len(self.pool.blocks) - self.pool.free_blocks())
        counts["rows_by_step"].append(len(items))
        counts["decodes_by_step"].append(len(self.chose))
        self.chose.clear()
