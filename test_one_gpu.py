"""What one GPU does with a model: the lab's one-pass prefill computes and reads what
one_gpu's formulas count; the real models' figures are the ones worked out by hand below,
and agree with what vLLM's logs and Hugging Face published."""
import ast
import copy
import random
import unittest

import batched
import one_gpu
import prefill
import verdicts
from bandwidth import LESSON, cache_bytes_per_token, llama_parameters
from instruments import count_reads, is_call_of, recording, replacing
from kv_cache import KVCache
from latent_attention import products
from one_gpu import A100, LLAMA_3_1_8B, MODELS
from support import PARAMS, STORIES, TOK, recorded, tear_down
from verdicts import Layer, Wrong, quick_check_case, set_up, step


LAYER = Layer("one_gpu", "what one GPU does with a model (one_gpu.py)",
              ("lesson", "prefill", "bandwidth"))


def setUpModule():
    set_up("one_gpu")


tearDownModule = tear_down
LLAMA_2_7B = MODELS[0]   # bandwidth.LLAMA_2_7B, with its context window of 4,096

# Llama-3.1-8B worked out by hand from its config.json. A layer's matrices: Wq and Wo of
# 4,096 x 4,096, Wk and Wv of 4,096 x 1,024 (8 key-value heads of 128), the MLP's three of
# 4,096 x 14,336: 33,554,432 + 8,388,608 + 176,160,768 = 218,103,808, and 32 layers
# 6,979,321,856. The output layer: 128,256 x 4,096 = 525,336,576.
# - A prefill of 1,000 tokens: 1,000 x 6,979,321,856 + 525,336,576 (the last token's
#   scores) + 32 layers x 4,096 x (1 + 2 + ... + 1,000 keys, and as many values, so
#   1,000 x 1,001) = 6,979,321,856,000 + 525,336,576 + 131,203,072,000 multiply-adds,
#   7,111,050,264,576, twice that in FLOPs.
# - A decode step reads every weight but 128,255 rows of the input embedding,
#   (8,030,261,248 - 525,332,480) x 2 = 15,009,857,536 bytes, and 1,000 tokens of cache,
#   2 x 32 layers x 8 x 128 x 2 bytes = 131,072 a token: 15,140,929,536 bytes.
# - A prefill of n tokens does 2 x (6,979,321,856 n + 525,336,576 + 131,072 n (n + 1))
#   FLOPs and reads 15,009,857,536 + 8,192 (n - 1) bytes: 152.11 FLOPs a byte at 163
#   tokens, 153.04 at 164, and the ridge is 312e12 / 2,039e9 = 153.02.
# - Memory: 0.9 x 80 GiB = 77,309,411,328 bytes, less 8,030,261,248 x 2 = 16,060,522,496 of
#   weights: 61,248,888,832, which hold 467,291 tokens of 131,072 bytes (467,291.9), 14
#   requests of 32,768 tokens.
BY_HAND = (
    ("the FLOPs of a prefill of 1,000 tokens", "prefill_flops", (LLAMA_3_1_8B, 1000),
     2 * 7_111_050_264_576),
    ("the least a decode step after 1,000 tokens takes", "decode_seconds", (LLAMA_3_1_8B, 1000),
     15_140_929_536 / 2039e9),
    ("the shortest prompt whose prefill is bound by arithmetic", "tokens_to_the_ridge",
     (LLAMA_3_1_8B,), 164),
    ("the bytes left for the cache", "bytes_left", (LLAMA_3_1_8B,), 61_248_888_832),
    ("the tokens of cache that fit", "tokens_that_fit", (LLAMA_3_1_8B,), 467_291),
    ("the requests of 32,768 tokens that fit", "requests_that_fit", (LLAMA_3_1_8B, 32768), 14),
    ("the requests of 32,768 tokens that fit (none: beyond its context)", "requests_that_fit",
     (LLAMA_2_7B, 32768), None),
)


