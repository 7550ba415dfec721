"""Tests of the checkpoint format (checkpoint.py): exact floats, the data signature, and
every refusal of load and save. The files it writes are lab_files.py's, tested in
test_lab_files."""
import json
import os
import unittest

import checkpoint
import model
import support
from bpe import Tokenizer
from support import HERE

CONFIG = {"width": 16, "hidden": 64, "seed": 3, "learning_rate": 0.01, "epochs": 2}
SIGNATURE = "0123456789abcdef"
AWKWARD_FLOATS = [0.1 + 0.2, 1e-300, -2.5e17, 1 / 3, -0.0, 5e-324, 1e30, 2.0 ** 99,
                  2.0 ** 0.5, -1e-5]   # 1e30: the largest weight a checkpoint takes


class CheckpointTestCase(support.InAFolder):
    """A test in a folder of its own that saves a good checkpoint, alters it, and asserts
    that load refuses it."""

    def save_good_checkpoint(self):
        checkpoint.save(self.path, self.params, CONFIG, SIGNATURE, epoch=1)

    def rewrite_record(self, change):
        """Save a good checkpoint, then let change(record) alter it and write it back."""
        self.save_good_checkpoint()
        with open(self.path, encoding="utf-8") as f:
            record = json.load(f)
        change(record)
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(record, f)

    def assert_load_refused(self, *fragments, config=CONFIG, signature=SIGNATURE):
        """load raises ValueError naming the file and every fragment; returns the rest."""
        with self.assertRaises(ValueError) as caught:
            checkpoint.load(self.path, config, signature)
        message = str(caught.exception)
        self.assertIn(self.path, message)
        rest = message.replace(self.path, "")   # the random folder name could hold a fragment
        for fragment in fragments:
            self.assertIn(fragment, rest)
        return rest


class TestRoundTrip(CheckpointTestCase):
    def test_floats_round_trip_exactly(self):
        self.params["b1"][:len(AWKWARD_FLOATS)] = AWKWARD_FLOATS
        self.params["W_out"][15][-len(AWKWARD_FLOATS):] = AWKWARD_FLOATS
        checkpoint.save(self.path, self.params, CONFIG, SIGNATURE, epoch=4, val_loss=0.1 + 0.2)
        record = checkpoint.load(self.path, CONFIG, SIGNATURE)
        self.assertEqual(record["params"], self.params)
        self.assertEqual(repr(record["params"]), repr(self.params))
        self.assertEqual(repr(record["params"]["b1"][:len(AWKWARD_FLOATS)]), repr(AWKWARD_FLOATS))
        self.assertEqual(record["meta"], {"epoch": 4, "val_loss": 0.1 + 0.2})
        self.assert_only_files("best.json")

    def test_config_floats_round_trip_exactly(self):
        config = dict(CONFIG, learning_rate=0.1 + 0.2, beta2=1 / 3)
        checkpoint.save(self.path, self.params, config, SIGNATURE)
        self.assertEqual(checkpoint.load(self.path, config, SIGNATURE)["params"], self.params)


