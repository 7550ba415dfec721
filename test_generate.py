"""Tests of generate.py: next-token probabilities (greedy, temperature, top-k), sampling
by seed, the three stop reasons, how generate calls the model, every refusal, and the
command line."""
import math
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import generate
import model
from bpe import Tokenizer
from instruments import recording

HERE = os.path.dirname(os.path.abspath(__file__))
LOGITS = [0.5, -1.0, 2.0, 3.5, 0.0, 3.4, -2.0, 1.0]


class NextTokenProbsTest(unittest.TestCase):

    def test_greedy_takes_the_first_highest_score(self):
        probs = generate.next_token_probs([1.0, 3.0, -2.0, 3.0, 2.0], 0, None)
        self.assertEqual(probs, [0.0, 1.0, 0.0, 0.0, 0.0])
        probs = generate.next_token_probs([5.0, 5.0, 5.0], 0.0, None)
        self.assertEqual(probs, [1.0, 0.0, 0.0])

    def test_greedy_ignores_top_k(self):
        self.assertEqual(generate.next_token_probs(LOGITS, 0.0, 3),
                         generate.next_token_probs(LOGITS, 0.0, None))

    def test_temperature_1_is_the_softmax_of_the_logits(self):
        self.assertEqual(generate.next_token_probs(LOGITS, 1.0, None),
                         model.softmax_row(LOGITS))

    def test_temperature_divides_the_logits(self):
        self.assertEqual(generate.next_token_probs(LOGITS, 0.5, None),
                         model.softmax_row([s / 0.5 for s in LOGITS]))

    def test_lower_temperature_sharpens(self):
        top = LOGITS.index(max(LOGITS))
        peaks = [generate.next_token_probs(LOGITS, t, None)[top] for t in (2.0, 1.0, 0.5, 0.1)]
        self.assertEqual(peaks, sorted(peaks))
        self.assertEqual(len(set(peaks)), len(peaks), peaks)
        for t in (2.0, 1.0, 0.5):
            probs = generate.next_token_probs(LOGITS, t, None)
            order = sorted(range(len(LOGITS)), key=lambda i: -LOGITS[i])
            self.assertEqual(sorted(range(len(probs)), key=lambda i: -probs[i]), order)

    def test_top_k_keeps_exactly_the_k_highest(self):
        order = sorted(range(len(LOGITS)), key=lambda i: -LOGITS[i])
        for k in range(1, len(LOGITS) + 1):
            with self.subTest(top_k=k):
                probs = generate.next_token_probs(LOGITS, 1.0, k)
                kept = {i for i, p in enumerate(probs) if p != 0.0}
                self.assertEqual(kept, set(order[:k]))
                self.assertLess(abs(math.fsum(probs) - 1.0), 1e-12)
                expected = model.softmax_row([LOGITS[i] for i in sorted(kept)])
                self.assertEqual([probs[i] for i in sorted(kept)], expected)

    def test_top_k_of_the_whole_vocabulary_is_plain_softmax(self):
        self.assertEqual(generate.next_token_probs(LOGITS, 0.7, len(LOGITS)),
                         generate.next_token_probs(LOGITS, 0.7, None))

    def test_next_token_probs_refuses_bad_settings(self):
        # Public, and shared with kv_cache.generate_cached: it refuses bad settings too.
        for temperature in (-0.1, math.nan, math.inf):
            with self.subTest(temperature=temperature), self.assertRaises(ValueError):
                generate.next_token_probs(LOGITS, temperature, None)
        for top_k in (0, True, len(LOGITS) + 1):
            with self.subTest(top_k=top_k), self.assertRaises(ValueError):
                generate.next_token_probs(LOGITS, 1.0, top_k)


class GenerateTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tok = Tokenizer.load(os.path.join(HERE, "tokenizer.json"))
        cls.newline = cls.tok.ids["\n"]

    def params(self, seed=0, newline_bias=None):
        """Small random parameters; newline_bias, if given, becomes b_out's newline entry."""
        params = model.init_params(seed)
        if newline_bias is not None:
            params["b_out"][self.newline] = newline_bias
        return params

    def long_prompt(self, tokens):
        """A prompt of exactly `tokens` tokens: "a a a ..." (each letter and space a token)."""
        prompt = "a" + " a" * ((tokens - 1) // 2) + (" " if tokens % 2 == 0 else "")
        self.assertEqual(len(self.tok.encode(prompt)), tokens)
        return prompt

    def test_result_has_exactly_text_steps_and_stopped(self):
        result = generate.generate(self.params(), self.tok, "mia found a shell.",
                                   max_new_tokens=4, temperature=1.0, seed=3)
        self.assertEqual(set(result), {"text", "steps", "stopped"})
        self.assertIsInstance(result["text"], str)
        self.assertIn(result["stopped"], ("end of story", "max_new_tokens"))
        for step in result["steps"]:
            self.assertEqual(set(step), {"token", "probability"})
            self.assertIn(step["token"], self.tok.vocab)
            self.assertEqual(round(step["probability"], 4), step["probability"])
        self.assertEqual(result["text"],
                         "mia found a shell." + "".join(s["token"] for s in result["steps"]))

    def test_generate_calls_model_forward_once_per_token_on_all_tokens_so_far(self):
        prompt = "mia found a shell."
        prompt_len = len(self.tok.encode(prompt))
        params = self.params(1, newline_bias=-100.0)
        with recording(model, "forward") as calls:
            result = generate.generate(params, self.tok, prompt, max_new_tokens=6,
                                       temperature=1.0, top_k=5, seed=2)
        self.assertEqual(len(result["steps"]), 6)
        self.assertEqual(len(calls), len(result["steps"]))
        rows = [len(call.result[0]) for call in calls]   # one row of logits per token given
        for k, call in enumerate(calls, start=1):
            self.assertEqual(rows[k - 1], prompt_len + k - 1)
            self.assertEqual(len(call.args), 2)          # (params, ids), no keyword argument
            self.assertIs(call.args[0], params)
        ids = self.tok.encode(result["text"])
        for k, (call, step) in enumerate(zip(calls, result["steps"])):
            # generate passes its list of IDs, which grows after the call: its first rows
            self.assertEqual(call.args[1][:rows[k]], ids[:prompt_len + k])
            probs = generate.next_token_probs(call.result[0][-1], 1.0, 5)
            chosen = ids[prompt_len + k]
            self.assertEqual(step["probability"], round(probs[chosen], 4))
            self.assertGreater(probs[chosen], 0.0)

    def test_greedy_generation_takes_the_highest_scoring_token(self):
        params = self.params(4)
        result = generate.generate(params, self.tok, "mia found a shell.", max_new_tokens=3)
        ids = self.tok.encode("mia found a shell.")
        for step in result["steps"]:
            logits, _ = model.forward(params, ids)
            best = logits[-1].index(max(logits[-1]))
            self.assertEqual(step, {"token": self.tok.vocab[best], "probability": 1.0})
            ids.append(best)

    def test_sampling_is_reproducible_by_seed(self):
        params = self.params(5, newline_bias=-100.0)
        run = lambda seed: generate.generate(params, self.tok, "mia went home.",
                                             max_new_tokens=6, temperature=1.0, seed=seed)
        first = run(7)
        self.assertEqual(run(7), first)
        others = [run(seed) for seed in (8, 9, 10, 11)]
        self.assertTrue(any(other != first for other in others))

    def test_end_of_story_keeps_the_newline(self):
        params = self.params(6, newline_bias=100.0)
        prompt = "mia found a shell."
        for temperature in (0.0, 1.0):
            with self.subTest(temperature=temperature):
                result = generate.generate(params, self.tok, prompt, temperature=temperature)
                self.assertEqual(result["stopped"], "end of story")
                self.assertEqual(result["steps"], [{"token": "\n", "probability": 1.0}])
                self.assertEqual(result["text"], prompt + "\n")

    def test_end_of_story_stops_as_soon_as_the_newline_is_chosen(self):
        # The real model never picks the newline; a stand-in forward makes the newline
        # the top score once the input has prompt_len + 3 rows, so the 4th step ends.
        params = self.params(7, newline_bias=-100.0)
        prompt = "mia found a shell."
        prompt_len = len(self.tok.encode(prompt))
        real, calls = model.forward, []

        def forward(given_params, ids):
            calls.append(len(ids))
            logits, saved = real(given_params, ids)
            if len(ids) >= prompt_len + 3:
                logits[-1][self.newline] = 100.0
            return logits, saved

        with mock.patch.object(generate.model, "forward", forward):
            result = generate.generate(params, self.tok, prompt, max_new_tokens=20)
        self.assertEqual(result["stopped"], "end of story")
        self.assertEqual(calls, [prompt_len, prompt_len + 1, prompt_len + 2, prompt_len + 3])
        self.assertEqual([s["token"] == "\n" for s in result["steps"]],
                         [False, False, False, True])
        self.assertEqual(result["steps"][-1], {"token": "\n", "probability": 1.0})
        self.assertTrue(result["text"].endswith("\n"))
        self.assertEqual(result["text"].count("\n"), 1)

    def test_max_new_tokens_gives_exactly_that_many_steps(self):
        params = self.params(8, newline_bias=-100.0)
        for n in (0, 1, 5):
            with self.subTest(max_new_tokens=n):
                result = generate.generate(params, self.tok, "mia found a shell.",
                                           max_new_tokens=n)
                self.assertEqual(result["stopped"], "max_new_tokens")
                self.assertEqual(len(result["steps"]), n)
                self.assertNotIn("\n", result["text"])

    def test_context_full_stops_after_64_tokens(self):
        params = self.params(9, newline_bias=-100.0)
        for prompt_len in (60, 61, 63, 64):
            prompt = self.long_prompt(prompt_len)
            with self.subTest(prompt_tokens=prompt_len), recording(model, "forward") as calls:
                result = generate.generate(params, self.tok, prompt, max_new_tokens=60)
                self.assertEqual(result["stopped"], "context full")
                self.assertEqual(len(result["steps"]), 64 - prompt_len)
                self.assertEqual(len(self.tok.encode(result["text"])), 64)
                self.assertEqual(len(calls), 64 - prompt_len)
                self.assertEqual(max([len(c.result[0]) for c in calls], default=0),
                                 63 if prompt_len < 64 else 0)

    def test_the_first_limit_reached_decides_the_stop_reason(self):
        params = self.params(9, newline_bias=-100.0)
        result = generate.generate(params, self.tok, self.long_prompt(61), max_new_tokens=4)
        self.assertEqual(result["stopped"], "context full")
        self.assertEqual(len(result["steps"]), 3)
        result = generate.generate(params, self.tok, self.long_prompt(61), max_new_tokens=2)
        self.assertEqual(result["stopped"], "max_new_tokens")
        self.assertEqual(len(result["steps"]), 2)

    def assert_refused(self, prompt="mia found a shell.", **settings):
        """generate raises ValueError and never reaches the model."""
        with recording(model, "forward") as calls, self.assertRaises(ValueError):
            generate.generate(self.params(), self.tok, prompt, **settings)
        self.assertEqual(calls, [])

    def test_bad_temperature_is_refused(self):
        for temperature in (-0.1, math.nan, math.inf, -math.inf, "1", True, None, 10 ** 400):
            with self.subTest(temperature=model.excerpt(temperature)):
                self.assert_refused(temperature=temperature)
                with self.assertRaises(ValueError):
                    generate.check_settings(temperature, None, 96)
        generate.check_settings(0, None, 96)
        generate.check_settings(2.5, 96, 96)
        generate.check_settings(10 ** 300, 96, 96)   # an int a float can hold

    def test_a_temperature_too_small_for_the_scores_is_refused_naming_it(self):
        """Divided by 5e-324, a score of 1 is beyond a float: the softmax has nothing to
        work with (random.choices would say only "Total of weights must be finite")."""
        with self.assertRaisesRegex(ValueError, "temperature 5e-324 is too small for these "
                                                "scores"):
            generate.next_token_probs([1.0, 0.5, -2.0], 5e-324, None)
        self.assertEqual(generate.next_token_probs([1.0, 0.5, -2.0], 1e-300, None),
                         [1.0, 0.0, 0.0])   # small, but the scores divided by it are floats

    def test_a_tokenizer_that_is_not_one_is_refused(self):
        for tok in (None, "tokenizer.json"):
            with self.subTest(tok=tok), self.assertRaisesRegex(ValueError,
                                                               "tok must be a bpe.Tokenizer"):
                generate.generate(self.params(), tok, "mia")

    def test_bad_top_k_is_refused(self):
        for top_k in (0, -1, 97, True, 2.5, "3"):
            with self.subTest(top_k=top_k):
                self.assert_refused(temperature=1.0, top_k=top_k)
                self.assert_refused(temperature=0.0, top_k=top_k)
                with self.assertRaises(ValueError):
                    generate.check_settings(1.0, top_k, 96)
        generate.check_settings(1.0, 1, 96)

    def test_bad_max_new_tokens_is_refused(self):
        for max_new_tokens in (-1, 1.5, True, None, "3"):
            with self.subTest(max_new_tokens=max_new_tokens):
                self.assert_refused(max_new_tokens=max_new_tokens)

    def test_bad_seed_is_refused(self):
        for seed in (1.5, True, None, "3"):
            with self.subTest(seed=seed):
                self.assert_refused(temperature=1.0, seed=seed)

    def test_empty_prompt_is_refused(self):
        self.assert_refused(prompt="")
        self.assert_refused(prompt=None)

    def test_a_prompt_without_letters_is_refused(self):
        for prompt in (" ", "   ", ". ,", "\n"):
            with self.subTest(prompt=prompt):
                self.assert_refused(prompt=prompt)
                with self.assertRaisesRegex(ValueError, "prompt has no letters, got "):
                    generate.generate(self.params(), self.tok, prompt)
        self.assertEqual(generate.generate(self.params(), self.tok, " mia", max_new_tokens=0)
                         ["text"], " mia")

    def test_prompt_longer_than_64_tokens_is_refused(self):
        self.assert_refused(prompt=self.long_prompt(65))
        self.assert_refused(prompt=self.long_prompt(100))

    def test_unknown_characters_are_refused(self):
        for prompt in ("Mia found a shell.", "mia found a shell!", "mia\tsat."):
            with self.subTest(prompt=prompt):
                self.assert_refused(prompt=prompt)


class CommandLineTest(unittest.TestCase):

    def run_cli(self, *args, cwd=None):
        """generate.py run from another folder (a new empty one unless cwd is given)."""
        with tempfile.TemporaryDirectory() as folder:
            return subprocess.run([sys.executable, os.path.join(HERE, "generate.py"), *args],
                                  cwd=cwd or folder, capture_output=True, text=True, timeout=60)

    def assert_one_line_error(self, done, about):
        """A non-zero exit with one line on stderr, naming `about`."""
        self.assertNotEqual(done.returncode, 0)
        self.assertNotIn("Traceback", done.stderr)
        lines = done.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, done.stderr)
        self.assertTrue(lines[0].startswith("generate.py: error:"), done.stderr)
        self.assertIn(about, lines[0])

    def test_command_line_prints_the_story_and_the_stop_reason(self):
        done = self.run_cli("mia found a shell.", "--max-new-tokens", "3")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(done.stderr, "")
        lines = done.stdout.splitlines()
        self.assertTrue(lines[0].startswith("mia found a shell."), done.stdout)
        self.assertRegex(lines[-1], r"^stopped: (max_new_tokens|end of story)$")
        steps = lines[1:-1]
        self.assertTrue(1 <= len(steps) <= 3, done.stdout)
        if lines[-1] == "stopped: max_new_tokens":
            self.assertEqual(len(steps), 3, done.stdout)
        for line in steps:
            self.assertRegex(line, r"^  '.+' +[01]\.\d{4}$")

    def test_command_line_refuses_a_negative_temperature_in_one_line(self):
        done = self.run_cli("mia found a shell.", "--temperature", "-1")
        self.assert_one_line_error(done, "temperature")

    def test_command_line_refuses_top_k_0_in_one_line(self):
        self.assert_one_line_error(self.run_cli("mia found a shell.", "--top-k", "0"), "top_k")

    def test_command_line_without_the_model_files_says_so_in_one_line(self):
        with tempfile.TemporaryDirectory() as folder:
            self.assert_one_line_error(self.run_cli("mia", "--folder", folder), "tokenizer.json")
            for name in ("tokenizer.json", "corpus.txt"):
                shutil.copy(os.path.join(HERE, name), folder)
            done = self.run_cli("mia", "--folder", folder, cwd=folder)
        self.assert_one_line_error(done, "best.json is missing: restore the shipped best.json "
                                         "(git checkout -- best.json")

    def test_help_gives_the_prompt_alphabet_and_an_example(self):
        done = self.run_cli("--help")
        self.assertEqual(done.returncode, 0)
        help_text = " ".join(done.stdout.split())
        self.assertIn("in lowercase letters, spaces, commas and periods", help_text)
        self.assertIn('e.g. "zoe went to the park."', help_text)

    def test_a_capital_letter_is_refused_with_the_fix(self):
        self.assert_one_line_error(self.run_cli("Mia found a shell."),
                                   "unknown character 'M' at index 0")
        self.assertIn("use lowercase: 'm'", self.run_cli("Mia found a shell.").stderr)

    def test_command_line_unknown_flag_is_a_usage_error(self):
        done = self.run_cli("mia found a shell.", "--topk", "3")
        self.assertEqual(done.returncode, 2)
        self.assertNotIn("Traceback", done.stderr)
        self.assertIn("unrecognized arguments", done.stderr)


if __name__ == "__main__":
    unittest.main()