def quick_check():
    """The products the lesson's one-pass prefill of the first test opening computes (recorded
    in batched.py, which computes its rows) against one_gpu.prefill_multiply_adds, then the
    real models' figures against the ones worked out by hand: a prefill's FLOPs and a decode
    step's time for Llama-3.1-8B, the prompt from which its prefill is bound by arithmetic,
    the bytes, tokens and requests its cache has on an A100 80GB, and Llama-2-7B's requests
    beyond its context."""
    ids = TOK.encode(STORIES[0].split(". ")[0] + ".")
    step(f"the lesson's one-pass prefill of the first test opening ({len(ids)} tokens)")
    with recording(batched, "dot", "linear") as calls:
        prefill.prefill(PARAMS, KVCache(PARAMS), ids, 0)
    counted = one_gpu.prefill_multiply_adds(LESSON, len(ids))
    if products(calls) != counted:
        return Wrong(f"the lesson's one-pass prefill of the first test opening ({len(ids)} "
                     f"tokens) computes {products(calls):,} products, and "
                     f"one_gpu.prefill_multiply_adds counts {counted:,}",
                     f"  fed: token IDs {ids}, into an empty KVCache")
    for what, function, arguments, wanted in BY_HAND:
        model = arguments[0]["model"]
        step(f"{model}: one_gpu.{function}, {what}")
        got = getattr(one_gpu, function)(*arguments)
        if got != wanted:
            return Wrong(f"{model}, {what}: {got!r} from one_gpu.{function}, {wanted!r} "
                         f"worked out by hand",
                         f"  fed: {model}'s shape, {arguments[1:]}, on the {A100['gpu']}")
    return None


QuickCheck = quick_check_case("one_gpu", __name__)


SCORES_OF_EVERY_PAIR = replacing(   # fed["cached_scores"]: the rows squared, no causal mask
    lambda node: isinstance(node, ast.Subscript) and getattr(node.slice, "value", "") ==
    "cached_scores",
    lambda node: ast.BinOp(ast.Subscript(node.value, ast.Constant("cached_rows"), ast.Load()),
                           ast.Pow(), ast.Constant(2)))
ATTENTION_IN_ONE_LAYER = replacing(   # layers * width * n * (n + 1): the layers forgotten
    lambda node: (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)
                  and getattr(node.left, "id", "") == "layers"
                  and getattr(node.right, "id", "") == "width"),
    lambda node: node.right)
UTILIZATION_OF_WHAT_THE_WEIGHTS_LEAVE = replacing(   # floor(u x memory) - weights
    lambda node: (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)
                  and is_call_of(node.right, "weight_bytes")),
    lambda node: ast.parse("math.floor(utilization * (gpu['memory_bytes'] - "
                           "weight_bytes(model)))", mode="eval").body)
NO_CONTEXT_WINDOW = replacing(   # None if beyond the context window else ...: never None
    lambda node: isinstance(node, ast.IfExp), lambda node: node.orelse)

BY_HAND_SAYS = r"{}: .* from one_gpu\.{}, .* worked out by hand"
MISTAKES = [
    ("a score for every pair of the prompt's positions, no causal mask", one_gpu,
     "prefill_multiply_adds", SCORES_OF_EVERY_PAIR,
     r"the lesson's one-pass prefill .* computes [\d,]+ products, and "
     r"one_gpu.prefill_multiply_adds counts [\d,]+"),
    ("attention's FLOPs of one layer, not of every layer", one_gpu, "prefill_flops",
     ATTENTION_IN_ONE_LAYER, BY_HAND_SAYS.format("Llama-3.1-8B, the FLOPs of a prefill of 1,000 tokens",
                                                 "prefill_flops")),
    ("the utilization taken of what the weights leave, not of the memory", one_gpu,
     "bytes_left", UTILIZATION_OF_WHAT_THE_WEIGHTS_LEAVE,
     BY_HAND_SAYS.format("Llama-3.1-8B, the bytes left for the cache", "bytes_left")),
    ("requests counted beyond the model's context window", one_gpu, "requests_that_fit",
     NO_CONTEXT_WINDOW, BY_HAND_SAYS.format(r"Llama-2-7B, the requests of 32,768 .*beyond "
                                            r"its context\)", "requests_that_fit")),
]


class Teeth(unittest.TestCase):
    """Each mistake, planted in the real one_gpu (by its syntax tree), makes the layer's
    quick check fail, naming the model, the quantity and both values."""

    def test_each_mistake_is_named_by_the_quick_check(self):
        verdicts.assert_verdicts(self, "one_gpu", MISTAKES)


class Lesson(unittest.TestCase):

    def test_a_prefill_computes_and_reads_what_the_formulas_count(self):
        """The real prefill.prefill of 1, 9 and 64 different tokens: its products (recorded in
        batched.py, which computes its rows) and the distinct numbers it reads of the
        weights (instruments.count_reads, on a copy of the trained model), against the
        formulas'; and a decode step after it reads what one_gpu.pass_numbers_read counts
        for one token."""
        for n in (1, 9, 64):
            ids = random.Random(n).sample(range(len(PARAMS["tok_emb"])), n)
            params = copy.deepcopy(PARAMS)   # count_reads watches its vectors for good
            cache = KVCache(params)
            with self.subTest(tokens=n):
                with recording(batched, "dot", "linear") as calls:
                    read = count_reads(lambda: prefill.prefill(params, cache, ids, 0),
                                       params, cache.columns)
                self.assertEqual(products(calls), one_gpu.prefill_multiply_adds(LESSON, n))
                self.assertEqual(read, one_gpu.pass_numbers_read(LESSON, n))
        self.assertEqual(one_gpu.pass_numbers_read(LESSON, 18), 4912 + 17 * 32)
        self.assertEqual(one_gpu.pass_numbers_read(LESSON, 1, 18), 4912 + 18 * 32)


