"""Tests of model.py: the backward pass against finite differences, causality, the exact
arithmetic of reference.md (The model), and the refusals of bad input."""
import math
import random
import re
import unittest
from math import fsum

import model

IDS = [5, 17, 30, 5, 62, 8, 30, 5]          # repeats, so tok_emb rows gather several positions
TARGETS = [17, 30, 5, 62, 8, 30, 5, 0]


def random_params(seed):
    """init_params, then gains, biases and b1/b2/b_out moved away from 1 and 0 so that
    every parameter takes part in the arithmetic with a value of its own."""
    params = model.init_params(seed)
    rng = random.Random(seed + 1000)
    for name, shape in model.SHAPES.items():
        if len(shape) == 1:
            base = 1.0 if name.endswith("_g") else 0.0
            params[name] = [base + rng.uniform(-0.5, 0.5) for _ in range(shape[0])]
    return params


def mean_cross_entropy(params, ids, targets):
    """The loss from the forward pass alone: mean of -log p(target) per position."""
    logits, _ = model.forward(params, ids)
    return fsum(-math.log(model.softmax_row(scores)[t])
                for scores, t in zip(logits, targets)) / len(ids)


def get(params, name, index):
    return params[name][index] if isinstance(index, int) else params[name][index[0]][index[1]]


def put(params, name, index, value):
    if isinstance(index, int):
        params[name][index] = value
    else:
        params[name][index[0]][index[1]] = value


def first_difference(got, expected):
    """None if the two lists of rows are equal (==), else a short description of the
    first difference (unittest's own diff of long float lists is slow to compute)."""
    if len(got) != len(expected):
        return f"{len(got)} rows, expected {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            j = next((j for j, (a, b) in enumerate(zip(g, e)) if a != b), None)
            if j is None:
                return f"row {i}: length {len(g)}, expected {len(e)}"
            return f"row {i}, column {j}: {g[j]!r} != {e[j]!r}"
    return None


class GradientTest(unittest.TestCase):
    H = 1e-5
    TOLERANCE = 1e-4

    def entries_to_check(self, name, grads, rng):
        """A few entries of one parameter: three random ones (embedding rows limited to
        the rows the input uses) and the one with the largest analytic gradient."""
        shape = model.SHAPES[name]
        if name == "tok_emb":
            rows = sorted(set(IDS))
        elif name == "pos_emb":
            rows = list(range(len(IDS)))
        else:
            rows = list(range(shape[0]))
        if len(shape) == 1:
            candidates = rows
        else:
            candidates = [(r, c) for r in rows for c in range(shape[1])]
        chosen = rng.sample(candidates, 3)
        largest = max(candidates, key=lambda index: abs(get(grads, name, index)))
        return chosen + [largest]

    def test_every_parameter_gradient_matches_finite_differences(self):
        params = random_params(3)
        loss, grads = model.loss_and_grads(params, IDS, TARGETS)
        self.assertLess(abs(loss - mean_cross_entropy(params, IDS, TARGETS)), 1e-12 * loss)
        self.assertEqual(set(grads), set(model.SHAPES))
        rng = random.Random(7)
        for name in model.SHAPES:
            for index in self.entries_to_check(name, grads, rng):
                with self.subTest(parameter=name, entry=index):
                    original = get(params, name, index)
                    put(params, name, index, original + self.H)
                    up = mean_cross_entropy(params, IDS, TARGETS)
                    put(params, name, index, original - self.H)
                    down = mean_cross_entropy(params, IDS, TARGETS)
                    put(params, name, index, original)
                    numeric = (up - down) / (2 * self.H)
                    analytic = get(grads, name, index)
                    scale = max(abs(numeric), abs(analytic), 1e-6)
                    self.assertLess(abs(numeric - analytic) / scale, self.TOLERANCE,
                                    f"analytic {analytic!r}, finite difference {numeric!r}")

    def test_gradients_have_the_shapes_of_the_parameters(self):
        _, grads = model.loss_and_grads(random_params(4), IDS[:4], TARGETS[:4])
        for name, shape in model.SHAPES.items():
            with self.subTest(parameter=name):
                if len(shape) == 1:
                    self.assertEqual(len(grads[name]), shape[0])
                    self.assertTrue(all(isinstance(g, float) for g in grads[name]))
                else:
                    self.assertEqual([len(r) for r in grads[name]], [shape[1]] * shape[0])

    def test_unused_embedding_rows_get_zero_gradient(self):
        _, grads = model.loss_and_grads(random_params(5), IDS, TARGETS)
        for t in range(model.VOCAB_SIZE):
            if t not in IDS:
                self.assertEqual(grads["tok_emb"][t], [0.0] * model.WIDTH, f"token {t}")
            else:
                self.assertNotEqual(grads["tok_emb"][t], [0.0] * model.WIDTH, f"token {t}")
        for i in range(len(IDS), model.CONTEXT):
            self.assertEqual(grads["pos_emb"][i], [0.0] * model.WIDTH, f"position {i}")

    def test_loss_and_grads_refuses_mismatched_or_bad_targets(self):
        params = random_params(6)
        for targets in (TARGETS[:-1], TARGETS[:-1] + [96], TARGETS[:-1] + [-1],
                        TARGETS[:-1] + [True]):
            with self.subTest(targets=targets), self.assertRaises(ValueError):
                model.loss_and_grads(params, IDS, targets)


