"""What the paged pool (paged.py) refuses, and what it says it has room for: every misuse
is refused by name with the pool as it was, a position joins whole or not at all, and the
pool's answers about room are what it then takes or refuses."""
import random
import unittest

import batched
import model
import paged
import prefill
import support
import verdicts
from kv_cache import feed, forward_step, generate_cached
from support import OPENINGS, PARAMS, STORIES, TOK, assert_equal, filled_cache, snapshot


def setUpModule():
    """Built on the paged cache: if its layer is wrong, these tests skip (python3 -m
    unittest test_paged says why); then they run from another folder than the lab's."""
    verdicts.skip_unless_sound("paged")
    support.enter_another_folder()


tearDownModule = support.tear_down


class Refusals(unittest.TestCase):
    """Every refusal of the pool and its sequences, before anything changes."""

    def setUp(self):
        self.ids = TOK.encode(STORIES[0])

    def assert_refused(self, pool, attempt, fragment):
        """attempt raises a ValueError naming fragment, and the pool is as it was."""
        before = support.pool_snapshot(pool)
        with self.assertRaises(ValueError) as caught:
            attempt()
        self.assertIn(fragment, str(caught.exception))
        assert_equal(self, support.pool_snapshot(pool), before, "the pool")


    def test_sequence_checks_its_ids_like_forward_step(self):
        pool = paged.BlockPool(PARAMS, 10, 4)
        feed(PARAMS, pool.sequence(), [1, 0, 5, 6])
        for ids, fragment in (([1.0, False, 5, 6, 7], "ids[0] = 1.0 is outside the vocabulary"),
                              ([5, 96], "ids[1] = 96 is outside the vocabulary"),
                              ([500], "ids[0] = 500"), ("mia", "ids must be a list"),
                              ([5] * 65, "beyond the 64 positions")):
            with self.subTest(ids=ids):
                self.assert_refused(pool, lambda: pool.sequence(ids), fragment)

    def test_a_refused_continuation_names_the_pool_and_leaks_nothing(self):
        """A pool of one block of 3, held by a sequence of 3 tokens: continuing its prompt
        needs a copy of that block, and there is no room."""
        pool = paged.BlockPool(PARAMS, 1, 3)
        seq = pool.sequence()
        feed(PARAMS, seq, TOK.encode("tom ran"))
        before, held = support.pool_snapshot(pool), snapshot(seq)
        with self.assertRaisesRegex(ValueError, "the cache has no room for the 60 more "
                                                "positions this generation may need .* its pool "
                                                "has 0 of its 1 blocks of 3 positions free"):
            generate_cached(PARAMS, TOK, "tom ran", cache=seq)
        assert_equal(self, support.pool_snapshot(pool), before, "the pool")
        assert_equal(self, snapshot(seq), held, "the sequence")
        seq.free()
        self.assertEqual(pool.free_blocks(), 1)

    def test_a_generation_the_pool_may_not_hold_is_refused_before_anything_changes(self):
        """A pool of 4 blocks of 4 with "zoe went" cached: a generation of up to 30 new
        tokens from a sequence of "mia was sad." may need more blocks than the pool has
        free, so it is refused at once, the prefix cache included (it used to run until the
        pool was out, evicting the cached block on the way)."""
        pool = paged.BlockPool(PARAMS, 4, 4)
        cached = pool.sequence()
        feed(PARAMS, cached, TOK.encode("zoe went to"))
        cached.free()                                     # its full blocks stay cached
        seq = pool.sequence()
        feed(PARAMS, seq, TOK.encode("mia was sad."))
        before, held = support.pool_snapshot(pool), snapshot(seq)
        with self.assertRaisesRegex(ValueError, "no room for the 30 more positions"):
            generate_cached(PARAMS, TOK, "mia was sad.", max_new_tokens=30, cache=seq)
        assert_equal(self, support.pool_snapshot(pool), before, "the pool")
        assert_equal(self, snapshot(seq), held, "the sequence")
        self.assertEqual(pool.evictions, 0)
        short = generate_cached(PARAMS, TOK, "mia was sad.", max_new_tokens=3, cache=seq)
        self.assertEqual(short, generate_cached(PARAMS, TOK, "mia was sad.", max_new_tokens=3))

    def test_feed_and_chunked_prefill_keep_what_was_fed_before_a_refusal(self):
        """Each position joins whole or not at all: a refusal in the middle of an input
        leaves the positions fed before it, as its docstring says, and feeding the rest
        later gives the rows of one run."""
        for fill in (lambda seq, ids: feed(PARAMS, seq, ids),
                     lambda seq, ids: prefill.prefill_in_chunks(PARAMS, seq, ids, 4)):
            pool = paged.BlockPool(PARAMS, 2, 4)
            seq = pool.sequence()
            with self.assertRaisesRegex(ValueError, "out of blocks"):
                fill(seq, self.ids[:12])
            self.assertEqual(seq.tokens, self.ids[:8])
            assert_equal(self, snapshot(seq), snapshot(filled_cache(self.ids[:8])),
                         "the sequence")

    def test_the_pool_refuses_misuse_of_its_own_methods(self):
        pool = paged.BlockPool(PARAMS, 4, 4)
        seq = pool.sequence()
        feed(PARAMS, seq, TOK.encode(OPENINGS[0])[:4])   # block 0, full
        k = seq.keys[0]
        for attempt, fragment in (
                (lambda: pool.release(1), "block 1 is held by no table"),
                (lambda: pool.share(9), "block id must be an int from 0 to 3, got 9"),
                (lambda: pool.share(True), "block id must be an int"),
                (lambda: pool.share(2), "block 2 is free and holds nothing to share"),
                (lambda: pool.take([1] * 5, [k] * 5, [k] * 5), "a block holds up to 4"),
                (lambda: pool.take([1], [k], []), "got 1 tokens, 1 keys and 0 values"),
                (lambda: pool.append(0, 1, k, k, [1] * 5), "this one is full"),
                (lambda: pool.truncate(0, 5), "length must be an int from 0 to 4")):
            with self.subTest(fragment=fragment):
                self.assert_refused(pool, attempt, fragment)
        part = pool.sequence()
        feed(PARAMS, part, [5, 6])                        # block 1: two of its four slots
        fork = part.copy()
        self.assert_refused(pool, lambda: pool.append(part.table[0], 1, k, k, [5, 6, 1]),
                            f"block {part.table[0]}, slot 2: a position is written only into "
                            f"a block one table holds that is not full, and this one is held "
                            f"by 2 tables")
        fork.free()

    def test_refusals_leave_the_pool_unchanged(self):
        pool = paged.BlockPool(PARAMS, 3, 4)
        seq = pool.sequence()
        feed(PARAMS, seq, self.ids[:10])   # blocks of 4, 4 and 2: two free slots, no free block
        self.assert_refused(pool, lambda: prefill.prefill(PARAMS, seq, self.ids[10:13], 10),
                            "the pool is out of blocks: it has 3 blocks of 4 positions, 0 free, "
                            "and 1 more is needed")
        fork = seq.copy()                  # takes no block...
        self.assert_refused(pool, lambda: forward_step(PARAMS, fork, self.ids[10], 10),
                            "out of blocks")   # ...until it writes to the shared last one
        fork.free()
        feed(PARAMS, seq, self.ids[:12])   # now every block is full
        self.assert_refused(pool, lambda: forward_step(PARAMS, seq, self.ids[12], 12),
                            "out of blocks")
        self.assertEqual(seq.tokens, self.ids[:12])
        seq.free()
        for attempt in (lambda: forward_step(PARAMS, seq, 5, 0), lambda: feed(PARAMS, seq, [5]),
                        seq.copy, lambda: seq.crop(0), lambda: seq.extend([5], [[0.0]], [[0.0]])):
            self.assert_refused(pool, attempt, "this sequence was freed")
        for blocks, size in ((0, 4), (3, 0), (3, 2.0), (True, 4), (3, None), (10 ** 9, 4),
                             (3, model.CONTEXT + 1)):
            with self.subTest(blocks=blocks, block_size=size):
                with self.assertRaisesRegex(ValueError, r"must be an int from 1 to \d+ \((each "
                                                        r"is made with the pool|the model's "
                                                        r"positions)\), got"):
                    paged.BlockPool(PARAMS, blocks, size)


