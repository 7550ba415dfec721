"""Batched rows (batched.py): with the lab's exact product every row of a batch is
forward_step's, whatever rides with it; an engine's kernel, with 16-bit or 32-bit sums,
makes a row depend on its batch, and a batch-invariant one does not; each kernel rounds
exactly what it says; mistakes planted in the real forward_rows and in_pieces are caught;
a bad batch is refused before anything changes."""
import ast
import random
import unittest

import batched
import model
import paged
import support
import verdicts
from instruments import is_call_of, replacing
from kv_cache import KVCache, feed
from lossy import QuantizedCache, WindowCache
from support import (PARAMS, STORIES, TOK, assert_changed, assert_each_mistake_is_caught,
                     assert_same_rows, first_difference)
from verdicts import Layer, Wrong, differ, step, story_name

LAYER = Layer("batched", "batched rows (batched.py)", ("lesson", "paged", "lossy"))


IDS = [TOK.encode(story) for story in STORIES[:3]]


def setUpModule():
    """forward_rows' first check (its layer's, LAYER), before any test of this
    module: three stories fed in mixed batches give forward_step's rows. If not, its one
    line names the first number that differs (or why forward_rows refused), and no other
    test runs."""
    verdicts.set_up("batched")


tearDownModule = support.tear_down
def in_batches(params, caches, ids, seed=0, steps=None):
    """Feed each cache its ids through batched.forward_rows, in steps that mix, at random
    from seed, a chunk of one cache's next tokens with one next token of each other
    cache: the rows of each cache, in position order. Each step's (cache index, position)
    pairs are appended to steps, if given, before the step runs."""
    rng = random.Random(seed)
    rows = [[] for _ in caches]
    while any(len(cache) < len(own) for cache, own in zip(caches, ids)):
        items, owners = [], []
        for index, (cache, own) in enumerate(zip(caches, ids)):
            count = min(rng.choice((0, 1, 1, 3)), len(own) - len(cache))
            for position in range(len(cache), len(cache) + count):
                items.append((cache, own[position], position))
                owners.append(index)
        if items:
            if steps is not None:
                steps.append([(index, position) for index, (_, _, position)
                              in zip(owners, items)])
            for index, logits in zip(owners, batched.forward_rows(params, items)):
                rows[index].append(logits)
    return rows


def _batch_words(batch, labels):
    """A step's batch in words: how many rows, and whose positions."""
    owners = {}
    for index, position in batch:
        owners.setdefault(index, []).append(position)
    return f"a batch of {len(batch)} rows: " + "; ".join(
        f"{labels[index]}, position{'s' * (len(positions) > 1)} "
        f"{', '.join(map(str, positions))}" for index, positions in owners.items())


def where_batches_differ(params, caches, ids, seed=0, labels=None, fresh=KVCache):
    """None if each cache's rows, fed in_batches, are forward_step's (one token at a time,
    into fresh(params): a cache of the same kind), else (a Wrong) the
    first number that differs, named by its sequence (labels[index], else "sequence
    index"), position and logit, and the batch that computed it; or the ValueError
    forward_rows raised (a refusal) and the batch it raised it for."""
    labels = labels or [f"sequence {index}" for index in range(len(ids))]
    steps = []
    try:
        rows = in_batches(params, caches, ids, seed=seed, steps=steps)
    except ValueError as refused:   # a refusal, or a planted mistake's ValueError
        return Wrong(f"forward_rows, at step {len(steps)} of the mixed batches (seed {seed}), "
                     f"{_batch_words(steps[-1], labels)}, raised ValueError: {refused}")
    for index, (got, own) in enumerate(zip(rows, ids)):
        wanted = feed(params, fresh(params), own)
        why = differ(f"the logits of {labels[index]}, fed in mixed batches (seed {seed})", got,
                     wanted, "forward_rows", fed=f"token IDs {own}")
        found = why and first_difference(got, wanted)
        if found and found[0].startswith("["):   # a row, not the count
            position = int(found[0][1:].split("]")[0])
            batch = next(number for number, batch in enumerate(steps, 1)
                         if (index, position) in batch)
            return Wrong(f"{why} (step {batch}, {_batch_words(steps[batch - 1], labels)})",
                         why.detail)
        if why:
            return why
    return None


