"""Prefill in chunks under a token budget, measured (budget_runs.py): a run's figures as
worked out plainly from made-up counts and events, mistakes planted in them named by the
quick check, and what the recorded run says of the budgets."""
import unittest

import budget_runs
import support
import verdicts
from support import swapping
from verdicts import Layer, Wrong, step


LAYER = Layer("budget_runs", "prefill in chunks under a token budget, measured "
              "(budget_runs.py)", ("token_budget",))


def setUpModule():
    verdicts.set_up("budget_runs")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down

# A made-up run of two requests, as serve would count it under a budget of 8 (BUDGETS):
# five steps of 3, 9, 8, 10 and 1 rows, of which 0, 1, 2, 2 and 1 decode rows. Request 0
# is admitted at step 1, prefilled at steps 1 and 2, and first decodes at step 3; request
# 1 is admitted at step 1, prefilled at step 2, and its first token ends it at step 4.
COUNTS = {"steps": 5, "rows": 31, "chunks": 3, "largest_step": 10,
          "rows_by_step": [3, 9, 8, 10, 1], "decodes_by_step": [0, 1, 2, 2, 1]}
FIRST = {(0, "admitted"): 1, (0, "prefill"): 1, (0, "decode"): 3,
         (1, "admitted"): 1, (1, "prefill"): 2, (1, "finished"): 4}
WORKED_OUT = {"stalled_decodes": [1 + 2],            # the steps of 9 and 10 rows, over 8
              "mean_steps_to_first_token": (2 + 3) / 2,
              "identical": 1}                         # "a" as expected, "b" not


def quick_check():
    """budget_runs.measured of the made-up run above gives the figures worked out plainly.

    None if its stalled decodes, mean steps to the first token and results identical are
    those (and the counts it copies are the counts'); else a Wrong naming the figure."""
    step("budget_runs.measured of a made-up run of two requests under a budget of 8")
    run = budget_runs.measured(8, ["a", "b"], COUNTS, FIRST, ["a", "c"])
    for key, wanted in {**{key: COUNTS[key] for key in ("steps", "rows", "chunks",
                                                       "largest_step")},
                        **WORKED_OUT, "budget": 8}.items():
        if run.get(key) != wanted:
            return Wrong(f"budget_runs.measured, a made-up run of two requests under a budget "
                         f"of 8: its {key} is {run.get(key)!r}, {wanted!r} worked out plainly",
                         f"  rows by step {COUNTS['rows_by_step']}, decode rows by step "
                         f"{COUNTS['decodes_by_step']}, first events {FIRST}")
    return None


QuickCheck = verdicts.quick_check_case("budget_runs", __name__)


class Teeth(unittest.TestCase):
    """Each mistake, planted in the real budget_runs.py (by its syntax tree), makes the
    layer's quick check fail, naming the figure."""

    MISTAKES = [
        ("a step of exactly the budget's rows counted as one over it", budget_runs, "stalls",
         swapping("rows > budget", "rows >= budget"),
         r"under a budget of 8: its stalled_decodes is \[5\], \[3\] worked out plainly$"),
        ("the wait for the first token counted from the first chunk, not the admission",
         budget_runs, "measured",
         swapping("first[index, 'admitted']", "first[index, 'prefill']"),
         r"under a budget of 8: its mean_steps_to_first_token is 2\.0, 2\.5 worked out "
         r"plainly$"),
        ("a request whose first token ends it never reaching its first token", budget_runs,
         "measured", swapping("min(first.get((index, 'decode'), math.inf), first.get((index, "
                              "'finished'), math.inf))",
                              "first.get((index, 'decode'), math.inf)"),
         r"under a budget of 8: its mean_steps_to_first_token is inf, 2\.5 worked out "
         r"plainly$"),
    ]

    def test_the_quick_check_names_each_mistake_and_where(self):
        verdicts.assert_verdicts(self, "budget_runs", self.MISTAKES)


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of the token budget."""

    def test_budgets_cap_the_steps_end_the_stalls_and_change_no_story(self):
        """Every run's stories are generate's; a budgeted run's steps compute at most its
        budget and none of its decodes waits in a step over it; whole prompts make decodes
        wait at every budget; a budget takes more steps than whole prompts."""
        record = support.recorded("token_budget")
        whole, *budgeted = record["runs"]
        self.assertEqual(whole["budget"], budget_runs.WHOLE)
        self.assertEqual([run["budget"] for run in budgeted], list(budget_runs.BUDGETS))
        for run in record["runs"]:
            with self.subTest(budget=run["budget"]):
                self.assertEqual(run["identical"], record["requests"])
        for run in budgeted:
            with self.subTest(budget=run["budget"]):
                self.assertLessEqual(run["largest_step"], run["budget"])
                self.assertEqual(run["stalled_decodes"][budget_runs.BUDGETS.index(
                    run["budget"])], 0)
        self.assertTrue(all(whole["stalled_decodes"]))
        self.assertEqual(whole["chunks"], record["requests"])
        self.assertTrue(all(run["steps"] > whole["steps"] for run in budgeted))


if __name__ == "__main__":
    unittest.main()
