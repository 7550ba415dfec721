"""Tests of trace_kv.py: its stages shared by workers, a failing or killed stage, the
record's files and the command's output. That the record, kv-trace.json, is what the
whole run records now is test_whole_trace's."""
import ast
import io
import json
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from contextlib import redirect_stderr, redirect_stdout
from unittest import mock

import documents
import kv_cache
import lab_files
import model
import support
import instruments
import trace_kv
import trace_lesson
import trace_records
from instruments import recording
from support import HERE, lab_file


def setUpModule():
    support.enter_another_folder()   # as a learner might run the commands


tearDownModule = support.tear_down


class Workers(unittest.TestCase):

    def test_the_record_is_the_same_for_any_number_of_workers(self):
        """The lesson's stages (Part 1: cases gathered, a result at the top of the record,
        results under their names) on the first opening: in one process, or shared by
        two. In one process the lab is loaded once, and only Part 1's keys are recorded."""
        with recording(trace_kv, "load_trained") as loads:
            alone, _ = trace_kv.run(workers=1, stories=1, parts=1)
        self.assertEqual(len(loads), 1)
        shared, timing = trace_kv.run(workers=2, stories=1, parts=1)
        self.assertEqual(timing["workers"], 2)
        self.assertEqual(trace_records.differing_keys(alone, shared), [])
        self.assertEqual(json.dumps(alone), json.dumps(shared))   # byte for byte, in order
        self.assertIn("prefix_sharing", alone)
        self.assertNotIn("ladder", alone)
        self.assertEqual(set(alone) - set(json.loads(lab_file(trace_kv.TRACE))), set())


class FailingStage(unittest.TestCase):

    def test_a_stage_that_raises_is_named_with_its_part_and_where_it_raised(self):
        def broken(lab):
            return model.check_int("chunk size", 0, 1)
        stages = tuple(stage._replace(function=broken) for stage in trace_kv.STAGES
                       if stage.name == "sums_in_another_order")   # the only stage run
        with mock.patch.object(trace_kv, "STAGES", stages), \
                self.assertRaises(trace_kv.StageFailed) as failed:
            trace_kv.run(workers=1, stories=1, parts=1)
        self.assertRegex(str(failed.exception),
                         r"^stage sums_in_another_order \(Part 1\) failed: ValueError: chunk "
                         r"size must be an int >= 1, got 0 \(in .*model\.py line \d+, "
                         r"check_int\)$")


class DeclaredRecords(unittest.TestCase):

    def test_a_stage_that_records_an_undeclared_key_or_misses_one_fails_the_run_naming_it(self):
        """Planted in the real stage: a key added to what it returns, or one dropped."""
        added = instruments.replacing(
            lambda node: isinstance(node, ast.Dict) and len(node.keys) == 2,
            lambda node: ast.Dict([*node.keys, ast.Constant("gap_second_story")],
                                  [*node.values, ast.Constant(0.0)]))
        dropped = instruments.replacing(
            lambda node: isinstance(node, ast.Dict) and len(node.keys) == 2,
            lambda node: ast.Dict(node.keys[:1], node.values[:1]))
        for planting, problem in (
                (added, "the record's sums_in_another_order has a key 'gap_second_story' "
                        "that is not declared"),
                (dropped, "the record's sums_in_another_order has no key "
                          "'largest_logit_gap_first_story_in_both_paths'")):
            planted = instruments.plant(trace_lesson, "reordered_sums", planting)
            stages = tuple(stage._replace(function=planted) for stage in trace_kv.STAGES
                           if stage.name == "sums_in_another_order")   # the only stage run
            with self.subTest(problem=problem), mock.patch.object(trace_kv, "STAGES", stages), \
                    self.assertRaises(trace_kv.StageFailed) as failed:
                trace_kv.run(workers=1, stories=1, parts=1)
            self.assertEqual(str(failed.exception),
                             "stage sums_in_another_order (Part 1) recorded what "
                             f"trace_lesson.RECORDS does not declare: {problem}")


class OneTokenStories(unittest.TestCase):

    def test_a_greedy_story_of_one_token_runs_through_every_stage_that_reads_the_runs(self):
        """Each opening replaced by its whole story, which the model ends at its first token,
        as a retrained model may: every stage that reads the stories' runs records its
        entry, as declared."""
        stages = tuple(stage for stage in trace_kv.STAGES
                       if stage.name == "runs" or "runs" in stage.needs)
        with mock.patch.object(trace_kv, "STAGES", stages), mock.patch.object(
                trace_kv, "openings", lambda test: [story.rstrip("\n") for story in test]):
            record, _ = trace_kv.run(workers=1, stories=1)
        self.assertEqual((record["generated_tokens"], record["greedy_ended_with_newline"]),
                         (1, 1))
        self.assertEqual(set(record), set(trace_kv.record_shape(stages)))