KERNEL_ROW = [1.0] * 16


KERNEL_COLUMNS = [[1.0, 2 ** -24, 2 ** -26, 0.0, -1.0] + [0.0] * 11,
                  [1.0, 2 ** -11, 0.0, 0.0, 2 ** -40] + [0.0] * 11]


KERNEL_OUTPUTS = {   # (kernel, rows): each row's two outputs
    ("exact", 1): [2 ** -24 + 2 ** -26, 1 + 2 ** -11 + 2 ** -40],
    ("by_batch", 1): [0.0, 1.0],                 # each piece, and the total, to 16 bits
    ("by_batch", 3): [2 ** -24, 1 + 2 ** -10],   # one piece: the sum rounded once
    ("by_batch_float32", 1): [2 ** -23, 1.0],    # pieces and total to 32 bits, then 16
    ("by_batch_float32", 3): [2 ** -24, 1.0],
    ("batch_invariant", 1): [2 ** -24, 1 + 2 ** -10],
}


def where_kernels_round_otherwise():
    """None if each product kernel of batched.py gives KERNEL_OUTPUTS for rows of
    KERNEL_ROW times KERNEL_COLUMNS, else a Wrong naming the kernel, the batch, the row
    and the output. The two dot products have 16 terms, which a row alone cuts into four
    pieces of four terms and three rows leave in one, their terms chosen so that every
    rounding shows. Column 0: pieces adding to 1 + 2**-24 + 2**-26 and -1, so a first
    piece rounded to 32 bits (1 + 2**-23) leaves 2**-23, rounded to 16 bits (1.0)
    nothing; in one piece the sum is 2**-24 + 2**-26, which a 16-bit output makes 2**-24.
    Column 1: pieces adding to 1 + 2**-11 and 2**-40, a total just above halfway between
    the 16-bit floats 1 and 1 + 2**-10, and exactly halfway once rounded to 32 bits (a
    tie goes to the even one, 1.0)."""
    for (kernel, rows), wanted in KERNEL_OUTPUTS.items():
        step(f"multiplying {rows} row(s) of 16 terms by two columns with batched.{kernel}")
        why = differ(f"batched.{kernel} on a batch of {rows} row{'s' * (rows > 1)} of 16 terms",
                     getattr(batched, kernel)([KERNEL_ROW] * rows, KERNEL_COLUMNS),
                     [wanted] * rows, kernel, names=("row", "output"),
                     fed=f"rows of {KERNEL_ROW}, columns {KERNEL_COLUMNS}")
        if why:
            return why
    return None


def quick_check():
    """Three test stories fed in mixed batches (chunks of one story's next tokens beside
    one next token of each other) give forward_step's rows, in KVCaches and in int8
    QuantizedCaches (a row reads the batch's new keys as its cache stores them); and each
    product kernel rounds two dot products of 16 terms, alone and in a batch of 3, as its
    docstring says (where_kernels_round_otherwise)."""
    ids = [TOK.encode(story) for story in STORIES[:3]]
    labels = [story_name(index) for index in range(3)]
    for kind, fresh in (("", KVCache), (" in an int8 QuantizedCache",
                                        lambda params: QuantizedCache(params, "int8"))):
        step(f"feeding three test stories{kind or ' in KVCaches'} through batched.forward_rows "
             f"in mixed batches, expecting forward_step's rows")
        why = where_batches_differ(PARAMS, [fresh(PARAMS) for _ in ids], ids,
                                   labels=[label + kind for label in labels], fresh=fresh)
        if why:
            return why
    return where_kernels_round_otherwise()


QuickCheck = verdicts.quick_check_case("batched", __name__)


