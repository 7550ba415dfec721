"""Serving many requests (serving.py): every result is generate.generate's for any pool,
batch size and order, preempted or not; bad requests are refused before anything runs."""
import ast
import copy
import math
import random
import threading
import unittest

import batched
import generate
import kv_cache
import model
import paged
import serving
import support
import verdicts
from instruments import replacing
from kv_cache import feed, generate_cached
from support import OPENINGS, PARAMS, STORIES, TOK, assert_equal, cached_rows, filled_cache
from verdicts import Layer, Wrong, step


LAYER = Layer("serving", "serving (serving.py)", ("prefill", "paged", "batched"))


def setUpModule():
    verdicts.set_up("serving")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down
def parting(result, expected):
    """Where a generation parts from the one expected, in words: "at new token 5 ('x',
    where 'y' was expected)", or how it stopped otherwise. New tokens count from 1."""
    for number, (mine, theirs) in enumerate(zip(result["steps"], expected["steps"]), 1):
        if mine != theirs:
            return (f"at new token {number} ({mine['token']!r} with probability "
                    f"{mine['probability']}, where {theirs['token']!r} with "
                    f"{theirs['probability']} was expected)")
    return (f"in where it stopped (after {len(result['steps'])} new tokens, "
            f"{result['stopped']}; expected after {len(expected['steps'])}, "
            f"{expected['stopped']})")


def quick_check():
    """Requests served from one pool, each against generate_cached: four (three greedy, one
    sampled) in 14 blocks of 4 with batches of up to 4, which must preempt and readmit;
    a request and another whose prompt starts with the first's, in blocks of 4, so that
    the second finds the first's full blocks; and one prompt twice in blocks of 1, one at
    a time, so that the second finds all but its last position. None if each result is
    generate_cached's and each run did what it is there for, else a Wrong naming the run,
    the request and the new token where it parts. Last, the batch-dependent kernel's
    blocks are found by its serves only (where_kernels_mix)."""
    shared = OPENINGS[1] + " she was"
    runs = (("four requests that preempt", [{"prompt": prompt, "max_new_tokens": 12}
                                           for prompt in OPENINGS[:3]]
             + [{"prompt": OPENINGS[3], "max_new_tokens": 12, "temperature": 1.0, "seed": 3}],
             paged.BlockPool(PARAMS, 14, 4), 4, "readmitted_prefix_hits"),
            ("two requests sharing a prefix", [{"prompt": shared[:-8], "max_new_tokens": 6},
                                               {"prompt": shared, "max_new_tokens": 6,
                                                "temperature": 1.0, "seed": 1}],
             paged.BlockPool(PARAMS, 40, 4), 1, "prefix_hits"),
            ("one prompt twice", [{"prompt": OPENINGS[0], "max_new_tokens": 4}] * 2,
             paged.BlockPool(PARAMS, 40, 1), 1, "prefix_hits"))
    for label, requests, pool, max_batch, exercised in runs:
        where = f"{label} (blocks of {pool.block_size}, batches of up to {max_batch})"
        step(f"serving {where}")
        served, counts = serving.serve(PARAMS, TOK, requests, pool, max_batch, log=lambda s, i, e:
                                       step(f"serving {where}, after step {s}: request {i} {e}"))
        for index, (request, result) in enumerate(zip(requests, served)):
            expected = kv_cache.generate_cached(PARAMS, TOK, **request)
            if result != expected:
                return Wrong(f"{where}: request {index} parts from generate_cached's "
                             f"{parting(result, expected)}; {counts['preemptions']} "
                             f"preemptions, {counts['prefix_hits']} prefix hits",
                             f"  request {index}: {request}\n  served:   {result['text']!r}"
                             f"\n  expected: {expected['text']!r}")
        if not counts[exercised]:
            return Wrong(f"{where}: no {exercised.replace('_', ' ')[:-1]} in this run, "
                         f"which is there to make them", f"  counts: {counts}")
    return where_kernels_mix()


