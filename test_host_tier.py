"""The host tier (host_tier.py): a block the pool evicts is copied to the host and loaded
back, bit for bit, in place of recomputing it; only a sequence computed by the same kernel
finds it; serving with a tier gives generate's results; the blocks, copies and bytes moved
are counted; when loading pays on real hardware follows from the two times compared."""
import ast
import random
import unittest

import batched
import host_tier
import kv_cache
import serving
import support
import verdicts
from bandwidth import cache_bytes_per_token
from host_tier import LAYOUTS, HostTier, TieredPool, pack, unpack
from instruments import replacing
from kv_cache import feed
from model import WIDTH
from one_gpu import A100, MODELS, prefill_flops, prefill_seconds
from random_models import random_tokens
from support import OPENINGS, PARAMS, TOK, check_random_cases, swapping
from verdicts import Layer, Wrong, differ, step, where_cache_differs


LAYER = Layer("host_tier", "the host tier (host_tier.py)", ("serving",))


def setUpModule():
    verdicts.set_up("host_tier")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down
BLOCK_BYTES = 4 * 2 * WIDTH * 8   # a block of 4 positions: a key and a value of 16 floats each


def fed_sequence(pool, ids, kernel=None):
    """A new sequence of pool for ids, every row computed (by kernel's product, or exactly)."""
    seq = pool.sequence(ids, batched.computed_by(kernel) if kernel else None)
    if kernel is None:
        feed(PARAMS, seq, ids)
    else:
        batched.forward_rows(PARAMS, [(seq, t, p) for p, t in enumerate(ids)][len(seq):],
                             kernel)
    return seq


def where_loads_stray(layout):
    """None if a story's blocks, evicted to the tier and loaded back, are what feeding it
    computes, found whole, and counted; else a Wrong naming the quantity and where.

    A pool of 3 blocks of 4 and a tier of 6 in layout: a story of 12 tokens is fed and
    freed; another of 12 takes every block (so the first's go to the tier); it is freed,
    and a new sequence for the first story loads them (evicting the other's to the tier:
    6 blocks moved to the host in all, 3 back)."""
    first, other = random_tokens(12, seed=1), random_tokens(12, seed=2)
    pool = TieredPool(PARAMS, 3, 4, 6, layout)
    fed_sequence(pool, first).free()
    fed_sequence(pool, other).free()
    step(f"loading the first story's blocks back ({layout})")
    seq = pool.sequence(first)
    label = f"the host tier ({layout}), the first story loaded back"
    if len(seq) != len(first):
        return Wrong(f"{label}: the prefix found is {len(seq)} positions from TieredPool, "
                     f"{len(first)} expected", f"  fed: token IDs {first}, blocks of 4")
    why = where_cache_differs(label, seq, support.filled_cache(first), "TieredPool")
    if why:
        return why
    copies = 2 if layout == "by layer" else 1
    for way, blocks in (("to host", 6), ("to device", 3)):
        why = differ(f"{label}: blocks, copies and bytes moved {way}",
                     list(pool.host.moved[way].values()),
                     [blocks, blocks * copies, blocks * BLOCK_BYTES], "HostTier",
                     names=("count",), fed="counted: blocks, copies, bytes (blocks of 4)")
        if why:
            return why
    return None


def where_kernels_mix():
    """None if a block computed by the batch-dependent kernel, evicted to the tier, is found
    by a sequence of that kernel only; else a Wrong."""
    ids, other = random_tokens(8, seed=3), random_tokens(8, seed=4)
    pool = TieredPool(PARAMS, 2, 4, 4)
    fed_sequence(pool, ids, batched.by_batch).free()
    fed_sequence(pool, other).free()
    step("an exact sequence for the batch-dependent kernel's story")
    found = len(pool.sequence(ids))
    if found:
        return Wrong(f"the host tier: an exact sequence found {found} positions computed by "
                     f"by_batch, 0 expected (a tier finds a block by its kernel too)",
                     f"  fed: token IDs {ids}, computed by by_batch, then evicted")
    seq = pool.sequence(ids, batched.computed_by(batched.by_batch))
    return None if len(seq) == len(ids) else Wrong(
        f"the host tier: a by_batch sequence found {len(seq)} positions, {len(ids)} expected")


