"""What a decode step reads: the numbers the real steps take from the weights and the
cache, counted by instruments.count_reads, are bandwidth.floats_read's, for the lesson's
model and for deep_model's shapes on every path; the bound follows from them."""
import ast
import copy
import unittest

import bandwidth
import deep_model
import kv_cache
import model
import verdicts
from instruments import replacing
from kv_cache import KVCache, feed
from random_models import random_tokens
from support import PARAMS, STORIES, TOK, tear_down
from verdicts import Layer, Wrong, quick_check_case, set_up, step


LAYER = Layer("bandwidth", "the numbers a step reads (bandwidth.py)",
              ("lesson", "deep_model", "latent_attention"))


def setUpModule():
    set_up("bandwidth")


tearDownModule = tear_down
def reads_of(decode, weights, cache):
    """The distinct numbers decode() reads (instruments.count_reads) from the holders of
    weights and from those of cache, apart: {"weights": ..., "cache": ...}, as
    bandwidth.floats_read counts them."""
    from instruments import count_reads
    from_cache = []
    from_weights = count_reads(lambda: from_cache.append(count_reads(decode, *cache)),
                               *weights)
    return {"weights": from_weights, "cache": from_cache[0]}


def lesson_step_reads(ids):
    """What the lesson's step of ids[-1] reads (reads_of), on a copy of the trained model
    (count_reads watches the vectors it is given for good), its cache holding the rest."""
    params = copy.deepcopy(PARAMS)
    cache = KVCache(params)
    feed(params, cache, ids[:-1])
    return reads_of(lambda: kv_cache.forward_step(params, cache, ids[-1], len(ids) - 1),
                    [params, cache.columns], [cache.keys, cache.values])


def deep_step_reads(params, path, ids):
    """What the step of ids[-1] of a deep_model (for path "cached" or "rebuilt",
    deep_model.forward_step; for "absorbed", latent_attention.absorbed_step) reads
    (reads_of), its cache holding the rest. Watched for good: pass params made for it."""
    import latent_attention
    cache = deep_model.DeepCache(params)
    folded = path == "absorbed" and latent_attention.fold(params)

    def decode(position):
        if folded:
            return latent_attention.absorbed_step(folded, cache, ids[position], position)
        return deep_model.forward_step(params, cache, ids[position], position)
    for position in range(len(ids) - 1):
        decode(position)
    return reads_of(lambda: decode(len(ids) - 1),
                    [params, cache.block_columns, cache.out_columns,
                     folded.blocks if folded else []], [cache.layers])


def quick_check():
    """A decode step's reads, counted apart from the weights and from the cache, against
    bandwidth.floats_read's: the lesson's model with 5 positions held; with 3 held, a
    2-layer grouped-query model (4 heads, 2 key-value heads) with rotary positions, and a
    2-layer latent model (latent 8, rotary key 2), its rebuilt and its absorbed path."""
    ids = TOK.encode(STORIES[0])
    latent = ("a 2-layer latent model (latent 8, rotary key 2)", (2, 4, 4, 16, 0, "rotary", 8))
    for label, made, path, held in (
            ("the lesson's model", None, "cached", 5),
            ("a 2-layer grouped-query model (4 heads, 2 key-value heads, rotary positions)",
             (2, 4, 2, 16, 0, "rotary"), "cached", 3),
            (*latent, "rebuilt", 3), (*latent, "absorbed", 3)):
        where = f"{label}, its {path} step with {held} positions held"
        step(f"{where}: counting what it reads")
        if made is None:
            shape, read = bandwidth.LESSON, lesson_step_reads(ids[:held + 1])
        else:
            params = deep_model.init_params(*made)   # layers, heads, kv_heads, width, seed, ...
            shape, read = params["shape"], deep_step_reads(params, path, ids[:held + 1])
        step(f"{where}: bandwidth.floats_read({shape}, {held}, {path!r})")
        counted = bandwidth.floats_read(shape, held, path)
        for part in ("weights", "cache"):
            if read[part] != counted.get(part):
                return Wrong(f"{where} reads {read[part]} numbers of the {part}, and "
                             f"bandwidth.floats_read counts {counted.get(part)}",
                             f"  fed: the shape {shape}, {held} positions held, path {path!r}\n"
                             f"  the step read: {read}\n  floats_read:   {counted}")
    return None


QuickCheck = quick_check_case("bandwidth", __name__)


def in_branch(path, mistake):
    """mistake (a planting), made only in the branch of floats_read that if path == ...
    takes (the cached path's)."""
    def planting(tree):
        return sum(mistake(ast.Module(node.body, [])) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                   and getattr(node.test.comparators[0], "value", None) == path)
    return planting


ONLY_THE_KEYS_CACHED = replacing(   # cache = 2 * kv_width becomes cache = kv_width
    lambda node: (isinstance(node, ast.Assign) and isinstance(node.value, ast.BinOp)
                  and getattr(node.value.left, "value", None) == 2
                  and isinstance(node.value.right, ast.Name)),
    lambda node: ast.Assign(node.targets, node.value.right))
SQUARE_KEY_AND_VALUE_MATRICES = in_branch("cached", replacing(   # 2 * width * kv_width: * width
    lambda node: (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)
                  and isinstance(node.left, ast.BinOp) and isinstance(node.right, ast.Name)),
    lambda node: ast.BinOp(node.left, ast.Mult(), node.left.right)))
ONE_LAYER = replacing(   # shape["layers"] * ...: the layers forgotten
    lambda node: (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)
                  and isinstance(node.left, ast.Subscript)
                  and getattr(node.left.slice, "value", None) == "layers"),
    lambda node: node.right)
A_POSITION_ROW_ALWAYS = replacing(   # 2 if positions are learned else 1: always 2
    lambda node: isinstance(node, ast.IfExp), lambda node: node.body)
