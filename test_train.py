"""Tests of train.py: the split of corpus.txt, Adam lowering the loss, reproducibility by
seed, the unigram baseline, a whole (tiny) training run, the scoring of stories against
the corpus's rules (pronouns that agree with the name, corpus words), and interruptions."""
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout
from unittest import mock

import checkpoint
import model
import train
from bpe import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))

# Hand-made token sequences: a tiny "corpus" of two repeated patterns.
SEQUENCES = [[4, 1, 30, 1, 4, 3, 0], [5, 1, 31, 1, 5, 3, 0], [4, 1, 30, 1, 5, 3, 0]]

TINY_STORIES = [
    "mia found a shell. she took it home.\n",
    "the dog lost a ball. he found it.\n",
    "ana played with a kite. it was fun.\n",
    "tom made a cake. he said thank you.\n",
    "mia went home. she played with the dog.\n",
    "the cat found a box. it played in it.\n",
    "ana lost her hat. she found it.\n",
    "tom took a ball home. he had fun.\n",
]
TINY_CONFIG = {"test_stories": 2, "val_stories": 2, "epochs": 2, "batch_size": 2}


def read(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


def params_difference(first, second):
    """None if the two parameter dicts are equal (==), else where they first differ
    (unittest's own diff of long float lists is slow to compute)."""
    if set(first) != set(second):
        return f"names differ: {sorted(set(first) ^ set(second))}"
    for name in model.SHAPES:
        rows_a = first[name] if isinstance(first[name][0], list) else [first[name]]
        rows_b = second[name] if isinstance(second[name][0], list) else [second[name]]
        for i, (a, b) in enumerate(zip(rows_a, rows_b)):
            if a != b:
                return f"{name} row {i} differs"
        if len(rows_a) != len(rows_b):
            return f"{name} has {len(rows_a)} rows, the other {len(rows_b)}"
    return None


def adam_steps(params, sequences, steps, lr=0.01):
    """Run full-batch Adam steps on the sequences, updating params in place."""
    adam = train.Adam(params)
    for _ in range(steps):
        grads = [model.loss_and_grads(params, ids[:-1], ids[1:])[1] for ids in sequences]
        adam.update(params, train.average_grads(grads), lr)


class OptimiserTest(unittest.TestCase):

    def test_a_few_adam_steps_lower_the_loss(self):
        params = model.init_params(0)
        before = train.mean_loss(params, SEQUENCES)
        adam_steps(params, SEQUENCES, 5)
        after = train.mean_loss(params, SEQUENCES)
        self.assertLess(after, 0.9 * before)

    def test_the_same_seed_gives_the_same_weights(self):
        first, second = model.init_params(1), model.init_params(1)
        self.assertIsNone(params_difference(first, second))
        adam_steps(first, SEQUENCES, 3)
        adam_steps(second, SEQUENCES, 3)
        self.assertIsNone(params_difference(first, second))
        self.assertIsNotNone(params_difference(first, model.init_params(1)))

    def test_a_different_seed_gives_different_weights(self):
        first, second = model.init_params(1), model.init_params(2)
        adam_steps(first, SEQUENCES, 3)
        adam_steps(second, SEQUENCES, 3)
        for name in model.MATRICES + ("tok_emb", "pos_emb"):
            self.assertTrue(first[name] != second[name], name)

    def test_average_grads_is_the_element_wise_mean(self):
        _, g1 = model.loss_and_grads(model.init_params(3), [4, 1, 30], [1, 30, 3])
        _, g2 = model.loss_and_grads(model.init_params(4), [5, 1], [1, 31])
        _, g3 = model.loss_and_grads(model.init_params(5), [31, 1, 4, 3], [1, 4, 3, 0])
        self.assertIsNone(params_difference(train.average_grads([g1, g1]), g1))
        mean = train.average_grads([g1, g2, g3])
        self.assertEqual(set(mean), set(model.SHAPES))
        self.assertEqual(mean["b_out"], [math.fsum(cells) / 3 for cells in
                                         zip(g1["b_out"], g2["b_out"], g3["b_out"])])
        self.assertEqual(mean["W1"][3], [math.fsum(cells) / 3 for cells in
                                         zip(g1["W1"][3], g2["W1"][3], g3["W1"][3])])


class UnigramEntropyTest(unittest.TestCase):

    def test_uniform_over_4_tokens_is_log_4(self):
        self.assertEqual(train.unigram_entropy([[0, 1, 2, 3]]), math.log(4))
        self.assertEqual(train.unigram_entropy([[3, 2], [1, 0], [0, 1, 2, 3]]), math.log(4))

    def test_one_token_only_has_zero_entropy(self):
        self.assertEqual(train.unigram_entropy([[7, 7, 7]]), 0.0)

    def test_uneven_counts_have_less_entropy_than_uniform(self):
        self.assertLess(train.unigram_entropy([[0, 0, 0, 1, 2, 3]]), math.log(4))


class TrainingRunTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tok = Tokenizer.load(os.path.join(HERE, "tokenizer.json"))
        cls.text = "".join(TINY_STORIES)
        with tempfile.TemporaryDirectory() as folder:   # the run with seed 0, for both tests
            cls.seed_0 = cls.run_training(folder, "best.json", 0)
            cls.written = os.listdir(folder)

    @classmethod
    def run_training(cls, folder, name, seed):
        """train.train on the tiny corpus with a small CONFIG; the saved params and log."""
        path = os.path.join(folder, name)
        lines = []
        with mock.patch.dict(train.CONFIG, dict(TINY_CONFIG, seed=seed)):
            best, baseline = train.train(cls.tok, cls.text, out_path=path, log=lines.append)
            record = checkpoint.load(path, train.CONFIG,
                                     checkpoint.input_signature(cls.tok, cls.text))
        return record, best, baseline, lines

    def test_training_writes_the_best_checkpoint_and_reports_progress(self):
        record, best, baseline, lines = self.seed_0
        self.assertEqual(self.written, ["best.json"])
        self.assertEqual(record["meta"]["val_loss"], best)
        self.assertEqual(record["meta"]["unigram_baseline"], baseline)
        self.assertIn(record["meta"]["epoch"], (1, 2))
        self.assertTrue(math.isfinite(best) and best > 0)
        self.assertTrue(any(line.startswith("epoch  1/2") for line in lines), lines)
        self.assertTrue(any(line.startswith("epoch  2/2") for line in lines), lines)
        self.assertTrue(all("left" in line for line in lines if line.startswith("epoch")))

    def test_training_is_reproducible_by_seed(self):
        first, best1, _, _ = self.seed_0
        with tempfile.TemporaryDirectory() as folder:
            second, best2, _, _ = self.run_training(folder, "b.json", 0)
            other, _, _, _ = self.run_training(folder, "c.json", 1)
        self.assertIsNone(params_difference(first["params"], second["params"]))
        self.assertEqual(best1, best2)
        self.assertIsNotNone(params_difference(first["params"], other["params"]))


class InterruptedTraining(unittest.TestCase):

    def test_an_interrupted_training_leaves_the_checkpoint_byte_identical(self):
        tok = Tokenizer.load(os.path.join(HERE, "tokenizer.json"))
        calls = {"n": 0}
        real = model.loss_and_grads

        def interrupted_in_epoch_2(params, ids, targets):
            calls["n"] += 1
            if calls["n"] == 5:   # epoch 1 is two batches of two stories: four calls
                raise KeyboardInterrupt
            return real(params, ids, targets)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "best.json")
            with open(path, "wb") as f:
                f.write(b"the shipped model\n")
            with mock.patch.dict(train.CONFIG, TINY_CONFIG), \
                    mock.patch.object(model, "loss_and_grads", interrupted_in_epoch_2), \
                    self.assertRaises(KeyboardInterrupt) as caught:
                train.train(tok, "".join(TINY_STORIES), path, log=lambda line: None)
            with open(path, "rb") as f:
                self.assertEqual(f.read(), b"the shipped model\n")
            self.assertEqual(os.listdir(folder), ["best.json"])
        self.assertEqual(calls["n"], 5)
        self.assertIn(f"during epoch 2/2: {path} is unchanged; this run's best (epoch 1, ",
                      str(caught.exception))

    def test_an_interrupted_training_into_a_new_file_writes_nothing(self):
        tok = Tokenizer.load(os.path.join(HERE, "tokenizer.json"))
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "quick.json")
            with mock.patch.dict(train.CONFIG, TINY_CONFIG), \
                    mock.patch.object(model, "loss_and_grads", side_effect=KeyboardInterrupt), \
                    self.assertRaises(KeyboardInterrupt) as caught:
                train.train(tok, "".join(TINY_STORIES), path, log=lambda line: None)
            self.assertEqual(os.listdir(folder), [])
        self.assertEqual(str(caught.exception), f"during epoch 1/2: nothing written to {path}")

    @unittest.skipIf(os.name == "nt", "Ctrl-C is a console event on Windows, not a signal")
    def test_ctrl_c_from_another_folder_stops_in_one_line_and_keeps_best_json(self):
        with open(os.path.join(HERE, "best.json"), "rb") as f:
            shipped = f.read()
        with tempfile.TemporaryDirectory() as folder:
            # A shell may start a background job with Ctrl-C ignored; the learner's is not.
            running = subprocess.Popen([sys.executable, "-u", os.path.join(HERE, "train.py")],
                                       cwd=folder, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True,
                                       preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                        signal.SIG_DFL))
            first_line = running.stdout.readline()   # the lab's data were found from here
            running.send_signal(signal.SIGINT)
            _, stderr = running.communicate(timeout=60)
            self.assertEqual(os.listdir(folder), [])
        self.assertIn("training and 100 validation stories", first_line)
        self.assertEqual(running.returncode, 130)
        self.assertEqual(stderr.splitlines(), [
            f"train.py: interrupted during epoch 1/{train.CONFIG['epochs']}: "
            f"{os.path.join(HERE, 'best.json')} is unchanged"])
        with open(os.path.join(HERE, "best.json"), "rb") as f:
            self.assertEqual(f.read(), shipped)


