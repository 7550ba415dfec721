"""Parallel sampling by copy on write (forks.py): continuations from forks of one paged
sequence are generate's for their seeds, hold the prompt's full blocks once, and every
refusal leaves the pool as it was."""
import math
import unittest

import forks
import kv_cache
import model
import paged
import support
import verdicts
from instruments import recording
from kv_cache import generate_cached
from stories import story_ids
from support import OPENINGS, PARAMS, TOK, assert_equal, swapping
from verdicts import Layer, Wrong, step


LAYER = Layer("forks", "parallel sampling from forks (forks.py)", ("lesson", "paged"))


def setUpModule():
    verdicts.set_up("forks")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down


def quick_check():
    """Forked continuations are generate's for their seeds, and share the prompt's blocks.

    Three continuations (seeds 0, 1, 3: three different stories) of the fifth test
    opening (14 tokens: 3 full blocks and 2 positions) forked from one prefill in a pool of
    48 blocks of 4: None if each is generate_cached's for its seed, the prompt's rows are
    computed once, the blocks held at the end are the prompt's full blocks once and each
    continuation's own, and every block is back in the pool; else a Wrong naming the seed
    and the quantity."""
    pool, prompt, seeds = paged.BlockPool(PARAMS, 48, 4), OPENINGS[4], (0, 1, 3)
    prompt_tokens, where = len(TOK.encode(prompt)), f"forks of {OPENINGS[4]!r}"
    step(f"{where}: sampling seeds {seeds} (forks.sample_from_forks)")
    with recording(kv_cache, "forward_step") as rows:
        results, held = forks.sample_from_forks(PARAMS, TOK, prompt, seeds, pool)
    positions = []
    for seed, result in zip(seeds, results):
        step(f"{where}: generate_cached for seed {seed}")
        expected = generate_cached(PARAMS, TOK, prompt, temperature=1.0, seed=seed)
        if result != expected:
            parts = [f"new token {number}: {mine} from sample_from_forks, {theirs} expected"
                     for number, (mine, theirs) in enumerate(zip(result["steps"],
                                                                  expected["steps"]), 1)
                     if mine != theirs]
            return Wrong(f"{where}: the continuation of seed {seed}, at " + (parts or [
                f"its end: {len(result['steps'])} new tokens ({result['stopped']}) from "
                f"sample_from_forks, {len(expected['steps'])} ({expected['stopped']}) "
                f"expected"])[0], f"  fed: {prompt!r}, seeds {seeds}, blocks of 4\n"
                f"  got:      {result['text']!r}\n  expected: {expected['text']!r}")
        positions.append(len(story_ids(TOK, prompt, result)) - 1)
    full = prompt_tokens // 4
    for quantity, got, wanted in (
            ("rows computed (the prompt's once, then each continuation's)", len(rows),
             prompt_tokens + sum(n - prompt_tokens for n in positions)),
            ("blocks held when the last ended (the prompt's full blocks once)", held,
             full + sum(math.ceil(n / 4) - full for n in positions)),
            ("free blocks afterwards", pool.free_blocks(), len(pool.blocks)),
            ("blocks still counted as held afterwards", sum(pool.ref_counts), 0)):
        if got != wanted:
            return Wrong(f"{where}: {quantity} {got}, {wanted} expected",
                         f"  fed: {prompt!r} ({prompt_tokens} tokens), seeds {seeds}, "
                         f"blocks of 4\n  continuations end at positions {positions}")
    return None


QuickCheck = verdicts.quick_check_case("forks", __name__)


class QuickCheckTeeth(unittest.TestCase):
    """Mistakes planted in the real forks.sample_from_forks (by its syntax tree): the
    quick check names the seed or the quantity that shows each."""

    MISTAKES = [
        ("every continuation sampled with the first seed", forks, "sample_from_forks",
         swapping("generate.generate_with(next_logits, tok, list(ids), 60, 1.0, None, seed)",
                  "generate.generate_with(next_logits, tok, list(ids), 60, 1.0, None, seeds[0])"),
         r"^forks of .*: the continuation of seed 1, at new token"),
        ("the seeds taken in another order", forks, "sample_from_forks",
         swapping("zip(seeds, forks)", "zip(sorted(seeds, reverse=True), forks)"),
         r"^forks of .*: the continuation of seed 0, at new token"),
        ("every fork the parent itself, not a copy", forks, "sample_from_forks",
         swapping("seq.copy()", "seq"), r"^forks of .*: (the continuation of seed 0|.*raised)"),
        ("the parent sequence kept until the end, so the last fork copies its block too",
         forks, "sample_from_forks", swapping("seq.free()", "pass"),
         r"^forks of .*: blocks held when the last ended .* \d+, \d+ expected"),
        ("the forks not given back on the way out", forks, "sample_from_forks",
         swapping("sequence.free()", "pass"), r"^forks of .*: free blocks afterwards")]

    def test_each_mistake_names_its_seed_or_quantity(self):
        verdicts.assert_verdicts(self, "forks", self.MISTAKES)


