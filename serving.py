"""Serving many requests from one pool (Part 4, sections 20 to 23): continuous batching,
preemption by recompute, and a prefix cache that outlives requests. Each step computes the
running requests' rows together (batched.forward_rows). With the lab's exact product each
request's result is exactly generate.generate's: the pool and the batch change the work
and the memory, never a token. With an engine's kernel (batched.by_batch, by_batch_float32)
they change it.
"""
import os
from collections import deque

import generate
import model
import svg
from batched import ItemRefused, computed_by, exact, exact_attention, forward_rows
from documents import LAB, bold, shown, table
from instruments import chosen_rows, largest_gap, recording
from paged import BlockPool, check_pool
from stories import openings, split_stories, story_ids
from token_budget import BudgetedSteps, check_budget

PREFIX_CACHE_BLOCKS = 64          # the experiment: a pool far smaller than the 60 stories
MAX_BATCH, SMALL_POOL = 8, 24     # the experiment: 120 requests, preempting in a small pool


def serve(params, tok, requests, pool, max_batch, log=None, product=exact,
          attention=exact_attention, budget=None):
    """Run requests to completion from one pool, with continuous batching as servers do.

    Each request is a dict of generate.generate's keyword arguments, prompt included. At
    each step every running request chooses one token, and all of them are fed theirs in one
    batch (a decode row each, forward_rows with product and attention); a waiting request is
    admitted, its tokens prefilled in one pass, as soon as the batch and the pool have room;
    a finished one leaves at once. When the running requests need more blocks than are free,
    the most recently admitted one is preempted by recompute: its blocks are freed, and when
    it is admitted again it takes back the full blocks of its tokens that the pool still
    caches and prefills the rest again (its random numbers go on where they were: none is
    drawn twice). Returns (results, counts): each result, in request order, exactly
    generate.generate's for its request with the exact product and attention, and what
    serving did (among it, the positions readmitted requests had held, the blocks they found
    again, and the requests that chose a token, summed over the steps). log(step, request
    index, event), if given, is told each "prefill", "decode", "preempted" and "finished" as
    it happens. If anything raises (log itself, say), every block serve took goes back to
    the pool, and (without a budget) pool.prefix_hits counts only the blocks found by
    admissions whose rows were computed; what an attention gives that is not a row's mixed values is refused,
    naming the request.

    budget, if given, is the most rows a step computes (Part 7, section 39: at least
    max_batch): each step is then one batch, a decode row for every running request that
    chose a token, then chunks of the admitted prompts, oldest admission first, while the
    budget lasts; a request chooses its first token the step after its last chunk, and
    log is also told "admitted" when a request takes its blocks
    (token_budget.BudgetedSteps). The counts then also hold chunks (prefill pieces
    computed), largest_step (the most rows a step computed), and rows_by_step and
    decodes_by_step."""
    log = checked_settings(params, tok, requests, pool, max_batch, log, product, attention)
    if budget is not None:
        check_budget(budget, max_batch)
    served = [Served(params, tok, index, request, pool)
              for index, request in enumerate(requests)]    # every request checked first
    waiting = [request for request in served if not request.generation.stopped]
    steps = (Steps(params, pool, max_batch, log, product, attention, waiting)
             if budget is None else
             BudgetedSteps(params, pool, max_batch, log, product, attention, waiting, budget))
    return run_steps(steps, served)


def run_steps(steps, served):
    """Take steps.step() until no request waits or runs; give the results and the counts.

    On the way out, normally or not, no block stays taken."""
    try:
        while steps.waiting or steps.running:
            steps.step()
    finally:
        for request in served:
            if request.seq is not None:
                request.seq.free()
    return [request.generation.result() for request in served], steps.counts