WO_READ_ON_THE_ABSORBED_PATH = replacing(   # ... - width * width: Wo counted too
    lambda node: isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub),
    lambda node: node.left)
LATENT_WITHOUT_ITS_ROTARY_KEY = replacing(   # cache = latent + r becomes cache = latent
    lambda node: (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
                  and isinstance(node.left, ast.Name) and isinstance(node.right, ast.Name)),
    lambda node: node.left)

READS = r"reads \d+ numbers of the {}, and bandwidth.floats_read counts \d+"
MISTAKES = [
    ("a held position's value left out", bandwidth, "floats_read", ONLY_THE_KEYS_CACHED,
     r"the lesson's model, its cached step with [1-9]\d* positions held " + READS.format("cache")),
    ("Wk and Wv counted width x width, as if every head had its key and value", bandwidth,
     "floats_read", SQUARE_KEY_AND_VALUE_MATRICES,
     r"grouped-query .*, its cached step with \d+ positions held " + READS.format("weights")),
    ("one layer counted", bandwidth, "floats_read", ONE_LAYER,
     r"2-layer .*, its \w+ step with \d+ positions held " + READS.format("weights")),
    ("a position row counted with rotary positions", bandwidth, "floats_read",
     A_POSITION_ROW_ALWAYS, r"rotary positions.*step with \d+ positions held "
                            + READS.format("weights")),
    ("Wo counted on the absorbed path, which folds it", bandwidth, "floats_read",
     WO_READ_ON_THE_ABSORBED_PATH, r"latent .*, its absorbed step with \d+ positions held "
                                   + READS.format("weights")),
    ("the latent counted without its rotary key", bandwidth, "floats_read",
     LATENT_WITHOUT_ITS_ROTARY_KEY, r"latent .*rotary key 2.*, its rebuilt step with "
                                    r"[1-9]\d* positions held " + READS.format("cache")),
]


class Teeth(unittest.TestCase):
    """Each mistake, planted in the real bandwidth.floats_read (by its syntax tree), makes
    the layer's quick check fail, naming the model, the path, weights or cache, and both counts."""

    def test_each_mistake_is_named_by_the_quick_check(self):
        verdicts.assert_verdicts(self, "bandwidth", MISTAKES)


class Reads(unittest.TestCase):
    """What the real steps read, counted apart from the weights and from the cache, on more
    shapes and held positions than the quick check."""

    def test_the_lessons_step_reads_what_the_formula_counts(self):
        """kv_cache.forward_step on a copy of the trained model: its weights once, and
        the 2 x 16 numbers of each held position."""
        for held in (0, 1, 40, model.CONTEXT - 1):
            with self.subTest(held=held):
                self.assertEqual(lesson_step_reads(random_tokens(held + 1)),
                                 bandwidth.floats_read(bandwidth.LESSON, held),
                                 f"the numbers the lesson's step reads with {held} positions "
                                 f"held, counted (first) and by floats_read")

    def test_deeper_steps_read_what_the_formula_counts_on_every_path(self):
        cases = [(deep_model.init_params(2, 4, kv_heads, 16, 0, positions), "cached")
                 for kv_heads in (4, 2, 1) for positions in ("learned", "rotary")]
        for positions, rotary_key in (("learned", None), ("rotary", None), ("rotary", 0)):
            params = deep_model.init_params(2, 4, 4, 16, 0, positions, 8, rotary_key)
            cases += [(params, "rebuilt")] + ([(params, "absorbed")] if rotary_key is None else [])
        for params, path in cases:
            for held in (0, 9):
                with self.subTest(shape=params["shape"], path=path, held=held):
                    self.assertEqual(deep_step_reads(copy.deepcopy(params), path,
                                                     random_tokens(held + 1)),
                                     bandwidth.floats_read(params["shape"], held, path),
                                     f"the numbers the {path} step reads with {held} positions "
                                     f"held, counted (first) and by floats_read")


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


class Refusals(unittest.TestCase):

    def test_the_formulas_refuse_a_misspelt_path_a_negative_count_and_no_batch(self):
        latent = deep_model.init_params(1, 4, 4, 16, 0, "rotary", 8)["shape"]
        for call, fragment in (
                (lambda: bandwidth.floats_read(latent, 16, "rebuild"), "path must be \"cached\""),
                (lambda: bandwidth.floats_read(bandwidth.LESSON, -1), "held must be an int >= 0"),
                (lambda: bandwidth.floats_read(None, 3), "shape must be a deep_model shape"),
                (lambda: bandwidth.cache_outweighs_weights(bandwidth.LLAMA_2_7B, 0),
                 "batch must be an int >= 1"),
                (lambda: bandwidth.bound(bandwidth.LLAMA_2_7B, -5), "context must be an int >= 0"),
                (lambda: bandwidth.bound(bandwidth.LLAMA_2_7B, 5, 1, 0), "bandwidth must be"),
                (lambda: bandwidth.bound({"layers": 32}, 5), "model must be a dict as"),
                (lambda: bandwidth.bound({"layers": 32, "kv_heads": 8}, 5),
                 "has no weight_bytes_read"),
                (lambda: bandwidth.cache_bytes_per_token({}),
                 r"model must be a dict as bandwidth\.LLAMA_2_7B; this one has no layers, "
                 r"kv_heads \(or latent and rotary_key\)"),
                (lambda: bandwidth.cache_bytes_per_token({"latent": 512}), "has no layers$"),
                (lambda: bandwidth.cache_bytes_per_token(None), "model must be a dict as "
                                                                 "bandwidth.LLAMA_2_7B, got None")):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                call()


if __name__ == "__main__":
    unittest.main()