def where_kernels_mix():
    """None if one prompt served twice with the batch-dependent kernel (batched.by_batch),
    then exactly, from one pool of blocks of 1, finds the kernel's blocks the second time
    and none of them the third, with generate_cached's result; else a Wrong naming the serve."""
    pool, request = paged.BlockPool(PARAMS, 40, 1), {"prompt": OPENINGS[0], "max_new_tokens": 4}
    for serve, product, hits in (("the first, with the batch-dependent kernel", batched.by_batch,
                                  "none"),
                                 ("the second, with the batch-dependent kernel",
                                  batched.by_batch, "the first's blocks"),
                                 ("the third, exactly", batched.exact, "none")):
        where = (f"one prompt served three times from one pool (blocks of 1, batches of up "
                 f"to 1): {serve}")
        step(f"serving {where}")
        (result,), counts = serving.serve(PARAMS, TOK, [request], pool, 1, product=product)
        if bool(counts["prefix_hits"]) != (hits != "none"):
            return Wrong(f"{where}: {counts['prefix_hits']} prefix hits, where it should find "
                         f"{hits}", f"  request: {request}\n  counts: {counts}")
    expected = kv_cache.generate_cached(PARAMS, TOK, **request)
    if result != expected:
        return Wrong(f"{where}: the request parts from generate_cached's "
                     f"{parting(result, expected)}",
                     f"  served:   {result['text']!r}\n  expected: {expected['text']!r}")
    return None


QuickCheck = verdicts.quick_check_case("serving", __name__)


def _source_is(source, kind=ast.AST):
    """A syntax-tree test: the node (of kind) whose source is source."""
    return lambda node: isinstance(node, kind) and ast.unparse(node) == source


class ServingTeeth(unittest.TestCase):
    """Mistakes planted in the real serving.py (by its syntax tree): serving's quick check
    names the run, the request and the new token where each shows."""

    MISTAKES = [
        ("a decode row's logits not kept (the request chooses from stale ones)",
         serving.Served, "fed", replacing(_source_is("self.logits = logits", ast.stmt),
                                           lambda node: ast.Pass())),
        ("a readmitted request's prefill fed from position 0, not after the blocks found",
         serving.Served, "admit", replacing(_source_is("enumerate(ids[start:], start)"),
                                             lambda node: ast.parse("enumerate(ids[start:])",
                                                                    mode="eval").body)),
        ("a preempted request's blocks not given back", serving.Served, "preempt",
         replacing(_source_is("self.seq.free()", ast.stmt), lambda node: ast.Pass())),
        ("the prefix looked up with the last token too, so nothing is left to prefill",
         serving.Served, "admit", replacing(_source_is("self.pool.sequence(ids[:-1], kernel)"),
                                             lambda node: ast.parse(
                                                 "self.pool.sequence(ids, kernel)",
                                                 mode="eval").body)),
        ("a prefix looked up without the kernel that computes the rows", serving.Served,
         "admit", replacing(_source_is("self.pool.sequence(ids[:-1], kernel)"),
                            lambda node: ast.parse("self.pool.sequence(ids[:-1])",
                                                   mode="eval").body))]

    def test_each_mistake_names_its_run_and_request(self):
        verdicts.assert_verdicts(self, "serving", [
            (*mistake, r"^(serving )?(four requests that preempt|two requests sharing a "
                       r"prefix|one prompt (twice|served three times from one pool)) "
                       r"\(blocks of \d+, batches of up to \d+\)"
                       r".*(request \d+|no \w+|the (first|second|third), .*(prefix hits|raised))")
            for mistake in self.MISTAKES])


PRODUCTS = (batched.exact, batched.by_batch, batched.by_batch_float32, batched.batch_invariant)


def where_hand_feeding_strays(rng, pool, prompt):
    """None if a sequence of pool made for a product drawn from rng, fed the start of
    prompt by hand in random chunks of forward_rows with that product or (one time in
    three) another, keeps its own product's rows only (an exact one's being forward_step's)
    and refuses another's with the sequence and the pool as they were; else why not. One
    time in two, the sequence is then freed."""
    made = rng.choice(PRODUCTS)
    ids = TOK.encode(prompt)[:rng.randint(1, len(TOK.encode(prompt)))]
    seq = pool.sequence(ids, batched.computed_by(made))
    product = made if rng.random() < 2 / 3 else rng.choice(PRODUCTS)
    while len(seq) < len(ids):
        chunk = range(len(seq), min(len(ids), len(seq) + rng.randint(1, 5)))
        before = support.snapshot(seq), support.pool_snapshot(pool)
        try:
            rows = batched.forward_rows(PARAMS, [(seq, ids[i], i) for i in chunk], product)
        except ValueError as refused:
            if product is made or "this paged sequence is for rows computed by" \
                    not in str(refused):
                return f"{product.__name__} rows refused by a {made.__name__} " \
                       f"sequence: {refused}"
            if (support.snapshot(seq), support.pool_snapshot(pool)) != before:
                return f"a refusal of {product.__name__} rows changed the pool"
            break
        if product is not made:
            return f"{product.__name__} rows kept by a {made.__name__} sequence"
        if made is batched.exact and rows != cached_rows(PARAMS, ids)[chunk.start:chunk.stop]:
            return f"exact rows of {prompt!r} at {chunk} are not forward_step's"
    if rng.random() < 0.5:
        seq.free()
    return None