def checked_settings(params, tok, requests, pool, max_batch, log, product, attention):
    """Check serve's arguments, the requests' own aside; give the log to tell.

    The log is log, or one that does nothing."""
    if log is not None and not callable(log):
        raise ValueError(f"log must be a function of (step, request index, event), got {log!r}")
    check_pool(pool, params)
    model.check_int("max_batch", max_batch, 1)
    if not callable(product):
        raise ValueError(f"product must be a function of (rows, columns), such as "
                         f"batched.exact, got {model.excerpt(product)}")
    if not callable(attention):
        raise ValueError(f"attention must be a function of (q, keys, values, rows), such as "
                         f"batched.exact_attention, got {model.excerpt(attention)}")
    generate.check_tokenizer(tok)
    if not isinstance(requests, (list, tuple)):
        raise ValueError(f"requests must be a list of dicts, got {type(requests).__name__}")
    return log or (lambda step, index, event: None)


class Steps:
    """The steps of serve without a budget: each admission prefilled as it happens.

    The waiting requests (in order) and the running ones (in the order they were
    admitted), what serving counted, and the four parts of a step."""

    def __init__(self, params, pool, max_batch, log, product, attention, waiting):
        self.params, self.pool, self.max_batch, self.log = params, pool, max_batch, log
        self.product, self.attention = product, attention
        self.waiting, self.running = deque(waiting), []
        self.counts = dict.fromkeys(("steps", "request_steps", "rows", "recomputed_rows",
                                     "readmitted_positions", "readmitted_prefix_hits",
                                     "preemptions", "peak_blocks", "prefix_hits"), 0)

    def step(self):
        """Take one step: admit, choose the next tokens, preempt for room, decode."""
        self.admit()
        self.choose()
        self.preempt_for_room()
        self.decode()

    def note_peak(self):   # after every admission and every decode row
        self.counts["peak_blocks"] = max(self.counts["peak_blocks"],
                                         len(self.pool.blocks) - self.pool.free_blocks())

    def admit(self):
        """Admit waiting requests in order, each prefilled, while there is room.

        Room in the batch and in the pool; a first one that cannot be admitted with
        nothing running is refused."""
        waiting, running = self.waiting, self.running
        while waiting and len(running) < self.max_batch and waiting[0].admit(
                self.counts, self.product, self.attention):
            running.append(waiting.popleft())
            self.note_peak()
            self.log(self.counts["steps"] + 1, running[-1].index, "prefill")
        if not running:   # and the first waiting request cannot be admitted: it never will
            raise ValueError(f"request {waiting[0].index} cannot be admitted and nothing "
                             f"runs: {waiting[0].seq_room()}")

    def choose(self):
        """A new step: every running request chooses its token; a finished one leaves."""
        self.counts["steps"] += 1
        self.counts["request_steps"] += len(self.running)
        for request in list(self.running):
            request.generation.choose(request.logits)
            if request.generation.stopped:
                self.running.remove(request)
                request.seq.free()
                self.log(self.counts["steps"], request.index, "finished")

    def preempt_for_room(self):
        """Preempt the most recently admitted request until the others have room.

        Room for a decode row each."""
        while not self.pool.room_for([(request.seq, 1) for request in self.running]):
            victim = self.running.pop()
            victim.preempt()
            self.waiting.appendleft(victim)
            self.counts["preemptions"] += 1
            self.log(self.counts["steps"], victim.index, "preempted")

    def decode(self):
        """Feed every running request its chosen token, the rows in one batch."""
        if not self.running:
            return
        items = [request.next_item() for request in self.running]
        try:
            rows = forward_rows(self.params, items, self.product, self.attention)
        except ItemRefused as refused:   # name the request
            raise ValueError(f"request {self.running[refused.item].index}: {refused.why}") from None
        for request, logits in zip(self.running, rows):
            request.fed(logits, self.counts)
            self.log(self.counts["steps"], request.index, "decode")
        self.note_peak()