class ExactProduct(unittest.TestCase):

    def test_every_batched_row_of_paged_sequences_equals_forward_step(self):
        """Three stories in mixed steps (chunks and single tokens), in paged sequences of
        one pool (the quick check feeds them in KVCaches)."""
        pool = paged.BlockPool(PARAMS, 64, 4)
        self.assertIsNone(where_batches_differ(
            PARAMS, [pool.sequence() for _ in IDS], IDS,
            labels=[verdicts.story_name(index) for index in range(len(IDS))]))

    def test_random_models_and_batches(self):
        """Case n draws, from random.Random(n), a model (init_params with a random seed)
        and 1 to 5 random token sequences, fed in random mixed steps; then a batch of one
        more token for each of those caches and a float16 cache, with one flaw drawn at
        random (a position out of order, a token outside the vocabulary, or keys a
        million times too large for float16), which must be refused with every cache as
        it was."""
        def check(index):
            rng = random.Random(index)
            params = model.init_params(rng.randrange(10 ** 6))
            ids = [[rng.randrange(model.VOCAB_SIZE) for _ in range(rng.randint(1, 20))]
                   for _ in range(rng.randint(1, 5))]
            caches = [KVCache(params) for _ in ids]
            why = where_batches_differ(params, caches, ids, seed=index)
            if why:
                return why
            flaw = rng.choice(("position", "token", "storage"))
            if flaw == "storage":
                params = dict(params, Wk=[[w * 1e6 for w in row] for row in params["Wk"]])
                caches = [support.filled_cache(own[:3], params) for own in ids]
            caches.append(QuantizedCache(params, "float16"))
            items = [(cache, rng.randrange(model.VOCAB_SIZE), len(cache)) for cache in caches]
            flawed = rng.randrange(len(items))
            cache, token_id, position = items[flawed]
            items[flawed] = {"position": (cache, token_id, position + 1),
                             "token": (cache, model.VOCAB_SIZE, position)}.get(flaw,
                                                                               items[flawed])
            before = [support.snapshot(cache) for cache in caches]
            try:
                batched.forward_rows(params, items)
                return f"a batch with a flawed {flaw} was not refused"
            except ValueError:
                pass
            if [support.snapshot(cache) for cache in caches] != before:
                return f"a batch refused for its {flaw} changed a cache"
            return None
        support.check_random_cases(self, 10, check)


class Kernels(unittest.TestCase):
    """One story's rows, computed alone and with 1, 3 and 7 other stories' rows."""

    def rows_with(self, product, companions):
        caches = [KVCache(PARAMS) for _ in range(1 + companions)]
        ids = [IDS[0]] + [IDS[1 + n % 2] for n in range(companions)]
        steps = min(len(own) for own in ids)
        rows = []
        for position in range(steps):
            rows.append(batched.forward_rows(
                PARAMS, [(cache, own[position], position) for cache, own in zip(caches, ids)],
                product)[0])
        return rows

    def test_the_exact_product_gives_forward_step_s_rows_in_any_batch(self):
        alone = feed(PARAMS, KVCache(PARAMS), IDS[0])
        for companions in (0, 1, 3, 7):
            with self.subTest(companions=companions):
                rows = self.rows_with(batched.exact, companions)
                assert_same_rows(self, rows, alone[:len(rows)])

    def test_an_engine_s_kernel_gives_a_row_that_depends_on_its_batch(self):
        alone = self.rows_with(batched.by_batch, 0)
        for companions in (1, 3, 7):
            with self.subTest(companions=companions):
                rows = self.rows_with(batched.by_batch, companions)
                assert_changed(self, rows, alone[:len(rows)], "the rows in a larger batch")

    def test_the_32_bit_kernel_s_rows_depend_on_the_batch_too(self):
        """Alone (four pieces) and with 3 other rows (one piece)."""
        rows = self.rows_with(batched.by_batch_float32, 3)
        assert_changed(self, rows, self.rows_with(batched.by_batch_float32, 0)[:len(rows)],
                       "the rows in a batch of 4")

    def test_a_batch_invariant_kernel_gives_the_same_row_in_any_batch(self):
        alone = self.rows_with(batched.batch_invariant, 0)
        assert_changed(self, alone, feed(PARAMS, KVCache(PARAMS), IDS[0])[:len(alone)],
                       "the batch-invariant kernel's rows against the exact ones")
        for companions in (1, 3, 7):
            with self.subTest(companions=companions):
                rows = self.rows_with(batched.batch_invariant, companions)
                assert_same_rows(self, rows, alone[:len(rows)])