def where_an_exact_block_differs(pool, size):
    """None if every full block of pool (blocks of size) that its index gives exact serves
    holds forward_step's keys and values; else why not."""
    for block in pool.blocks:
        if block.prefix is not None and block.computed_by is None:
            fresh = filled_cache(list(block.prefix))
            if [block.keys, block.values] != [fresh.keys[-size:], fresh.values[-size:]]:
                return f"a block of {block.prefix} indexed as exact holds other keys"
    return None


def where_a_serve_differs(rng, pool, prompts, size):
    """None if, on pool, an exact serve of requests of prompts drawn from rng gives
    generate's results, and a batch-invariant serve those it gives on a fresh pool; else
    why not."""
    requests = [{"prompt": prompt, "max_new_tokens": rng.randint(0, 6),
                 "temperature": rng.choice((0.0, 1.0)), "seed": rng.randrange(100)}
                for prompt in prompts]
    for product, expected in (
            (batched.exact, [generate_cached(PARAMS, TOK, **r) for r in requests]),
            (batched.batch_invariant, serving.serve(
                PARAMS, TOK, requests, paged.BlockPool(PARAMS, pool.free_blocks(), size),
                len(requests), product=batched.batch_invariant)[0])):
        results, _ = serving.serve(PARAMS, TOK, requests, pool, rng.randint(1, 4),
                                   product=product)
        if results != expected:
            return f"a {product.__name__} serve after hand-fed sequences differs"
    return None


