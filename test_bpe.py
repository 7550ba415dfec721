"""Tests of the byte-pair tokenizer (bpe.py) and its command line."""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

from bpe import Tokenizer
from model import VOCAB_SIZE

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS_PATH = os.path.join(HERE, "corpus.txt")
TOKENIZER_PATH = os.path.join(HERE, "tokenizer.json")
SEPARATORS = " .,\n"

# Worked out by hand. Letter runs longer than one character: "the" x2, "cat", "hat",
# "bat" ("a" alone has no pair). Alphabet: "\n", " ", ",", ".", a b c e h t (10).
#  1. counts: a-t 3, t-h 2, h-e 2, c-a 1, h-a 1, b-a 1          -> a + t = "at"
#  2. counts: t-h 2, h-e 2, c-at 1, h-at 1, b-at 1; tie at 2, and ("h", "e") sorts
#     before ("t", "h"), though t-h is seen first                 -> h + e = "he"
#  3. counts: t-he 2, others 1                                    -> t + he = "the"
#  4-6. c-at, h-at, b-at tie at 1, taken alphabetically           -> "bat", "cat", "hat"
# After that every word is one token, so 16 is the largest possible vocabulary.
TINY_TEXT = "the cat. the hat, a bat\n"
TINY_ALPHABET = ["\n", " ", ",", ".", "a", "b", "c", "e", "h", "t"]
TINY_MERGES = [("a", "t"), ("h", "e"), ("t", "he"), ("b", "at"), ("c", "at"), ("h", "at")]