class TestInputSignature(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(os.path.join(HERE, "corpus.txt"), encoding="utf-8") as f:
            cls.corpus = f.read()
        cls.tok = Tokenizer.load(os.path.join(HERE, "tokenizer.json"))

    def test_signature_is_stable_for_the_same_inputs(self):
        first = checkpoint.input_signature(self.tok, self.corpus)
        self.assertIsInstance(first, str)
        self.assertEqual(checkpoint.input_signature(self.tok, self.corpus), first)
        reloaded = Tokenizer.load(os.path.join(HERE, "tokenizer.json"))
        self.assertEqual(checkpoint.input_signature(reloaded, self.corpus), first)
        copy = Tokenizer(list(self.tok.vocab), [list(pair) for pair in self.tok.merges])
        self.assertEqual(checkpoint.input_signature(copy, self.corpus), first)

    def test_signature_changes_when_the_corpus_text_changes(self):
        first = checkpoint.input_signature(self.tok, self.corpus)
        changed = [self.corpus.replace("mia", "ana", 1), self.corpus + "mia sat.\n",
                   self.corpus[:-1], self.corpus[1:]]
        for text in changed:
            self.assertNotEqual(text, self.corpus)
            self.assertNotEqual(checkpoint.input_signature(self.tok, text), first)

    def test_signature_changes_when_the_tokenizer_differs(self):
        first = checkpoint.input_signature(self.tok, self.corpus)
        smaller = Tokenizer(self.tok.vocab[:-1], self.tok.merges[:-1])
        self.assertNotEqual(checkpoint.input_signature(smaller, self.corpus), first)
        tiny_a = Tokenizer.train("the cat. the hat\n", 12)
        tiny_b = Tokenizer.train("the cat. the hat\n", 13)
        self.assertNotEqual(checkpoint.input_signature(tiny_a, "x"),
                            checkpoint.input_signature(tiny_b, "x"))
        # Same vocabulary, different merges: "the" made as t + he or as th + e.
        vocab = ["e", "h", "t", "th", "he", "the"]
        t_he = Tokenizer(vocab, [("t", "h"), ("h", "e"), ("t", "he")])
        th_e = Tokenizer(vocab, [("t", "h"), ("h", "e"), ("th", "e")])
        self.assertNotEqual(checkpoint.input_signature(t_he, "x"),
                            checkpoint.input_signature(th_e, "x"))


class TestLoadRefuses(CheckpointTestCase):
    def test_loading_a_missing_file_raises_file_not_found(self):
        with self.assertRaises(FileNotFoundError):
            checkpoint.load(self.path, CONFIG, SIGNATURE)

    def test_load_refuses_malformed_json(self):
        for text in ["not json at all", "", "{\"format\": "]:
            with self.subTest(text=text):
                with open(self.path, "w", encoding="utf-8") as f:
                    f.write(text)
                self.assert_load_refused()

    def test_load_refuses_a_truncated_file(self):
        self.save_good_checkpoint()
        with open(self.path, encoding="utf-8") as f:
            text = f.read()
        for keep in [len(text) - 3, len(text) // 2, 1]:
            with self.subTest(keep=keep):
                with open(self.path, "w", encoding="utf-8") as f:
                    f.write(text[:keep])
                self.assert_load_refused()

    def test_load_refuses_another_format(self):
        self.rewrite_record(lambda record: record.update(format="kv-lab-checkpoint-0"))
        self.assert_load_refused(checkpoint.FORMAT)
        self.rewrite_record(lambda record: record.pop("format"))
        self.assert_load_refused(checkpoint.FORMAT)
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump([self.params], f)
        self.assert_load_refused(checkpoint.FORMAT)

    def test_load_refuses_a_different_config_naming_the_differing_keys(self):
        self.save_good_checkpoint()
        other = dict(CONFIG, seed=4, learning_rate=0.02, layers=2)
        message = self.assert_load_refused("seed", "learning_rate", "layers", config=other)
        for same in ["width", "hidden", "epochs"]:
            self.assertNotIn(same, message)
        fewer = {key: value for key, value in CONFIG.items() if key != "epochs"}
        message = self.assert_load_refused("epochs", config=fewer)
        self.assertNotIn("seed", message)

    def test_load_refuses_a_different_signature(self):
        self.save_good_checkpoint()
        self.assert_load_refused("signature", signature="fedcba9876543210")

    def test_load_refuses_a_missing_parameter(self):
        self.rewrite_record(lambda record: record["params"].pop("Wq"))
        self.assert_load_refused("Wq")

    def test_load_refuses_an_extra_parameter(self):
        self.rewrite_record(lambda record: record["params"].update(W_extra=[[0.5] * 16] * 16))
        self.assert_load_refused("W_extra")

    def test_load_refuses_a_wrong_shape_naming_the_parameter(self):
        wrong = {
            "Wk": lambda m: m[:-1],                    # one row fewer
            "W1": lambda m: [m[0][:-1]] + m[1:],       # one row one short
            "pos_emb": lambda m: m + [m[0]],           # one row more
            "b2": lambda v: v[:-1],                    # vector one short
            "ln1_g": lambda v: [v],                    # vector wrapped as a matrix
            "Wo": lambda m: [x for r in m for x in r],  # matrix flattened
            "b_out": lambda v: {"0": v},               # not a list
            "lnf_b": lambda v: 0.0,                    # a number, not a list
        }
        for name, change in wrong.items():
            with self.subTest(name):
                self.rewrite_record(lambda record: record["params"].update(
                    {name: change(record["params"][name])}))
                self.assert_load_refused(name)

    def test_load_refuses_a_value_that_is_not_a_finite_number(self):
        for bad in [float("nan"), float("inf"), float("-inf"), "0.5", True, False, None, [0.5]]:
            for name in ["b1", "tok_emb"]:
                with self.subTest(bad=bad, name=name):
                    def change(record):
                        vector = record["params"][name]
                        vector = vector if name == "b1" else vector[7]
                        vector[3] = bad
                    self.rewrite_record(change)
                    self.assert_load_refused(name)

    def test_load_refuses_an_integer_too_large_for_a_float(self):
        self.rewrite_record(lambda record: record["params"]["b2"].__setitem__(0, 10 ** 400))
        self.assert_load_refused("b2")

    def test_load_refuses_a_weight_so_large_that_a_row_s_sums_could_overflow(self):
        """1e308 is a finite float, but a row multiplies weights: OverflowError in fsum."""
        for bad in (1e308, -1.0000000000000001e30 * 2):
            with self.subTest(bad=bad):
                self.rewrite_record(lambda record: record["params"]["Wq"][2].__setitem__(5, bad))
                self.assert_load_refused("params: Wq holds", "larger than 1e+30")

    def test_load_refuses_a_file_that_is_not_utf8(self):
        self.save_good_checkpoint()
        with open(self.path, "rb") as f:
            data = f.read()
        with open(self.path, "wb") as f:
            f.write(b"\xff" + data)
        self.assert_load_refused()


class TestSaveRefuses(CheckpointTestCase):
    def bad_params(self):
        """(problem, params) pairs that save must refuse."""
        def with_value(name, value):
            params = model.init_params(0)
            params[name][0] = value
            return params

        missing = model.init_params(0)
        del missing["W2"]
        extra = dict(model.init_params(0), W3=[[0.0] * 16] * 16)
        short = model.init_params(0)
        short["W_out"] = short["W_out"][:-1]
        return [("missing W2", missing), ("extra W3", extra), ("W_out short", short),
                ("nan", with_value("b1", float("nan"))), ("inf", with_value("b2", float("inf"))),
                ("bool", with_value("ln2_b", True)), ("string", with_value("lnf_g", "1.0")),
                ("not a dict", list(model.init_params(0).values())), ("None", None)]

    def test_save_refuses_bad_params_before_writing_anything(self):
        for problem, params in self.bad_params():
            with self.subTest(problem):
                with self.assertRaises(ValueError):
                    checkpoint.save(self.path, params, CONFIG, SIGNATURE)
                self.assert_only_files()

    def test_save_refusing_bad_params_leaves_the_previous_checkpoint_unchanged(self):
        self.save_good_checkpoint()
        with open(self.path, "rb") as f:
            before = f.read()
        for problem, params in self.bad_params():
            with self.subTest(problem):
                with self.assertRaises(ValueError):
                    checkpoint.save(self.path, params, CONFIG, SIGNATURE)
                with open(self.path, "rb") as f:
                    self.assertEqual(f.read(), before)
                self.assert_only_files("best.json")

    def test_save_refuses_an_integer_too_large_for_a_float(self):
        self.params["b1"][0] = 10 ** 400
        with self.assertRaises(ValueError):
            checkpoint.save(self.path, self.params, CONFIG, SIGNATURE)
        self.assert_only_files()


if __name__ == "__main__":
    unittest.main()
