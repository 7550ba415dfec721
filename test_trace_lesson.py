"""The lesson's record (trace_lesson.py, the stages of Part 1): what kv-trace.json says of
both generators on the 60 test openings, and its figures against real runs. The file is
this run's record: test_whole_trace proves it (support.recorded)."""
import unittest

import generate
import kv_cache
import model
from generate import never_ending
from instruments import largest_gap, recording, sums_in_another_order
from kv_cache import generate_cached
from verdicts import skip_unless_sound
from support import (OPENINGS, PARAMS, STORIES, TOK, assert_changed, assert_same_rows,
                     cached_rows, generation_difference, recorded)


def setUpModule():
    skip_unless_sound("lesson")   # the real runs below are the lesson's


class TheRecord(unittest.TestCase):
    """What the recorded run says of the lesson's claims."""

    def test_every_cached_row_of_every_story_equals_the_full_pass_s(self):
        every = recorded("every_row_of_every_story")
        self.assertEqual(every["largest_logit_gap"], 0.0,
                         "kv-trace.json records a cached row unlike the full pass's: python3 "
                         "-m unittest test_kv_cache.Exactness shows where, and python3 "
                         "trace_kv.py --write records the run again once it passes")
        self.assertEqual(recorded("largest_logit_gap_first_story"), 0.0)
        self.assertEqual(every["stories"], 2 * recorded("stories"))   # greedy and sampled
        self.assertGreater(every["positions"], 60 * 2 * 20)

    def test_both_generators_write_the_same_stories(self):
        for kind in ("greedy_identical", "sampled_identical"):
            with self.subTest(kind):
                self.assertEqual(recorded(kind), recorded("stories"))

    def test_every_run_from_a_shared_prefill_is_the_run_without_it(self):
        sharing = recorded("prefix_sharing")
        self.assertEqual(sharing["identical"], sharing["runs"])


class RecordedFigures(unittest.TestCase):
    """The lesson's figures in kv-trace.json that the README quotes, against real runs
    (that the README quotes them is test_readme's part)."""

    @classmethod
    def setUpClass(cls):
        cls.record = {key: recorded(key) for key in ("cost_by_length", "prefix_sharing",
                                                      "sums_in_another_order")}

    def test_cost_by_length_matches_instrumented_runs(self):
        """Every length's counts are the formula's; the rows of the two shortest lengths
        are counted in real runs too (test_kv_cache's Work tests count a whole story's:
        the formula is the rows the code computes)."""
        never_ends = never_ending(PARAMS, TOK)
        for entry in self.record["cost_by_length"]:
            self.assertEqual(entry, {"positions": entry["positions"],
                                     **kv_cache.work(1, entry["positions"] - 1)})
        for entry in self.record["cost_by_length"][:2]:
            length, settings = entry["positions"], {"max_new_tokens": entry["positions"] - 1}
            with recording(model, "forward") as passes, \
                    recording(kv_cache, "forward_step") as steps:
                result = generate.generate(never_ends, TOK, "mia", **settings)
                cached = generate_cached(never_ends, TOK, "mia", **settings)
            if cached != result:
                self.fail(generation_difference(never_ends, "mia", settings, cached, result))
            self.assertEqual(len(TOK.encode("mia")) + len(result["steps"]), length)
            self.assertEqual(sum(len(call.result[0]) for call in passes), entry["uncached_rows"])
            self.assertEqual(len(steps), entry["cached_rows"])
            self.assertEqual(entry, {"positions": length, **kv_cache.work(1, length - 1)})

    def test_prefix_sharing_saves_the_recorded_rows(self):
        sharing = self.record["prefix_sharing"]
        self.assertEqual(sharing["identical"], sharing["runs"])
        lengths = [len(TOK.encode(prompt)) for prompt in OPENINGS]
        self.assertEqual(sharing["prompt_rows_without_sharing"], 3 * sum(lengths))
        self.assertEqual(sharing["prompt_rows_with_sharing"], sum(lengths) + 3 * len(lengths))

    def test_sums_in_another_order_change_the_scores_and_only_inside_the_block(self):
        ids = TOK.encode(STORIES[0])
        full, _ = model.forward(PARAMS, ids)
        with sums_in_another_order():
            reordered = cached_rows(PARAMS, ids)
        assert_changed(self, reordered, full, "the rows with sums in another order")
        self.assertEqual(largest_gap(full, reordered),
                         self.record["sums_in_another_order"]["largest_logit_gap_first_story"])
        self.assertEqual(self.record["sums_in_another_order"]
                         ["largest_logit_gap_first_story_in_both_paths"], 0.0,
                         "with plain sums in both paths the rows must still be equal")
        assert_same_rows(self, cached_rows(PARAMS, ids), full)



if __name__ == "__main__":
    unittest.main()
