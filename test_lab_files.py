"""Tests of the lab's file and command-line handling (lab_files.py): writes that never
leave a half-written or temporary file, sets of files that are all old or all new, JSON
read back with its refusals, and commands that end quietly on Ctrl-C or a closed pipe."""
import io
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
import lab_files
import support
from bpe import Tokenizer
from support import HERE

CONFIG, SIGNATURE = checkpoint.CONFIG, "0123456789abcdef"   # for a checkpoint through these files
COMMANDS = ["bpe.py", "cache_files.py", "generate.py", "kv_cache.py", "train.py", "trace_kv.py"]


class TestWriteAtomically(support.InAFolder):
    def write_old_file(self):
        with open(self.path, "w", encoding="utf-8") as f:
            f.write("the old checkpoint\n")

    def assert_old_file_intact(self):
        with open(self.path, encoding="utf-8") as f:
            self.assertEqual(f.read(), "the old checkpoint\n")
        self.assert_only_files("best.json")

    def test_write_replaces_the_file_and_leaves_no_temporary_file(self):
        self.write_old_file()
        lab_files.write_atomically(self.path, "the new checkpoint\n")
        with open(self.path, encoding="utf-8") as f:
            self.assertEqual(f.read(), "the new checkpoint\n")
        self.assert_only_files("best.json")

    def test_failed_rename_keeps_the_previous_file_and_no_temporary_file(self):
        self.write_old_file()
        with mock.patch("lab_files.os.replace", side_effect=OSError("disk full")) as replace:
            with self.assertRaises(OSError):
                lab_files.write_atomically(self.path, "the new checkpoint\n")
            with self.assertRaises(OSError):
                checkpoint.save(self.path, self.params, CONFIG, SIGNATURE)
        self.assertEqual(replace.call_count, 2)
        self.assert_old_file_intact()

    def test_failed_write_keeps_the_previous_file_and_no_temporary_file(self):
        self.write_old_file()
        with self.assertRaises(UnicodeEncodeError):
            lab_files.write_atomically(self.path, "half \ud800 written")
        self.assert_old_file_intact()
        with mock.patch("lab_files.os.fsync", side_effect=OSError("I/O error")):
            with self.assertRaises(OSError):
                lab_files.write_atomically(self.path, "the new checkpoint\n")
        self.assert_old_file_intact()
        with mock.patch("lab_files.os.fsync", side_effect=KeyboardInterrupt):
            with self.assertRaises(KeyboardInterrupt):
                lab_files.write_atomically(self.path, "the new checkpoint\n")
        self.assert_old_file_intact()

    def test_failed_first_write_leaves_no_file_at_all(self):
        with mock.patch("lab_files.os.replace", side_effect=OSError("disk full")):
            with self.assertRaises(OSError):
                lab_files.write_atomically(self.path, "the new checkpoint\n")
        self.assert_only_files()


    def test_a_read_only_folder_is_named_by_its_target(self):
        with mock.patch("lab_files.os.open",
                        side_effect=PermissionError(13, "Permission denied")):
            with self.assertRaisesRegex(OSError, f"cannot write {self.path}: Permission denied"):
                lab_files.write_atomically(self.path, "text\n")
        with mock.patch("lab_files.os.replace",
                        side_effect=PermissionError(13, "Permission denied")):
            with self.assertRaisesRegex(OSError, f"cannot write {self.path}: Permission denied"):
                lab_files.write_atomically(self.path, "text\n")
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
        lab_files.write_atomically(self.path, "the new checkpoint\n")
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
        with mock.patch("lab_files.os.open", open_then_ctrl_c), \
                self.assertRaises(KeyboardInterrupt):
            lab_files.write_atomically(self.path, "text\n")
        with self.assertRaises(OSError):   # closed
            os.fstat(opened[0])
        self.assert_only_files()

    def test_the_tempfile_module_and_its_lock_are_not_used(self):
        with mock.patch("tempfile.mkstemp", side_effect=AssertionError("mkstemp")), \
                mock.patch("tempfile._get_candidate_names", side_effect=AssertionError("lock")):
            lab_files.write_atomically(self.path, "text\n")
        self.assert_only_files("best.json")


    def test_a_terminated_save_leaves_no_temporary_file(self):
        """A real SIGTERM, during a save that takes long (the text is 200 MB)."""
        if not hasattr(os, "kill") or sys.platform == "win32":
            self.skipTest("SIGTERM is a POSIX signal")
        script = ("import sys, os; sys.path.insert(0, sys.argv[1]); import lab_files\n"
                  "def main(): print('started', flush=True); "
                  "lab_files.write_atomically(sys.argv[2], 'x' * 200_000_000)\n"
                  "lab_files.run_command(main)\n")
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
                    lab_files.write_atomically(path, "text\n")
                with self.assertRaisesRegex(ValueError, fragment):
                    lab_files.read_json(path, "f", "a file")
        with self.assertRaisesRegex(ValueError, "it is a folder"):
            lab_files.write_atomically(self.folder, "text\n")


