"""Tests of the lab's file and command-line handling (lab_files.py): writes that never
leave a half-written or temporary file, sets of files that are all old or all new, JSON
read back with its refusals, and commands that end quietly on Ctrl-C or a closed pipe."""
import contextlib
import dis
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

    @unittest.skipUnless(hasattr(signal, "pthread_sigmask"), "signals are held on POSIX only")
    def test_an_interrupt_at_any_point_leaves_the_old_file_or_the_new_and_nothing_else(self):
        """Ctrl-C at each point where Python takes a signal in a write (InterruptPoints):
        no temporary file, no open descriptor."""
        self.write_old_file()
        with InterruptPoints() as points:
            lab_files.write_atomically(self.path, "the old checkpoint\n")
        descriptors = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else None
        for at in range(1, points.counted + 1):
            before = descriptors and sorted(os.listdir(descriptors))
            with InterruptPoints(at) as point:
                try:
                    lab_files.write_atomically(self.path, "the new checkpoint\n")
                except KeyboardInterrupt:
                    pass
            with self.subTest(at=point.where):
                self.assert_only_files("best.json")
                self.assertEqual(descriptors and sorted(os.listdir(descriptors)), before)

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

    @unittest.skipUnless(hasattr(signal, "pthread_sigmask"), "signals are held on POSIX only")
    def test_an_interrupt_at_any_point_of_a_save_leaves_one_whole_set_and_nothing_else(self):
        """Ctrl-C (KeyboardInterrupt) at a random one of every point where Python takes a
        signal while a set is saved (InterruptPoints): the folder holds the old set or the
        new one at once, and nothing else (no temporary file, journal or lock), and no
        descriptor is left open. A --write's save is this one with more files. 40 of the
        save's 500-odd points by default; KV_LAB_RANDOM_CASES=600 runs every one."""
        descriptors = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else None
        waits = mock.patch.object(lab_files, "LOCK_SECONDS", 0.2)   # for a lock left held
        waits.start()
        self.addCleanup(waits.stop)
        lab_files.write_together(self.folder, self.NEW)
        with InterruptPoints() as points:
            lab_files.write_together(self.folder, self.OLD)
        order = list(range(1, points.counted + 1))
        random.Random(0).shuffle(order)   # case n: the point order[n], every one by turns

        def trial(number):
            old, new = (self.OLD, self.NEW) if number % 2 else (self.NEW, self.OLD)
            lab_files.write_together(self.folder, old)
            before = descriptors and os.listdir(descriptors)
            with InterruptPoints(order[number % len(order)]) as point:
                try:
                    lab_files.write_together(self.folder, new)
                except KeyboardInterrupt:   # not a with: contextlib's code counts its points
                    pass
            found = {}
            for name in os.listdir(self.folder):
                with open(os.path.join(self.folder, name), encoding="utf-8") as f:
                    found[name] = f.read()
            if found not in (old, new):
                return f"interrupted at {point.where}, the folder holds {found}"
            if descriptors and sorted(os.listdir(descriptors)) != sorted(before):
                return f"interrupted at {point.where}, a descriptor is left open"
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

    def stop_among_the_renames(self, texts):
        """Save texts, stopped among its renames as a save killed outright is: a.json
        renamed, b.svg not, the journal left."""
        real = os.replace

        def replace(source, target):
            if target.endswith("b.svg"):   # after the journal and a.json
                raise KeyboardInterrupt
            real(source, target)
        with mock.patch("lab_files.os.replace", replace), self.assertRaises(KeyboardInterrupt):
            lab_files.write_together(self.folder, texts)
        self.assertIn(lab_files.JOURNAL, os.listdir(self.folder))

    def test_a_save_stopped_among_its_renames_is_finished_by_the_next(self):
        self.stop_among_the_renames(self.NEW)
        lab_files.finish_saving(self.folder)
        self.assert_set(self.NEW)
        self.stop_among_the_renames(self.OLD)
        lab_files.write_together(self.folder, {"d.json": "d\n"})   # finishes the old first
        self.assert_set({**self.OLD, "d.json": "d\n"})

    def test_every_command_and_the_tests_finish_a_stopped_save_first(self):
        """Before anything else: a command (run_command, for the lab's folder) and the
        tests, as they read the lab's files (support.lab_file)."""
        for owner, name, first in (
                (lab_files, "LAB", lambda: lab_files.run_command(mock.Mock())),
                (support, "HERE", lambda: support.lab_file("a.json"))):
            with self.subTest(first=name):
                self.stop_among_the_renames(self.NEW)
                with mock.patch.object(owner, name, self.folder), \
                        mock.patch("sys.argv", ["generate.py"]):
                    first()
                self.assert_set(self.NEW)
                lab_files.write_together(self.folder, self.OLD)

    @unittest.skipUnless(hasattr(signal, "pthread_kill"), "signals are held on POSIX only")
    def test_a_signal_among_the_renames_is_taken_once_the_set_is_whole(self):
        """Ctrl-C, or SIGTERM as run_command handles it, sent as the first file is renamed:
        the save ends with all of its renames done and no journal, then the signal is taken."""
        real = os.replace

        def replace(source, target):
            real(source, target)
            if target.endswith("a.json"):
                signal.pthread_kill(threading.main_thread().ident, signum)
        for signum, handler, taken in (
                (signal.SIGINT, signal.default_int_handler, KeyboardInterrupt),
                (signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum), SystemExit)):
            with self.subTest(signal=signum.name):
                self.addCleanup(signal.signal, signum, signal.signal(signum, handler))
                with mock.patch("lab_files.os.replace", replace), self.assertRaises(taken):
                    lab_files.write_together(self.folder, self.NEW)
                self.assert_set(self.NEW)
                lab_files.write_together(self.folder, self.OLD)

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