def run_bpe(args, folder=None):
    """Run bpe.py as a learner would, from the folder, on the lab files in it (--folder);
    without a folder, from a new empty one, on the lab's own files."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryDirectory() as elsewhere:
        flags = ["--folder", folder] if folder else []
        return subprocess.run([sys.executable, os.path.join(HERE, "bpe.py"), *args, *flags],
                              cwd=folder or elsewhere, capture_output=True, text=True,
                              timeout=60, env=env)


def setUpModule():
    global CORPUS, TOK, TOKENIZER_TEXT
    with open(CORPUS_PATH, encoding="utf-8") as f:
        CORPUS = f.read()
    with open(TOKENIZER_PATH, encoding="utf-8") as f:
        TOKENIZER_TEXT = f.read()
    TOK = Tokenizer.load(TOKENIZER_PATH)


class TestEncodeDecode(unittest.TestCase):
    def test_every_story_round_trips(self):
        stories = CORPUS.splitlines(keepends=True)
        self.assertGreater(len(stories), 0)
        for number, story in enumerate(stories):
            self.assertEqual(TOK.decode(TOK.encode(story)), story, f"story {number}")
        self.assertEqual(TOK.decode(TOK.encode(CORPUS)), CORPUS)

    def test_random_strings_over_the_alphabet_round_trip(self):
        alphabet = sorted(set(CORPUS))
        rng = random.Random(0)
        for _ in range(300):
            text = "".join(rng.choices(alphabet, k=rng.randrange(0, 40)))
            self.assertEqual(TOK.decode(TOK.encode(text)), text)

    def test_no_vocab_token_mixes_letters_and_non_letters(self):
        for token in TOK.vocab:
            self.assertTrue(token.isalpha() or len(token) == 1, repr(token))

    def test_encoding_never_spans_a_space_period_comma_or_newline(self):
        for story in CORPUS.splitlines(keepends=True):
            tokens = [TOK.vocab[i] for i in TOK.encode(story)]
            for token in tokens:
                if len(token) > 1:
                    self.assertTrue(token.isalpha(), f"{token!r} in {story!r}")
            for separator in SEPARATORS:
                self.assertEqual(tokens.count(separator), story.count(separator), story)

    def test_shipped_vocabulary_has_96_tokens_with_newline_and_mia(self):
        self.assertEqual(len(TOK.vocab), 96)
        self.assertEqual(len(TOK.vocab), VOCAB_SIZE)
        self.assertEqual(TOK.vocab[TOK.ids["\n"]], "\n")
        self.assertEqual(TOK.vocab[TOK.ids["mia"]], "mia")
        self.assertEqual(TOK.encode("mia"), [TOK.ids["mia"]])
        self.assertEqual(TOK.ids, {token: i for i, token in enumerate(TOK.vocab)})


class TestTraining(unittest.TestCase):
    def test_tiny_example_gives_the_merges_worked_out_on_paper(self):
        tok = Tokenizer.train(TINY_TEXT, 16)
        self.assertEqual(tok.merges, TINY_MERGES)
        self.assertEqual(tok.vocab, TINY_ALPHABET + ["at", "he", "the", "bat", "cat", "hat"])

    def test_tiny_example_encodes_by_merge_rank(self):
        tok = Tokenizer.train(TINY_TEXT, 16)
        pieces = lambda text: [tok.vocab[i] for i in tok.encode(text)]
        self.assertEqual(pieces("the cat."), ["the", " ", "cat", "."])
        # Words training never saw: a-t (rank 0) goes first, then whatever it enables.
        self.assertEqual(pieces("that"), ["t", "hat"])
        self.assertEqual(pieces("heat"), ["he", "at"])

    def test_vocab_size_of_the_alphabet_gives_no_merges(self):
        tok = Tokenizer.train(TINY_TEXT, len(TINY_ALPHABET))
        self.assertEqual(tok.vocab, TINY_ALPHABET)
        self.assertEqual(tok.merges, [])

    def test_retraining_on_the_corpus_reproduces_tokenizer_json_byte_for_byte(self):
        with open(TOKENIZER_PATH, "rb") as f:
            shipped = f.read()
        self.assertEqual(Tokenizer.train(CORPUS, 96).to_json().encode("utf-8"), shipped)

    def test_vocab_size_smaller_than_the_alphabet_is_refused(self):
        for text, size in [(TINY_TEXT, len(TINY_ALPHABET) - 1), (CORPUS, 10)]:
            with self.subTest(size=size), self.assertRaises(ValueError) as caught:
                Tokenizer.train(text, size)
            self.assertIn(str(size), str(caught.exception))

    def test_impossibly_large_vocab_size_is_refused(self):
        for text, size in [(TINY_TEXT, 17), (CORPUS, 100000)]:
            with self.subTest(size=size), self.assertRaises(ValueError) as caught:
                Tokenizer.train(text, size)
            self.assertIn(str(size), str(caught.exception))

    def test_vocab_size_that_is_not_an_int_or_empty_text_is_refused(self):
        for text, size in [(TINY_TEXT, 16.0), (TINY_TEXT, True), (TINY_TEXT, "16"), ("", 16)]:
            with self.subTest(text=text, size=size), self.assertRaises(ValueError):
                Tokenizer.train(text, size)


class TestSaveLoad(unittest.TestCase):
    def test_save_and_load_round_trip(self):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "tokenizer.json")
            TOK.save(path)
            loaded = Tokenizer.load(path)
            with open(path, encoding="utf-8") as f:
                self.assertEqual(f.read(), TOKENIZER_TEXT)
            self.assertEqual(os.listdir(folder), ["tokenizer.json"])
        self.assertEqual(loaded.vocab, TOK.vocab)
        self.assertEqual(loaded.merges, TOK.merges)
        self.assertEqual(loaded.ids, TOK.ids)
        self.assertEqual(loaded.encode(CORPUS), TOK.encode(CORPUS))

    def test_a_failed_save_keeps_the_previous_file_and_leaves_no_temporary_file(self):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "tokenizer.json")
            with open(path, "w", encoding="utf-8") as f:
                f.write("the previous tokenizer\n")
            for target in ("lab_files.os.replace", "lab_files.os.fsync"):
                with self.subTest(failing=target):
                    with mock.patch(target, side_effect=OSError("disk full")):
                        with self.assertRaises(OSError):
                            TOK.save(path)
                    with open(path, encoding="utf-8") as f:
                        self.assertEqual(f.read(), "the previous tokenizer\n")
                    self.assertEqual(os.listdir(folder), ["tokenizer.json"])

    def test_loading_a_missing_file_raises_file_not_found(self):
        with tempfile.TemporaryDirectory() as folder:
            with self.assertRaises(FileNotFoundError):
                Tokenizer.load(os.path.join(folder, "tokenizer.json"))

    def test_loading_a_malformed_or_inconsistent_file_is_refused_naming_the_path(self):
        data = json.loads(TOKENIZER_TEXT)
        vocab, merges = data["vocab"], data["merges"]
        base = len(vocab) - len(merges)

        def changed(**fields):
            return json.dumps(dict(data, **fields))

        swapped = vocab[:-2] + [vocab[-1], vocab[-2]]
        cases = {
            "not JSON": "this is not json",
            "truncated": TOKENIZER_TEXT[:len(TOKENIZER_TEXT) // 2],
            "empty": "",
            "not an object": json.dumps([vocab, merges]),
            "another format": changed(format="kv-lab-bpe-0"),
            "no format": json.dumps({"vocab": vocab, "merges": merges}),
            "no vocab": json.dumps({"format": data["format"], "merges": merges}),
            "merge result is not the next token": changed(vocab=swapped),
            "merge across a non-letter": changed(vocab=vocab + [" a"], merges=merges + [[" ", "a"]]),
            "duplicated token": changed(vocab=vocab + [vocab[base]],
                                        merges=merges + [merges[0]]),
            "merge of a token not made yet": changed(vocab=vocab + ["mmmia"],
                                                     merges=merges + [["mm", "mia"]]),
            "a merge that is not a pair": changed(merges=merges[:-1] + [["a", "b", "c"]]),
            "a long token among the characters": changed(vocab=["ab"] + vocab[1:]),
        }
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "tokenizer.json")
            for problem, text in cases.items():
                with self.subTest(problem):
                    with open(path, "w", encoding="utf-8") as f:
                        f.write(text)
                    with self.assertRaises(ValueError) as caught:
                        Tokenizer.load(path)
                    self.assertIn(path, str(caught.exception))

    def test_loading_a_file_that_is_not_utf8_is_refused_naming_the_path(self):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "tokenizer.json")
            with open(path, "wb") as f:
                f.write(b"\xff\xfe" + TOKENIZER_TEXT.encode("utf-8"))
            with self.assertRaises(ValueError) as caught:
                Tokenizer.load(path)
            self.assertIn(path, str(caught.exception))


class TestBadInput(unittest.TestCase):
    def test_unknown_character_is_refused_naming_it_and_its_index(self):
        for text, character, index in [("mia had a cat!", "!", 13), ("Mia", "M", 0),
                                        ("a b? c?", "?", 3)]:
            with self.subTest(text=text), self.assertRaises(ValueError) as caught:
                TOK.encode(text)
            message = str(caught.exception)
            self.assertIn(repr(character), message)
            self.assertIn(f"index {index}", message)
            self.assertEqual("use lowercase: 'm'" in message, character == "M")

    def test_decode_refuses_ids_outside_the_vocabulary(self):
        good = TOK.ids["mia"]
        for bad in [-1, -96, 96, 10**6, True, False, 1.0, "1", None]:
            with self.subTest(bad=bad), self.assertRaises(ValueError) as caught:
                TOK.decode([good, bad])
            self.assertIn(repr(bad), str(caught.exception))

    def test_decode_of_a_generator_gives_the_same_text(self):
        ids = TOK.encode("mia was tired.")
        self.assertEqual(TOK.decode(i for i in ids), "mia was tired.")


class TestCommandLine(unittest.TestCase):
    def assert_one_line_error(self, result):
        self.assertNotEqual(result.returncode, 0)
        self.assertNotIn("Traceback", result.stderr)
        self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)

    def test_check_passes_on_the_repo_from_another_folder(self):
        result = run_bpe(["--check"])
        self.assertEqual(result.returncode, 0, result.stderr)

    def test_check_fails_with_one_line_when_tokenizer_json_differs(self):
        data = json.loads(TOKENIZER_TEXT)
        smaller = json.dumps({"format": data["format"], "vocab": data["vocab"][:-1],
                              "merges": data["merges"][:-1]}, indent=1) + "\n"
        cases = {"one merge fewer": smaller, "one extra newline": TOKENIZER_TEXT + "\n",
                 "missing": None}
        for problem, text in cases.items():
            with self.subTest(problem), tempfile.TemporaryDirectory() as folder:
                shutil.copy(CORPUS_PATH, folder)
                path = os.path.join(folder, "tokenizer.json")
                if text is not None:
                    with open(path, "w", encoding="utf-8", newline="\n") as f:
                        f.write(text)
                result = run_bpe(["--check"], folder)
                self.assert_one_line_error(result)
                if text is None:
                    self.assertFalse(os.path.exists(path))
                else:
                    with open(path, encoding="utf-8", newline="") as f:
                        self.assertEqual(f.read(), text, "--check must not rewrite the file")

    def test_unknown_flag_is_a_usage_error(self):
        with tempfile.TemporaryDirectory() as folder:
            shutil.copy(CORPUS_PATH, folder)
            result = run_bpe(["--chekc"], folder)
            self.assertEqual(result.returncode, 2)
            self.assertNotIn("Traceback", result.stderr)
            self.assertIn("usage", result.stderr)
            self.assertEqual(os.listdir(folder), ["corpus.txt"])


if __name__ == "__main__":
    unittest.main()
