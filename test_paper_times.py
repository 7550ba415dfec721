"""Time on paper (paper_times.py): a step's time is the larger of its FLOPs at the peak rate
and its bytes at the bandwidth, counted here again from the model's shape; the chunks
fill the budget beside the decodes; each way's times follow from its steps; the record's
times are the code's."""
import math
import unittest

import paper_times
import support
import verdicts
from one_gpu import A100, LLAMA_3_1_8B
from support import swapping
from verdicts import Layer, Wrong


LAYER = Layer("paper_times", "time on paper (paper_times.py)", ("one_gpu",))


def setUpModule():
    verdicts.set_up("paper_times")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down


def by_hand(rows, model=LLAMA_3_1_8B):
    """A step's least seconds, written out: each row's matrices, attention and output layer
    in FLOPs, every weight and each cached token's keys and values in bytes."""
    layers, width, vocab = model["layers"], model["width"], model["vocab"]
    matrices = (layers * (2 * width * width + 2 * width * model["kv_heads"] * 128
                          + 3 * width * model["mlp_width"]))
    flops = sum(2 * new * matrices + 2 * vocab * width
                + 4 * layers * width * sum(held + i + 1 for i in range(new))
                for new, held in rows)
    per_token = 2 * layers * model["kv_heads"] * 128 * model["bytes_per_number"]
    read = model["weight_bytes_read"] + sum(held for _, held in rows) * per_token
    return max(flops / A100["flops_per_second"], read / A100["bytes_per_second"])


def quick_check():
    """Steps of decodes alone, a prompt alone and both together against by_hand (within
    1e-12 of each other: two sums of one formula); the chunks of 8,192 tokens under a
    budget of 2,048 beside 16 decodes; each way's first token and worst time between
    tokens from those steps and the link."""
    w = paper_times.WORKLOAD
    decodes = [(1, w["context"])] * w["running"]
    for label, rows in (("16 decodes", decodes), ("a prompt of 100 tokens", [(100, 0)]),
                        ("a chunk of 50 after 30, beside 3 decodes", [(50, 30)] + decodes[:3])):
        got, expected = paper_times.step_seconds(LLAMA_3_1_8B, rows), by_hand(rows)
        if not math.isclose(got, expected, rel_tol=1e-12):
            return Wrong(f"paper_times: the step of {label}: {got} s from step_seconds, "
                         f"{expected} s by hand")
    pieces = paper_times.chunks(w["prompt"], w["budget"], w["running"])
    if sum(pieces) != w["prompt"] or max(pieces) + w["running"] != w["budget"]:
        return Wrong(f"paper_times: the chunks {pieces}: they must sum to the prompt, "
                     f"{w['prompt']}, and the largest fill the budget, {w['budget']}, beside "
                     f"{w['running']} decodes")
    times = paper_times.times()
    starts = [sum(pieces[:at]) for at in range(len(pieces))]
    expected = {
        "whole prompt": (by_hand([(w["prompt"], 0)] + decodes),) * 2,
        "chunks": (sum(by_hand([(c, s)] + decodes) for c, s in zip(pieces, starts)),
                   max(by_hand([(c, s)] + decodes) for c, s in zip(pieces, starts))),
        "two servers": (by_hand([(w["prompt"], 0)]) + w["prompt"] * 131072
                        / paper_times.LINK_BYTES_PER_SECOND, by_hand(decodes))}
    for way, (first, worst) in expected.items():
        got = times[way]["first_token"], times[way]["between_tokens_at_worst"]
        if not all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(got, (first, worst))):
            return Wrong(f"paper_times: {way}: first token and worst time between tokens "
                         f"{got} s from times, {(first, worst)} s by hand")
    return None


QuickCheck = verdicts.quick_check_case("paper_times", __name__)


class Teeth(unittest.TestCase):
    """Each mistake planted in the real paper_times.py makes the layer's quick check fail
    with a line naming the quantity and where."""

    MISTAKES = [
        ("chunks that fill the whole budget, the decodes forgotten", paper_times, "chunks",
         swapping("budget - running", "budget"),
         r"paper_times: the chunks \[2048, 2048, 2048, 2048\]: they must sum to the prompt"),
        ("the weights read once a request, not once a step", paper_times, "step_seconds",
         swapping("model['weight_bytes_read']", "model['weight_bytes_read'] * len(rows)"),
         r"paper_times: the step of 16 decodes: .* s from step_seconds, .* s by hand"),
        ("the transfer left out of the two servers' first token", paper_times, "times",
         swapping("alone + sent", "alone"),
         r"paper_times: two servers: first token and worst time between tokens"),
    ]

    def test_the_quick_check_names_each_mistake_and_where(self):
        verdicts.assert_verdicts(self, "paper_times", self.MISTAKES)


class Refusals(unittest.TestCase):

    def test_a_budget_with_no_room_for_a_prompt_token_is_refused(self):
        with self.assertRaisesRegex(ValueError, r"budget must be an int >= 17 \(a decode row "
                                                r"a running request"):
            paper_times.chunks(100, 16, 16)


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of the times on paper."""

    def test_each_way_trades_one_time_for_another(self):
        """The record's times are times()'s, in ms; whole prompts give the first token soonest
        and the worst wait between tokens; chunks cut that wait and delay the first token;
        two servers never stall a decode and add the transfer to the first token."""
        record = support.recorded("paper_times")
        ways = record["ways"]
        for way, figures in paper_times.times().items():
            for key, seconds in figures.items():
                self.assertEqual(ways[way][f"{key}_ms"], 1e3 * seconds)
        whole, chunked, two = ways["whole prompt"], ways["chunks"], ways["two servers"]
        self.assertLess(whole["first_token_ms"], chunked["first_token_ms"])
        self.assertLess(chunked["between_tokens_at_worst_ms"],
                        whole["between_tokens_at_worst_ms"])
        self.assertEqual(two["between_tokens_at_worst_ms"], two["between_tokens_ms"])
        self.assertGreater(two["first_token_ms"], whole["first_token_ms"])


if __name__ == "__main__":
    unittest.main()
