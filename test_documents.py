"""documents.py, the filling of the documents' marks: what a mark may name, and that a
mark naming nothing is found in a moment, before python3 trace_kv.py --write runs the lab,
and that what is drawn by running the lab's code comes from the folder written. (That
every document's marks are what the record gives is test_readme's.)"""
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import bpe
import checkpoint
import documents
import model
import svg
import verdicts
from stories import openings, split_stories
from support import HERE, lab_file

CONFLICT = re.compile(r"^(<{7} |={7}$|>{7} )", re.M)   # what a merge leaves when it stops

RECORDED = {"work": {"cached_rows": 5}, "paged": {"slots": 3}}
RECORD, TIMING = (json.loads(lab_file(name)) for name in (documents.TRACE, documents.TIMES))
SHAPE = {"work": {"cached_rows": svg.COUNT}, "paged": {"slots": svg.COUNT},   # as declared
         "eviction": {"kept": svg.COUNT, "rungs": [{"cache": str, "gap": svg.optional(svg.COUNT)}]}}
TIME_SHAPE = {"speedup": svg.COUNT}


class Marks(unittest.TestCase):

    def test_a_mark_may_name_the_record_a_stage_to_come_or_a_function_of_the_lab(self):
        text = ("<!--fig work.cached_rows-->5<!--/--> <!--fig time.speedup-->1<!--/-->\n"
                "<!--fig eviction.kept-->1<!--/--> <!--fig forks.forks_table()-->x<!--/-->\n"
                "<!--fig eviction.rungs.0.gap:.2f-->1<!--/--> "
                "<!--fig eviction.rungs.cache=int4&gap=0.cache-->1<!--/-->\n\n"
                "<!--block lossy.ladder_table-->\n| a |\n\n"
                "<!--picture lossy.ladder_picture-->\n![the ladder](kv-ladder.svg)\n")
        self.assertEqual(documents.unknown_names(text, SHAPE, TIME_SHAPE), [])

    def test_a_mark_that_names_nothing_is_named_with_its_line(self):
        text = ("one <!--fig wrok.cached_rows-->5<!--/-->\n"
                "<!--fig paged.no_such_figure()-->x<!--/-->\n\n"
                "<!--block lossy.no_such_table-->\n| a |\n\n"
                "<!--picture nowhere.drawn-->\n![a picture](kv-x.svg)\n")
        problems = documents.unknown_names(text, SHAPE, TIME_SHAPE)
        self.assertEqual(len(problems), 4, problems)
        self.assertRegex(problems[0], r"^line 1, <!--fig wrok\.cached_rows-->.*no entry 'wrok' "
                                      r"in the record.*trace_kv\.STAGES")
        self.assertIn("line 2", problems[1])
        self.assertIn("paged.py has no function no_such_figure", problems[1])
        self.assertIn("lossy.py has no function no_such_table", problems[2])
        self.assertIn("nowhere.drawn names no module of the lab", problems[3])

    def test_a_mark_is_checked_against_the_declared_shapes_at_every_depth(self):
        """A wrong key under a known one, in a list's item, in a field picking an item,
        below a single value, and under time. (The stages' real declarations meet every
        document's marks in test_trace_kv.)"""
        marks = {"work.cached_rowz": "no entry 'cached_rowz' in the record's work",
                 "eviction.rungs.0.cahce": "no entry 'cahce' in the record's eviction.rungs.0",
                 "eviction.rungs.cahce=int4.gap": "the record's eviction.rungs's items have no "
                                                  "field 'cahce'",
                 "eviction.rungs.first.gap": "the record's eviction.rungs is a list: 'first' "
                                             "is neither",
                 "eviction.kept.count": "the record's eviction.kept is a single value: it has "
                                        "no 'count'",
                 "time.speedupp": "no entry 'speedupp' in kv-time.json"}
        text = "".join(f"<!--fig {mark}-->1<!--/-->\n" for mark in marks)
        problems = documents.unknown_names(text, SHAPE, TIME_SHAPE)
        self.assertEqual(len(problems), len(marks), problems)
        for (mark, problem), found in zip(marks.items(), problems):
            self.assertIn(f"<!--fig {mark}-->1<!--/-->: {problem}", found)

    def test_an_entry_missing_from_the_record_is_a_key_error_that_names_it(self):
        with self.assertRaisesRegex(KeyError, "work.rows has no 'rows'"):
            documents.entry("work.rows", RECORDED, {})


def block(text, name):
    """The lines of text's block marked name, as one string."""
    return next(found[2] for found in documents.BLOCK.finditer(text) if found[1] == name)


class Write(unittest.TestCase):

    def test_what_is_drawn_by_running_the_lab_comes_from_the_folder_written(self):
        """Part 2's block tables and Part 4's serving timeline are drawn by running the
        lab's code, not from the record: for another folder (the last 400 stories, a
        tokenizer trained on them, a random model), the documents get that folder's, which
        differ from the shipped folder's (test_readme's Figures: drawn from the shipped
        folder, they are what the documents hold)."""
        verdicts.skip_unless_sound("serving")   # it serves four requests to draw them
        stories = lab_file("corpus.txt").splitlines(keepends=True)[-400:]
        corpus = "".join(stories)
        tok = bpe.Tokenizer.train(corpus, model.VOCAB_SIZE)
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "corpus.txt"), "w", encoding="utf-8") as f:
                f.write(corpus)
            tok.save(os.path.join(folder, "tokenizer.json"))
            for name in documents.documents():   # the course map counts the folder's
                shutil.copy(os.path.join(HERE, name), folder)
            checkpoint.save(os.path.join(folder, "best.json"), model.init_params(1),
                            checkpoint.CONFIG, checkpoint.input_signature(tok, corpus))
            # what each shows of the folder: the tokens of the first block, the openings
            first_block = ", ".join("space" if tok.vocab[t] == " " else tok.vocab[t]
                                    for t in tok.encode("mia was sad.")[:4])
            for name, document, shown in (
                    ("paged.block_tables", "part2-prefill-and-paging.md",
                     [f"block 0: {first_block} "]),
                    ("serving.timeline", "part4-a-servers-life.md",
                     openings(split_stories(corpus)[2])[:4])):
                with self.subTest(name):
                    text = lab_file(document)
                    self.assertIn(f"<!--block {name}-->", text)
                    # the shipped folder's block is the shipped text's (test_readme's Figures)
                    theirs = block(documents.rendered(text, RECORD, TIMING, folder), name)
                    self.assertNotEqual(theirs, block(text, name), f"{name}, drawn for "
                                        f"another folder, is the shipped folder's")
                    for part in shown:
                        self.assertIn(part, theirs)

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