class WhatTheKernelsRound(unittest.TestCase):
    """The quick check's two dot products of 16 terms, whose every rounding shows
    (where_kernels_round_otherwise): the kernels round them as their
    docstrings say (the quick check), and each mistake in in_pieces' rounding is caught
    (Verdicts plants another, the pieces' total not rounded, and asks for its name)."""

    def test_each_mistake_in_the_kernels_rounding_is_caught(self):
        assert_each_mistake_is_caught(self, batched, "in_pieces", {
            "every sum rounded to 16 bits, whatever bits says":
                replacing(lambda node: is_call_of(node, "_rounded")
                          and isinstance(node.args[1], ast.Name),
                          lambda node: ast.Call(node.func, [node.args[0], ast.Constant(16)], [])),
            "the output left in 32 bits":
                replacing(lambda node: is_call_of(node, "_output"),
                          lambda node: node.args[0]),
        }, where_kernels_round_otherwise)


class Teeth(unittest.TestCase):
    """Each mistake planted in the real batched.forward_rows makes a row differ."""

    MISTAKES = {
        "a row attends to its cache without its own position (keys[:i])":
            replacing(lambda node: isinstance(node, ast.Slice) and isinstance(node.upper, ast.BinOp)
                      and isinstance(node.upper.left, ast.Name) and node.upper.left.id == "i",
                      lambda node: ast.Slice(None, node.upper.left, None)),
        "the batch's new keys and values left out of what its rows attend to":
            replacing(lambda node: isinstance(node, ast.Expr)
                      and ast.unparse(node).endswith(".append(cache.stored(k))"),
                      lambda node: ast.Pass()),
        "each row mixes with the next item's query (the batch misaligned)":
            replacing(lambda node: is_call_of(node, "zip", 2)
                      and isinstance(node.args[1], ast.Name) and node.args[1].id == "qs",
                      lambda node: ast.Call(node.func, [node.args[0], ast.parse(
                          "qs[1:] + qs[:1]", mode="eval").body], [])),
    }

    def test_each_mistake_in_forward_rows_is_caught(self):
        """Each makes a row differ; the real forward_rows gives none (setUpModule)."""
        assert_each_mistake_is_caught(self, batched, "forward_rows", self.MISTAKES,
                                      lambda: where_batches_differ(PARAMS, [KVCache(PARAMS) for _ in IDS], IDS))


def _weight(node):
    """The name of the weight matrix a call product(rows, cols["W..."]) applies, or None."""
    if is_call_of(node, "product", 2) \
            and isinstance(node.args[1], ast.Subscript) \
            and isinstance(node.args[1].slice, ast.Constant):
        return node.args[1].slice.value
    return None


def residual_from_h1(tree):
    """zip(x0s, product(mixed, cols["Wo"])) becomes zip(h1s, ...): the attention's output
    added to the row forward_rows normalised (whatever product(_, cols["Wq"]) is given)."""
    normalised = next(node.args[0] for node in ast.walk(tree) if _weight(node) == "Wq")
    changed = 0
    for node in ast.walk(tree):
        if is_call_of(node, "zip", 2) and _weight(node.args[1]) == "Wo":
            node.args[0], changed = normalised, changed + 1
    return changed


ROW_NAMED = (r"the logits of the (first|second|third) test story, fed in mixed batches "
             r"\(seed 0\), at position \d+, logit \d+: \S+ from forward_rows, \S+ expected "
             r"\(step \d+, a batch of \d+ rows: ")