class ByHand(unittest.TestCase):
    """Llama-2-7B's figures worked out by hand, as the quick check's for Llama-3.1-8B."""

    def test_llama_2_7b_on_an_a100(self):
        # 6,738,415,616 parameters at 2 bytes; 0.9 x 80 GiB less them: 63,832,580,096 bytes,
        # 121,750 tokens of 524,288 bytes (121,750.98), 29 requests of 4,096
        self.assertEqual(one_gpu.weight_bytes(LLAMA_2_7B), 13_476_831_232)
        self.assertEqual(one_gpu.bytes_left(LLAMA_2_7B), 63_832_580_096)
        self.assertEqual(one_gpu.tokens_that_fit(LLAMA_2_7B), 121_750)
        self.assertEqual(one_gpu.requests_that_fit(LLAMA_2_7B, 4096), 29)
        # a layer's matrices, 4 x 4,096 x 4,096 + 3 x 4,096 x 11,008, in 32 layers; the
        # output layer 32,000 x 4,096 for the last token; attention as Llama-3.1-8B's
        layers = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
        self.assertEqual(one_gpu.prefill_flops(LLAMA_2_7B, 1000),
                         2 * (1000 * layers + 32000 * 4096 + 32 * 4096 * 1000 * 1001))

    def test_the_ridge_is_crossed_by_the_shortest_such_prompt(self):
        ridge = one_gpu.ridge_point()
        self.assertEqual(ridge, 312e12 / 2039e9)
        for model in MODELS:
            n = one_gpu.tokens_to_the_ridge(model)
            with self.subTest(model=model["model"]):
                self.assertLess(one_gpu.prefill_flops(model, n - 1),
                                ridge * one_gpu.pass_bytes(model, n - 1))
                self.assertGreaterEqual(one_gpu.prefill_flops(model, n),
                                        ridge * one_gpu.pass_bytes(model, n))
                self.assertEqual(one_gpu.prefill_seconds(model, n - 1),
                                 one_gpu.pass_bytes(model, n - 1) / 2039e9)
                self.assertEqual(one_gpu.prefill_seconds(model, n),
                                 one_gpu.prefill_flops(model, n) / 312e12)

    def test_a_model_whose_weights_do_not_fit_has_no_room_for_cache(self):
        large = {**LLAMA_3_1_8B, "layers": 320}   # about 70 billion parameters
        self.assertLess(one_gpu.bytes_left(large), 0)
        self.assertEqual(one_gpu.tokens_that_fit(large), 0)
        self.assertEqual(one_gpu.requests_that_fit(large, 4096), 0)


