"""documents.py, the filling of the documents' marks: what a mark may name, and that a
mark naming nothing is found in a moment, before python3 trace_kv.py --write runs the lab.
(That every document's marks are what the record gives is test_readme's.)"""
import os
import subprocess
import sys
import tempfile
import unittest

import documents
from support import HERE

RECORDED = {"work": {"cached_rows": 5}, "paged": {"slots": 3}}
STAGES = ["paged", "eviction"]


class Marks(unittest.TestCase):

    def test_a_mark_may_name_the_record_a_stage_to_come_or_a_function_of_the_lab(self):
        text = ("<!--fig work.cached_rows-->5<!--/--> <!--fig time.speedup-->1<!--/-->\n"
                "<!--fig eviction.kept-->1<!--/--> <!--fig paged.forks_table()-->x<!--/-->\n\n"
                "<!--block lossy.ladder_table-->\n| a |\n\n"
                "<!--picture lossy.ladder_picture-->\n![the ladder](kv-ladder.svg)\n")
        self.assertEqual(documents.unknown_names(text, RECORDED, STAGES), [])

    def test_a_mark_that_names_nothing_is_named_with_its_line(self):
        text = ("one <!--fig wrok.cached_rows-->5<!--/-->\n"
                "<!--fig paged.no_such_figure()-->x<!--/-->\n\n"
                "<!--block lossy.no_such_table-->\n| a |\n\n"
                "<!--picture nowhere.drawn-->\n![a picture](kv-x.svg)\n")
        problems = documents.unknown_names(text, RECORDED, STAGES)
        self.assertEqual(len(problems), 4, problems)
        self.assertRegex(problems[0], r"^line 1, <!--fig wrok\.cached_rows-->.*no entry 'wrok' "
                                      r"in the record.*trace_kv\.STAGES")
        self.assertIn("line 2", problems[1])
        self.assertIn("paged.py has no function no_such_figure", problems[1])
        self.assertIn("lossy.py has no function no_such_table", problems[2])
        self.assertIn("nowhere.drawn names no module of the lab", problems[3])

    def test_an_entry_missing_from_the_record_is_a_key_error_that_names_it(self):
        with self.assertRaisesRegex(KeyError, "work.rows has no 'rows'"):
            documents.entry("work.rows", RECORDED, {})


class Write(unittest.TestCase):

    def test_write_refuses_a_mark_that_names_nothing_before_it_runs_anything(self):
        with tempfile.TemporaryDirectory() as folder:
            for name, text in (("README.md", "a <!--fig pagd.slots-->3<!--/--> b\n"),
                               ("kv-trace.json", '{"paged": {"slots": 3}}\n')):
                with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                    f.write(text)
            done = subprocess.run([sys.executable, os.path.join(HERE, "trace_kv.py"), "--write",
                                   "--folder", folder], capture_output=True, text=True,
                                  timeout=60)
            self.assertEqual(done.returncode, 1, done.stderr)
            self.assertIn("README.md line 1, <!--fig pagd.slots-->3<!--/-->: no entry 'pagd'", done.stderr)
            self.assertNotIn("Running", done.stderr)   # no run started
            self.assertEqual(sorted(os.listdir(folder)), ["README.md", "kv-trace.json"])


if __name__ == "__main__":
    unittest.main()
