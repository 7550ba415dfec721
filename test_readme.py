"""The course's documents (README.md, each Part's file, the Reference, CONTRIBUTING.md)
against the record and the code: every figure, block and picture they mark, the course
map's figures, their links, the glossary's terms and the lab's names they quote.

Every figure a document quotes from the record (kv-trace.json, kv-time.json) is marked
with the entry it comes from, every figure of the course map (words, minutes, lines) with
the course_map function that counts it, and every table, text block and diagram made by
the code with the function that makes it (documents.py). python3 trace_kv.py --write
rewrites them all, so after a --write these checks hold; a change of the code, of the
documents or a retrained model that changes what they show fails them until the next
--write. The commands and sessions they show are test_examples'. The exactness of the
cache is tested elsewhere."""
import collections
import importlib
import inspect
import json
import os
import re
import tempfile
import unittest
import unittest.mock

import course_map
import documents
import trace_kv
import trace_records
from course_map import (EXERCISES, anchor, code_lines, course, heading_offsets,
                        is_lab_module, opening, parts, prose_words, the_documents)
from documents import BLOCK, FIGURE, README
from support import HERE, ON_PURPOSE, lab_file
from verdicts import skip_unless_sound

WRITE = ("python3 trace_kv.py --write records the run and writes every marked figure and "
         "block of every document from it")
NUMBER = re.compile(r"(?<![\w.,])\d[\d,]*(?:\.\d+)?(?:e[-+]\d+)?(?![\w])")


def setUpModule():
    """The README shows what the code does: if a layer of the lab is wrong, its examples
    and figures wait (the layer's own tests say what is wrong)."""
    skip_unless_sound("every Part")


def readme():
    return lab_file("README.md")


def lab_json(name):
    return json.loads(lab_file(name))


def link_problems(texts, folder=HERE):
    """Each relative link of the documents whose file is not in the lab's folder, or whose
    #anchor names no heading of its file, a line each."""
    problems = []
    for name, text in texts.items():
        plain = re.sub(r"^```.*?^```$", lambda f: "\n" * f[0].count("\n"), text,
                       flags=re.M | re.S)
        for link in re.finditer(r"\]\(([^)\s]+)\)", plain):
            target, _, wanted = link[1].partition("#")
            if re.match(r"\w+:", target):   # https: and the like
                continue
            where = f"{name} line {documents.line_of(plain, link.start())}, ({link[1]})"
            if target and not os.path.isfile(os.path.join(folder, target)):
                problems.append(f"{where}: there is no file {target}")
            elif wanted and wanted not in heading_offsets(texts.get(target or name, "")):
                problems.append(f"{where}: {target or name} has no heading whose anchor is "
                                f"{wanted!r}")
    return problems


GLOSSARY = "reference.md"


def glossary(texts):
    """{term: its anchor} for every term of the Reference's glossary (its ### headings)."""
    text = texts[GLOSSARY]
    section = text[text.index("## Glossary"):]
    section = section[:re.search(r"^## (?!Glossary)", section, re.M).start()]
    return {term: anchor(term) for term in re.findall(r"^### (.+)$", section, re.M)}


def first_use(texts, term):
    """(file, start, end) of the term's first use in the course's prose (the Parts'
    documents in their order; not in code, headings, comments or a link's address), as
    written or plural; its case counts only if it holds a capital. None if never used."""
    pattern = re.compile(rf"\b{re.escape(term)}s?\b", 0 if term != term.lower() else re.I)
    for name in dict.fromkeys(part.file for part in course(texts)):
        text = texts[name]
        hidden = [found.span() for found in BLOCK.finditer(text)] + [
            found.span() for found in re.finditer(
            r"^```.*?^```$|^#[^\n]*|^    [^\n]*|<!--[^\n]*?-->|`[^`\n]*`|\]\([^)]*\)", text, re.M | re.S)]
        for found in pattern.finditer(text):
            if not any(start <= found.start() < end for start, end in hidden):
                return name, found.start(), found.end()
    return None