@unittest.skipUnless(hasattr(signal, "SIGKILL")
                     and multiprocessing.get_start_method() == "fork",
                     "the workers must inherit the stages this test plants (fork, on POSIX)")
class TheWorkerPool(unittest.TestCase):

    def test_a_killed_worker_ends_the_command_at_once_in_one_line_leaving_no_process(self):
        """The line names the stages that were running (the killed one among them), with
        the command's SIGTERM handler in force, as run_command sets it: a worker that
        inherited it would block when the pool ends it."""
        folder = tempfile.TemporaryDirectory()
        self.addCleanup(folder.cleanup)

        def started(lab):   # each stage leaves its worker's pid
            open(os.path.join(folder.name, str(os.getpid())), "w").close()

        def killed(lab):   # as the out-of-memory killer does, once slow has started too
            started(lab)
            deadline = time.monotonic() + 2
            while len(os.listdir(folder.name)) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)

        def slow(lab):   # still running when the other dies
            started(lab)
            time.sleep(60)
        stages = (trace_kv.Stage(1, "killed", killed), trace_kv.Stage(1, "slow", slow),
                  trace_kv.Stage(1, "waiting", slow))   # for a worker: not named
        handler = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        self.addCleanup(signal.signal, signal.SIGTERM, handler)
        start = time.monotonic()
        with mock.patch.object(trace_kv, "STAGES", stages), redirect_stderr(io.StringIO()), \
                self.assertRaises(SystemExit) as ended:
            trace_kv.main(["--workers", "2"])
        self.assertLess(time.monotonic() - start, 3)
        self.assertRegex(str(ended.exception.code),
                         r"^trace_kv\.py: error: a worker process died during stage killed "
                         r"\(Part 1\) or slow \(Part 1\), [^\n]*$")
        for pid in map(int, os.listdir(folder.name)):
            with self.assertRaises(ProcessLookupError):
                os.kill(pid, 0)

    def test_a_worker_killed_at_a_random_moment_ends_the_command_at_once_leaving_no_process(self):
        """Stages of random lengths, and a worker killed (SIGKILL, as the out-of-memory
        killer does) at a random moment: starting, running a stage, between two, sending a
        result. The command ends in one line naming stages of the run, and no worker is
        left. 4 cases by default, each within 3 s."""
        folder = tempfile.TemporaryDirectory()
        self.addCleanup(folder.cleanup)
        command = os.getpid()

        def loaded(folder_, stories):   # each worker leaves its pid (the lab is not needed)
            if os.getpid() != command:
                open(os.path.join(folder.name, str(os.getpid())), "w").close()

        def trial(number):
            rng = random.Random(number)
            for pid in os.listdir(folder.name):
                os.unlink(os.path.join(folder.name, pid))
            lengths = [rng.uniform(0, 0.1) for _ in range(rng.randint(1, 5))]
            stages = tuple(trace_kv.Stage(1, f"stage{i}", lambda lab, s=seconds: time.sleep(s))
                           for i, seconds in enumerate(lengths)) + (
                trace_kv.Stage(1, "slow", lambda lab: time.sleep(60)),)   # the run never ends

            def kill():
                time.sleep(rng.uniform(0, 0.3))
                while not os.listdir(folder.name):
                    time.sleep(0.005)
                os.kill(int(rng.choice(os.listdir(folder.name))), signal.SIGKILL)
            killer = threading.Thread(target=kill)
            start = time.monotonic()
            with mock.patch.object(trace_kv, "STAGES", stages), \
                    mock.patch.object(trace_kv, "_load", loaded), \
                    redirect_stderr(io.StringIO()), self.assertRaises(SystemExit) as ended:
                killer.start()
                trace_kv.main(["--workers", "2"])
            killer.join()
            if time.monotonic() - start > 3:
                return f"the command took {time.monotonic() - start:.1f} s to end"
            line, names = str(ended.exception.code), "|".join(stage.name for stage in stages)
            if not re.fullmatch(rf"trace_kv\.py: error: a worker process died during stage "
                                rf"(({names}) \(Part 1\)( or )?)+, killed by a signal or out "
                                rf"of memory; the run was stopped", line):
                return f"the command ended with {line!r}"
            left = [pid for pid in map(int, os.listdir(folder.name)) if _alive(pid)]
            return f"workers {left} are left" if left else None
        handler = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        self.addCleanup(signal.signal, signal.SIGTERM, handler)
        support.check_random_cases(self, 4, trial)

    def test_a_failing_stage_ends_the_run_at_once_with_the_stages_still_running(self):
        def failing(lab):
            raise ValueError("a planted mistake")

        def slow(lab):
            time.sleep(30)
        stages = (trace_kv.Stage(1, "failing", failing), trace_kv.Stage(1, "slow", slow))
        start = time.monotonic()
        with mock.patch.object(trace_kv, "STAGES", stages), \
                self.assertRaisesRegex(trace_kv.StageFailed, "stage failing .* planted mistake"):
            trace_kv.run(workers=2, stories=1, parts=1)
        self.assertLess(time.monotonic() - start, 3)

    def test_a_run_of_no_story_and_other_bad_arguments_are_refused_at_once(self):
        """A run of 0 stories would give every stage of openings no case, and wait for
        them for ever: refused, like any count but an int from 1, before the lab loads; so
        are no workers, Parts that are not 1 to 5, and a folder that is not one."""
        for name, bad, fragment in (
                *(("stories", bad, r"stories must be an int >= 1") for bad in
                  (0, -1, 1.5, True, "2")),
                *(("workers", bad, r"workers must be an int from 1 to 64") for bad in
                  (0, False, 65, 2.5, "2")),
                *(("parts", bad, rf"parts must be an int from 1 to {trace_kv.PARTS}")
                  for bad in (0, -3, 99, True, 2.5, "1")),
                *(("folder", bad, r"folder must be the path of a folder of the lab's files, "
                                  rf"got {re.escape(repr(bad))}$")
                  for bad in (5, None, os.path.join(HERE, "nowhere"), trace_kv.__file__))):
            arguments = dict({"workers": 1, "parts": 1}, **{name: bad})
            with self.subTest(**{name: bad}), recording(trace_kv, "load_trained") as loads:
                with self.assertRaisesRegex(ValueError, fragment):
                    trace_kv.run(**arguments)
                self.assertEqual(loads, [])

    def test_workers_start_with_the_default_signal_handlers(self):
        def interrupted(signum, frame):
            raise KeyboardInterrupt
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.addCleanup(signal.signal, signum, signal.signal(signum, interrupted))
        with mock.patch.object(trace_kv, "_load"):
            trace_kv._start_worker(HERE, 1)
        self.assertEqual([signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)],
                         [signal.SIG_DFL, signal.SIG_DFL])


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class RecordFiles(unittest.TestCase):

    def test_a_write_names_the_documents_whose_figures_changed_and_no_other(self):
        """A README whose mark is stale is named; a document whose marks hold is not; a
        second write names no document."""
        with tempfile.TemporaryDirectory() as folder:
            for name, text in (("README.md", "<!--fig stories-->59<!--/--> stories\n"),
                               ("part2-x.md", "<!--fig stories-->60<!--/--> stories\n")):
                with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                    f.write(text)
            timing = {"python": "3"}
            self.assertEqual(trace_records.save_records({"stories": 60}, timing, folder),
                             [trace_kv.TRACE, trace_kv.TIMES, "the figures of README.md"])
            self.assertEqual(trace_records.save_records({"stories": 60}, timing, folder, False),
                             [trace_kv.TRACE])

    def test_a_failed_write_keeps_the_previous_records_and_leaves_no_temporary_file(self):
        previous = {trace_kv.TRACE: "the previous trace\n", trace_kv.TIMES: "the previous times\n"}
        with tempfile.TemporaryDirectory() as folder:
            for name, text in previous.items():
                with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                    f.write(text)
            for target in ("lab_files.os.replace", "lab_files.os.fsync"):
                with self.subTest(failing=target):
                    with mock.patch(target, side_effect=OSError("disk full")):
                        with self.assertRaises(OSError):
                            trace_records.save_records({"stories": 60}, {"python": "3"}, folder)
                    self.assertEqual(sorted(os.listdir(folder)), sorted(previous))
                    for name, text in previous.items():
                        with open(os.path.join(folder, name), encoding="utf-8") as f:
                            self.assertEqual(f.read(), text)
            trace_records.save_records({"stories": 60}, {"python": "3"}, folder)
            with open(os.path.join(folder, trace_kv.TRACE), encoding="utf-8") as f:
                self.assertEqual(json.load(f), {"stories": 60})

    def test_write_names_a_misspelt_mark_at_any_depth_before_anything_runs(self):
        """Checked against the stages' declarations (no record in the folder): a first key,
        a second key, a key inside a list's item, a field picking an item, a time key."""
        marks = ("laddr.stories", "ladder.rungz", "ladder.rungs.0.cahce",
                 "eviction.rungs.cahce=heavy.positions_kept", "time.speedupp",
                 "time.cost_by_length.0.speedupp")
        good = "<!--fig ladder.rungs.1.positions_kept--> <!--fig time.cost_by_length.0.speedup-->"
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
                f.write(good.replace("-->", "-->1<!--/-->") + "\n"
                        + "".join(f"<!--fig {mark}-->1<!--/-->\n" for mark in marks))
            with mock.patch.object(trace_kv, "run") as run, self.assertRaises(SystemExit) as ended:
                trace_kv.main(["--write", "--folder", folder])
            run.assert_not_called()
            self.assertEqual(os.listdir(folder), ["README.md"])
        lines = str(ended.exception.code).splitlines()[1:]
        self.assertEqual(len(lines), len(marks), lines)
        for line, mark, problem in zip(lines, marks, (
                "no entry 'laddr' in the record,", "no entry 'rungz' in the record's ladder",
                "no entry 'cahce' in the record's ladder.rungs.0",
                "the record's eviction.rungs's items have no field 'cahce'",
                "no entry 'speedupp' in kv-time.json,",
                "no entry 'speedupp' in kv-time.json's cost_by_length.0")):
            self.assertIn(f"<!--fig {mark}-->1<!--/-->: {problem}", line)

    def test_check_names_a_missing_or_unreadable_record_and_the_keys_that_differ(self):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, trace_kv.TRACE)
            with self.assertRaisesRegex(ValueError, "cannot read .*--write"):
                trace_records.read_record(path)
            for text in ("{ not json", "[1, 2]", "\xff", "[" * 100_000 + "]" * 100_000):
                with open(path, "w", encoding="latin-1") as f:
                    f.write(text)
                with self.subTest(text=text[:20]), self.assertRaisesRegex(ValueError, "--write"):
                    trace_records.read_record(path)
        record = {"stories": 60, "greedy_identical": 60, "work": {"cached_rows": 5}}
        changed = dict(record, greedy_identical=59, work={"cached_rows": 6}, extra=1)
        self.assertEqual(trace_records.differing_keys(record, changed),
                         ["extra", "greedy_identical", "work"])
        self.assertEqual(trace_records.differing_keys(record, dict(record)), [])

    def test_check_fails_fast_in_one_line_when_the_record_is_missing(self):
        with tempfile.TemporaryDirectory() as folder:
            done = subprocess.run([sys.executable, os.path.join(HERE, "trace_kv.py"), "--check",
                                   "--folder", folder], capture_output=True, text=True,
                                  timeout=60)
        self.assertEqual(done.returncode, 1)
        self.assertEqual(len(done.stderr.strip().splitlines()), 1, done.stderr)
        self.assertIn(f"cannot read {os.path.join(folder, 'kv-trace.json')}", done.stderr)

    def test_unknown_flags_are_usage_errors(self):
        """Each as main() parses it (argparse's exit 2, before anything runs), and one as
        the command does, in a process of its own."""
        for flag in ("--chek", "--check --write", "--workers 0", "--workers two",
                     "--workers 100000", "--write --part 2", "--times", "--check --times"):
            err = io.StringIO()
            with self.subTest(flag=flag), redirect_stderr(err), \
                    self.assertRaises(SystemExit) as ended:
                trace_kv.main(flag.split())
            self.assertEqual(ended.exception.code, 2)
            self.assertIn("usage:", err.getvalue())
        done = subprocess.run([sys.executable, os.path.join(HERE, "trace_kv.py"), "--chek"],
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 2)
        self.assertNotIn("Traceback", done.stderr)
        self.assertIn("usage:", done.stderr)