class WriteTogether(support.InAFolder):
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
            with self.subTest(fsync=calls), mock.patch("lab_files.os.fsync", fsync), \
                    self.assertRaises(KeyboardInterrupt):
                lab_files.write_together(self.folder, self.NEW)
            self.assert_set(self.OLD)
        lab_files.write_together(self.folder, self.NEW)
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
            lab_files.write_together(self.folder, old)
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
            patches = [mock.patch(f"lab_files.os.{name}", interrupting(name, getattr(os, name)))
                       for name in ("open", "fsync", "replace", "unlink")]
            for patch in patches:
                patch.start()
            try:
                lab_files.write_together(self.folder, new)
            except KeyboardInterrupt:
                pass
            finally:
                for patch in patches:
                    patch.stop()
            lab_files.finish_saving(self.folder)
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
        saver = ("import os, sys, time, lab_files\n"
                 "folder, tag, times, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), "
                 "float(sys.argv[4])\n"
                 "time.sleep(max(0.0, start - time.time()))   # both begin together\n"
                 "for i in range(times):\n"
                 "    lab_files.write_together(folder, {n: f'{tag} {i}\\n' for n in "
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
            lab_files.finish_saving(self.folder)
            names = sorted(name for name in os.listdir(self.folder)   # a killed save's go
                           if not (number % 2 and (name.endswith(".part")    # with the next
                                                   or name == lab_files.LOCK)))
            if names != sorted(self.OLD):
                return f"the folder holds {names}, where only the set should be"
            texts = set()
            for name in names:
                with open(os.path.join(self.folder, name), encoding="utf-8") as f:
                    texts.add(f.read().split()[0])   # whose save: "first" or "second"
            if len(texts) != 1:
                return f"the files are of different saves: {sorted(texts)}"
            lab_files.write_together(self.folder, self.NEW)   # the lock can be taken again,
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
        with mock.patch("lab_files.os.replace", replace), self.assertRaises(KeyboardInterrupt):
            lab_files.write_together(self.folder, self.NEW)
        self.assertIn(lab_files.JOURNAL, os.listdir(self.folder))
        lab_files.finish_saving(self.folder)
        self.assert_set(self.NEW)
        with mock.patch("lab_files.os.replace", replace), self.assertRaises(KeyboardInterrupt):
            lab_files.write_together(self.folder, self.OLD)
        lab_files.write_together(self.folder, {"d.json": "d\n"})   # finishes the old first
        self.assert_set({**self.OLD, "d.json": "d\n"})

    def test_a_save_waits_for_another_and_refuses_after_a_while(self):
        with mock.patch.object(lab_files, "LOCK_SECONDS", 0.2), lab_files._lock(self.folder), \
                self.assertRaisesRegex(TimeoutError, f"cannot write in {self.folder}: another"):
            lab_files.write_together(self.folder, self.NEW)
        self.assert_set(self.OLD)

    def test_a_target_that_is_a_folder_is_refused_before_anything_is_written(self):
        os.mkdir(os.path.join(self.folder, "d.svg"))
        with self.assertRaisesRegex(ValueError, "d.svg: it is a folder"):
            lab_files.write_together(self.folder, {**self.NEW, "d.svg": "d\n"})
        self.assert_only_files(*self.OLD, "d.svg")


class ReadJson(support.InAFolder):

    def test_json_that_python_cannot_read_is_refused_naming_the_file(self):
        for text, fragment in (("[" * 100_000 + "]" * 100_000, "RecursionError"),
                               ('{"format": "f", "n": ' + "7" * 5000 + "}", "ValueError"),
                               (" " * (lab_files.MAX_BYTES + 1), "larger than")):
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
        with mock.patch("lab_files.os.replace", renamed_then_interrupted), \
                self.assertRaises(KeyboardInterrupt):
            lab_files.write_atomically(self.path, "the new text\n")
        self.assertEqual(os.listdir(self.folder), ["best.json"])
        with open(self.path, encoding="utf-8") as f:
            self.assertEqual(f.read(), "the new text\n")

    def test_a_name_as_long_as_the_file_system_takes_is_written(self):
        path = os.path.join(self.folder, "c" * (lab_files.NAME_MAX - 5) + ".json")
        for text in ("first\n", "second\n"):
            lab_files.write_atomically(path, text)
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
            lab_files.run_command(interrupted)
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
        # lab_files.run_command as these three.
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