class Verdicts(unittest.TestCase):
    """Each mistake planted in the real batched.py (by its syntax tree) makes the layer's
    own check fail, naming the quantity that differs and where: the story, position and
    logit, and the batch; or the kernel, its batch, the row and the output."""

    MISTAKES = [
        ("a row of a step starts from its cache's stored keys, forgetting the batch's new "
         "ones before it (held[...] = ..., not setdefault)", batched, "forward_rows",
         replacing(lambda node: isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                   and isinstance(node.value.func, ast.Attribute)
                   and node.value.func.attr == "setdefault",
                   lambda node: ast.Assign([node.targets[0], ast.Subscript(
                       node.value.func.value, node.value.args[0], ast.Store())],
                       node.value.args[1])),
         ROW_NAMED),
        ("the batch's new keys and values read as computed, not as their cache stores "
         "them (k, not cache.stored(k))", batched, "forward_rows",
         replacing(lambda node: isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and node.func.attr == "stored", lambda node: node.args[0]),
         r"the logits of the first test story in an int8 QuantizedCache, fed in mixed "
         r"batches \(seed 0\), at position \d+, logit \d+: \S+ from forward_rows, \S+ "
         r"expected \(step \d+"),
        ("the attention's output added to the normalised row h1, not to x0", batched,
         "forward_rows", residual_from_h1, ROW_NAMED),
        ("the pieces' total not rounded to bits (only the output)", batched, "in_pieces",
         replacing(lambda node: is_call_of(node, "_rounded")
                   and isinstance(node.args[0], ast.ListComp)
                   and is_call_of(node.args[0].generators[0].iter, "zip"),
                   lambda node: node.args[0]),
         r"batched\.by_batch_float32 on a batch of 1 row of 16 terms, at row 0, output 1: "
         r"1\.0009765625 from by_batch_float32, 1\.0 expected"),
        ("the split count inverted: more rows, more pieces (len(rows) // PROCESSORS)", batched,
         "_pieces", replacing(lambda node: isinstance(node, ast.BinOp)
                              and isinstance(node.op, ast.FloorDiv),
                              lambda node: ast.BinOp(node.right, ast.FloorDiv(), node.left)),
         r"batched\.by_batch on a batch of 1 row of 16 terms, at row 0, output \d: \S+ from "
         r"by_batch, \S+ expected"),
    ]

    def test_each_mistake_is_named_by_the_layer_s_check(self):
        verdicts.assert_verdicts(self, "batched", self.MISTAKES)