def glossary_problems(texts):
    """Each glossary term not linked to its entry at its first use in the course."""
    problems = []
    for term, wanted in glossary(texts).items():
        used = first_use(texts, term)
        if not used:
            problems.append(f"{term!r} is in the glossary but the course never uses it")
            continue
        name, start, end = used
        link = re.compile(r"\[([^\]]*)\]\(([^)]*)\)")
        around = next((found for found in link.finditer(texts[name])
                       if found.start() < start < found.end()), None)
        if not around or around[2] != f"{GLOSSARY}#{wanted}":
            problems.append(f"{name} line {documents.line_of(texts[name], start)}: the first use of "
                            f"{term!r} must link to its entry, [{texts[name][start:end]}]"
                            f"({GLOSSARY}#{wanted})")
    return problems


LIBRARIES = "The same ideas in the libraries"   # the Reference's table of the libraries' names
LAB_NAME = re.compile(r"([A-Za-z_][\w.]*)(?:\(([\w, ]*)\))?")


def lab_names(texts):
    """(the row's idea, the text in backticks) for each name in the "here" column of the
    Reference's table of the libraries' names."""
    section = re.search(rf"^## {LIBRARIES}\n(.*?)(?=^## )", texts[GLOSSARY], re.M | re.S)[1]
    rows = [row.split("|")[1:3] for row in re.findall(r"^\|(?!---).*", section, re.M)][1:]
    return [(idea.strip(), name) for idea, here in rows
            for name in re.findall(r"`([^`]*)`", here)]


def lab_definitions():
    """{name: [each function and class of that name defined in a module of the lab]}."""
    found = collections.defaultdict(list)
    for module in sorted(file[:-3] for file in os.listdir(HERE) if file.endswith(".py")):
        if is_lab_module(module):
            for name, value in vars(importlib.import_module(module)).items():
                if (inspect.isfunction(value) or inspect.isclass(value)) \
                        and value.__module__ == module:
                    found[name].append(value)
    return found


def lab_name_problems(names, definitions):
    """Each name that is not `function`, `Class`, `module.name` or `Class.method` of the
    lab, or that shows an argument, `name(a, b)`, that it does not take."""
    problems = []
    for idea, text in names:
        written = LAB_NAME.fullmatch(text)
        if not written:
            problems.append(f"{idea!r}: `{text}` is not written as a name of the lab")
            continue
        first, *rest = written[1].split(".")
        found = [importlib.import_module(first)] if rest and is_lab_module(first) \
            else definitions.get(first, [])
        for part in rest:
            found = [getattr(owner, part) for owner in found if hasattr(owner, part)]
        found = [named for named in found if callable(named)]
        arguments = [a.strip() for a in (written[2] or "").split(",") if a.strip()]
        if not found:
            problems.append(f"{idea!r}: `{text}` is no function, class or method of the lab")
        else:
            missing = min((set(arguments) - set(inspect.signature(named).parameters)
                           for named in found), key=len)
            if missing:
                problems.append(f"{idea!r}: `{text}`: {written[1]} takes no argument "
                                f"{', '.join(sorted(missing))}")
    return problems


def sentences(text):
    """The sentences of text's prose (not code, tables, formulas), marks kept."""
    text = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
    for paragraph in re.split(r"\n\s*\n|\n(?=\s*[-*] )", text):   # a list item alone
        lines = [line for line in paragraph.splitlines()
                 if not line.startswith(("|", "    ", "<!--block", "<!--picture", "!["))]
        joined = " ".join(lines)
        held = FIGURE.sub(lambda found: "\0" * len(found[0]), joined)   # no split in a mark
        at = 0
        for cut in re.finditer(r"(?<=[.!?])\s+(?=[A-Z(`*\[<\0])", held):
            yield joined[at:cut.start()]
            at = cut.end()
        yield joined[at:]


def crowded_sentences(text):
    """Each sentence of text with more than three figure marks, a line each."""
    return [f"{len(FIGURE.findall(sentence))} figure marks in one sentence, more "
            f"than 3: {FIGURE.sub(lambda f: f[2], sentence)[:120]!r}"
            for sentence in sentences(text) if len(FIGURE.findall(sentence)) > 3]