class Served:
    """One request in serve, checked as it is made.

    Its generation, its sequence in the pool while admitted, the logits for its next
    token, and how many of its positions were ever computed."""

    SETTINGS = {"max_new_tokens": 60, "temperature": 0.0, "top_k": None, "seed": 0}

    def __init__(self, params, tok, index, request, pool):
        if not isinstance(request, dict) or "prompt" not in request \
                or not set(request) <= {"prompt", *self.SETTINGS}:
            raise ValueError(f"request {index} must be a dict of generate's keyword arguments "
                             f"({', '.join(['prompt', *self.SETTINGS])}), got {request!r}")
        settings = dict(self.SETTINGS, **request)
        prompt = settings.pop("prompt")
        try:
            ids = generate.check_request(tok, prompt, **settings)
        except ValueError as refused:
            raise ValueError(f"request {index}: {refused}") from None
        self.generation = generate.Generation(tok, ids, **settings)
        fed = min(len(ids) + settings["max_new_tokens"], model.CONTEXT) - 1
        if not self.generation.stopped and not pool.could_hold(fed):
            held = len(pool.blocks) - pool.free_blocks()
            raise ValueError(f"request {index} may need {pool.blocks_to_hold(fed)} blocks of "
                             f"{pool.block_size} positions, and the pool has "
                             f"{pool.free_blocks()} free"
                             + (f" ({held} of its {len(pool.blocks)} are held by sequences "
                                f"made outside serve)" if held else "")
                             + ": it could never run; make a larger pool")
        self.params, self.pool, self.index = params, pool, index
        self.seq, self.logits, self.computed = None, None, 0

    def admit(self, counts, product, attention):
        """Prefill the tokens so far into a new sequence, in one pass; False if no room.

        The rows after the full blocks the pool has cached for them (never the last
        position: its logits are needed); False, with nothing changed, if the pool lacks
        room. If the rows fail, the blocks found are not counted as hits, in
        pool.prefix_hits either."""
        ids = self.generation.ids
        # The product's kernel (the attention does not matter here: in this one-block
        # model a key or value depends on its own token and position alone).
        kernel = computed_by(product)
        if not self.pool.room_for_sequence(ids[:-1], len(ids), kernel):
            return False
        self.seq = self.pool.sequence(ids[:-1], kernel)
        found, start = len(self.seq.table), len(self.seq)   # the full blocks found cached
        items = [(self.seq, token_id, at) for at, token_id in enumerate(ids[start:], start)]
        try:
            self.logits = forward_rows(self.params, items, product, attention)[-1]
        except BaseException as failed:   # no row was computed from the blocks found
            self.pool.prefix_hits -= found
            if isinstance(failed, ItemRefused):
                raise ValueError(f"request {self.index}: {failed.why}") from None
            raise
        counts["prefix_hits"] += found
        if self.computed:   # readmitted: it held every position but its last token's
            counts["readmitted_positions"] += self.computed
            counts["readmitted_prefix_hits"] += found
            counts["recomputed_rows"] += self.computed - start
        counts["rows"] += len(ids) - start
        self.computed = max(self.computed, len(ids))
        return True

    def seq_room(self):
        """Why there is no room for this request's sequence now, in words."""
        held = len(self.pool.blocks) - self.pool.free_blocks()
        return (f"it needs {self.pool.blocks_to_hold(len(self.generation.ids))} blocks of "
                f"{self.pool.block_size} positions, and the pool has {self.pool.free_blocks()} "
                f"free ({held} of its {len(self.pool.blocks)} are held by sequences made "
                f"outside serve, perhaps by log)")

    def next_item(self):
        """The token just chosen, at its position: this request's row of a decode step."""
        ids = self.generation.ids
        return self.seq, ids[-1], len(ids) - 1

    def fed(self, logits, counts):
        """Keep the logits of the decode row just computed, and count it."""
        self.logits = logits
        counts["rows"] += 1
        self.computed = max(self.computed, len(self.generation.ids))

    def preempt(self):
        """Give the blocks back; the generation keeps its tokens and random numbers."""
        self.seq.free()
        self.seq, self.logits = None, None


# ---- the experiments (stages of trace_kv.py) ----------------------------------------