class Contract(unittest.TestCase):

    def test_work_is_importable_from_trace_kv(self):
        self.assertIs(trace_kv.work, kv_cache.work)


class Summary(unittest.TestCase):
    """What python3 trace_kv.py prints for a person, from the recorded run."""

    @classmethod
    def setUpClass(cls):
        cls.record = json.loads(lab_file(trace_kv.TRACE))
        cls.timing = json.loads(lab_file(trace_kv.TIMES))

    def test_the_summary_gives_the_verdicts_the_work_and_the_speed_up(self):
        r, every = self.record, self.record["every_row_of_every_story"]
        lines = trace_kv.summary(r, self.timing).splitlines()
        self.assertIn(f"  every row's logits equal, bit for bit: yes (largest gap 0.0 over "
                      f"{every['positions']:,} positions of 120 stories)", lines)
        self.assertIn("  greedy stories identical:  yes (60 of 60)", lines)
        self.assertIn("  sampled stories identical: yes (60 of 60, temperature 1.0)", lines)
        self.assertIn(f"  rows{r['work']['uncached_rows']:>32,}{r['work']['cached_rows']:>10,}"
                      f"{r['rows_ratio']:>8}x", lines)
        self.assertIn(f"{self.timing['speedup']}x faster (rows ratio {r['rows_ratio']}x)",
                      lines[-1])

    def test_a_difference_is_a_no(self):
        broken = dict(self.record, greedy_identical=59, every_row_of_every_story=dict(
            self.record["every_row_of_every_story"], largest_logit_gap=2.0 ** -52))
        text = trace_kv.summary(broken, None)
        self.assertIn("bit for bit: NO (largest gap 2.220446049250313e-16 over", text)
        self.assertIn("greedy stories identical:  NO (59 of 60)", text)
        self.assertIn("sampled stories identical: yes", text)
        self.assertNotIn("Time", text)

    def run_main(self, *args):
        """trace_kv.main with run() replaced by the recorded run: (stdout, stderr)."""
        out, err = io.StringIO(), io.StringIO()
        with mock.patch.object(trace_kv, "run", return_value=(self.record, self.timing)), \
                redirect_stdout(out), redirect_stderr(err):
            trace_kv.main(list(args))
        return out.getvalue(), err.getvalue()

    def test_the_command_prints_the_summary_and_the_record_only_when_asked(self):
        out, err = self.run_main()
        self.assertTrue(out.startswith("Exactness\n"), out)
        self.assertIn("The full record: ", out)
        self.assertIn(trace_records.last_duration(), err)
        self.assertIn(" s in ", trace_records.last_duration())
        out, _ = self.run_main("--json")
        self.assertEqual(json.loads(out), self.record)
        out, _ = self.run_main("--check")
        shown = os.path.relpath(os.path.join(HERE, "kv-trace.json"))
        self.assertTrue(out.endswith(f"{shown} matches this run\n"), out)

    def test_check_names_a_tampered_record_s_keys_in_one_printable_bounded_line(self):
        """Escape codes (here: clear the screen) are shown, not sent; a key of a million
        characters is cut; of many keys, ten are named and the rest counted."""
        tampered = {"\x1b[2J": 1, "a" * 10 ** 6: 2, **{f"extra {i}": i for i in range(50)}}
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, trace_kv.TRACE), "w", encoding="utf-8") as f:
                json.dump(dict(self.record, **tampered), f)
            with self.assertRaises(SystemExit) as ended:
                self.run_main("--check", "--folder", folder)
        line = str(ended.exception.code)
        self.assertTrue(line.isprintable(), line[:300])
        self.assertLess(len(line), 2500)
        self.assertIn(f"in: '\\x1b[2J', {'a' * 197}..., extra 0, extra 1, extra 10, ", line)
        self.assertRegex(line, r", extra 15 and 42 more$")

    def assert_save_fails_in_one_line(self, folder, fragment, *flags):
        with self.assertRaises(SystemExit) as ended:
            self.run_main("--write", "--folder", folder, *flags)
        self.assertRegex(str(ended.exception.code), r"^trace_kv\.py: error: [^\n]*$")
        self.assertIn(fragment, str(ended.exception.code))

    def test_a_save_that_fails_after_the_run_is_one_line_and_writes_nothing(self):
        with tempfile.TemporaryDirectory() as folder:
            os.mkdir(os.path.join(folder, trace_kv.TIMES))
            self.assert_save_fails_in_one_line(folder, "kv-time.json: it is a folder",
                                               "--times")
            self.assertEqual(os.listdir(folder), [trace_kv.TIMES])
        with tempfile.TemporaryDirectory() as folder, mock.patch(
                "lab_files.os.fsync", side_effect=OSError(28, "No space left on device")):
            self.assert_save_fails_in_one_line(folder, "No space left on device")
            self.assertEqual(os.listdir(folder), [])

    def test_write_keeps_the_times_and_their_figures_unless_asked(self):
        """--write fills the time marks from kv-time.json as it is and leaves the file
        alone; --write --times records this run's (timing more); so does the first --write
        of a folder without kv-time.json; one that cannot be read stops before the run."""
        kept = '{"python": "2.7"}\n'
        for flags, times in (((), kept), (("--times",), kept), ((), None)):
            with self.subTest(flags=flags, times=times), \
                    tempfile.TemporaryDirectory() as folder:
                files = {"README.md": "Python <!--fig time.python-->x<!--/-->\n",
                         trace_kv.TIMES: times}
                files = self.write_main(folder, files, *flags)
                self.assertEqual(files[trace_kv.TRACE], trace_records.dumps(self.record))
                python = "2.7" if times and not flags else self.timing["python"]
                self.assertEqual(files["README.md"],
                                 f"Python <!--fig time.python-->{python}<!--/-->\n")
                self.assertEqual(files[trace_kv.TIMES], trace_records.dumps(self.timing)
                                 if python != "2.7" else kept)
                self.assertEqual(self.timed, python != "2.7")
        for bad in ("{ not json", "[1]"):
            with self.subTest(bad=bad), tempfile.TemporaryDirectory() as folder:
                with open(os.path.join(folder, trace_kv.TIMES), "w", encoding="utf-8") as f:
                    f.write(bad)
                with mock.patch.object(trace_kv, "run") as run, \
                        redirect_stderr(io.StringIO()), self.assertRaises(SystemExit) as ended:
                    trace_kv.main(["--write", "--folder", folder])
                self.assertRegex(str(ended.exception.code), r"^trace_kv\.py: error: cannot "
                                 r"read .*kv-time\.json to keep it .*--write --times to "
                                 r"record it again$")
                run.assert_not_called()

    def write_main(self, folder, files, *flags):
        """--write (with flags) in folder holding files (a None text: no such file), run()
        replaced by the recorded run: the folder's files after it. self.timed: whether the
        run was asked to time more (full_timing)."""
        for name, text in files.items():
            if text is not None:
                with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                    f.write(text)
        with mock.patch.object(trace_kv, "run", return_value=(self.record, self.timing)) as run:
            with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
                trace_kv.main(["--write", "--folder", folder, *flags])
        self.timed = run.call_args.args[0]
        after = {}
        for name in os.listdir(folder):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                after[name] = f.read()
        return after

    def test_write_rebuilds_a_missing_or_unreadable_record_in_a_folder_of_the_lab(self):
        """A copy of the lab's documents and data, without kv-trace.json or with one that
        cannot be read: --write (the recorded run in place of run()) checks every mark
        against the stages' declarations, not the record, and writes the record and every
        document byte for byte as the lab holds them."""
        names = [*documents.documents(), "best.json", "tokenizer.json", "corpus.txt"]
        for old in (None, "{ not json"):
            with self.subTest(old=old), tempfile.TemporaryDirectory() as folder:
                files = self.write_main(folder, {trace_kv.TRACE: old, trace_kv.TIMES: None,
                                                 **{name: lab_file(name) for name in names}})
                self.assertEqual(files[trace_kv.TRACE], lab_file(trace_kv.TRACE))
                for name in documents.documents():
                    self.assertEqual(files[name], lab_file(name), name)

    def test_a_write_stopped_among_its_renames_is_finished_before_anything_else(self):
        with tempfile.TemporaryDirectory() as folder:
            tmp = f".{trace_kv.TRACE}.tmp-99999999-0a1b2c3d.part"   # a killed process's
            with open(os.path.join(folder, tmp), "w", encoding="utf-8") as f:
                f.write(trace_records.dumps(self.record))
            with open(os.path.join(folder, lab_files.JOURNAL), "w", encoding="utf-8") as f:
                json.dump({"format": lab_files.JOURNAL_FORMAT,
                           "renames": [[tmp, trace_kv.TRACE]]}, f)
            out, _ = self.run_main("--check", "--folder", folder)
            self.assertIn("matches this run", out)
            self.assertEqual(os.listdir(folder), [trace_kv.TRACE])