class ForwardTest(unittest.TestCase):

    def setUp(self):
        self.params = random_params(11)
        self.ids = [random.Random(12).randrange(model.VOCAB_SIZE) for _ in range(12)]

    def test_logits_have_one_row_of_96_per_position(self):
        logits, saved = model.forward(self.params, self.ids)
        self.assertEqual(len(logits), len(self.ids))
        self.assertEqual([len(values) for values in saved], [len(self.ids)] * len(saved))
        self.assertTrue(all(len(scores) == model.VOCAB_SIZE for scores in logits))

    def test_changing_a_later_token_never_changes_an_earlier_row(self):
        logits, _ = model.forward(self.params, self.ids)
        for position in range(1, len(self.ids)):
            changed = list(self.ids)
            changed[position] = (changed[position] + 1) % model.VOCAB_SIZE
            other, _ = model.forward(self.params, changed)
            with self.subTest(changed_position=position):
                self.assertIsNone(first_difference(other[:position], logits[:position]))
                self.assertNotEqual(other[position], logits[position])

    def test_position_i_computes_exactly_i_plus_1_attention_scores(self):
        _, saved = model.forward(self.params, self.ids)
        for i, weights in enumerate(saved.weights):
            with self.subTest(position=i):
                self.assertEqual(len(weights), i + 1)
                self.assertTrue(all(w > 0.0 for w in weights), "no masked entries")
                self.assertLess(abs(fsum(weights) - 1.0), 1e-12)

    def test_forward_is_deterministic(self):
        first, _ = model.forward(self.params, self.ids)
        second, _ = model.forward(self.params, list(self.ids))
        self.assertIsNone(first_difference(first, second))

    def test_a_row_does_not_depend_on_how_many_rows_follow(self):
        full, _ = model.forward(self.params, self.ids)
        for m in range(1, len(self.ids)):
            prefix, _ = model.forward(self.params, self.ids[:m])
            with self.subTest(rows=m):
                self.assertIsNone(first_difference(prefix, full[:m]))

    def test_forward_does_exactly_the_spec_arithmetic(self):
        logits, _ = model.forward(self.params, self.ids)
        self.assertIsNone(first_difference(logits, spec_forward(self.params, self.ids)))


def spec_forward(params, ids):
    """The model's arithmetic (reference.md, The model) written out position by
    position, independently of model.py."""
    def dot(a, b):
        return fsum(a[k] * b[k] for k in range(len(a)))

    def row(x, W):
        return [dot(x, [W[r][j] for r in range(len(W))]) for j in range(len(W[0]))]

    def layernorm(x, g, b):
        n = len(x)
        mean = fsum(x) / n
        d = [value - mean for value in x]
        var = fsum(e * e for e in d) / n
        return [d[k] / math.sqrt(var + 1e-5) * g[k] + b[k] for k in range(n)]

    def softmax(s):
        top = max(s)
        exps = [math.exp(v - top) for v in s]
        total = fsum(exps)
        return [e / total for e in exps]

    p = params
    x0s, qs, ks, vs = [], [], [], []
    for i, t in enumerate(ids):
        x0 = [p["tok_emb"][t][c] + p["pos_emb"][i][c] for c in range(16)]
        h1 = layernorm(x0, p["ln1_g"], p["ln1_b"])
        x0s.append(x0)
        qs.append(row(h1, p["Wq"]))
        ks.append(row(h1, p["Wk"]))
        vs.append(row(h1, p["Wv"]))
    out = []
    for i in range(len(ids)):
        w = softmax([dot(qs[i], ks[j]) * (1 / math.sqrt(16)) for j in range(i + 1)])
        mixed = [fsum(w[j] * vs[j][c] for j in range(i + 1)) for c in range(16)]
        x1 = [a + b for a, b in zip(x0s[i], row(mixed, p["Wo"]))]
        h2 = layernorm(x1, p["ln2_g"], p["ln2_b"])
        z = [a + b for a, b in zip(row(h2, p["W1"]), p["b1"])]
        a = [value if value > 0 else 0.0 for value in z]
        mlp = [m + b for m, b in zip(row(a, p["W2"]), p["b2"])]
        x2 = [s + m for s, m in zip(x1, mlp)]
        hf = layernorm(x2, p["lnf_g"], p["lnf_b"])
        out.append([s + b for s, b in zip(row(hf, p["W_out"]), p["b_out"])])
    return out


