"""Tests of the checkpoint format (checkpoint.py): exact floats, the data signature,
every refusal, and writes that never leave a half-written or temporary file."""
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from contextlib import redirect_stderr
from unittest import mock

import checkpoint
import model
import support
from bpe import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = {"width": 16, "hidden": 64, "seed": 3, "learning_rate": 0.01, "epochs": 2}
SIGNATURE = "0123456789abcdef"
COMMANDS = ["bpe.py", "cache_files.py", "generate.py", "kv_cache.py", "train.py", "trace_kv.py"]
AWKWARD_FLOATS = [0.1 + 0.2, 1e-300, -2.5e17, 1 / 3, -0.0, 5e-324, 1e30, 2.0 ** 99,
                  2.0 ** 0.5, -1e-5]   # 1e30: the largest weight a checkpoint takes


class CheckpointTestCase(unittest.TestCase):
    """Each test gets its own folder, a fresh set of params and a path to save them to."""

    def setUp(self):
        folder = tempfile.TemporaryDirectory()
        self.addCleanup(folder.cleanup)
        self.folder = folder.name
        self.path = os.path.join(self.folder, "best.json")
        self.params = model.init_params(0)

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

    def assert_only_files(self, *names):
        self.assertEqual(sorted(os.listdir(self.folder)), sorted(names))


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