def serve_and_compare(lab, requests, results, full_rows, pool, max_batch):
    """Serve the requests, recording the logits every request chose a token with.

    Each result is expected in results, each with the rows of its uncached last full pass in
    full_rows. Returns (counts, the results identical, the largest gap between those logits
    and the full pass's row for the same position)."""
    with recording(generate.Generation, "choose") as choices:
        served, counts = serve(lab.params, lab.tok, requests, pool, max_batch)
    rows = {tuple(story_ids(lab.tok, request["prompt"], result)): full
            for request, result, full in zip(requests, results, full_rows)}
    gap = max((largest_gap([logits], [rows[tuple(generation.ids)][position]])
               for generation, position, logits in chosen_rows(choices)
               if tuple(generation.ids) in rows),
              default=None)   # None: no story came out as the uncached one
    return counts, sum(s == r for s, r in zip(served, results)), gap


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
POOLS = ("small pool", "ample pool")
GAP = "largest_logit_gap_of_choosing_rows"
RECORDS = {
    "prefix_cache": {
        "positions_held_in_all": svg.COUNT,
        **dict.fromkeys(POOLS, dict.fromkeys(
            ("blocks", "prefix_hits", "rows_saved", "rows", "evictions", "identical", GAP),
            svg.COUNT))},
    "many_requests": {
        "requests": svg.COUNT, "max_batch": svg.COUNT,
        **dict.fromkeys(POOLS, dict.fromkeys(
            ("steps", "request_steps", "rows", "recomputed_rows", "readmitted_positions",
             "readmitted_prefix_hits", "preemptions", "peak_blocks", "prefix_hits", "blocks",
             "evictions", "mean_requests_per_step", "first_admission_prefix_hits",
             "identical", GAP), svg.COUNT)),
        "small_pool_extra_rows": dict.fromkeys(
            ("in_all", "recomputed", "prefix_sharing_lost"), svg.COUNT),
        "static_batching_steps": svg.COUNT},
}


def prefix_cache(lab, runs):
    """Serve the greedy openings one after another, each freed when done.

    The full blocks of finished requests stay cached until a block is needed, and a later
    request that begins with the same tokens takes them instead of computing those rows
    again. From a pool of PREFIX_CACHE_BLOCKS blocks of 4, far fewer than the stories hold
    together, and from one large enough never to evict."""
    requests = [{"prompt": prompt} for prompt in lab.prompts]
    record = {"positions_held_in_all": sum(len(story_ids(lab.tok, p, r)) - 1
                                           for p, r in zip(lab.prompts, runs.greedy))}
    for name, blocks in (("small pool", PREFIX_CACHE_BLOCKS),
                         ("ample pool", len(requests) * 16)):
        pool = BlockPool(lab.params, blocks, 4)
        counts, identical, gap = serve_and_compare(lab, requests, runs.greedy,
                                                   runs.greedy_rows, pool, 1)
        record[name] = {"blocks": blocks, "prefix_hits": counts["prefix_hits"],
                        "rows_saved": 4 * counts["prefix_hits"], "rows": counts["rows"],
                        "evictions": pool.evictions, "identical": identical,
                        "largest_logit_gap_of_choosing_rows": gap}
    return record


def all_openings(lab):
    """The 60 greedy and the 60 sampled openings as 120 requests, in that order."""
    return ([{"prompt": prompt} for prompt in lab.prompts]
            + [{"prompt": prompt, "temperature": 1.0, "seed": index}
               for index, prompt in enumerate(lab.prompts)])


def many_requests(lab, runs):
    """Serve the 60 greedy and the 60 sampled openings as 120 requests, in that order.

    With batches of up to MAX_BATCH: from a pool of SMALL_POOL blocks of 4, which forces
    preemptions, and from an ample one; the small pool's extra rows, split into those
    readmitted requests recompute and the prefix sharing between requests it loses; and the
    steps static batching takes for the same requests (each batch of MAX_BATCH starts
    together and waits for its longest)."""
    requests = all_openings(lab)
    results = runs.greedy + runs.sampled
    record = {"requests": len(requests), "max_batch": MAX_BATCH}
    for name, blocks in (("small pool", SMALL_POOL), ("ample pool", len(requests) * 16)):
        pool = BlockPool(lab.params, blocks, 4)
        counts, identical, gap = serve_and_compare(
            lab, requests, results, runs.greedy_rows + runs.sampled_rows, pool, MAX_BATCH)
        record[name] = dict(counts, blocks=blocks, evictions=pool.evictions,
                            mean_requests_per_step=round(counts["request_steps"]
                                                         / counts["steps"], 3),
                            first_admission_prefix_hits=counts["prefix_hits"]
                            - counts["readmitted_prefix_hits"],
                            identical=identical, largest_logit_gap_of_choosing_rows=gap)
    small, ample = record["small pool"], record["ample pool"]
    record["small_pool_extra_rows"] = {
        "in_all": small["rows"] - ample["rows"],
        "recomputed": small["recomputed_rows"] - ample["recomputed_rows"],
        "prefix_sharing_lost": 4 * (ample["first_admission_prefix_hits"]
                                    - small["first_admission_prefix_hits"])}
    lengths = [len(result["steps"]) for result in results]
    record["static_batching_steps"] = sum(max(lengths[first:first + MAX_BATCH])
                                          for first in range(0, len(lengths), MAX_BATCH))
    return record