def _pools_holding_sequences(test, rng, story, whole):
    """Two small pools drawn from rng, and the sequences of story (whole: a KVCache fed it)
    left in them by six random steps: new ones, found by their prefix, forked, cropped,
    freed. A refusal on the way is only for want of blocks."""
    pools = [paged.BlockPool(PARAMS, rng.randint(1, 8), rng.choice((1, 2, 3, 4)))
             for _ in range(2)]
    live = []
    for _ in range(6):
        try:
            if live and rng.random() < 0.3:
                live.append(rng.choice(live).copy())
            else:
                live.append(rng.choice(pools).sequence(story[:rng.randint(0, 12)]))
                for p in range(len(live[-1]), rng.randint(len(live[-1]), 16)):
                    live[-1].append(story[p], whole.keys[p], whole.values[p])   # as fed
            if rng.random() < 0.3:
                live[-1].crop(rng.randint(0, len(live[-1])))
            if rng.random() < 0.2:
                live.pop().free()
        except ValueError as refused:
            test.assertIn("out of blocks", str(refused))
    return pools, live


def _assert_a_sequence_s_room_is_what_extend_does(test, rng, label, live, story, whole):
    """For each live sequence and a random number of more positions of story, its room_for
    and its pool's are whether extending it by them succeeds; a refusal changes nothing."""
    for seq in live:
        held = len(seq)
        more = rng.randint(0, min(6, len(story) - held))
        answer = seq.pool.room_for([(seq, more)])
        test.assertEqual(seq.room_for(more), answer, label)
        before = support.pool_snapshot(seq.pool), snapshot(seq)
        try:
            seq.extend(story[held:held + more], whole.keys[held:held + more],
                       whole.values[held:held + more])
            test.assertTrue(answer, f"{label}: room_for said no, extend took them")
        except ValueError as refused:
            test.assertFalse(answer, f"{label}: room_for said yes, extend: {refused}")
            assert_equal(test, (support.pool_snapshot(seq.pool), snapshot(seq)), before, label)