class Refusals(unittest.TestCase):

    def test_a_bad_batch_is_refused_before_anything_changes(self):
        held, other = KVCache(PARAMS), KVCache(model.init_params(1))
        feed(PARAMS, held, IDS[0][:3])
        full = paged.BlockPool(PARAMS, 1, 4)
        first, second = full.sequence(), full.sequence()
        for items, fragment in (
                ([], "items must be a non-empty list"),
                (None, "items must be a non-empty list"),
                ([(held, 5)], r"items\[0\] must be \(cache, token_id, position\)"),
                ([(other, 5, 0)], "different parameters"),
                ([(held, 5, 3), (held, 6, 3)], r"items\[1\]: expected position 4, got 3"),
                ([(held, 5, 3), (KVCache(PARAMS), 96, 0)], r"items\[1\]: token ID 96 is outside"),
                ([(WindowCache(PARAMS, 8), 5, 0)], "WindowCache drops positions"),
                ([(first, 5, 0), (second, 5, 0)], "the pool is out of blocks")):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                batched.forward_rows(PARAMS, items)
            self.assertEqual((len(held), len(first), len(second), full.free_blocks()),
                             (3, 0, 0, 1))
        long = KVCache(PARAMS)
        long.keys, long.values = [[0.0] * 16] * model.CONTEXT, [[0.0] * 16] * model.CONTEXT
        long.tokens = [0] * model.CONTEXT
        with self.assertRaisesRegex(ValueError, "beyond the 64 positions"):
            batched.forward_rows(PARAMS, [(long, 5, model.CONTEXT)])

    def test_the_products_refuse_bad_pieces_bits_and_rows_by_name(self):
        """in_pieces: pieces of 0 (a division by zero), -1 (taken as one), 2.5, True, and bits
        of no format (8); every product: no rows (by_batch's pieces divided by zero), and rows
        of 3 numbers against columns of 16 (zip stopped at 3): each a ValueError naming it."""
        cols, row = model.columns(PARAMS)["Wq"], [0.5] * model.WIDTH
        for call, fragment in (
                (lambda: batched.in_pieces([row], cols, 0), "pieces must be an int >= 1, got 0"),
                (lambda: batched.in_pieces([row], cols, -1), "pieces must be an int >= 1, got -1"),
                (lambda: batched.in_pieces([row], cols, 2.5), "pieces must be .*, got 2.5"),
                (lambda: batched.in_pieces([row], cols, True), "pieces must be .*, got True"),
                (lambda: batched.in_pieces([row], cols, 2, bits=8), "bits must be 16 or 32, got 8"),
                *((lambda product=product: product([], cols),
                   r"rows must be a non-empty list of rows, got \[\]")
                  for product in (batched.exact, batched.by_batch, batched.by_batch_float32,
                                  batched.batch_invariant)),
                *((lambda product=product: product([row, row[:3]], cols),
                   r"rows\[1\] has 3 numbers, and each column of the matrix 16")
                  for product in (batched.exact, batched.by_batch, batched.by_batch_float32,
                                  batched.batch_invariant))):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                call()

    def test_a_paged_sequence_takes_only_the_rows_of_the_kernel_it_is_for(self):
        """A sequence made for the exact arithmetic (pool.sequence()) refuses a kernel's
        batched rows; one made for a kernel refuses forward_step's, prefill's, exact
        batched rows and another kernel's; each refusal names both, and leaves the
        sequences and the pool as they were (its prefix index never holds a kernel's
        rows under another's name)."""
        import kv_cache
        import prefill
        pool = paged.BlockPool(PARAMS, 8, 4)
        exact_seq, kernel_seq = pool.sequence(), pool.sequence(computed_by=batched.by_batch)
        feed(PARAMS, exact_seq, IDS[0][:5])
        batched.forward_rows(PARAMS, [(kernel_seq, token_id, position) for position, token_id
                                      in enumerate(IDS[0][:5])], batched.by_batch)
        exact_arithmetic = "the exact arithmetic, and these would be computed by"
        for name, run, fragment in (
                ("by_batch rows", lambda: batched.forward_rows(
                    PARAMS, [(exact_seq, 5, 5)], batched.by_batch),
                 f"is for rows computed by {exact_arithmetic} by_batch: .* computed_by=by_batch"),
                ("exact rows", lambda: batched.forward_rows(PARAMS, [(kernel_seq, 5, 5)]),
                 "is for rows computed by by_batch, and these would be computed by the exact "
                 "arithmetic: .*computed_by=None"),
                ("another kernel's", lambda: batched.forward_rows(
                    PARAMS, [(kernel_seq, 5, 5)], batched.batch_invariant),
                 "by by_batch, and these would be computed by batch_invariant"),
                ("forward_step", lambda: kv_cache.forward_step(PARAMS, kernel_seq, 5, 5),
                 "by by_batch, and these would be computed by the exact"),
                ("prefill", lambda: prefill.prefill(PARAMS, kernel_seq, [5], 5),
                 "by by_batch, and these would be computed by the exact"),
                ("generate_cached", lambda: kv_cache.generate_cached(
                    PARAMS, TOK, TOK.decode(IDS[0][:8]), cache=kernel_seq),
                 "by by_batch, and these would be computed by the exact")):
            before = (support.snapshot(exact_seq), support.snapshot(kernel_seq),
                      support.pool_snapshot(pool))
            with self.subTest(name), self.assertRaisesRegex(ValueError, fragment):
                run()
            support.assert_equal(self, (support.snapshot(exact_seq), support.snapshot(kernel_seq),
                                        support.pool_snapshot(pool)), before,
                                 f"the sequences and the pool after refusing {name}")

    def test_a_refusal_while_the_rows_are_computed_changes_no_cache(self):
        """A key a float16 cache cannot store (keys 1e6 times too large), and a sum a
        16-bit kernel cannot hold at a later product, each refused with every cache of
        the batch (a list, a float16 cache, a paged sequence) as it was before."""
        large_keys = dict(PARAMS, Wk=[[w * 1e6 for w in row] for row in PARAMS["Wk"]])
        large_out = dict(PARAMS, W_out=[[w * 1e6 for w in row] for row in PARAMS["W_out"]])
        for params, product, fragment in ((large_keys, batched.exact, "beyond float16"),
                                          (large_out, batched.by_batch, "beyond 65504"),
                                          (large_out, batched.by_batch_float32,
                                           "beyond 65504, the largest 16-bit")):
            pool = paged.BlockPool(params, 8, 4)
            caches = [KVCache(params), QuantizedCache(params, "float16"),
                      pool.sequence(computed_by=batched.computed_by(product))]
            for cache in caches[::2] if product is batched.exact else caches[:1]:
                feed(params, cache, IDS[0][:3])   # (a kernel's sequence takes no exact row)
            before = [support.snapshot(cache) for cache in caches], support.pool_snapshot(pool)
            items = [(cache, 5, len(cache)) for cache in caches]
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                batched.forward_rows(params, items, product)
            support.assert_equal(self, ([support.snapshot(cache) for cache in caches],
                                        support.pool_snapshot(pool)), before,
                                 "the caches and the pool")


if __name__ == "__main__":
    unittest.main()
