"""What a decode step reads: the numbers the real steps take from the weights and the
cache, counted by instruments.count_reads, are bandwidth.floats_read's, for the lesson's
model and for deep_model's shapes on every path; the bound follows from them."""
import copy
import unittest

import bandwidth
import deep_model
import kv_cache
import latent_attention
import model
from instruments import count_reads
from verdicts import quick_check_case, set_up
from support import PARAMS, random_tokens, tear_down


def setUpModule():
    set_up("bandwidth")


tearDownModule = tear_down
QuickCheck = quick_check_case("bandwidth", __name__)


def deep_reads(params, path, held):
    """The numbers one step of path reads from params and a cache holding held positions
    (deep_model.forward_step, or latent_attention.absorbed_step for "absorbed")."""
    cache = deep_model.DeepCache(params)
    folded = path == "absorbed" and latent_attention._fold(params)
    ids = random_tokens(held + 1)

    def step(position):
        if folded:
            return latent_attention.absorbed_step(folded, cache, ids[position], position)
        return deep_model.forward_step(params, cache, ids[position], position)
    for position in range(held):
        step(position)
    return count_reads(lambda: step(held), params, cache.block_columns, cache.out_columns,
                       cache.layers, folded.blocks if folded else [])


class Reads(unittest.TestCase):

    def test_the_lessons_step_reads_what_the_formula_counts(self):
        """kv_cache.forward_step on a copy of the trained model: its weights once, and
        the 2 x 16 numbers of each held position."""
        for held in (0, 1, 40, model.CONTEXT - 1):
            params = copy.deepcopy(PARAMS)
            cache = kv_cache.KVCache(params)
            kv_cache.feed(params, cache, random_tokens(held))
            read = count_reads(lambda: kv_cache.forward_step(params, cache, 5, held),
                               params, cache.columns, cache.keys, cache.values)
            with self.subTest(held=held):
                self.assertEqual(read, sum(bandwidth.floats_read(bandwidth.LESSON, held).values()))

    def test_deeper_steps_read_what_the_formula_counts_on_every_path(self):
        cases = [(deep_model.init_params(2, 4, kv_heads, 16, 0, positions), "cached")
                 for kv_heads in (4, 2, 1) for positions in ("learned", "rotary")]
        for positions, rotary_key in (("learned", None), ("rotary", None), ("rotary", 0)):
            params = deep_model.init_params(2, 4, 4, 16, 0, positions, 8, rotary_key)
            cases += [(params, "rebuilt")] + ([(params, "absorbed")] if rotary_key is None else [])
        for params, path in cases:
            for held in (0, 9):
                with self.subTest(shape=params["shape"], path=path, held=held):
                    self.assertEqual(deep_reads(params, path, held),
                                     sum(bandwidth.floats_read(params["shape"], held,
                                                               path).values()))


class Bound(unittest.TestCase):

    def test_a_step_reads_one_row_of_the_input_embedding(self):
        """The published parameter counts follow from the shapes; a step reads them all
        but the input embedding's other 31,999 rows: 13.21 GB for Llama-2-7B, not the
        13.48 GB of all its weights (the 262 MB table read whole)."""
        llama, large = bandwidth.LLAMA_2_7B, bandwidth.LLAMA_2_70B_8_BIT
        self.assertEqual(bandwidth.llama_parameters(llama), 6_738_415_616)
        self.assertEqual(bandwidth.llama_parameters(large), 68_976_648_192)
        self.assertEqual(llama["weight_bytes_read"], (6_738_415_616 - 31_999 * 4096) * 2)
        self.assertEqual(large["weight_bytes_read"], 68_976_648_192 - 31_999 * 8192)
        self.assertEqual(f"{llama['weight_bytes_read'] / 1e9:.2f}", "13.21")
        self.assertEqual([round(bandwidth.bound(llama, context)) for context in (0, 4096)],
                         [154, 133])

    def test_the_bound_is_bandwidth_over_the_bytes_a_token_reads(self):
        llama = bandwidth.LLAMA_2_7B
        self.assertEqual(bandwidth.cache_bytes_per_token(llama), 512 * 1024)
        weights = llama["weight_bytes_read"]
        self.assertEqual(bandwidth.bound(llama, 0), bandwidth.A100_BYTES_PER_SECOND / weights)
        self.assertEqual(bandwidth.bound(llama, 4096, 8),
                         bandwidth.A100_BYTES_PER_SECOND / (weights / 8 + 4096 * 512 * 1024))
        at = bandwidth.cache_outweighs_weights(llama, 16)
        self.assertGreater(at * 512 * 1024, weights / 16)
        self.assertLessEqual((at - 1) * 512 * 1024, weights / 16)
        # gpt-fast's measured speeds are below the bound, and the bandwidth it reports is
        # its weights' size (all of them) times that speed
        for m in (bandwidth.LLAMA_2_7B, bandwidth.LLAMA_2_70B_8_BIT):
            with self.subTest(model=m["model"]):
                self.assertLess(m["measured_tokens_per_second"], bandwidth.bound(m, 0))
                size = bandwidth.llama_parameters(m) * m["bytes_per_number"]
                achieved = m["measured_tokens_per_second"] * size / 1e9
                self.assertLess(abs(achieved / m["measured_gb_per_s"] - 1), 0.05)


if __name__ == "__main__":
    unittest.main()
