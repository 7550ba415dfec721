"""documents.py, the filling of the documents' marks: what a mark may name, and that a
mark naming nothing is found in a moment, before python3 trace_kv.py --write runs the lab,
and that what is drawn by running the lab's code comes from the folder written. (That
every document's marks are what the record gives is test_readme's.)"""
import ast
import copy
import inspect
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET

import bpe
import checkpoint
import documents
import model
import support
import svg
import verdicts
from stories import openings, split_stories
from support import HERE, lab_file, paths

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


class HostileRecords(unittest.TestCase):
    """Every table and picture the documents mark, drawn from random edits of the shipped
    record and timing: its normal output, or a ValueError naming the record's key."""

    MARKUP = "a|b\n<b>`c`*d*"   # a cell's end, a line break, HTML and Markdown
    WILD = (None, 10 ** 400, -1, 0.5, math.nan, True, "3", [], {}, MARKUP)
    EACH = 20   # the default cases for each function

    @classmethod
    def setUpClass(cls):
        """The functions drawn from the record (whose record has no default), by mark, each
        with the paths of the record and the timing it reads."""
        marked = [name for text in map(lab_file, documents.documents()) for name in
                  [m[1] for m in documents.BLOCK.finditer(text)]
                  + [name for name, _ in documents.PICTURE.findall(text)]]
        cls.drawings = {name: draw for name, draw in map(
            lambda name: (name, documents.drawing(name)), marked)
            if inspect.signature(draw).parameters["record"].default is inspect.Parameter.empty}
        cls.reads = {}
        for name, draw in cls.drawings.items():
            read = set()
            draw(Reads(RECORD, ("record",), read), Reads(TIMING, ("time",), read))
            cls.reads[name] = sorted(read, key=repr)

    def problem(self, name, record, timing):
        """None if name draws record and timing, or refuses them naming a key; else why."""
        try:
            drawn = self.drawings[name](record, timing)
        except ValueError as refused:
            why = str(refused)
            return (None if why.startswith("the record") and why.isprintable()
                    and len(why) < 400 else f"{name} refused it with {why[:400]!r}")
        if isinstance(drawn, str):
            ET.fromstring(drawn)   # a picture: valid XML (test_pictures checks the rest)
            return None if len(drawn) < 100_000 else f"{name} drew {len(drawn):,} characters"
        lines = "\n".join(drawn).splitlines()
        cells = [len(re.findall(r"(?<!\\)\|", line)) for line in lines if line.startswith("|")]
        if len(set(cells)) > 1 or len(lines) != len(drawn):
            return f"{name} wrote rows of {sorted(set(cells))} | or a line break: {drawn}"
        quoted = documents.code(" ".join(self.MARKUP.splitlines())).replace("|", "\\|")
        if any(markup in line.replace(quoted, "") for line in lines if line.startswith("|")
               for markup in ("<b>", "`c`", "*d*")):   # in a table, as code or escaped only
            return f"{name} copied the record's markup: {drawn}"
        return None

    def test_random_edits_draw_each_table_and_picture_or_are_refused_naming_a_key(self):
        """Case n edits what the (n % count)th function reads, and draws it: 1 to 3 edits (a
        key removed, a value null, huge, negative, NaN, of another type or with markup, a
        list cut to one item, doubled or too long), or in 3 cases of 10 one of its texts
        made markup alone. Each edit draws a key of the record or the timing that the
        function reads, then a path below it."""
        names = sorted(name for name, reads in self.reads.items() if reads)

        def trial(number):
            rng, name = random.Random(number), names[number % len(names)]
            both = {"record": RECORD, "time": TIMING}
            read = {kind: [path for path in self.reads[name] if isinstance(at(both, path), kind)]
                    for kind in (str, list, object)}
            markup = bool(read[str]) and rng.random() < 0.3
            both, copied = {"record": dict(RECORD), "time": dict(TIMING)}, set()
            for _ in range(1 if markup else rng.choice((1, 1, 2, 3))):
                kind = "markup" if markup else rng.choice(("remove", "list", "value"))
                paths = read[str] if markup else read[list] if kind == "list" and read[list] \
                    else read[object]
                top = rng.choice(sorted({path[:2] for path in paths}))   # a key, then a path
                *within, last = path = rng.choice([p for p in paths if p[:2] == top])
                if len(path) > 2 and path[:2] not in copied and reaches(both[path[0]], path[1]):
                    both[path[0]][path[1]] = copy.deepcopy(both[path[0]][path[1]])
                    copied.add(path[:2])   # the shipped record is never edited
                inner = both
                for step in within:
                    inner = inner[step] if reaches(inner, step) else None
                if not reaches(inner, last):   # an earlier edit took the path away
                    continue
                if kind == "remove" and isinstance(inner, dict):
                    del inner[last]
                elif kind == "list" and isinstance(inner[last], list) and inner[last]:
                    inner[last] = rng.choice((inner[last][:1], inner[last] * 2,
                                              inner[last] * (svg.MOST_ITEMS + 1)))
                else:
                    inner[last] = self.MARKUP if markup else rng.choice(self.WILD)
            return self.problem(name, both["record"], both["time"])
        support.check_random_cases(self, self.EACH * len(names), trial)


class Reads(dict):
    """A copy of a record's dict that notes the path of each entry read of it (by [], get,
    in or iteration), at every depth, in read."""

    def __init__(self, value, where, read):
        super().__init__(value)
        self.where, self.read = where, read

    def __getitem__(self, key):
        self.read.add((*self.where, key))
        return watched(super().__getitem__(key), (*self.where, key), self.read)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def __contains__(self, key):
        self.read.add((*self.where, key))
        return super().__contains__(key)

    def items(self):
        return [(key, self[key]) for key in self]

    def values(self):
        return [self[key] for key in self]


class ReadList(list):
    """A copy of a record's list that notes each item read of it (Reads)."""

    def __init__(self, value, where, read):
        super().__init__(value)
        self.where, self.read = where, read

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        self.read.add((*self.where, index % len(self)))
        return watched(super().__getitem__(index), (*self.where, index % len(self)), self.read)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def watched(value, where, read):
    """value, noting what is read of it if it is a dict or a list (Reads, ReadList)."""
    if isinstance(value, dict):
        return Reads(value, where, read)
    return ReadList(value, where, read) if isinstance(value, list) else value


def at(value, path):
    """The value at path (a tuple of keys) in value."""
    for key in path:
        value = value[key]
    return value


def reaches(inner, key):
    """Whether inner (a dict or a list) holds key."""
    return (isinstance(inner, dict) and key in inner
            or isinstance(inner, list) and isinstance(key, int) and key < len(inner))


if __name__ == "__main__":
    unittest.main()
