"""An engine's kernels in the server (kernel_runs.py): each run compared with its kernel in
batches of 1 as worked out plainly, mistakes planted in that comparison named by the quick
check, and what the recorded run says of the kernels."""
import unittest

import kernel_runs
import support
import verdicts
from support import swapping
from verdicts import Layer, Wrong, step


LAYER = Layer("kernel_runs", "an engine's kernels in the server (kernel_runs.py)",
              ("serving", "batched"))


def setUpModule():
    verdicts.set_up("kernel_runs")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down

# Two made-up runs of one kernel, as kernel_run records them: alone (batches of 1) and in
# batches of up to 2. The batched run's stories part from alone's in two of three, at
# positions 3 and 1; its choosing rows: one as alone's, one other, and one for tokens alone
# never chose with (not compared).
ALONE = {"kernel": "k", "max_batch": 1, "pool": "ample", "blocks": 8, "steps": 9,
         "preemptions": 0, "prefix_hits": 0, "stories_identical_to_generate": 3,
         "greedy_stories_identical_to_generate": None, "largest_logit_gap_against_exact": 0.0,
         "stories": [[1, 2, 3, 4], [4, 5, 6], [7, 8, 9]],
         "chosen": [((1, 2, 3), [0.5, 0.25]), ((4, 5), [0.0, 1.0]), ((7, 8), [2.0, 1.0])]}
BATCHED = dict(ALONE, max_batch=2, stories=[[1, 2, 3, 5], [4, 9, 6], [7, 8, 9]],
               chosen=[((1, 2, 3), [0.5, 0.25]), ((4, 5), [0.0, 1.5]), ((4, 9), [1.0, 0.0])])
COMPARED = ("stories_identical_to_batches_of_1", "first_position_parting_from_batches_of_1",
            "choosing_rows_compared_with_batches_of_1", "choosing_rows_unlike_batches_of_1",
            "logits_as_with_batches_of_1")
WORKED_OUT = [1, 1, 2, 1, False]   # the batched run's COMPARED, by hand from the runs above


def quick_check():
    """kernel_table compares the two made-up runs as worked out plainly (WORKED_OUT).

    None if the batched run's comparison with batches of 1 and the requests counted are
    those; else a Wrong naming the figure."""
    step("kernel_runs.kernel_table of two made-up runs of one kernel")
    table = kernel_runs.kernel_table(None, [ALONE, BATCHED])
    got = [table["requests"], *(table["runs"][1][key] for key in COMPARED)]
    for key, mine, wanted in zip(("requests", *COMPARED), got,
                                 [len(ALONE["stories"]), *WORKED_OUT]):
        if mine != wanted:
            return Wrong(f"kernel_runs.kernel_table, the run in batches of up to 2 against "
                         f"batches of 1: its {key} is {mine!r}, {wanted!r} worked out plainly",
                         f"  fed: runs alone {ALONE['stories']} and batched "
                         f"{BATCHED['stories']}")
    return None


QuickCheck = verdicts.quick_check_case("kernel_runs", __name__)


class Teeth(unittest.TestCase):
    """Each mistake, planted in the real kernel_runs.py (by its syntax tree), makes the
    layer's quick check fail, naming the figure."""

    MISTAKES = [
        ("the last position where a story parts, not the first", kernel_runs, "kernel_table",
         swapping("min(parted, default=None)", "max(parted, default=None)"),
         r"against batches of 1: its first_position_parting_from_batches_of_1 is 3, 1 worked "
         r"out plainly$"),
        ("every choosing row counted unlike", kernel_runs, "kernel_table",
         swapping("logits not in rows_alone[ids]", "True"),
         r"against batches of 1: its choosing_rows_unlike_batches_of_1 is 2, 1 worked out "
         r"plainly$"),
        ("rows for tokens batches of 1 never chose with compared too", kernel_runs,
         "kernel_table", swapping("ids in rows_alone", "True"),
         r"kernel_table of two made-up runs of one kernel: raised KeyError: .*\(4, 9\) \(in "
         r"kernel_runs\.py line \d+, kernel_table"),
        ("each run's stories compared with themselves, not with batches of 1", kernel_runs,
         "kernel_table", swapping("first['stories']", "run['stories']"),
         r"against batches of 1: its stories_identical_to_batches_of_1 is 3, 1 worked out "
         r"plainly$"),
    ]

    def test_the_quick_check_names_each_mistake_and_where(self):
        verdicts.assert_verdicts(self, "kernel_runs", self.MISTAKES)


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of batched decode's kernels."""

    @classmethod
    def setUpClass(cls):
        cls.batched = support.recorded("batched_decode")

    def test_a_batch_invariant_kernel_s_rows_never_see_the_batch(self):
        for run in self.batched["runs"]:
            if run["kernel"] == "batch-invariant":
                with self.subTest(batch=run["max_batch"], pool=run["pool"]):
                    self.assertEqual((run["logits_as_with_batches_of_1"],
                                      run["stories_identical_to_batches_of_1"]),
                                     (True, self.batched["requests"]))

    def test_the_batch_dependent_kernels_give_other_logits_in_larger_batches(self):
        for kernel in ("batch-dependent", "32-bit batch-dependent", "split-KV attention"):
            with self.subTest(kernel):
                self.assertIn(False, [run["logits_as_with_batches_of_1"]
                                      for run in self.batched["runs"] if run["kernel"] == kernel])

    def test_no_greedy_story_changes_with_the_kernels_the_text_names(self):
        greedy = {(run["kernel"], run["max_batch"], run["pool"]):
                  run["greedy_stories_identical_to_generate"] for run in self.batched["runs"]
                  if run["greedy_stories_identical_to_generate"] is not None}
        self.assertEqual(greedy, dict.fromkeys(kernel_runs.GREEDY_TOO, self.batched["requests"]))


if __name__ == "__main__":
    unittest.main()