class CommandLineTest(unittest.TestCase):

    def test_a_short_run_with_epochs_and_out(self):
        with tempfile.TemporaryDirectory() as folder:
            shutil.copy(os.path.join(HERE, "tokenizer.json"), folder)
            with open(os.path.join(folder, "corpus.txt"), "w", encoding="utf-8") as f:
                f.write("".join(TINY_STORIES))
            out = os.path.join(folder, "quick.json")
            printed = io.StringIO()
            with mock.patch.dict(train.CONFIG, TINY_CONFIG), redirect_stdout(printed):
                train.main(["--folder", folder, "--epochs", "1", "--out", out])
            with open(out, encoding="utf-8") as f:
                saved = json.load(f)
            self.assertEqual(sorted(os.listdir(folder)), ["corpus.txt", "quick.json", "tokenizer.json"])
        self.assertEqual(saved["config"]["epochs"], 1)
        self.assertEqual(saved["meta"]["epoch"], 1)
        self.assertIn("epoch  1/1", printed.getvalue())
        self.assertIn(f"wrote {out}", printed.getvalue())

    def test_a_short_run_needs_a_file_of_its_own(self):
        done = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--epochs", "2"],
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 2)
        self.assertIn("--epochs 2 needs --out", done.stderr)
        self.assertNotIn("Traceback", done.stderr)

    def test_epochs_must_be_a_positive_int(self):
        """As main() parses them (argparse's exit 2, before anything runs); the command's
        own process gives the same exit (test_a_short_run_needs_a_file_of_its_own)."""
        for bad in (["0"], ["-1"], ["2.5"], ["two"], []):
            err = io.StringIO()
            with self.subTest(epochs=bad), redirect_stderr(err), \
                    self.assertRaises(SystemExit) as ended:
                train.main(["--epochs", *bad])
            self.assertEqual(ended.exception.code, 2)
            self.assertIn("--epochs: invalid positive_int value" if bad else
                          "--epochs: expected one argument", err.getvalue())

    def test_without_the_data_files_it_says_so_in_one_line(self):
        with tempfile.TemporaryDirectory() as folder:
            done = subprocess.run([sys.executable, os.path.join(HERE, "train.py"),
                                   "--folder", folder], cwd=folder,
                                  capture_output=True, text=True, timeout=60)
            self.assertEqual(os.listdir(folder), [])   # nothing written
        self.assertEqual(done.returncode, 1)
        self.assertNotIn("Traceback", done.stderr)
        self.assertEqual(len(done.stderr.strip().splitlines()), 1, done.stderr)
        self.assertIn("train.py: error:", done.stderr)
        self.assertIn("tokenizer.json", done.stderr)


if __name__ == "__main__":
    unittest.main()