def conflict_markers(folder):
    """Each line of folder's text files (its .py, .md, .json, .txt and .svg files, .ci/run
    and .gitattributes) that a merge left as a conflict marker: "FILE line N: MARKER"."""
    names = [name for name in sorted(os.listdir(folder))
             if name.endswith((".py", ".md", ".json", ".txt", ".svg")) or name == ".gitattributes"]
    names += [os.path.join(".ci", "run")] if os.path.isfile(os.path.join(folder, ".ci", "run")) else []
    found = []
    for name in names:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            text = f.read()
        found += [f"{name} line {documents.line_of(text, marker.start())}: {marker[1].strip()}"
                  for marker in CONFLICT.finditer(text)]
    return found


class Tables(unittest.TestCase):

    def test_a_cell_cannot_end_its_row_or_add_a_column(self):
        """A prompt from a record holding | or a line break stays in its cell."""
        lines = documents.table(["prompt", "n"], [["mia | was\nsad.", 3]])
        self.assertEqual(lines, ["| prompt | n |", "|---|---|", "| mia \\| was sad. | 3 |"])

    def test_a_record_s_text_is_shown_as_it_is_not_as_markup(self):
        """Escaped as text (plain), or as code whatever backticks it holds (code); a story
        indented on one line."""
        self.assertEqual(documents.plain("a <b>`c`*d*_e_[f]&x\\"),
                         "a \\<b\\>\\`c\\`\\*d\\*\\_e\\_\\[f\\]\\&x\\\\")
        self.assertEqual([documents.code(text) for text in ("mia ran.", "a`b", "`a``")],
                         ["`mia ran.`", "``a`b``", "``` `a`` ```"])
        self.assertEqual(documents.indented(["one\ntwo\n", "three\n"]),
                         ["    one two", "    three"])


class ConflictMarkers(unittest.TestCase):

    def test_no_file_of_the_lab_holds_a_merge_s_conflict_markers(self):
        self.assertEqual(conflict_markers(HERE), [], "a merge left its conflict markers: "
                         "keep the lines each side meant, and remove the markers")

    def test_a_conflict_marker_is_found_by_file_and_line(self):
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "x.md"), "w", encoding="utf-8") as f:
                f.write("a\n<<<<<<< HEAD\nb\n=======\nc\n>>>>>>> other\n== not one\n")
            self.assertEqual(conflict_markers(folder), ["x.md line 2: <<<<<<<",
                                                        "x.md line 4: =======",
                                                        "x.md line 6: >>>>>>>"])



def docstring_problems(source, name):
    """Where the module source (file name) strays from the style guide's docstrings: each
    public function and class opens with one line, a sentence saying what it does, then a
    blank line before any details; a method may have none, leaning on its class's."""
    problems = []

    def look(node, prefix):
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.ClassDef)) or child.name[0] == "_":
                continue
            where, doc = f"{name} line {child.lineno}, {prefix}{child.name}", ast.get_docstring(child)
            if doc is None:
                if not prefix:
                    problems.append(f"{where}: no docstring")
            elif "\n" in doc.split("\n\n")[0] or not doc.split("\n")[0].endswith("."):
                problems.append(f"{where}: its first line is not a sentence of its own "
                                f"({doc.split(chr(10))[0]!r})")
            if isinstance(child, ast.ClassDef):
                look(child, f"{child.name}.")
    look(ast.parse(source), "")
    return problems


class Docstrings(unittest.TestCase):

    def test_each_public_function_and_class_opens_with_one_line_that_says_what_it_does(self):
        problems = []
        for name in sorted(os.listdir(HERE)):
            if name.endswith(".py") and not name.startswith("test_"):
                problems += docstring_problems(lab_file(name), name)
        if problems:
            self.fail(f"{len(problems)} docstrings do not open with one line that says what "
                      f"the function or class does, then a blank line, then the details:\n"
                      + "\n".join(problems[:10]))

    def test_a_docstring_that_opens_with_two_lines_or_none_is_found(self):
        source = ('def f():\n    """Does one thing.\n\n    Then details."""\n'
                  'def g():\n    """Does\n    two lines."""\n'
                  'def h():\n    pass\n'
                  'class C:\n    """A thing."""\n    def m(self):\n        """no stop"""\n'
                  '    def n(self):\n        pass\n')
        self.assertEqual(docstring_problems(source, "x.py"), [
            "x.py line 5, g: its first line is not a sentence of its own ('Does')",
            "x.py line 8, h: no docstring",
            "x.py line 12, C.m: its first line is not a sentence of its own ('no stop')"])


if __name__ == "__main__":
    unittest.main()