class SharedOperationsTest(unittest.TestCase):

    def test_softmax_row_sums_to_one(self):
        rng = random.Random(21)
        for _ in range(20):
            scores = [rng.gauss(0.0, 5.0) for _ in range(model.VOCAB_SIZE)]
            probs = model.softmax_row(scores)
            self.assertLess(abs(fsum(probs) - 1.0), 1e-12)
            self.assertTrue(all(p >= 0.0 for p in probs))

    def test_softmax_row_subtracts_the_max_first(self):
        # Without subtracting the max, exp(1002.0) overflows; with it, a shift by a
        # constant gives the very same differences and so the very same floats.
        self.assertEqual(model.softmax_row([1000.0, 1001.0, 1002.0]),
                         model.softmax_row([0.0, 1.0, 2.0]))
        exps = [math.exp(-2.0), math.exp(-1.0), math.exp(0.0)]
        self.assertEqual(model.softmax_row([0.0, 1.0, 2.0]), [e / fsum(exps) for e in exps])

    def test_softmax_row_of_no_scores_says_the_row_attends_to_nothing(self):
        with self.assertRaisesRegex(ValueError, "softmax_row got no scores: the row attends to "
                                                "no position"):
            model.softmax_row([])

    def test_layernorm_gives_mean_zero_and_variance_one(self):
        rng = random.Random(22)
        rows = [[rng.gauss(3.0, 2.0) for _ in range(model.WIDTH)] for _ in range(5)]
        normed, _ = model.layernorm_forward(rows, [1.0] * model.WIDTH, [0.0] * model.WIDTH)
        self.assertEqual(len(normed), len(rows))
        for y in normed:
            self.assertLess(abs(fsum(y) / len(y)), 1e-12)
            self.assertLess(abs(fsum(v * v for v in y) / len(y) - 1.0), 1e-4)

    def test_layernorm_is_the_spec_formula_exactly(self):
        rng = random.Random(23)
        x = [rng.gauss(0.0, 1.0) for _ in range(model.WIDTH)]
        g = [rng.uniform(0.5, 1.5) for _ in range(model.WIDTH)]
        b = [rng.uniform(-0.5, 0.5) for _ in range(model.WIDTH)]
        n = len(x)
        mean = fsum(x) / n
        d = [value - mean for value in x]
        var = fsum(e * e for e in d) / n
        expected = [d[k] / math.sqrt(var + 1e-5) * g[k] + b[k] for k in range(n)]
        normed, _ = model.layernorm_forward([x], g, b)
        self.assertEqual(normed, [expected])


class RefusalTest(unittest.TestCase):

    def setUp(self):
        self.params = model.init_params(0)

    def test_empty_ids_are_refused(self):
        with self.assertRaises(ValueError):
            model.forward(self.params, [])

    def test_more_than_64_tokens_are_refused(self):
        model.forward(self.params, [1] * 64)
        with self.assertRaises(ValueError):
            model.forward(self.params, [1] * 65)

    def test_token_ids_outside_the_vocabulary_are_refused(self):
        model.forward(self.params, [0, 95])
        for bad in (-1, 96, True, 1.0, "3", None):
            with self.subTest(token_id=bad), self.assertRaises(ValueError):
                model.forward(self.params, [1, bad, 2])

    def test_init_params_refuses_a_seed_that_is_not_an_int(self):
        """None (random.Random would seed from the clock), 1.5, True and "0" (it would take
        them), as generate refuses them."""
        for seed in (None, 1.5, True, "0"):
            with self.subTest(seed=seed), self.assertRaisesRegex(
                    ValueError, f"seed must be an int, got {re.escape(repr(seed))}"):
                model.init_params(seed)

    def test_weights_whose_sums_overflow_are_refused_by_name(self):
        """Weights of 1e308 overflow fsum inside a row (or meet inf - inf): forward names
        the weight instead of letting fsum's OverflowError out."""
        for name in ("tok_emb", "Wq", "W_out"):
            params = dict(self.params, **{name: [[1e308] * len(r) for r in self.params[name]]})
            with self.subTest(name=name), self.assertRaisesRegex(
                    ValueError, f"params: {name} holds 1e\\+308, larger than"):
                model.forward(params, [1, 2])


if __name__ == "__main__":
    unittest.main()