def figure_problems(text, record, timing):
    """Every marked figure and block of text that is not what the record, the timing and
    the code give now, a line each (naming the README's line and both values)."""
    marks = list(FIGURE.finditer(text))
    starts = {found.start() for found in marks}
    problems = [f"line {documents.line_of(text, begun.start())}: a <!--fig mark without its <!--/--> on "
                f"the same line" for begun in re.finditer("<!--fig ", text)
                if begun.start() not in starts and text[begun.start() - 1] != "`"]
    for found in marks:
        try:
            wanted = documents.figure(found[1], record, timing)
        except (KeyError, IndexError, ValueError, TypeError) as e:
            wanted = f"no figure ({type(e).__name__}: {e})"
        if found[2] != wanted:
            problems.append(f"line {documents.line_of(text, found.start())}: <!--fig {found[1]}--> shows "
                            f"{found[2]!r}, where the record gives {wanted!r}")
    for found in BLOCK.finditer(text):
        where = f"line {documents.line_of(text, found.start())}, block {found[1]}"
        try:
            draw = documents.drawing(found[1])
        except ValueError as e:
            problems.append(f"{where}: {e}")
            continue
        shown, wanted = found[2].splitlines(), draw(record, timing)
        if shown != wanted:
            first = next((i for i, (a, b) in enumerate(zip(shown, wanted)) if a != b),
                         min(len(shown), len(wanted)))
            problems.append(f"{where}, its line {first + 1}: the README shows "
                            f"{(shown + ['(nothing)'])[first]!r}, the code gives "
                            f"{(wanted + ['(nothing)'])[first]!r}")
    return problems