class TestWriteAtomically(CheckpointTestCase):
    def write_old_file(self):
        with open(self.path, "w", encoding="utf-8") as f:
            f.write("the old checkpoint\n")

    def assert_old_file_intact(self):
        with open(self.path, encoding="utf-8") as f:
            self.assertEqual(f.read(), "the old checkpoint\n")
        self.assert_only_files("best.json")

    def test_write_replaces_the_file_and_leaves_no_temporary_file(self):
        self.write_old_file()
        checkpoint.write_atomically(self.path, "the new checkpoint\n")
        with open(self.path, encoding="utf-8") as f:
            self.assertEqual(f.read(), "the new checkpoint\n")
        self.assert_only_files("best.json")

    def test_failed_rename_keeps_the_previous_file_and_no_temporary_file(self):
        self.write_old_file()
        with mock.patch("checkpoint.os.replace", side_effect=OSError("disk full")) as replace:
            with self.assertRaises(OSError):
                checkpoint.write_atomically(self.path, "the new checkpoint\n")
            with self.assertRaises(OSError):
                checkpoint.save(self.path, self.params, CONFIG, SIGNATURE)
        self.assertEqual(replace.call_count, 2)
        self.assert_old_file_intact()

    def test_failed_write_keeps_the_previous_file_and_no_temporary_file(self):
        self.write_old_file()
        with self.assertRaises(UnicodeEncodeError):
            checkpoint.write_atomically(self.path, "half \ud800 written")
        self.assert_old_file_intact()
        with mock.patch("checkpoint.os.fsync", side_effect=OSError("I/O error")):
            with self.assertRaises(OSError):
                checkpoint.write_atomically(self.path, "the new checkpoint\n")
        self.assert_old_file_intact()
        with mock.patch("checkpoint.os.fsync", side_effect=KeyboardInterrupt):
            with self.assertRaises(KeyboardInterrupt):
                checkpoint.write_atomically(self.path, "the new checkpoint\n")
        self.assert_old_file_intact()

    def test_failed_first_write_leaves_no_file_at_all(self):
        with mock.patch("checkpoint.os.replace", side_effect=OSError("disk full")):
            with self.assertRaises(OSError):
                checkpoint.write_atomically(self.path, "the new checkpoint\n")
        self.assert_only_files()


    def test_a_read_only_folder_is_named_by_its_target(self):
        with mock.patch("checkpoint.os.open",
                        side_effect=PermissionError(13, "Permission denied")):
            with self.assertRaisesRegex(OSError, f"cannot write {self.path}: Permission denied"):
                checkpoint.write_atomically(self.path, "text\n")
        with mock.patch("checkpoint.os.replace",
                        side_effect=PermissionError(13, "Permission denied")):
            with self.assertRaisesRegex(OSError, f"cannot write {self.path}: Permission denied"):
                checkpoint.write_atomically(self.path, "text\n")
        self.assert_only_files()

    @unittest.skipIf(sys.platform == "win32", "Windows keeps every temporary file")
    def test_a_killed_save_s_temporary_file_is_removed_by_the_next_save_a_live_one_s_kept(self):
        """Told apart by the process in their name, not by their age (99999999 is beyond
        any process id); another target's are not this save's to remove."""
        dead = ".best.json.tmp-99999999-0a1b2c3d.part"
        live = f".best.json.tmp-{os.getpid()}-0a1b2c3d.part"   # a save in another thread
        other = ".tokenizer.json.tmp-99999999-0a1b2c3d.part"
        for name in (dead, live, other):
            path = os.path.join(self.folder, name)
            with open(path, "w", encoding="utf-8") as f:
                f.write("half")
            os.utime(path, (0, 0))   # long ago
        checkpoint.write_atomically(self.path, "the new checkpoint\n")
        self.assert_only_files("best.json", live, other)

    @unittest.skipUnless(hasattr(signal, "pthread_kill"), "Ctrl-C held back on POSIX only")
    def test_ctrl_c_as_the_temporary_file_opens_leaks_neither_it_nor_its_descriptor(self):
        real, opened = os.open, []

        def open_then_ctrl_c(path, *args):
            fd = real(path, *args)
            if path.endswith(".part"):
                opened.append(fd)
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            return fd
        handler = signal.signal(signal.SIGINT, signal.default_int_handler)
        self.addCleanup(signal.signal, signal.SIGINT, handler)
        with mock.patch("checkpoint.os.open", open_then_ctrl_c), \
                self.assertRaises(KeyboardInterrupt):
            checkpoint.write_atomically(self.path, "text\n")
        with self.assertRaises(OSError):   # closed
            os.fstat(opened[0])
        self.assert_only_files()

    def test_the_tempfile_module_and_its_lock_are_not_used(self):
        with mock.patch("tempfile.mkstemp", side_effect=AssertionError("mkstemp")), \
                mock.patch("tempfile._get_candidate_names", side_effect=AssertionError("lock")):
            checkpoint.write_atomically(self.path, "text\n")
        self.assert_only_files("best.json")


    def test_a_terminated_save_leaves_no_temporary_file(self):
        """A real SIGTERM, during a save that takes long (the text is 200 MB)."""
        if not hasattr(os, "kill") or sys.platform == "win32":
            self.skipTest("SIGTERM is a POSIX signal")
        script = ("import sys, os; sys.path.insert(0, sys.argv[1]); import checkpoint\n"
                  "def main(): print('started', flush=True); "
                  "checkpoint.write_atomically(sys.argv[2], 'x' * 200_000_000)\n"
                  "checkpoint.run_command(main)\n")
        done = subprocess.Popen([sys.executable, "-c", script, HERE, self.path],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(done.stdout.readline(), "started\n")
        done.terminate()
        done.communicate(timeout=60)
        self.assertEqual(done.returncode, 143)
        self.assert_only_files()

    def test_paths_that_cannot_name_a_file_are_refused(self):
        for path, fragment in ((None, "a file name is needed"), (3, "a file name is needed"),
                               ("", "is not a file name"), (self.folder + "/", "names a folder")):
            with self.subTest(path=path):
                with self.assertRaisesRegex(ValueError, fragment):
                    checkpoint.write_atomically(path, "text\n")
                with self.assertRaisesRegex(ValueError, fragment):
                    checkpoint.read_json(path, "f", "a file")
        with self.assertRaisesRegex(ValueError, "it is a folder"):
            checkpoint.write_atomically(self.folder, "text\n")


class WriteTogether(CheckpointTestCase):
    """A set of files, written all or none: kv-trace.json, kv-time.json, the pictures
    and the documents of one run of trace_kv.py --write."""

    OLD = {"a.json": "old a\n", "b.svg": "old b\n", "c.md": "old c\n"}
    NEW = {"a.json": "new a\n", "b.svg": "new b\n", "c.md": "new c\n"}

    def setUp(self):
        super().setUp()
        for name, text in self.OLD.items():
            with open(os.path.join(self.folder, name), "w", encoding="utf-8") as f:
                f.write(text)

    def assert_set(self, texts):
        """The folder holds texts' files, with texts' texts, and nothing else."""
        self.assert_only_files(*texts)
        for name, text in texts.items():
            with open(os.path.join(self.folder, name), encoding="utf-8") as f:
                self.assertEqual(f.read(), text, name)

    def test_an_interrupt_before_every_file_is_written_leaves_the_old_set(self):
        for calls in (1, 3, 4):   # the first file, the last, the journal
            real, done = os.fsync, []

            def fsync(fd):
                done.append(fd)
                if len(done) == calls:
                    raise KeyboardInterrupt
                real(fd)
            with self.subTest(fsync=calls), mock.patch("checkpoint.os.fsync", fsync), \
                    self.assertRaises(KeyboardInterrupt):
                checkpoint.write_together(self.folder, self.NEW)
            self.assert_set(self.OLD)
        checkpoint.write_together(self.folder, self.NEW)
        self.assert_set(self.NEW)

    def test_an_interrupt_at_a_random_call_leaves_one_whole_set_and_no_file_or_descriptor(self):
        """Ctrl-C (KeyboardInterrupt) raised at a random call that a save makes to the
        system (open, fsync, replace, unlink), before or after it (an open only before: a
        real Ctrl-C is held while a save opens a file); after finish_saving, the set is all
        old or all new, with no temporary file or descriptor left. 40 cases by default."""
        descriptors = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else None

        def trial(number):
            rng = random.Random(number)
            old = dict(self.OLD) if number % 2 else dict(self.NEW)
            new = self.NEW if number % 2 else self.OLD
            checkpoint.write_together(self.folder, old)
            before = descriptors and sorted(os.listdir(descriptors))
            at, after, calls = rng.randint(1, 14), rng.random() < 0.5, []

            def interrupting(name, real):
                def call(*args, **kwargs):
                    calls.append(real)
                    if len(calls) == at and not (after and name != "open"):
                        raise KeyboardInterrupt
                    result = real(*args, **kwargs)
                    if len(calls) == at:
                        raise KeyboardInterrupt
                    return result
                return call
            patches = [mock.patch(f"checkpoint.os.{name}", interrupting(name, getattr(os, name)))
                       for name in ("open", "fsync", "replace", "unlink")]
            for patch in patches:
                patch.start()
            try:
                checkpoint.write_together(self.folder, new)
            except KeyboardInterrupt:
                pass
            finally:
                for patch in patches:
                    patch.stop()
            checkpoint.finish_saving(self.folder)
            found = {}
            for name in os.listdir(self.folder):
                with open(os.path.join(self.folder, name), encoding="utf-8") as f:
                    found[name] = f.read()
            if found not in (old, new):
                return f"interrupted at call {at} ({'after' if after else 'before'}): {found}"
            if descriptors and sorted(os.listdir(descriptors)) != before:
                return f"interrupted at call {at}: a descriptor left open"
            return None
        support.check_random_cases(self, 40, trial)

    def test_saves_in_two_processes_at_once_leave_one_whole_set_even_if_one_is_killed(self):
        """Two processes save their own sets in one folder at once, a random number of
        times each; in odd cases one of them is killed outright at a random moment. Once both
        have ended and finish_saving has run, the folder holds one whole set (a process's
        last, or the set killed mid-way) and no journal; the next save can take the lock,
        and leaves nothing else (not even a killed save's temporary files). 4 cases by default."""
        saver = ("import os, sys, time, checkpoint\n"
                 "folder, tag, times, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), "
                 "float(sys.argv[4])\n"
                 "time.sleep(max(0.0, start - time.time()))   # both begin together\n"
                 "for i in range(times):\n"
                 "    checkpoint.write_together(folder, {n: f'{tag} {i}\\n' for n in "
                 f"{sorted(self.OLD)!r}}})\n")

        def trial(number):
            rng = random.Random(number)
            start = time.time() + 0.15   # after both processes have loaded the lab's modules
            times = str(rng.randint(10, 30))   # as many each: their last saves meet
            processes = [subprocess.Popen([sys.executable, "-c", saver, self.folder, tag,
                                           times, repr(start)],
                                          cwd=support.HERE)
                         for tag in ("first", "second")]
            if number % 2:
                time.sleep(max(0.0, start - time.time()) + rng.uniform(0.0, 0.1))
                processes[rng.randint(0, 1)].kill()
            for process in processes:
                process.wait(timeout=60)
            checkpoint.finish_saving(self.folder)
            names = sorted(name for name in os.listdir(self.folder)   # a killed save's go
                           if not (number % 2 and (name.endswith(".part")    # with the next
                                                   or name == checkpoint.LOCK)))
            if names != sorted(self.OLD):
                return f"the folder holds {names}, where only the set should be"
            texts = set()
            for name in names:
                with open(os.path.join(self.folder, name), encoding="utf-8") as f:
                    texts.add(f.read().split()[0])   # whose save: "first" or "second"
            if len(texts) != 1:
                return f"the files are of different saves: {sorted(texts)}"
            checkpoint.write_together(self.folder, self.NEW)   # the lock can be taken again,
            self.assert_set(self.NEW)                          # and nothing else is left
            return None
        support.check_random_cases(self, 4, trial)

    def test_a_save_stopped_among_its_renames_is_finished_by_the_next(self):
        real, done = os.replace, []

        def replace(source, target):
            done.append(target)
            if target.endswith("b.svg"):   # after the journal and a.json
                raise KeyboardInterrupt
            real(source, target)
        with mock.patch("checkpoint.os.replace", replace), self.assertRaises(KeyboardInterrupt):
            checkpoint.write_together(self.folder, self.NEW)
        self.assertIn(checkpoint.JOURNAL, os.listdir(self.folder))
        checkpoint.finish_saving(self.folder)
        self.assert_set(self.NEW)
        with mock.patch("checkpoint.os.replace", replace), self.assertRaises(KeyboardInterrupt):
            checkpoint.write_together(self.folder, self.OLD)
        checkpoint.write_together(self.folder, {"d.json": "d\n"})   # finishes the old first
        self.assert_set({**self.OLD, "d.json": "d\n"})

    def test_a_save_waits_for_another_and_refuses_after_a_while(self):
        with mock.patch.object(checkpoint, "LOCK_SECONDS", 0.2), checkpoint._lock(self.folder), \
                self.assertRaisesRegex(TimeoutError, f"cannot write in {self.folder}: another"):
            checkpoint.write_together(self.folder, self.NEW)
        self.assert_set(self.OLD)

    def test_a_target_that_is_a_folder_is_refused_before_anything_is_written(self):
        os.mkdir(os.path.join(self.folder, "d.svg"))
        with self.assertRaisesRegex(ValueError, "d.svg: it is a folder"):
            checkpoint.write_together(self.folder, {**self.NEW, "d.svg": "d\n"})
        self.assert_only_files(*self.OLD, "d.svg")


class ReadJson(CheckpointTestCase):

    def test_json_that_python_cannot_read_is_refused_naming_the_file(self):
        for text, fragment in (("[" * 100_000 + "]" * 100_000, "RecursionError"),
                               ('{"format": "f", "n": ' + "7" * 5000 + "}", "ValueError"),
                               (" " * (checkpoint.MAX_BYTES + 1), "larger than")):
            with self.subTest(fragment=fragment):
                with open(self.path, "w", encoding="utf-8") as f:
                    f.write(text)
                for load in (lambda: checkpoint.load(self.path, CONFIG, SIGNATURE),
                             lambda: Tokenizer.load(self.path)):
                    with self.assertRaises(ValueError) as refused:
                        load()
                    self.assertIn(self.path, str(refused.exception))
                    self.assertIn(fragment, str(refused.exception))


    def test_an_interrupt_just_after_the_rename_is_what_the_caller_sees(self):
        real = os.replace

        def renamed_then_interrupted(source, target):
            real(source, target)
            raise KeyboardInterrupt
        with mock.patch("checkpoint.os.replace", renamed_then_interrupted), \
                self.assertRaises(KeyboardInterrupt):
            checkpoint.write_atomically(self.path, "the new text\n")
        self.assertEqual(os.listdir(self.folder), ["best.json"])
        with open(self.path, encoding="utf-8") as f:
            self.assertEqual(f.read(), "the new text\n")

    def test_a_name_as_long_as_the_file_system_takes_is_written(self):
        path = os.path.join(self.folder, "c" * (checkpoint.NAME_MAX - 5) + ".json")
        for text in ("first\n", "second\n"):
            checkpoint.write_atomically(path, text)
        self.assertEqual(os.listdir(self.folder), [os.path.basename(path)])
        with open(path, encoding="utf-8") as f:
            self.assertEqual(f.read(), "second\n")

    def test_what_is_not_a_regular_file_is_refused_before_it_is_opened(self):
        """A folder, and a named pipe, which open() would wait on for ever."""
        pipe = os.path.join(self.folder, "pipe.json")
        kinds = [(self.folder, "a folder")]
        if hasattr(os, "mkfifo"):   # not on Windows
            os.mkfifo(pipe)
            kinds.append((pipe, "not a regular file"))
        for path, fragment in kinds:
            for load in (lambda: checkpoint.load(path, CONFIG, SIGNATURE),
                         lambda: Tokenizer.load(path)):
                with self.subTest(path=path), self.assertRaises(ValueError) as refused:
                    load()
                self.assertIn(f"{path}: {fragment}", str(refused.exception))


class QuietExits(unittest.TestCase):
    """Ctrl-C and a closed pipe end every command of the lab without a traceback."""

    def test_ctrl_c_ends_a_command_in_one_line_with_exit_code_130(self):
        def interrupted():
            raise KeyboardInterrupt
        err = io.StringIO()
        with mock.patch("sys.argv", ["generate.py"]), redirect_stderr(err), \
                self.assertRaises(SystemExit) as done:
            checkpoint.run_command(interrupted)
        self.assertEqual(done.exception.code, 130)
        self.assertEqual(err.getvalue(), "generate.py: interrupted\n")

    def test_ctrl_c_while_a_command_loads_its_modules_ends_in_one_line(self):
        # Every command imports argparse first; one that raises KeyboardInterrupt stands
        # for a Ctrl-C that arrives while the command loads.
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "argparse.py"), "w", encoding="utf-8") as f:
                f.write("raise KeyboardInterrupt\n")
            for script in COMMANDS:   # every file with a command line
                with self.subTest(script=script):
                    done = subprocess.run([sys.executable, os.path.join(HERE, script)],
                                          env={**os.environ, "PYTHONPATH": folder},
                                          capture_output=True, text=True, timeout=60)
                    self.assertEqual(done.stderr, f"{script}: interrupted\n")
                    self.assertNotEqual(done.returncode, 0)

    def test_a_closed_pipe_ends_every_command_quietly_with_exit_code_141(self):
        # trace_kv.py and train.py take minutes to print; they end through the same
        # checkpoint.run_command as these three.
        commands = [["generate.py", "mia found a shell."], ["kv_cache.py", "mia found a shell."],
                    ["bpe.py", "--check"]]
        for script, *args in commands:
            with self.subTest(script=script):
                running = subprocess.Popen([sys.executable, os.path.join(HERE, script), *args],
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                running.stdout.close()   # the reader is gone before anything is printed
                stderr = running.stderr.read().decode("utf-8")
                running.stderr.close()
                running.wait(timeout=60)
                self.assertEqual(running.returncode, 141, stderr)
                self.assertEqual(stderr, "")


if __name__ == "__main__":
    unittest.main()
