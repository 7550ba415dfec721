"""The record: python3 trace_kv.py's whole run (every Part, on the 60 test openings)
against kv-trace.json. What the record proves is each Part's claim, in its own test module
(support.recorded): they read kv-trace.json, which this module proves is this run's record.

The whole run takes about half a minute on two cores. It starts in a process of its own
as soon as unittest loads this module's tests (load_tests), and TheRecord waits for it.
unittest loads every module before it runs any, and runs them in the order of their names:
this one's sorts last, so that every other module's tests run while the record is made,
none after it with a core left idle. After a change on purpose, python3 trace_kv.py
--write records the new run."""
import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import unittest

import trace_kv
import trace_records
from support import HERE, lab_file
from verdicts import skip_unless_sound


_RUN = {}   # the background run of the whole trace: its process and output files


def _start_the_run():
    """Start python3 trace_kv.py --json in a process of its own (once)."""
    if not _RUN:
        _RUN["out"], _RUN["err"] = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        _RUN["process"] = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "trace_kv.py"), "--json"],
            stdout=_RUN["out"], stderr=_RUN["err"],
            start_new_session=hasattr(os, "killpg"))   # its workers in its group
        atexit.register(_stop_the_run)   # if unittest stops early


def _stop_the_run():
    """End the background run and its workers at once, if it still runs, and close its
    output files (atexit calls this too). (Told to stop politely mid-way, a process pool
    can hang in its own shutdown: a signal's exception can leave one of its locks held.)"""
    process = _RUN["process"]
    if process.poll() is None:
        if hasattr(os, "killpg"):
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
        process.wait()
    _RUN["out"].close()
    _RUN["err"].close()


def _the_run():
    """The record of the background run, once it has ended."""
    _start_the_run()
    if _RUN["process"].wait(timeout=900):
        _RUN["err"].seek(0)
        raise AssertionError(f"python3 trace_kv.py --json failed:\n"
                             f"{_RUN['err'].read().decode('utf-8', 'replace')[-2000:]}")
    _RUN["out"].seek(0)
    return json.loads(_RUN["out"].read().decode("utf-8"))


def load_tests(loader, tests, pattern):
    """unittest's hook, called as it loads this module's tests: start the whole run now."""
    _start_the_run()
    return tests


class TheRecord(unittest.TestCase):
    """One whole run of the trace, as python3 trace_kv.py does it (in the background)."""

    @classmethod
    def setUpClass(cls):
        try:
            skip_unless_sound("every Part")
        except unittest.SkipTest:
            if _RUN:
                _stop_the_run()   # its record would only repeat what the layer says
            raise
        cls.record = _the_run()

    def test_recorded_trace(self):
        """kv-trace.json is this run's record, key for key."""
        self.assertEqual(trace_records.differing_keys(self.record, json.loads(lab_file(trace_kv.TRACE))),
                         [], "kv-trace.json differs from this run in these keys; after a "
                             "change on purpose, python3 trace_kv.py --write records the new run")