class Forks(unittest.TestCase):
    """sample_from_forks: its continuations, the blocks they share, its refusals."""

    def test_sampled_continuations_from_forks_share_the_prompt_s_blocks(self):
        """Parallel sampling (forks.sample_from_forks): the prompt is computed once, its
        full blocks are held once for all the continuations, its partly filled last block
        is copied by every fork but the last to write, and each continuation is
        generate's for its seed."""
        pool, prompt, seeds = paged.BlockPool(PARAMS, 48, 4), OPENINGS[4], (0, 1, 3)
        prompt_tokens = len(TOK.encode(prompt))   # 14: 3 full blocks and 2 positions
        with recording(kv_cache, "forward_step") as rows:
            results, held = forks.sample_from_forks(PARAMS, TOK, prompt, seeds, pool)
        for seed, result in zip(seeds, results):
            assert_equal(self, result, generate_cached(PARAMS, TOK, prompt, temperature=1.0,
                                                       seed=seed), f"seed {seed}")
        positions = [len(story_ids(TOK, prompt, result)) - 1 for result in results]
        full = prompt_tokens // 4
        self.assertEqual(held, full + sum(math.ceil(n / 4) - full for n in positions))
        self.assertEqual(len(rows), prompt_tokens + sum(n - prompt_tokens for n in positions))
        self.assertEqual((pool.free_blocks(), pool.ref_counts), (48, [0] * 48))

    def test_sample_from_forks_refuses_bad_seeds_and_pools_before_anything_changes(self):
        """Seeds that are not a list, a tuple or a range (an iterator would be read up by
        the forks, leaving none to continue them; an int), seeds generate would refuse
        (None, 1.5, "a", True), more seeds than the pool has blocks (ten million, refused at
        once), a pool that is not one of these params', and one too small for what the
        forks may hold (a context each: it said "1 more are needed" part-way), each refused
        by name with the pool as it was; a range and a tuple are taken."""
        pool, prompt = paged.BlockPool(PARAMS, 48, 4), OPENINGS[4]
        other = paged.BlockPool(model.init_params(1), 48, 4)
        before = support.pool_snapshot(pool)
        for seeds, given, fragment in (
                (iter([0, 1]), pool, "seeds must be a list, a tuple or a range of ints, one a "
                                     "continuation, got list_iterator"),
                ((s for s in [0]), pool, "got generator"), (5, pool, "got int"),
                ([0, None], pool, r"seeds\[1\] must be an int, got None"),
                ([1.5], pool, r"seeds\[0\] must be an int, got 1\.5"),
                (["a"], pool, r"seeds\[0\] must be an int, got 'a'"),
                ([True], pool, r"seeds\[0\] must be an int, got True"),
                (range(10 ** 7), pool, "seeds: 10,000,000 continuations need a block of their "
                                       "own each, more than the pool's 48 blocks"),
                ([0], None, "pool must be a BlockPool made for these params, got NoneType"),
                ([0], other, "pool must be a BlockPool made for these params, got one made "
                             "for others")):
            with self.subTest(seeds=seeds, pool=type(given).__name__), \
                    self.assertRaisesRegex(ValueError, fragment):
                forks.sample_from_forks(PARAMS, TOK, prompt, seeds, given)
            assert_equal(self, support.pool_snapshot(pool), before, "the pool")
        small = paged.BlockPool(PARAMS, 41, 4)   # one block short of three contexts
        before = support.pool_snapshot(small)
        with self.assertRaisesRegex(ValueError, r"^pool: 3 continuations of a prompt of 14 "
                                                r"tokens may need 42 blocks of 4 positions "
                                                r"\(its 3 full blocks held once, and up to 63 "
                                                r"positions each\), and the pool has 41 free"):
            forks.sample_from_forks(PARAMS, TOK, prompt, (0, 1, 3), small)
        assert_equal(self, support.pool_snapshot(small), before, "the small pool")
        for seeds in (range(1, 3), (1, 2)):
            results, _ = forks.sample_from_forks(PARAMS, TOK, prompt, seeds, pool)
            self.assertEqual([r["text"] for r in results],
                             [generate_cached(PARAMS, TOK, prompt, temperature=1.0,
                                              seed=seed)["text"] for seed in seeds])


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of parallel sampling."""

    def test_forks_sample_generate_s_continuations_and_share_the_prompt_s_blocks(self):
        sampling = support.recorded("parallel_sampling")
        for opening in sampling["openings"]:
            with self.subTest(opening["prompt"]):
                self.assertEqual(opening["identical_to_generate"],
                                 sampling["continuations_each"])
                self.assertEqual(opening["prompt_rows_with_forks"], opening["prompt_tokens"])
                self.assertEqual(opening["blocks_held_by_caches_of_their_own"]
                                 - opening["blocks_held_with_forks"],
                                 (sampling["continuations_each"] - 1)
                                 * (opening["prompt_tokens"] // 4))   # its full blocks


if __name__ == "__main__":
    unittest.main()
