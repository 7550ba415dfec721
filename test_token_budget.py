"""Prefill in chunks under a token budget (token_budget.py, run by serving.serve's budget):
every result is generate's at every budget; no step computes more rows than the budget; a
request that has its first token decodes at every step until it finishes or is
preempted; chunks and rows are counted; a budget smaller than one row, or than the batch,
is refused."""
import random
import unittest

import batched
import kv_cache
import paged
import serving
import support
import token_budget
import verdicts
from support import OPENINGS, PARAMS, TOK, check_random_cases, swapping
from verdicts import Layer, Wrong, step


LAYER = Layer("token_budget", "prefill in chunks under a token budget (token_budget.py)",
              ("serving",))


def setUpModule():
    verdicts.set_up("token_budget")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down


def where_budget_strays(label, requests, blocks, max_batch, budget):
    """None if the requests served under budget hold what the module promises, else a Wrong.

    Each result is generate_cached's; no step computes more than budget rows; each request
    that has chosen its first token decodes at every step until it finishes or is
    preempted (no stall); chunks are the prefill events the log was told; rows are the
    steps' rows summed."""
    events = []
    step(f"{label}: serving")
    served, counts = serving.serve(PARAMS, TOK, requests, paged.BlockPool(PARAMS, blocks, 4),
                                   max_batch, lambda at, index, event: events.append(
                                       (at, index, event)), budget=budget)
    for index, (request, result) in enumerate(zip(requests, served)):
        if result != kv_cache.generate_cached(PARAMS, TOK, **request):
            return Wrong(f"{label}: request {index}'s result is not generate_cached's",
                         f"  request: {request}\n  served: {result['text']!r}")
    for at, rows in enumerate(counts["rows_by_step"], 1):
        if rows > budget:
            return Wrong(f"{label}: step {at} computed {rows} rows, more than the budget of "
                         f"{budget}", f"  rows by step: {counts['rows_by_step']}")
    decoding = set()
    for at in range(1, counts["steps"] + 1):
        now = [(index, event) for when, index, event in events if when == at]
        for index in decoding - {index for index, event in now
                                 if event in ("decode", "finished", "preempted")}:
            return Wrong(f"{label}: request {index} made no decode row at step {at}, after "
                         f"its first token (a stall)", f"  that step's events: {now}")
        decoding |= {index for index, event in now if event == "decode"}
        decoding -= {index for index, event in now if event in ("finished", "preempted")}
    told = sum(event == "prefill" for _, _, event in events)
    if counts["chunks"] != told or counts["rows"] != sum(counts["rows_by_step"]):
        return Wrong(f"{label}: {counts['chunks']} chunks and {counts['rows']} rows counted, "
                     f"{told} chunks told to the log and {sum(counts['rows_by_step'])} rows "
                     f"by step expected")
    return None


def quick_check():
    """Four requests (three greedy, one sampled) in 14 blocks of 4, batches of up to 4, at
    budgets of 4, 7 and 256 rows a step (256: every prompt whole in a step): what
    where_budget_strays checks holds at each."""
    requests = [{"prompt": prompt, "max_new_tokens": 12} for prompt in OPENINGS[:3]] + [
        {"prompt": OPENINGS[3], "max_new_tokens": 12, "temperature": 1.0, "seed": 3}]
    for budget in (4, 7, 256):
        why = where_budget_strays(f"four requests, a budget of {budget}", requests, 14, 4,
                                  budget)
        if why:
            return why
    return None


QuickCheck = verdicts.quick_check_case("token_budget", __name__)