# ---- what Part 4 shows of it (documents.py fills its marks) --------------------------

def prefix_cache_table(record, timing):
    """Section 20's table: the prefix cache in a small pool and in an ample one."""
    c = svg.checked(record, svg.picked(RECORDS, "prefix_cache"))["prefix_cache"]
    labels = {"small pool": f"small: far less than the 60 stories hold "
                            f"({shown(c['positions_held_in_all'])} positions)",
              "ample pool": "ample: nothing is evicted"}
    return table(["pool of blocks of 4", "blocks", "prefix hits (blocks)", "rows saved",
                  "rows computed", "evictions", "stories identical",
                  "gap of the choosing rows"],
                 [[label, shown(c[run]["blocks"]), c[run]["prefix_hits"],
                   shown(c[run]["rows_saved"]), shown(c[run]["rows"]), c[run]["evictions"],
                   bold(f"{c[run]['identical']} of 60"),
                   bold(shown(c[run]["largest_logit_gap_of_choosing_rows"]))]
                  for run, label in labels.items()])


def many_requests_table(record, timing):
    """Section 21's table: the openings as requests, served from a small pool and an ample one."""
    m = svg.checked(record, svg.picked(RECORDS, "many_requests"))["many_requests"]
    return table(["pool of blocks of 4", "steps", "requests choosing a token, mean a step",
                  "rows", "rows recomputed", "preemptions", "peak blocks", "evictions",
                  "prefix hits: at a first admission / at a readmission", "identical",
                  "gap of the choosing rows"],
                 [[f"{run.split()[0]} ({shown(c['blocks'])} blocks)", c["steps"],
                   shown(c["mean_requests_per_step"]), shown(c["rows"]),
                   c["recomputed_rows"], c["preemptions"], c["peak_blocks"], c["evictions"],
                   f"{c['first_admission_prefix_hits']} / {c['readmitted_prefix_hits']}",
                   bold(f"{c['identical']} of {m['requests']}"),
                   bold(shown(c["largest_logit_gap_of_choosing_rows"]))]
                  for run, c in ((run, m[run]) for run in POOLS)])


def timeline(record=None, timing=None, folder=LAB):
    """Draw section 21's picture from a real run of serve, one line per request.

    Not from the record: on folder's model and corpus, four openings, batches of up to four,
    a pool of 16 blocks of 4. One character per step: P admitted (its tokens prefilled), . a
    decode row, x preempted, - waiting, * finished."""
    params, tok = generate.load_trained(folder)
    with open(os.path.join(folder, "corpus.txt"), encoding="utf-8") as f:
        prompts = openings(split_stories(f.read())[2])[:4]
    events = {}
    _, counts = serve(params, tok, [{"prompt": p} for p in prompts], BlockPool(params, 16, 4),
                      4, lambda step, index, event: events.setdefault(
                          (index, step), set()).add(event))
    lines = []
    for index, prompt in enumerate(prompts):
        marks, finished = "", False
        for step in range(1, counts["steps"] + 1):
            happened = events.get((index, step), set())
            marks += ("*" if "finished" in happened else "x" if "preempted" in happened
                      else "P" if "prefill" in happened else "." if happened
                      else " " if finished else "-")
            finished = finished or "finished" in happened
        lines.append(f"{prompt:<{max(map(len, prompts))}}  {marks.rstrip()}")
    return ["```text", *lines, "```"]