def where_serving_strays():
    """None if four requests served from 12 blocks of 4 with a tier of 6 are generate_cached's
    and their readmissions load blocks back, recomputing fewer rows than without it."""
    requests = [{"prompt": prompt, "max_new_tokens": 16} for prompt in OPENINGS[:3]] + [
        {"prompt": OPENINGS[3], "max_new_tokens": 16, "temperature": 1.0, "seed": 3}]
    counts = {}
    for host_blocks in (0, 6):
        pool = TieredPool(PARAMS, 12, 4, host_blocks)
        step(f"serving four requests from 12 blocks with a tier of {host_blocks}")
        served, counts[host_blocks] = serving.serve(PARAMS, TOK, requests, pool, 4)
        for index, (request, result) in enumerate(zip(requests, served)):
            if result != kv_cache.generate_cached(PARAMS, TOK, **request):
                return Wrong(f"the host tier of {host_blocks} blocks: request {index}'s "
                             f"result is not generate_cached's", f"  request: {request}")
    loaded = pool.host.moved["to device"]["blocks"]
    if not loaded or counts[6]["recomputed_rows"] >= counts[0]["recomputed_rows"]:
        return Wrong(f"the host tier of 6 blocks: {loaded} blocks loaded back and "
                     f"{counts[6]['recomputed_rows']} rows recomputed, against "
                     f"{counts[0]['recomputed_rows']} without a tier: loads and fewer rows "
                     f"expected", f"  counts: {counts}")
    return None


def quick_check():
    """A story's blocks evicted to the tier and loaded back equal its fed cache, in each
    layout, with their blocks, copies and bytes counted; a kernel's block is found by that
    kernel only; four requests served with a tier are generate_cached's and load blocks
    back in place of rows."""
    for layout in LAYOUTS:
        why = where_loads_stray(layout)
        if why:
            return why
    return where_kernels_mix() or where_serving_strays()


QuickCheck = verdicts.quick_check_case("host_tier", __name__)


class Teeth(unittest.TestCase):
    """Each mistake planted in the real host_tier.py makes the layer's quick check fail with
    a line naming the quantity and where."""

    MISTAKES = [
        ("a block loaded into the wrong slots (its positions reversed)", host_tier, "unpack",
         swapping("range(positions)", "range(positions - 1, -1, -1)"),
         r"the host tier \(by layer\), the first story loaded back: its keys, at position 0, "
         r"number 0: .* from TieredPool, .* expected"),
        ("a tier that forgets a block's kernel", HostTier, "store",
         swapping("(kernel, prefix)", "(None, prefix)"),
         r"the host tier: an exact sequence found 8 positions computed by by_batch, 0 "
         r"expected"),
        ("a loaded block left out of the prefix index", TieredPool, "_load_prefix",
         replacing(lambda node: isinstance(node, ast.Expr)
                   and "prefix_index" in ast.unparse(node),
                   lambda node: ast.Pass()),
         r"the host tier \(by layer\), the first story loaded back: the prefix found is 0 "
         r"positions from TieredPool, 12 expected"),
        ("one copy counted for a block of many buffers", HostTier, "_count",
         swapping("len(buffers)", "1"),
         r"the host tier \(by layer\), the first story loaded back: blocks, copies and bytes "
         r"moved to host, at count 1: 6 from HostTier, 12 expected"),
    ]

    def test_the_quick_check_names_each_mistake_and_where(self):
        verdicts.assert_verdicts(self, "host_tier", self.MISTAKES)