class Serve(unittest.TestCase):
    """Many requests from one pool: continuous batching and preemption by recompute give
    every request exactly generate.generate's result."""

    def requests(self, count, order_seed):
        """count of the test openings, greedy, sampled and top-k in turn, in an order
        shuffled by order_seed."""
        kinds = ({}, {"temperature": 1.0}, {"temperature": 1.0, "top_k": 3})
        requests = [dict(kinds[i % 3], prompt=prompt, seed=i)
                    for i, prompt in enumerate(OPENINGS[:count])]
        random.Random(order_seed).shuffle(requests)
        return requests

    def test_every_result_is_generate_s_for_any_pool_batch_and_order(self):
        requests = self.requests(12, 0)
        # generate_cached's results are generate's (test_kv_cache), at a fraction of the cost
        expected = [generate_cached(PARAMS, TOK, **request) for request in requests]
        # The smallest pool serve takes: room for the longest any request could grow.
        smallest = max(math.ceil((min(len(TOK.encode(r["prompt"])) + 60, model.CONTEXT) - 1) / 4)
                       for r in requests)
        preempted = 0

        def check(case):
            blocks, max_batch, order = case
            shuffled = random.Random(order).sample(range(len(requests)), len(requests))
            pool = paged.BlockPool(PARAMS, blocks, 4)
            results, counts = serving.serve(PARAMS, TOK, [requests[i] for i in shuffled],
                                            pool, max_batch)
            nonlocal preempted
            preempted += counts["preemptions"]
            for i, result in zip(shuffled, results):
                if result != expected[i]:
                    return f"request {requests[i]} differs: {result['text']!r}"
            if pool.free_blocks() != blocks:
                return f"{blocks - pool.free_blocks()} blocks still held after serving"
            return None
        cases = [(f"{blocks} blocks, batches of {max_batch}, order {order}",
                  (blocks, max_batch, order))
                 for blocks, max_batch, order in (
                     (smallest, 1, 0), (smallest, 12, 1), (2 * smallest, 3, 3), (200, 12, 4))]
        support.check_every_case(self, cases, check)
        self.assertGreater(preempted, 0)   # the small pools did preempt

    def test_random_requests_pools_batches_and_a_log_that_fails(self):
        """Case n draws, from random.Random(n), up to six requests (greedy, sampled or
        top-k, 0 to 20 new tokens), blocks of 2 to 8 positions, a pool from the smallest
        serve accepts to ample, a batch size, and a kernel that serves them first, leaving
        its blocks in the pool; then serves them again, with the exact product, and in one
        case of three a log that raises at a random event, in another a log that takes
        blocks of the same pool at one. Afterwards every block serve took is free, and a
        run that ended has each request's generate.generate result (a log that took
        blocks may leave a request that can never be admitted: then a refusal)."""
        logged = 0

        def check(index):
            nonlocal logged
            rng = random.Random(index)
            requests = []
            for _ in range(rng.randint(1, 6)):
                kind = rng.choice(({}, {"temperature": 1.0}, {"temperature": 0.8, "top_k": 3}))
                requests.append(dict(kind, prompt=rng.choice(OPENINGS[:12]),
                                     max_new_tokens=rng.randint(0, 20),
                                     seed=rng.randrange(100)))
            size = rng.randint(2, 8)
            smallest = max(math.ceil((min(len(TOK.encode(r["prompt"])) + r["max_new_tokens"],
                                          model.CONTEXT) - 1) / size) for r in requests)
            pool = paged.BlockPool(PARAMS, rng.randint(max(smallest, 1), 4 * smallest + 1), size)
            kernel = rng.choice((batched.by_batch, batched.batch_invariant, batched.exact))
            serving.serve(PARAMS, TOK, requests, pool, rng.randint(1, 6), product=kernel)
            fails, takes = (index % 3 == 1, index % 3 == 2)
            at, events, taken = rng.randrange(60), [], []

            def log(step, request, event):
                events.append(event)
                if len(events) == at and fails:
                    raise RuntimeError("the log failed")
                if len(events) == at and takes and pool.free_blocks():
                    taken.append(pool.sequence())
                    positions = min(rng.randint(1, pool.free_blocks()) * size, model.CONTEXT)
                    feed(PARAMS, taken[-1], TOK.encode(STORIES[index % 60] * 3)[:positions])
            try:
                results, _ = serving.serve(PARAMS, TOK, requests, pool, rng.randint(1, 6), log)
            except RuntimeError:
                logged += 1
                results = None
            except ValueError as refused:
                if not (taken and "cannot be admitted and nothing runs" in str(refused)):
                    raise
                results = None
            for seq in taken:
                seq.free()
            if pool.free_blocks() != len(pool.blocks) or any(pool.ref_counts):
                return f"{len(pool.blocks) - pool.free_blocks()} blocks still held afterwards"
            if results is not None:
                for request, result in zip(requests, results):
                    if result != generate_cached(PARAMS, TOK, **request):
                        return (f"request {request} came back as {result['text']!r}, after "
                                f"{kernel.__name__} traffic on the same pool")
            return None
        if len(support.check_random_cases(self, 8, check)) >= 8:
            self.assertGreater(logged, 0)   # some log did fail part-way

    def test_random_hand_fed_sequences_of_every_kernel_never_reach_another_s_serve(self):
        """Case n draws, from random.Random(n), a pool of blocks of 2 to 8 positions and 1
        to 4 sequences of it, each made for one of batched.py's products (exact, by_batch,
        by_batch_float32, batch_invariant) and fed the start of an opening by hand, in
        chunks of forward_rows, with that product or (one time in three) another: rows of
        the sequence's own product are kept, an exact sequence's being forward_step's, bit
        for bit; another product's are refused, with the sequence and the pool as they
        were. Then some sequences are freed; every full block indexed as exact holds
        forward_step's keys and values; and on that pool an exact serve of the openings
        gives generate's results, and a batch-invariant serve those it gives on
        a fresh pool: no serve finds a block another kernel computed."""
        def check(index):
            rng = random.Random(index)
            size, prompts = rng.randint(2, 8), rng.sample(OPENINGS[:12], rng.randint(1, 4))
            pool = paged.BlockPool(PARAMS, (len(prompts) + 4) * math.ceil(model.CONTEXT / size),
                                   size)
            for prompt in prompts:
                why = where_hand_feeding_strays(rng, pool, prompt)
                if why:
                    return why
            return where_an_exact_block_differs(pool, size) or where_a_serve_differs(
                rng, pool, prompts, size)
        support.check_random_cases(self, 8, check)

    def test_preempted_requests_come_back_with_the_same_result(self):
        requests = self.requests(9, 2)
        pool = paged.BlockPool(PARAMS, 16, 4)
        results, counts = serving.serve(PARAMS, TOK, requests, pool, 9)
        self.assertGreater(counts["preemptions"], 0)
        self.assertGreater(counts["readmitted_prefix_hits"], 0)   # some blocks found again
        self.assertGreater(counts["recomputed_rows"], 0)
        for request, result in zip(requests, results):
            expected = generate_cached(PARAMS, TOK, **request)
            if result != expected:
                self.fail(f"{request} came back as {result['text']!r}, where generate "
                          f"writes {expected['text']!r}")
        # What readmitted requests had held is found again or recomputed; every other
        # row is a position computed once, less the blocks first admissions found.
        self.assertEqual(counts["recomputed_rows"], counts["readmitted_positions"]
                         - 4 * counts["readmitted_prefix_hits"])
        fed = sum(len(TOK.encode(r["prompt"])) + len(result["steps"]) - 1
                  for r, result in zip(requests, results))
        self.assertEqual(counts["rows"], fed + counts["recomputed_rows"] - 4 * (
            counts["prefix_hits"] - counts["readmitted_prefix_hits"]))
        self.assertEqual(counts["request_steps"], sum(len(r["steps"]) for r in results))

    def test_counts_add_up(self):
        requests = self.requests(6, 3)
        results, counts = serving.serve(PARAMS, TOK, requests, paged.BlockPool(PARAMS, 200, 4),
                                        6)
        fed = sum(len(TOK.encode(r["prompt"])) + len(result["steps"]) - 1
                  for r, result in zip(requests, results))
        self.assertEqual((counts["preemptions"], counts["recomputed_rows"]), (0, 0))
        self.assertEqual(counts["rows"], fed - 4 * counts["prefix_hits"])
        self.assertEqual(counts["steps"], max(len(r["steps"]) for r in results))
        one_at_a_time = serving.serve(PARAMS, TOK, requests, paged.BlockPool(PARAMS, 200, 4),
                                      1)[1]
        self.assertEqual(one_at_a_time["steps"], sum(len(r["steps"]) for r in results))

    def test_bad_requests_and_settings_are_refused_before_anything_runs(self):
        for requests, max_batch, fragment in (
                ([{"prompt": "mia was sad."}], 0, "max_batch must be an int >= 1"),
                ([{"prompt": "mia was sad."}], True, "max_batch must be an int >= 1"),
                ("mia was sad.", 1, "requests must be a list"),
                ([{"prompt": "mia"}, {"text": "mia"}], 1, "request 1 must be a dict"),
                ([{"prompt": "mia", "temprature": 1.0}], 1, "request 0 must be a dict"),
                ([{"prompt": "Mia"}], 1, "request 0: unknown character 'M'"),
                ([{"prompt": "mia", "top_k": 0}], 1, "request 0: top_k must be"),
                ([{"prompt": "mia", "max_new_tokens": 2}, {"prompt": "mia was sad."}], 1,
                 "request 1 may need 16 blocks of 4 positions, and the pool has 8 free: it "
                 "could never run"),
                ([{"prompt": "mia"}], 1, "log must be a function")):
            pool = paged.BlockPool(PARAMS, 8 if "may need" in fragment else 16, 4)
            with self.subTest(fragment=fragment):
                before = support.pool_snapshot(pool)
                with self.assertRaisesRegex(ValueError, fragment):
                    serving.serve(PARAMS, TOK, requests, pool, max_batch,
                                  log=5 if "log" in fragment else None)
                assert_equal(self, support.pool_snapshot(pool), before, "the pool")
        with self.assertRaisesRegex(ValueError, "a BlockPool made for these params"):
            serving.serve(copy.deepcopy(PARAMS), TOK, [], pool, 1)
        for tok, product, fragment in ((None, batched.exact, "tok must be a bpe.Tokenizer"),
                                       (TOK, 5, "product must be a function of")):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                serving.serve(PARAMS, tok, [{"prompt": "mia"}], pool, 1, product=product)

    def test_blocks_held_outside_serve_are_counted_before_it_starts(self):
        """A request that only the blocks held outside could make room for is refused
        at once (it used to wait for them for ever)."""
        pool = paged.BlockPool(PARAMS, 4, 4)
        outside = pool.sequence()
        feed(PARAMS, outside, TOK.encode("mia was sad. tom")[:12])   # 3 of the 4 blocks
        refused = self.refusal_in_time(lambda: serving.serve(
            PARAMS, TOK, [{"prompt": "tom ran.", "max_new_tokens": 3}], pool, 1))
        self.assertIn("the pool has 1 free (3 of its 4 are held by sequences made outside "
                      "serve): it could never run", refused)

    def refusal_in_time(self, serve):
        """The message of the ValueError serve() raises, in a thread that must end within
        30 s (a serve that waits for blocks no request can free never would)."""
        finished = []

        def attempt():
            try:
                serve()
            except ValueError as refused:
                finished.append(str(refused))
        thread = threading.Thread(target=attempt, daemon=True)
        thread.start()
        thread.join(timeout=30)
        self.assertFalse(thread.is_alive(), "serve waits for blocks no request can free")
        self.assertEqual(len(finished), 1)
        return finished[0]

    def test_a_log_that_takes_blocks_ends_the_run_with_a_refusal_not_a_wait(self):
        """The log takes ten of the twenty blocks during the run: the second request,
        which could have run at the start, can then never be admitted, and nothing runs
        to free a block (serve used to loop for ever); every block serve took goes back."""
        params = generate.never_ending(PARAMS, TOK)
        pool, taken = paged.BlockPool(params, 20, 4), []

        def log(step, index, event):
            if event == "prefill" and not taken:
                taken.append(pool.sequence())
                feed(params, taken[0], TOK.encode(STORIES[0] + STORIES[1])[:40])   # 10 blocks
        refused = self.refusal_in_time(lambda: serving.serve(
            params, TOK, [{"prompt": "mia was sad.", "max_new_tokens": 3},
                          {"prompt": "tom was sad.", "max_new_tokens": 40}], pool, 1, log))
        self.assertRegex(refused, r"^request 1 cannot be admitted and nothing runs: it "
                                      r"needs \d+ blocks of 4 positions, and the pool has 10 "
                                      r"free \(10 of its 20 are held by sequences made outside "
                                      r"serve, perhaps by log\)$")
        self.assertEqual(pool.free_blocks(), 10)   # only the log's sequence holds blocks

    def test_kernels_that_share_a_pool_never_share_its_blocks(self):
        """Batch-dependent (16-bit and 32-bit sums), exact and batch-invariant traffic
        served in turns through one pool, whose prefix index holds every kernel's blocks
        of the same prompts: every exact result is generate's, and every batch-invariant
        run gives what it gives on a fresh pool, at every batch size (blocks were found by
        their tokens alone)."""
        requests = [{"prompt": prompt, "max_new_tokens": 10, "temperature": 1.0, "seed": seed}
                    for seed, prompt in enumerate(OPENINGS[:3] * 2)]
        expected = [generate_cached(PARAMS, TOK, **request) for request in requests]
        invariant, _ = serving.serve(PARAMS, TOK, requests, paged.BlockPool(PARAMS, 60, 4), 1,
                                     product=batched.batch_invariant)
        pool = paged.BlockPool(PARAMS, 60, 4)
        for max_batch in (1, 3):
            for product in (batched.by_batch, batched.by_batch_float32, batched.exact,
                            batched.batch_invariant):
                results, counts = serving.serve(PARAMS, TOK, requests, pool, max_batch,
                                                product=product)
                with self.subTest(max_batch=max_batch, product=product.__name__):
                    self.assertGreater(counts["prefix_hits"], 0)   # the pool did share
                    if product in (batched.exact, batched.batch_invariant):
                        assert_equal(self, results, expected if product is batched.exact
                                     else invariant, "the results")

    def test_requests_that_need_no_block_are_served_from_any_pool(self):
        full = TOK.decode(TOK.encode(" ".join(s.rstrip("\n") for s in STORIES))[:model.CONTEXT])
        requests = [{"prompt": "mia was sad. tom ran.", "max_new_tokens": 0},
                    {"prompt": full}]   # no room left: context full at once
        results, counts = serving.serve(PARAMS, TOK, requests, paged.BlockPool(PARAMS, 1, 4), 1)
        self.assertEqual(results, [generate.generate(PARAMS, TOK, **request)
                                   for request in requests])
        self.assertEqual(counts["rows"], 0)

    def test_a_log_that_raises_leaves_every_block_free(self):
        for event in ("prefill", "decode", "finished"):
            pool = paged.BlockPool(PARAMS, 6, 4)

            def log(step, index, happened):
                if happened == event:
                    raise RuntimeError(f"log refused {happened}")
            with self.subTest(event=event):
                with self.assertRaisesRegex(RuntimeError, f"log refused {event}"):
                    serving.serve(PARAMS, TOK, [{"prompt": "mia was sad.", "max_new_tokens": 8},
                                                {"prompt": "tom ran.", "max_new_tokens": 8}],
                                  pool, 2, log=log)
                self.assertEqual((pool.ref_counts, pool.free_blocks()), ([0] * 6, 6))

    def test_an_attention_that_gives_no_row_s_mixed_values_is_refused_naming_the_request(self):
        """An attention that gives 3 numbers at a prefill row (of a prompt whose full blocks
        the pool has cached), or NaN at one decode row of the second request running (its
        position no other row reaches): refused naming the request, the attention and what
        it gave. Afterwards every block is free, and pool.prefix_hits counts the cached
        blocks of an admission that computed its rows, not of the refused one."""
        short = {"prompt": "tom ran.", "max_new_tokens": 3}
        long = {"prompt": "mia was sad. tom ran to the park.", "max_new_tokens": 4}
        prompt_tokens = len(TOK.encode(long["prompt"]))
        late = prompt_tokens + 2   # keys its second decode row reads, more than any other row

        def three_numbers(q, keys, values, rows):
            return batched.exact_attention(q, keys, values, rows)[:3]

        def nan_late(q, keys, values, rows):
            mixed = batched.exact_attention(q, keys, values, rows)
            return [math.nan] + mixed[1:] if len(keys) == late else mixed
        pool = paged.BlockPool(PARAMS, 32, 4)
        serving.serve(PARAMS, TOK, [long], pool, 1)   # its prompt's full blocks stay cached
        for attention, requests, fragment, found in (
                (three_numbers, [long], r"^request 0: the attention three_numbers gave "
                                        r"\[[^]]+\] at position \d+, where a row's mixed "
                                        r"values are 16 finite floats$", 0),
                (nan_late, [short, long], rf"^request 1: the attention nan_late gave \[nan, .* "
                                          rf"at position {late - 1}, where",
                 (prompt_tokens - 1) // 4)):
            with self.subTest(attention=attention.__name__):
                hits = pool.prefix_hits
                with self.assertRaisesRegex(ValueError, fragment):
                    serving.serve(PARAMS, TOK, requests, pool, 2, attention=attention)
                self.assertEqual((pool.free_blocks(), pool.ref_counts), (32, [0] * 32))
                self.assertEqual(pool.prefix_hits, hits + found)

    def test_peak_blocks_counts_the_blocks_held_during_a_step(self):
        pool = paged.BlockPool(PARAMS, 8, 4)
        _, counts = serving.serve(PARAMS, TOK, [{"prompt": "mia was sad.", "max_new_tokens": 1}],
                                  pool, 1)
        self.assertEqual(counts["peak_blocks"], 2)   # 7 prompt positions: blocks of 4 and 3


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of serving."""

    def test_every_request_served_is_generate_s_in_either_pool(self):
        for name, served in (("prefix_cache", 60), ("many_requests", 120)):
            for pool in ("small pool", "ample pool"):
                with self.subTest(stage=name, pool=pool):
                    run = support.recorded(name)[pool]
                    self.assertEqual((run["identical"],
                                      run["largest_logit_gap_of_choosing_rows"]), (served, 0.0))

    def test_the_small_pool_preempts_and_its_extra_rows_add_up(self):
        many = support.recorded("many_requests")
        self.assertGreater(many["small pool"]["preemptions"], 0)
        extra = many["small_pool_extra_rows"]   # recompute, and prefix sharing lost
        self.assertEqual(extra["in_all"], extra["recomputed"] + extra["prefix_sharing_lost"])


if __name__ == "__main__":
    unittest.main()