class Outside(unittest.TestCase):
    """The formulas against figures published by others."""

    def test_parameters_as_llama_cpp_prints_them(self):
        # "model params = 8.03 B" and "6.74 B" (llama.cpp's log, ollama/ollama#10874)
        self.assertEqual(f"{llama_parameters(LLAMA_3_1_8B) / 1e9:.2f}", "8.03")
        self.assertEqual(f"{llama_parameters(LLAMA_2_7B) / 1e9:.2f}", "6.74")

    def test_vllm_s_memory_profile_of_llama_3_8b_on_an_80_gb_gpu(self):
        """vLLM PR #10511's log of meta-llama/Meta-Llama-3-8B (Llama-3.1-8B's shapes):
        total_gpu_memory 79.22GiB, gpu_memory_utilization 0.90, model weights take 14.96GiB,
        non_torch_memory 1.79GiB, PyTorch activation peak memory 1.26GiB,
        available_kv_cache_memory 53.29GiB: what bytes_left leaves out."""
        self.assertEqual(f"{one_gpu.weight_bytes(LLAMA_3_1_8B) / 2 ** 30:.2f}", "14.96")
        as_cuda_reports = {**A100, "memory_bytes": 79.22 * 2 ** 30}
        left = one_gpu.bytes_left(LLAMA_3_1_8B, as_cuda_reports) / 2 ** 30
        self.assertEqual(f"{left - 1.79 - 1.26:.2f}", "53.29")

    def test_vllm_s_blocks_of_llama_3_1_8b(self):
        """vLLM issue #10517 (Llama-3.1-8B-Instruct, an RTX 3090): kv_cache_size=3.81GiB,
        # GPU blocks: 1952 (of 16 tokens), Maximum concurrency for 20000 tokens per
        request: 1.56x."""
        tokens = 1952 * 16
        self.assertEqual(f"{tokens * cache_bytes_per_token(LLAMA_3_1_8B) / 2 ** 30:.2f}", "3.81")
        self.assertEqual(f"{tokens / 20000:.2f}", "1.56")

    def test_vllm_s_blocks_of_llama_2_7b_on_an_a100_80gb(self):
        """vLLM PR #2031: Llama-2-7B on one A100-80GB at 0.9, 7,449 blocks of 16 tokens
        before it and 7,351 after (its profile of the activations grew): below the tokens
        that fit with nothing but the weights, by a few percent."""
        fit = one_gpu.tokens_that_fit(LLAMA_2_7B)
        for blocks in (7449, 7351):
            with self.subTest(blocks=blocks):
                self.assertLess(blocks * 16, fit)
                self.assertGreater(blocks * 16, 0.95 * fit)

    def test_hugging_face_s_cache_sizes_of_llama_3_1_8b(self):
        # Hugging Face's Llama 3.1 post, "Inference Memory Requirements": the 8B's cache in
        # 16 bits, 1.95 GB at 16k tokens and 15.62 GB at 128k (GiB, of 16,000 and 128,000)
        per_token = cache_bytes_per_token(LLAMA_3_1_8B)
        self.assertEqual(f"{16000 * per_token / 2 ** 30:.2f}", "1.95")
        self.assertEqual(f"{128000 * per_token / 2 ** 30:.2f}", "15.62")


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of one GPU."""

    def test_a_prefill_does_many_multiply_adds_for_each_number_a_decode_step_reads_once(self):
        lesson = recorded("one_gpu")["lesson"]
        self.assertEqual(lesson["prompt_tokens"], recorded("one_pass_prefill")[
            "prompt_calls_one_token_at_a_time"], "the prompts' tokens, two stages' counts")
        self.assertEqual(lesson["prompt_tokens"] + recorded("generated_tokens") - lesson["prompts"],
                         recorded("work")["cached_rows"], "the prompts' rows and the decode "
                         "steps' (each chosen token but the last), the cached generator's")
        prefill_rate = lesson["prefill_multiply_adds"] / lesson["prefill_numbers_read"]
        decode_rate = lesson["decode_multiply_adds"] / lesson["decode_numbers_read"]
        self.assertLess(decode_rate, 1)
        self.assertGreater(prefill_rate, 10 * decode_rate)

    def test_a_first_token_waits_for_its_prompt_and_a_grouped_cache_holds_four_times_more(self):
        models = {entry["kv_heads"]: entry for entry in recorded("one_gpu")["models"]}
        for entry in models.values():
            with self.subTest(model=entry["model"]):
                self.assertGreater(entry["prefill_seconds"][0], 5 * entry["decode_seconds"][0])
                self.assertLess(entry["tokens_to_the_ridge"], 1000)
                self.assertGreater(entry["bytes_left"], 0)
        self.assertIsNone(models[32]["prefill_seconds"][1], "10,000 tokens in Llama-2-7B")
        self.assertIsNone(models[32]["requests"][1], "32,768 tokens in Llama-2-7B")
        self.assertGreater(models[8]["tokens_that_fit"], 3.5 * models[32]["tokens_that_fit"])
        self.assertGreater(models[8]["requests"][0], 3.5 * models[32]["requests"][0])


class Refusals(unittest.TestCase):

    def test_the_formulas_refuse_bad_models_counts_gpus_and_utilizations(self):
        for call, fragment in (
                (lambda: one_gpu.prefill_flops({"layers": 32}, 10), "model must be a dict as"),
                (lambda: one_gpu.prefill_flops(LLAMA_3_1_8B, 0), "prompt_tokens must be an int"),
                (lambda: one_gpu.prefill_multiply_adds(LESSON, 1.5), "prompt_tokens must be"),
                (lambda: one_gpu.pass_numbers_read(LESSON, 0), "new_tokens must be an int"),
                (lambda: one_gpu.decode_seconds(LLAMA_3_1_8B, -1), "context must be an int"),
                (lambda: one_gpu.prefill_seconds(LLAMA_3_1_8B, 5, {"gpu": "x"}),
                 "gpu must be a dict as"),
                (lambda: one_gpu.ridge_point({**A100, "bytes_per_second": 0}), "gpu must be"),
                (lambda: one_gpu.bytes_left(LLAMA_3_1_8B, A100, 1.5), "utilization must be"),
                (lambda: one_gpu.bytes_left(LLAMA_3_1_8B, A100, True), "utilization must be"),
                (lambda: one_gpu.requests_that_fit(LLAMA_3_1_8B, 0), "tokens_each must be")):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                call()


if __name__ == "__main__":
    unittest.main()