class Teeth(unittest.TestCase):
    """Each mistake planted in the real token_budget.py (by its syntax tree) makes the
    layer's quick check fail with a line naming the quantity and where."""

    MISTAKES = [
        ("a chunk that starts one position late", token_budget.BudgetedSteps, "compute",
         swapping("range(start, start + rows)", "range(start + 1, start + rows + 1)"),
         r"four requests, a budget of 4: serving: raised ValueError: items\[\d+\]: expected "
         r"position \d+, got \d+ \(in token_budget.py line \d+, compute"),
        ("chunks that ignore the decode rows already planned", token_budget.BudgetedSteps, "plan",
         swapping("self.budget - len(plan)", "self.budget"),
         r"four requests, a budget of 4: step \d+ computed [5-8] rows, more than the budget "
         r"of 4"),
        ("a decode row counted as a chunk", token_budget.BudgetedSteps, "compute",
         swapping("not decoding", "1"),
         r"four requests, a budget of 4: \d+ chunks and \d+ rows counted, \d+ chunks told to "
         r"the log"),
    ]

    def test_the_quick_check_names_each_mistake_and_where(self):
        verdicts.assert_verdicts(self, "token_budget", self.MISTAKES)


def random_budget_case(n):
    """None if random requests served under a random budget hold what where_budget_strays
    checks, else why.

    All from random.Random(n): 3 to 6 openings, some with a shared start added, greedy or
    sampled, 4 to 16 new tokens; batches of 1 to 4; a budget from the batch to 20, or one
    no step reaches (whole prompts); a pool of blocks of 4 that fits each request, with up to 8 more."""
    rng = random.Random(n)
    requests = []
    for _ in range(rng.randint(3, 6)):
        prompt = rng.choice(OPENINGS) + (" she saw a dog." if rng.random() < 0.3 else "")
        requests.append({"prompt": prompt, "max_new_tokens": rng.randint(4, 16),
                         **({"temperature": 1.0, "seed": rng.randrange(100)}
                            if rng.random() < 0.5 else {})})
    max_batch = rng.randint(1, 4)
    budget = rng.choice((256, rng.randint(max_batch, 20)))
    fits = max(-(-min(len(TOK.encode(r["prompt"])) + r["max_new_tokens"], 64) // 4)
               for r in requests)
    blocks = rng.randint(fits, fits + 8)
    return where_budget_strays(f"{len(requests)} requests, {blocks} blocks, batches of up to "
                               f"{max_batch}, a budget of {budget}", requests, blocks,
                               max_batch, budget)


class Budget(unittest.TestCase):

    def test_a_budget_s_blocks_are_found_by_their_kernel_only(self):
        """One prompt served three times under a budget from one pool of blocks of 1: with
        the batch-dependent kernel twice (the second finds the first's blocks), then exactly
        (it finds none of them, and its result is generate's)."""
        pool, request = paged.BlockPool(PARAMS, 40, 1), {"prompt": OPENINGS[0],
                                                         "max_new_tokens": 4}
        hits = []
        for product in (batched.by_batch, batched.by_batch, batched.exact):
            (result,), counts = serving.serve(PARAMS, TOK, [request], pool, 1,
                                              product=product, budget=3)
            hits.append(counts["prefix_hits"])
        self.assertEqual((hits[0], bool(hits[1]), hits[2]), (0, True, 0))
        self.assertEqual(result, kv_cache.generate_cached(PARAMS, TOK, **request))

    def test_random_requests_budgets_and_pools(self):
        """Random requests, batches, budgets and pools (3 cases, more with
        KV_LAB_RANDOM_CASES): what random_budget_case checks holds."""
        check_random_cases(self, 3, random_budget_case)

    def test_bad_budgets_are_refused_naming_them(self):
        """A budget below one row, not an int, a bool, or below max_batch: refused before
        any block is taken."""
        pool = paged.BlockPool(PARAMS, 32, 4)
        requests = [{"prompt": OPENINGS[0], "max_new_tokens": 4}]
        for budget, fragment in (
                (0, r"budget must be an int >= 1 \(rows a step\), got 0"),
                (-3, "budget must be an int >= 1"), (2.0, "budget must be an int"),
                (True, "budget must be an int"),
                (3, r"budget 3 is smaller than max_batch 4: every running request decodes a "
                    r"row at each step")):
            with self.subTest(budget=budget), self.assertRaisesRegex(ValueError, fragment):
                serving.serve(PARAMS, TOK, requests, pool, 4, budget=budget)
        self.assertEqual(pool.free_blocks(), 32)
        self.assertEqual(pool.prefix_index, {})


if __name__ == "__main__":
    unittest.main()