def _leaves(value, path=()):
    """(path, number) for every number in a record, its path as a mark names it."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, path + (str(key),))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, path + (str(index),))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield ".".join(path), value


def unmarked_quotes(text, record):
    """Figures of the README's prose and tables written as an entry of the record is
    (a count of 1,000 or more, or a fraction), but not marked: each would go stale at the
    next --write, so each must be marked (a line each). Only kv-trace.json's: it is the
    same on every machine, so a --write cannot make a figure agree with it by chance."""
    entries = {}
    for path, number in _leaves(record):
        if number >= 1000 or number != int(number):   # 64 positions: a count of all
            for shown in {documents.shown(number), f"{number:,}"}:
                entries.setdefault(shown, path)

    def blank(found):   # keep the line numbers
        return "\n" * found[0].count("\n")
    plain = FIGURE.sub(blank, BLOCK.sub(blank, text))
    plain = re.sub(r"^```.*?^```$", blank, plain, flags=re.M | re.S)
    return [f"line {documents.line_of(plain, found.start())}: {found[0]} is written as "
            f"{entries[found[0]]} of the record, unmarked"
            for found in NUMBER.finditer(plain) if found[0] in entries]


def map_problems(texts):
    """The lesson's sections within 2,500 words; the README's map and each Part's opening
    giving their figures as marks of course_map (the figure check compares each with its
    rule): each Part's prose cell, and for a Part with code its last cell and its opening's
    "With its code, N to M minutes."."""
    problems = []
    lesson = course(texts)[0].text
    words = len(prose_words(lesson, r"^#+ 1\. ", EXERCISES))   # sections 1 to 14 alone
    if words > 2500:
        problems.append(f"the lesson (sections 1 to 14, without code, tables and formulas) "
                        f"has {words:,} words, more than 2,500")
    with_code = course(texts)
    for part in parts(texts):
        cells = [(part.words, f"course_map.prose({part.file})")]
        if part in with_code:
            cells.append((part.time, f"course_map.with_code({part.file})"))
            said = f"With its code, <!--fig course_map.minutes({part.file})-->"
            if said not in " ".join(opening(part).split()):
                problems.append(f"{part.name}'s opening ({part.file}) must say \"{said}N to M "
                                f"minutes<!--/-->.\"")
        for cell, name in cells:
            if not re.fullmatch(rf"<!--fig {re.escape(name)}-->[^<]*<!--/-->", cell):
                problems.append(f"the README's map must give {part.name} the mark "
                                f"<!--fig {name}-->, not {cell!r}")
    rows = parts(texts)
    for at, part in enumerate(rows):   # links to the rows around it, filled by --write
        for name, needed in (("next_part", at < len(rows) - 1), ("previous_part", at > 0)):
            mark = f"<!--fig course_map.{name}({part.file})-->"
            if needed and mark not in part.text:
                problems.append(f"{part.file} must link the {name.split('_')[0]} row of the "
                                f"map by the mark {mark}")
    return problems


def digit_problems(name, text):
    """Decimal figures of a Part's prose and tables (not what a command prints) with more
    than 6 significant digits: a reader gets them rounded."""
    text = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
    prose = "\n".join(line for line in FIGURE.sub(lambda found: found[2], text).splitlines()
                      if not line.startswith("    "))
    return [f"{name} prints {figure}: round it (documents.shown does)"
            for figure in re.findall(r"\d[\d,]*\.\d+(?:e[-+]?\d+)?", prose)
            if len(re.sub(r"e.*|\D", "", figure).lstrip("0")) > 6]


def course_digit_problems(texts):
    return [problem for part in course(texts)
            for problem in digit_problems(part.file, texts[part.file])]


def slower(timing, uncached, cached):
    """The timing of a run on a machine where the uncached path takes uncached times as
    long and the cached one cached times: every time scaled, every ratio of them again."""
    def scaled(entry):
        entry = dict(entry)
        for key in entry:
            if key.endswith(("seconds", "per_row")):
                entry[key] = round(entry[key] * (uncached if "uncached" in key else cached), 4)
        if "speedup" in entry:
            entry["speedup"] = round(entry["uncached_seconds"] / entry["cached_seconds"], 2)
        return entry
    slow = scaled(timing)
    slow["cost_by_length"] = [scaled(entry) for entry in timing["cost_by_length"]]
    return slow


def words_but_figures(text):
    """The words of text, every number in them a figure N: what no run may change (a
    word that a mark or a block chose by a timing shows here)."""
    return re.sub(r"\d[\d,.]*(?:e[-+]?\d+)?", "N", text).split()


def first_changed_word(text, other):
    """None, or the first word (not a figure) where other differs from text, in context."""
    words, others = words_but_figures(text), words_but_figures(other)
    at = next((i for i, (a, b) in enumerate(zip(words, others)) if a != b),
              None if len(words) == len(others) else min(len(words), len(others)))
    return None if at is None else (f"{' '.join(words[max(at - 8, 0):at + 3])!r} became "
                                    f"{' '.join(others[max(at - 8, 0):at + 3])!r}")


class Figures(unittest.TestCase):
    """Every figure from the record in one place: the record; each document marks it."""

    @classmethod
    def setUpClass(cls):
        cls.record, cls.timing = lab_json(trace_kv.TRACE), lab_json(trace_kv.TIMES)
        cls.texts = the_documents()

    def assert_none(self, problems, what):
        if problems:
            self.fail(f"{len(problems)} {what}; the first: {problems[0]}"
                      + "".join(f"\n  {problem}" for problem in problems[1:5]))

    def each_document(self, check):
        return [f"{name} {problem}" for name, text in self.texts.items()
                for problem in check(text)]

    def test_every_marked_figure_and_block_is_what_the_record_and_the_code_give(self):
        self.assert_none(self.each_document(lambda text: figure_problems(
            text, self.record, self.timing)), f"marks are out of date ({WRITE})")

    def test_no_figure_of_the_record_is_quoted_unmarked(self):
        self.assert_none(self.each_document(lambda text: unmarked_quotes(text, self.record)),
                         "figures quote the record without a mark (write "
                         "<!--fig PATH-->figure<!--/-->, PATH as the message names it)")

    def test_a_write_on_a_slower_or_a_faster_machine_changes_no_word_but_figures(self):
        """The documents as --write would write them after a run three times slower (the
        cached path three and a half), and after one three times faster: only figures
        change, no word of the prose or of a block, and every check still holds."""
        for pace in (3.0, 1 / 3):
            timing = slower(self.timing, pace, pace * 7 / 6)
            self.assertNotEqual(timing["speedup"], self.timing["speedup"])
            texts = {name: documents.rendered(text, self.record, timing)
                     for name, text in self.texts.items()}
            self.assertNotEqual(texts, self.texts)
            for name, text in texts.items():
                with self.subTest(pace=pace, document=name):
                    changed = first_changed_word(self.texts[name], text)
                    if changed:
                        self.fail(f"{name}: a timing changed a word: {changed}")
                    self.assert_none(figure_problems(text, self.record, timing) +
                                     unmarked_quotes(text, self.record),
                                     f"problems of the rewritten {name}")
            with self.subTest(pace=pace, check="lengths and digits"):
                self.assert_none(map_problems(texts) + course_digit_problems(texts),
                                 "problems of the rewritten documents")

    def test_the_map_and_each_opening_give_their_figures_by_marks(self):
        self.assert_none(map_problems(self.texts), f"the course map is typed. {ON_PURPOSE}")

    def test_a_map_cell_or_an_opening_typed_by_hand_is_found(self):
        """A cell whose figure is off is a mark out of date; a cell, an opening or a link to
        the next Part typed without its mark is found by map_problems."""
        text = self.texts[README]
        cell = next(found for found in FIGURE.finditer(text)
                    if found[1] == "course_map.with_code(README.md)")
        wrong = text.replace(cell[0], cell[0].replace(" to ", " to 1", 1))
        self.assertEqual(len(figure_problems(wrong, self.record, self.timing)), 1)
        typed = dict(self.texts, **{README: text.replace(cell[0], cell[2]).replace(
            "<!--fig course_map.minutes(README.md)-->", "")})
        self.assertEqual(len(map_problems(typed)), 2, map_problems(typed))
        part = "part4-a-servers-life.md"
        linked = dict(self.texts, **{part: self.texts[part].replace(
            f"<!--fig course_map.next_part({part})-->", "")})
        self.assertEqual(map_problems(linked), [f"{part} must link the next row of the map by "
                                                f"the mark <!--fig course_map.next_part({part})-->"])

    def test_no_figure_in_the_text_has_more_than_6_significant_digits(self):
        self.assert_none(course_digit_problems(self.texts), "figures are too long")

    def test_no_sentence_carries_more_than_three_figure_marks(self):
        self.assert_none(self.each_document(crowded_sentences),
                         "sentences are too crowded with figures (say them in a table)")

    def test_a_write_that_cannot_fill_a_mark_of_one_document_writes_no_file(self):
        """--write draws every document before it writes any: a mark of the second
        document that the run cannot fill leaves the first, and the records, as they were."""
        before = {"README.md": "a <!--fig stories-->1<!--/-->\n",
                  "part2-x.md": "b <!--fig no.such.entry-->2<!--/-->\n",
                  trace_kv.TRACE: "the previous trace\n"}
        with tempfile.TemporaryDirectory() as folder:
            for name, text in before.items():
                with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                    f.write(text)
            with self.assertRaisesRegex(ValueError, r"^part2-x\.md: a mark cannot be "
                                                    r"filled .*nothing was written"):
                trace_records.save_records({"stories": 60}, {}, folder)
            after = {}
            for name in os.listdir(folder):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    after[name] = f.read()
        self.assertEqual(after, before)

    def test_every_link_between_documents_finds_its_file_and_heading(self):
        self.assert_none(link_problems(self.texts), "links go nowhere")

    def test_the_quick_start_gives_the_run_time_as_the_progress_line_does(self):
        shown = FIGURE.sub(lambda found: found[2], self.texts[README])
        self.assertIn(trace_records.last_duration().strip(), shown)

    def test_section_9_gives_llama_2_7b_s_weights_as_bandwidth_counts_them(self):
        """Section 9's weights, in GB and in GiB, are bandwidth.llama_parameters' at 2
        bytes a number (section 29 quotes them from the same code)."""
        import bandwidth
        weights = 2 * bandwidth.llama_parameters(bandwidth.LLAMA_2_7B)
        self.assertIn(f"Llama-2-7B's weights ({weights / 1e9:.2f} GB, {weights / 2**30:.2f} GiB)",
                      self.texts[README])

    def test_each_glossary_term_is_linked_at_its_first_use(self):
        self.assert_none(glossary_problems(self.texts), "terms are not linked to the glossary")

    def test_the_libraries_table_names_the_lab_as_it_is(self):
        """Each name in backticks in the "here" column of the Reference's table of the
        libraries' names is a function, class or method of the lab, with the arguments it
        shows; a table with a wrong name and a wrong argument gives two problems."""
        definitions = lab_definitions()
        names = lab_names(self.texts)
        self.assertGreaterEqual(len(names), 20)
        self.assert_none(lab_name_problems(names, definitions),
                         f"names in reference.md's table \"{LIBRARIES}\" are not the lab's")
        table = (f"## {LIBRARIES}\n\n| the idea | here |\n|---|---|\n"
                 f"| a | `KVCache.crop(lenght)` |\n"
                 f"| b | `kv_cache.forward_stp`, `WindowCache(window, sinks)` |\n\n## Glossary\n")
        self.assertEqual(len(lab_name_problems(lab_names({GLOSSARY: table}), definitions)), 2)

    def test_a_link_check_finds_a_missing_file_and_a_missing_heading(self):
        texts = {"README.md": "# The lab\n\n## Quick start, again\n\n[a](part9.md) "
                              "[b](#quick-start-again) [c](other.md#nowhere) [d](#the-lab) "
                              "[e](https://x.y/z#w)\n",
                 "other.md": "# Other\n"}
        with tempfile.TemporaryDirectory() as folder:
            for name in texts:
                open(os.path.join(folder, name), "w").close()
            problems = link_problems(texts, folder)
        self.assertEqual(len(problems), 2, problems)
        self.assertIn("no file part9.md", problems[0])
        self.assertIn("'nowhere'", problems[1])
        self.assertEqual(anchor("Every bad input, and what it gets"),
                         "every-bad-input-and-what-it-gets")
        self.assertEqual(anchor("20. Batched decode, and `serve`'s kernels"),
                         "20-batched-decode-and-serves-kernels")

    def test_a_sentence_with_four_marks_is_found(self):
        mark = "<!--fig a.b-->1.5<!--/-->"
        text = (f"One {mark} and {mark}, {mark}: {mark}.\n\nTwo {mark}, {mark} and "
                f"{mark}. Three {mark}.\n")
        self.assertEqual(len(crowded_sentences(text)), 1)

    def test_the_two_paths_name_the_code_as_it_is(self):
        """Section 4's picture: every function and class it names is the lab's."""
        import generate
        import kv_cache
        import model
        start = readme().index("### 4. ")
        picture = readme()[start:readme().index("```\n", readme().index("```text", start) + 7)]
        names = {word for word in re.findall(r"\b[A-Za-z]\w*(?:\.\w+)?", picture)
                 if len(word) > 2 and ("_" in word or "." in word
                                       or any(map(str.isupper, word[1:])))}
        names |= set(re.findall(r"\bgenerate(?=:)", picture))   # a heading names its generator
        self.assertGreaterEqual(len(names), 5, names)
        for name in sorted(names):
            module, _, attribute = name.rpartition(".")
            owners = [{"model": model, "generate": generate}[module]] if module else [
                kv_cache, generate]
            with self.subTest(name=name):
                self.assertTrue(any(hasattr(owner, attribute) for owner in owners), name)

    def test_the_pictures_show_what_their_prose_says(self):
        """Section 5: one line differs in where the keys and values come from; section
        16: the second prompt shares a block; section 21: a request is preempted."""
        import paged
        import serving
        import trace_lesson
        changed = [line for line in trace_lesson.the_row_side_by_side()[3:] if line[:1] in "+-"]
        self.assertEqual(len([line for line in changed
                              if line[1:].startswith("keys, values =")]), 2)
        self.assertIn("refs 2  (held by A and B)", "".join(paged.block_tables()))
        self.assertIn("x", "".join(line[32:] for line in serving.timeline()[1:-1]))

    def test_a_mark_names_an_entry_by_its_keys_its_items_and_a_format(self):
        record = {"work": {"rows": 20509}, "runs": [{"kind": "a", "n": 2, "gap": 0.0},
                                                    {"kind": "b", "n": 2, "gap": 2.354e-14}]}
        for mark, shown in (("work.rows", "20,509"), ("runs.1.gap", "2.354e-14"),
                            ("runs.kind=a&n=2.gap", "0.0"), ("time.share:.1%", "51.2%"),
                            ("time.ok", "yes")):
            with self.subTest(mark=mark):
                self.assertEqual(documents.figure(mark, record, {"share": 0.512, "ok": True}),
                                 shown)
        import trace_lesson
        text = ("a <!--fig work.rows-->1<!--/--> b\n<!--block trace_lesson.greedy_examples-->\n"
                "old\n\nc")
        with unittest.mock.patch.object(trace_lesson, "greedy_examples",
                                        lambda r, t: ["new", "lines"]):
            self.assertEqual(documents.rendered(text, record, {}),
                             "a <!--fig work.rows-->20,509<!--/--> b\n"
                             "<!--block trace_lesson.greedy_examples-->\nnew\nlines\n\nc")
            self.assertEqual(len(figure_problems(text, record, {})), 2)
        with self.assertRaisesRegex(KeyError, "picks 2 items"):
            documents.figure("runs.n=2.gap", record, {})

    def test_the_lesson_counts_its_words_without_code_tables_and_formulas(self):
        text = ("### 1. One\n\nTwo words, [a link](https://x.y/z).\n\n```python\nx = 1\n```\n"
                "| a | table |\n    a formula\n<!-- a comment -->\n- a list `item`\n")
        self.assertEqual(prose_words(text),
                         ["1.", "One", "Two", "words,", "[a", "link].", "a", "list", "`item`"])

    def test_a_part_counts_the_lines_of_the_lab_s_code_it_names_first(self):
        import deep_model
        import kv_cache
        texts = {README: "| [the lesson](#the-lesson) | 1 | x | y |\n"
                         "| [Part 2](part2.md) | 2 | x | y |\n\n## The lesson\n\n"
                         "### 1. One\n[kv_cache.py](kv_cache.py): `forward_step`, "
                         "`feed(ids)`, `math.fsum`, `cache.crop`\n",
                 "part2.md": "# Part 2\n\nThe modules it adds: [prefill.py](prefill.py).\n\n"
                             "## 2. Two\n`forward_step` again, `prefill.prefill`, "
                             "`deep_model.forward_step`, [deep_model.py](deep_model.py), "
                             "`DeepCache`\n"}
        source = lab_file("prefill.py")
        lines = [len(inspect.getsourcelines(named)[0]) for named in (
            kv_cache.forward_step, kv_cache.feed, deep_model.forward_step, deep_model.DeepCache)]
        self.assertEqual(code_lines(texts), {
            "the lesson": lines[0] + lines[1],
            "Part 2": source[:course_map.EXPERIMENT_RULE.search(source).start()].count("\n")
            + lines[2] + lines[3]})

    def test_the_reference_quotes_the_checkpoint_figures(self):
        meta = lab_json("best.json")["meta"]
        val, baseline = meta["val_loss"], meta["unigram_baseline"]
        text = lab_file("reference.md")
        for figure in (f"| {baseline:.4f} nats per token |",
                       f"| {val:.4f} nats per token, {val / baseline:.1%} of the baseline |",
                       f"best validation loss {val:.4f} = {val / baseline:.1%} of the unigram "
                       f"baseline (epoch {meta['epoch']})"):
            with self.subTest(figure=figure):
                self.assertTrue(figure in text, f"not in reference.md. {ON_PURPOSE}.")



if __name__ == "__main__":
    unittest.main()


if __name__ == "__main__":
    unittest.main()