def _assert_the_pools_room_is_what_forward_rows_does(test, rng, label, pools, live, story):
    """room_for of each pool is whether forward_rows takes a random batch of positions of
    story for live sequences of both pools and a KVCache; a refusal changes nothing."""
    batch = [seq for seq in live if rng.random() < 0.7 and len(seq) < len(story)]
    items = [(seq, story[p], p) for seq in batch
             for p in range(len(seq), min(len(seq) + rng.randint(1, 3), len(story)))]
    items.append((filled_cache(story[:3]), story[3], 3))
    answer = all(pool.room_for([(seq, sum(s is seq for s, _, _ in items))
                                for seq in batch if seq.pool is pool])
                 for pool in pools)
    before = [support.pool_snapshot(pool) for pool in pools], [snapshot(s) for s in batch]
    try:
        batched.forward_rows(PARAMS, items)
        test.assertTrue(answer, f"{label}: room_for said no, forward_rows took them")
    except ValueError as refused:
        test.assertFalse(answer, f"{label}: room_for said yes, forward_rows: {refused}")
        assert_equal(test, ([support.pool_snapshot(pool) for pool in pools],
                            [snapshot(s) for s in batch]), before, label)


def _holds(test, new, ids):
    """Whether the new sequence takes ids (it is then freed); a refusal is only for want
    of blocks."""
    try:
        feed(PARAMS, new, ids)
        return True
    except ValueError as refused:
        test.assertIn("out of blocks", str(refused))
        return False
    finally:
        new.free()


def _assert_room_for_a_new_sequence_is_what_it_holds(test, rng, label, pool, story):
    """room_for_sequence (from a random start of story) and could_hold of pool, for a random
    number of positions, are whether a new sequence then holds so many of story's."""
    ids = story[:rng.randint(0, 12)]
    positions = rng.randint(len(ids), len(story))
    test.assertEqual(pool.room_for_sequence(ids, positions),
                     _holds(test, pool.sequence(ids), story[:positions]),
                     f"{label}: room_for_sequence({len(ids)} ids, {positions})")
    test.assertEqual(pool.could_hold(positions), _holds(test, pool.sequence(), story[:positions]),
                     f"{label}: could_hold({positions})")


class RoomHasOneOwner(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        verdicts.skip_unless_sound("batched")   # it feeds batches through forward_rows

    def test_the_pool_s_room_answers_are_what_it_then_does(self):
        """On random pairs of small pools holding sequences of one story (new ones,
        found by their prefix, forked, cropped, freed): room_for of one sequence is whether
        extending it succeeds; room_for of each pool, whether forward_rows takes a batch of
        sequences of both pools and a KVCache; a refusal changes nothing; and
        room_for_sequence and could_hold are whether a new sequence then holds so many."""
        story = TOK.encode(STORIES[0])
        whole = filled_cache(story)

        def trial(number):
            rng = random.Random(number)
            pools, live = _pools_holding_sequences(self, rng, story, whole)
            label = f"trial {number}"
            _assert_a_sequence_s_room_is_what_extend_does(self, rng, label, live, story, whole)
            _assert_the_pools_room_is_what_forward_rows_does(self, rng, label, pools, live,
                                                             story)
            for seq in live:
                seq.free()
            _assert_room_for_a_new_sequence_is_what_it_holds(self, rng, label, pools[0], story)
        support.check_random_cases(self, 60, trial)


if __name__ == "__main__":
    unittest.main()