_CONTEXTLIB = contextlib.__file__


class InterruptPoints:
    """Raise KeyboardInterrupt at the point number at of the lab_files code run in the block
    (and of contextlib's, which its with-statements run), as a signal would; count them in
    counted, and name the one in where.

    The points are where CPython takes a signal (3.10 and later): just after a call returns,
    at a function's start or a generator's resumption, at a jump taken; and each call of a
    function written in C (a system call among them) raising in place of running, but
    os.close, which never raises for a signal (PEP 475). None while the signals are held."""

    def __init__(self, at=None):
        self.at, self.counted, self.where = at, 0, None
        self.instructions = {}

    def __enter__(self):
        sys.settrace(self.trace)
        sys.setprofile(self.profile)
        return self

    def __exit__(self, *exception):
        sys.settrace(None)
        sys.setprofile(None)

    def point(self, where):
        if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, ()):
            return
        self.counted += 1
        if self.counted == self.at:
            self.where = where
            raise KeyboardInterrupt

    def trace(self, frame, event, arg):
        if frame.f_code.co_filename not in (lab_files.__file__, _CONTEXTLIB):
            return None
        frame.f_trace_opcodes = True
        code, last = frame.f_code, [None]
        if code not in self.instructions:
            listed = list(dis.get_instructions(code))
            self.instructions[code] = {i.offset: (i.opname, after.offset) for i, after in
                                       zip(listed, listed[1:] + listed[-1:])}
        table = self.instructions[code]

        def opcode(frame, event, arg):
            if event == "opcode":
                previous, last[0] = last[0], frame.f_lasti
                if previous is None or table[previous][1] != frame.f_lasti or \
                        table[previous][0].startswith(("CALL", "YIELD_VALUE")):
                    self.point(f"{code.co_name} line {frame.f_lineno}")
            return opcode
        return opcode

    def profile(self, frame, event, arg):
        if event == "c_call" and arg is not os.close and \
                frame.f_code.co_filename in (lab_files.__file__, _CONTEXTLIB):
            self.point(f"{frame.f_code.co_name} line {frame.f_lineno}, calling {arg.__name__}")

if __name__ == "__main__":
    unittest.main()