def random_serving_case(n):
    """None if random requests served from a random small pool and tier are generate_cached's,
    every copy the tier holds is the block a feed computes, and bytes = blocks x block bytes.

    All from random.Random(n): 3 to 5 openings, greedy or sampled, 6 to 20 new tokens; a
    pool of blocks of 4 that fits each request, with up to 6 blocks more; a tier of 0 to 12
    blocks, in either layout; batches of 1 to 4."""
    rng = random.Random(n)
    requests = [{"prompt": rng.choice(OPENINGS), "max_new_tokens": rng.randint(6, 20),
                 **({"temperature": 1.0, "seed": rng.randrange(100)} if rng.random() < 0.5
                    else {})} for _ in range(rng.randint(3, 5))]
    fits = max(-(-min(len(TOK.encode(r["prompt"])) + r["max_new_tokens"], 64) // 4)
               for r in requests)
    pool = TieredPool(PARAMS, rng.randint(fits, fits + 6), 4, rng.randint(0, 12),
                      rng.choice(LAYOUTS))
    label = (f"{len(pool.blocks)} blocks, a tier of {pool.host.blocks} ({pool.host.layout}), "
             f"{len(requests)} requests")
    served, _ = serving.serve(PARAMS, TOK, requests, pool, rng.randint(1, 4))
    for index, (request, result) in enumerate(zip(requests, served)):
        if result != kv_cache.generate_cached(PARAMS, TOK, **request):
            return Wrong(f"{label}: request {index} is not generate_cached's")
    for (kernel, prefix), (tokens, buffers) in pool.host.held.items():
        cache = support.filled_cache(list(prefix))
        expected = [(cache.keys[-4:], cache.values[-4:])]
        why = differ(f"{label}: the copy of the block ending at {len(prefix)}",
                     unpack(buffers, pool.host.layout, 4, WIDTH), expected, "HostTier",
                     names=("layer", "part", "position", "number"))
        if why:
            return why
    for way, moved in pool.host.moved.items():
        if moved["bytes"] != moved["blocks"] * BLOCK_BYTES:
            return Wrong(f"{label}: {moved['bytes']} bytes moved {way} for {moved['blocks']} "
                         f"blocks of {BLOCK_BYTES}")
    return None


class Tier(unittest.TestCase):

    def test_random_requests_pools_and_tiers_serve_generate_s_results(self):
        """Random requests, pools, tiers and layouts (3 cases, more with
        KV_LAB_RANDOM_CASES): what random_serving_case checks holds."""
        check_random_cases(self, 3, random_serving_case)

    def test_a_block_packs_and_unpacks_in_each_layout(self):
        """A block of 3 layers of 2 positions of 2 numbers: by layer, 6 buffers of 4; as one
        block, one of 24; each unpacks to what was packed."""
        layers = [([[10 * l + 1, 2.5], [3, 4]], [[5, 6], [7, 8 + l]]) for l in range(3)]
        by_layer, one = pack(layers, "by layer"), pack(layers, "one block")
        self.assertEqual([len(b) for b in by_layer], [4] * 6)
        self.assertEqual(one, [[x for b in by_layer for x in b]])
        for layout, buffers in (("by layer", by_layer), ("one block", one)):
            self.assertEqual(unpack(buffers, layout, 2, 2), layers)

    def test_bad_tiers_are_refused_naming_them(self):
        """A tier of a negative size, a float, a bool; a layout that is not one of LAYOUTS;
        params the pool refuses: each before anything is made."""
        for call, fragment in (
                (lambda: TieredPool(PARAMS, 8, 4, -1),
                 r"host blocks must be an int >= 0 \(the blocks the host tier holds\), got -1"),
                (lambda: HostTier(2.0), "host blocks must be an int"),
                (lambda: HostTier(True), "host blocks must be an int"),
                (lambda: TieredPool(PARAMS, 8, 4, 4, "by head"),
                 r"layout must be one of \('by layer', 'one block'\), got 'by head'"),
                (lambda: TieredPool(PARAMS, 0, 4, 4), "blocks must be an int from 1"),
                (lambda: TieredPool(PARAMS, 8, 4, 4).sequence("ab"),
                 "ids must be a list of token IDs, got str"),
                (lambda: TieredPool(PARAMS, 8, 4, 4).sequence([96]),
                 r"ids\[0\] = 96 is outside the vocabulary")):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                call()


def pays(real, tokens, link):
    """Whether loading tokens tokens' cache over link beats recomputing them on an A100,
    computed here from the bytes and the FLOPs."""
    return (tokens * cache_bytes_per_token(real) / link["bytes_per_second"]
            < prefill_flops(real, tokens) / A100["flops_per_second"])


class LoadingPays(unittest.TestCase):

    def test_loading_beats_recomputing_from_the_length_given_and_not_before(self):
        """For each real model and link: at the length loading_pays_from gives, loading beats
        recomputing, one token shorter it does not (unless it is 1), and at the context
        window too; None means it loses at the context window, and (the difference being
        convex) at every length before it where it lost at 1."""
        for real in MODELS:
            for link in host_tier.LINKS:
                with self.subTest(model=real["model"], link=link["link"]):
                    start = host_tier.loading_pays_from(real, link)
                    context = real["context_window"]
                    if start is None:
                        self.assertFalse(pays(real, context, link))
                        self.assertFalse(pays(real, 1, link))
                    else:
                        self.assertTrue(pays(real, start, link))
                        self.assertTrue(start == 1 or not pays(real, start - 1, link))
                        self.assertTrue(pays(real, context, link))

    def test_loading_beats_a_prefill_alone_up_to_the_length_given_and_not_one_more(self):
        """For each real model and link: loading beats a prefill alone on the A100 (its
        FLOPs at the peak or every weight read once, whichever is longer:
        one_gpu.prefill_seconds) at every length up to loading_wins_alone_up_to's, and not
        one token longer; None only where loading pays from the first token."""
        for real in MODELS:
            for link in host_tier.LINKS:
                with self.subTest(model=real["model"], link=link["link"]):
                    up_to = host_tier.loading_wins_alone_up_to(real, link)
                    wins = [tokens * cache_bytes_per_token(real) / link["bytes_per_second"]
                            < prefill_seconds(real, tokens)
                            for tokens in range(1, (up_to or 0) + 2)]
                    if up_to is None:
                        self.assertEqual(host_tier.loading_pays_from(real, link), 1)
                    else:
                        self.assertEqual(wins, [True] * up_to + [False])

    def test_a_slower_link_needs_a_longer_prompt(self):
        """Llama-3.1-8B over links from 64 GB/s down to 0.5 GB/s: the length from which
        loading pays never falls as the link slows, and the slowest never pays."""
        real = MODELS[1]
        starts = [host_tier.loading_pays_from(real, {"bytes_per_second": gbps * 1e9})
                  for gbps in (64, 8, 2, 1.2, 1, 0.5)]
        found = [s for s in starts if s is not None]
        self.assertEqual(found, sorted(found))
        self.assertIsNone(starts[-1])


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of the host tier."""

    def test_rows_recomputed_fall_as_the_tier_grows_and_bytes_are_blocks(self):
        """Every tier: all results generate's, the same steps and preemptions (the device
        pool alone sets them); rows recomputed falling as the tier grows; bytes moved each
        way = blocks x bytes a block, one copy a block (one block layout); with the ample
        tier, every row beyond the ample pool's (section 21) is a row recomputed, those of
        readmitted requests' last, unfilled blocks."""
        record = support.recorded("host_tier")
        ample = support.recorded("many_requests")["ample pool"]
        tiers = record["tiers"]
        for tier in tiers:
            with self.subTest(host_blocks=tier["host_blocks"]):
                self.assertEqual(tier["identical"], record["requests"])
                self.assertEqual((tier["steps"], tier["preemptions"]),
                                 (tiers[0]["steps"], tiers[0]["preemptions"]))
                for way in ("to_host", "to_device"):
                    moved = tier[way]
                    self.assertEqual(moved["bytes"], moved["blocks"] * BLOCK_BYTES)
                    self.assertEqual(moved["copies"], moved["blocks"])
        recomputed = [tier["recomputed_rows"] for tier in tiers]
        self.assertEqual(recomputed, sorted(recomputed, reverse=True))
        self.assertEqual(tiers[-1]["rows"], ample["rows"] + tiers[-1]["recomputed_rows"])

    def test_by_layer_takes_two_copies_a_layer_and_one_block_one(self):
        record = support.recorded("host_tier")
        for row in record["layouts"]:
            with self.subTest(model=row["model"], layout=row["layout"]):
                self.assertTrue(row["unpacked_equal"])
                self.assertEqual(row["copies_a_block"],
                                 2 * row["layers"] if row["layout"] == "by layer" else 1)
        self.assertEqual(len({(r["model"], r["numbers_a_block"]) for r in record["layouts"]}), 2)


if __name__ == "__main__":
    unittest.main()
