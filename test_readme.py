"""The course's documents (README.md, each Part's file, the Reference, CONTRIBUTING.md)
against the code: every example, excerpt, diagram, figure and link they show.

Every figure a document quotes from the record (kv-trace.json, kv-time.json) is marked
with the entry it comes from, and every table, text block and diagram made by the code
with the function that makes it (documents.py). python3 trace_kv.py --write rewrites them
all, so after a --write on any machine these checks hold; a change of the code or a
retrained model that changes what the README shows fails them until the next --write.
The other checks: every example prints what is shown, every excerpt is in its function,
and each Part says its own length. The exactness of the cache is tested elsewhere."""
import collections
import doctest
import importlib
import inspect
import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import unittest
import unittest.mock

import documents
import trace_kv
from documents import BLOCK, FIGURE
from verdicts import skip_unless_sound

HERE = os.path.dirname(os.path.abspath(__file__))
ON_PURPOSE = ("If you did not mean to change this, `git diff` shows what did (and `git "
              "checkout -- FILE` undoes an edit). If you changed the code or retrained on "
              "purpose, this is expected: bring the document up to date")
WRITE = ("python3 trace_kv.py --write records the run and writes every marked figure and "
         "block of every document from it")
TIMES = re.compile(r"\d[\d,]*\.\d+ (s|µs)\b")   # seconds vary from run to run
NUMBER = re.compile(r"(?<![\w.,])\d[\d,]*(?:\.\d+)?(?:e[-+]\d+)?(?![\w])")


def setUpModule():
    """The README shows what the code does: if a layer of the lab is wrong, its examples
    and figures wait (the layer's own tests say what is wrong)."""
    skip_unless_sound("every Part")


def lab_file_text(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


def readme():
    return lab_file_text("README.md")


def lab_json(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return json.load(f)


def fenced_blocks(text):
    """(line number, first line, lines) of every fenced block of text."""
    return [(text[:found.start()].count("\n") + 2, found.group(1), found.group(2).splitlines())
            for found in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)]


def mismatch(shown, printed, source="the command"):
    """None if the lines printed match the lines shown, else the first line that does not:
    times are not compared, and a line "..." in shown stands for any number of lines."""
    shown = [TIMES.sub("<seconds>", line) for line in shown]
    printed = [TIMES.sub("<seconds>", line) for line in printed]
    at, skipping = 0, False
    for line in shown:
        if line == "...":
            skipping = True
            continue
        if skipping:
            found = next((i for i in range(at, len(printed)) if printed[i] == line), None)
            if found is None:
                return f"the README shows {line!r}, which {source} does not give after line {at}"
            at, skipping = found + 1, False
        elif at >= len(printed) or printed[at] != line:
            got = printed[at] if at < len(printed) else "(nothing more)"
            return f"line {at + 1}: the README shows {line!r}, {source} gives {got!r}"
        else:
            at += 1
    if not skipping and at < len(printed):
        return f"{source} gives more than the README shows, from line {at + 1}: {printed[at]!r}"
    return None


Part = collections.namedtuple("Part", "name file offset text words time")
MAP_ROW = re.compile(r"^\| \[([^\]]+)\]\(([\w.-]*)(?:#([\w-]+))?\)[^|\n]* \| [^|\n]* \| "
                     r"([^|\n]*) \| ([^|\n]*) \|$", re.M)
README = documents.README
EXERCISES = r"^#+ Exercises$"   # each Part ends with them
SECTION = re.compile(r"^#+ \d+\. ", re.M)        # a numbered section: the course's
WORDS_A_MINUTE = 130   # prose full of figures and cross-references, read with care


def the_documents():
    """{file: its text} for every document of the course."""
    return {name: lab_file_text(name) for name in documents.documents()}


def parts(texts):
    """Each row of the README's map of the course, in order: its name, its file, and its
    text (the whole file; for a row that links a heading, from that heading on), with the
    row's prose and time cells."""
    found = []
    for name, file, heading, words, time in MAP_ROW.findall(texts[README]):
        text = texts[file or README]
        offset = heading_offsets(text)[heading] if heading else 0
        found.append(Part(name, file or README, offset, text[offset:], words, time))
    return found


def course(texts):
    """The Parts with numbered sections, exercises and code (the Reference has none)."""
    return [part for part in parts(texts) if SECTION.search(part.text)]


def prose_words(text, start=None, end=None):
    """The words of the prose of text (from the heading start, up to the heading end:
    regular expressions), without code blocks, tables, indented formula blocks, comments
    and link targets; a marked figure counts as one word, whatever a run writes there."""
    if start:
        text = text[re.compile(start, re.M).search(text).start():]
    if end:
        text = text[:re.compile(end, re.M).search(text).start()]
    part = FIGURE.sub("figure", text)   # one word each
    part = re.sub(r"^```.*?^```$", "", part, flags=re.M | re.S)
    kept = [line for line in part.splitlines()
            if not line.startswith(("|", "    ", "<!--", "!["))]
    prose = re.sub(r"\]\([^)]*\)", "]", "\n".join(kept))
    return [word for word in prose.split() if re.search(r"[A-Za-z0-9]", word)]


def anchor(heading):
    """GitHub's anchor of a heading: lowercase, punctuation dropped but hyphens and
    spaces, spaces to hyphens (a link's target kept, its address dropped)."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def heading_offsets(text):
    """{anchor: where its heading starts} for every heading of text outside code blocks;
    a repeated anchor gets -1, -2 ... as on GitHub."""
    plain = re.sub(r"^```.*?^```$", lambda f: " " * len(f[0]), text, flags=re.M | re.S)
    found = {}
    for heading in re.finditer(r"^#+ (.*)$", plain, re.M):
        name, n = anchor(heading[1]), 1
        while name in found:
            name, n = f"{anchor(heading[1])}-{n}", n + 1
        found[name] = heading.start()
    return found


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
        if _is_lab_module(module):
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
        found = [importlib.import_module(first)] if rest and _is_lab_module(first) \
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


def opening(part):
    """A Part's text before its first numbered section."""
    return part.text[:SECTION.search(part.text).start()]


def length_problems(texts):
    """The lesson's sections within 2,500 words; the README's map giving each Part's words
    of prose and the minutes they take at 130 words a minute; each Part's opening saying
    the minutes with its code, as the map does."""
    problems = []
    lesson = course(texts)[0].text
    words = len(prose_words(lesson, r"^#+ 1\. ", EXERCISES))   # sections 1 to 14 alone
    if words > 2500:
        problems.append(f"the lesson (sections 1 to 14, without code, tables and formulas) "
                        f"has {words:,} words, more than 2,500")
    for part in parts(texts):
        words = len(prose_words(part.text))
        wanted = f"{words:,} words, about {round(words / WORDS_A_MINUTE)} minutes"
        minutes = re.match(r"\d+ to \d+ minutes", part.time)
        if part.words != wanted:
            problems.append(f"the README's map must give {part.name} {wanted!r}, not "
                            f"{part.words!r}")
        elif not minutes:
            problems.append(f"the README's map must give {part.name}'s time as \"N to M "
                            f"minutes\", not {part.time!r}")
        elif SECTION.search(part.text) and (f"With its code, {minutes[0]}."
                                            not in " ".join(opening(part).split())):
            problems.append(f"{part.name}'s opening ({part.file}) must say \"With its code, "
                            f"{minutes[0]}.\", as the README's map does")
    return problems


Exercise = collections.namedtuple("Exercise", "part file line title edit answer")


def exercises(texts):
    """Every exercise of every Part: its Part, its file and line, its title, its edit of
    the code if it asks for one ((file, old, new): "in FILE.py, change `OLD` to `NEW`")
    and the text of its answer (its <details> block)."""
    found = []
    for part in course(texts):
        at = part.offset + re.search(EXERCISES, part.text, re.M).start()
        text = texts[part.file]
        for asked in re.finditer(r"^\*\*(\d+\. [^*]+)\*\*(.*?)^<details>(.*?)^</details>",
                                 text[at:], re.M | re.S):
            edit = re.search(r"in (\w+\.py),? change `([^`]+)`\s+to `([^`]+)`",
                             " ".join(asked[2].split()), re.I)
            found.append(Exercise(part.name, part.file, documents.line_of(text, at + asked.start()),
                                  asked[1], edit.groups() if edit else None, asked[3]))
    return found


def commands(answer):
    """The fenced blocks of an answer: ("console", its "$ " command, the lines shown) or
    ("pycon", the session's text, None)."""
    found = []
    for kind, body in re.findall(r"^```(console|pycon)\n(.*?)^```$", answer, re.M | re.S):
        lines = body.splitlines()
        found.append((kind, lines[0], lines[1:]) if kind == "console" else (kind, body, None))
    return found


def session_problems(session, name, folder=HERE):
    """Replay a Python session (>>> lines and what they print) in folder, as a learner
    typing it into python3 there: None, or what doctest reports of its first mismatch."""
    test = doctest.DocTestParser().get_doctest(session, {}, name, None, 0)
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.REPORT_ONLY_FIRST_FAILURE)
    before = os.getcwd()
    os.chdir(folder)
    try:
        runner.run(test, out=report.write)
    finally:
        os.chdir(before)
    return report.getvalue() or None


def run_shown(command, shown, folder=HERE):
    """Run a "$ python3 ..." command in folder: None if it prints the lines shown, else
    the first line that differs."""
    done = subprocess.run([sys.executable, *shlex.split(command[len("$ python3 "):])],
                          cwd=folder, capture_output=True, text=True, timeout=120)
    return mismatch(shown, (done.stdout + done.stderr).splitlines())


MENTION = re.compile(r"\]\((\w+)\.py\)|`(?:(\w+)\.)?(\w+)(?:\([^`]*\))?`")   # a link, a name


def _is_lab_module(name):
    return not name.startswith("test_") and os.path.isfile(os.path.join(HERE, f"{name}.py"))


def _lab_object(module, name):
    """The function or class name defined in the lab's module (not imported there), or
    None."""
    found = getattr(importlib.import_module(module), name, None)
    return found if ((inspect.isfunction(found) or inspect.isclass(found))
                     and found.__module__ == module) else None


EXPERIMENT_RULE = re.compile(r"^# ---- (the experiment|what Part)", re.M)


def read_whole(part):
    """{module: its lines from its top to the rule that opens its experiment} for the
    modules a Part's opening says it adds (a paragraph "The modules it adds ...")."""
    said = re.search(r"^The modules it adds.*?(?=\n\n)", opening(part), re.M | re.S)
    found = {}
    for module in re.findall(r"\]\((\w+)\.py\)", said[0] if said else ""):
        source = lab_file_text(f"{module}.py")
        rule = EXPERIMENT_RULE.search(source)
        found[module] = source[:rule.start() if rule else len(source)].count("\n")
    return found


def _starts_at(module, name):
    """The line where the lab's function or class name of module starts (inf if none)."""
    try:
        return inspect.getsourcelines(_lab_object(module, name))[1]
    except (OSError, TypeError):   # not the lab's, or made by a call (a namedtuple)
        return math.inf


def code_lines(texts):
    """{Part: lines of code} by the map's rule: the lines of the modules it adds, each to
    its experiment (read_whole), and the source lines (inspect) of every other function
    and class of the lab it names in backticks, as `name`, `name(...)` or `module.name`
    (a bare name is the one in the module linked or named last before it that defines
    one), each counted once, in the first Part that names it."""
    counted, lines = set(), {}
    for part in course(texts):
        whole = read_whole(part)
        lines[part.name] = sum(whole.values())
        for module, end in whole.items():   # what they define above the rule is read
            counted |= {(module, name) for name in vars(importlib.import_module(module))
                        if _starts_at(module, name) <= end}
        modules = []     # the lab's modules linked or named so far, in order
        for link, module, name in MENTION.findall(part.text):
            if _is_lab_module(link or module):
                modules = [m for m in modules if m != (link or module)] + [link or module]
            if link or (module and module not in modules):   # `math.fsum`, `cache.crop`
                continue
            owner = next((m for m in ([module] if module else reversed(modules))
                          if _lab_object(m, name)), None)
            if owner and (owner, name) not in counted:
                counted.add((owner, name))
                lines[part.name] += len(inspect.getsourcelines(_lab_object(owner, name))[0])
    return lines


def code_line_problems(texts):
    """Each Part's "about N lines" in the README's map: its code_lines to the nearest 10."""
    problems = []
    times = {part.name: part.time for part in parts(texts)}
    for name, lines in code_lines(texts).items():
        wanted = f"about {int(lines / 10 + 0.5) * 10} lines"
        stated = re.search(r"about [\d,]+ lines", times[name])
        if not stated or stated[0] != wanted:
            problems.append(f"the README's map must give {name} {wanted!r} ({lines} lines of "
                            f"the modules it adds and the functions and classes it names "
                            f"first), not {stated[0] if stated else 'nothing'!r}, and its "
                            f"minutes by the rule above the map")
    return problems


COUNTED = re.compile(r"\b(a|an|\d+) (tables?|diagrams?|pictures?|diffs?|exercises?)\b")


def shown_items(text):
    """The tables, diagrams (```text blocks), pictures and diffs a Part's text shows."""
    return {"table": len(re.findall(r"^\|(?:---\|)+$", text, re.M)),
            "diagram": len(re.findall(r"^```text$", text, re.M)),
            "picture": len(re.findall(r"^!\[", text, re.M)),
            "diff": len(re.findall(r"^```diff$", text, re.M))}


def minute_problems(texts):
    """Each Part's "N to M minutes" in the README's map by the rule under it: the prose's
    minutes, its lines at 10 and at 5 a minute, a minute for each table, diagram, picture
    and diff the row counts, 5 for each exercise (10 for one that asks for an edit of the
    code: the edit, the run and the undoing), each end rounded to 5 minutes."""
    problems = []
    asked = collections.Counter(exercise.part for exercise in exercises(texts))
    edits = collections.Counter(exercise.part for exercise in exercises(texts) if exercise.edit)
    for part in course(texts):
        prose = round(len(prose_words(part.text)) / WORDS_A_MINUTE)
        lines = int(re.search(r"about ([\d,]+) lines", part.time)[1].replace(",", ""))
        counted = {kind.rstrip("s"): 1 if n in ("a", "an") else int(n)
                   for n, kind in COUNTED.findall(part.time)}
        if counted.get("exercise") != asked[part.name]:
            problems.append(f"the README's map counts {counted.get('exercise')} exercises "
                            f"for {part.name}, which has {asked[part.name]}")
        for kind, found in shown_items(part.text).items():
            if counted.get(kind, 0) != found:
                problems.append(f"the README's map counts {counted.get(kind, 0)} {kind}s "
                                f"for {part.name}, whose text shows {found}")
        rest = (prose + sum(counted.values()) + 4 * asked[part.name]   # 5 an exercise,
                + 5 * edits[part.name])                                  # 10 with an edit
        wanted = "{} to {} minutes".format(*(5 * round((rest + lines / pace) / 5)
                                            for pace in (10, 5)))
        if not part.time.startswith(wanted):
            problems.append(f"the README's map must give {part.name} {wanted!r} by its rule "
                            f"({prose} of prose, {lines} lines, {counted}), not "
                            f"{part.time.split(',')[0]!r}")
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
                self.assert_none(length_problems(texts) + course_digit_problems(texts),
                                 "problems of the rewritten documents")

    def test_the_lesson_and_each_part_give_their_own_length(self):
        self.assert_none(length_problems(self.texts), f"lengths are wrong. {ON_PURPOSE}")

    def test_each_part_gives_the_lines_of_code_it_names(self):
        self.assert_none(code_line_problems(self.texts), f"lines are wrong. {ON_PURPOSE}")

    def test_each_part_gives_the_minutes_its_rule_gives(self):
        self.assert_none(minute_problems(self.texts), f"minutes are wrong. {ON_PURPOSE}")

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
                trace_kv.save_records({"stories": 60}, {}, folder)
            after = {}
            for name in os.listdir(folder):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    after[name] = f.read()
        self.assertEqual(after, before)

    def test_every_link_between_documents_finds_its_file_and_heading(self):
        self.assert_none(link_problems(self.texts), "links go nowhere")

    def test_the_quick_start_gives_the_run_time_as_the_progress_line_does(self):
        shown = FIGURE.sub(lambda found: found[2], self.texts[README])
        self.assertIn(trace_kv.last_duration().strip(), shown)

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


class Examples(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.texts = the_documents()

    def test_every_example_prints_what_the_documents_show(self):
        """Each fenced block whose first line is "$ python3 ..." is run from the lab's
        folder, but those of the exercises (which run in a copy of it, below); training
        logs (python3 train.py) are one real run's and are tied to best.json by
        test_the_reference_quotes_the_checkpoint_figures instead."""
        answers = "".join(exercise.answer for exercise in exercises(self.texts))
        examples = [(name, line, block[0], block[1:]) for name, text in self.texts.items()
                    for line, _, block in fenced_blocks(text)
                    if block and block[0].startswith("$ python3 ")
                    and not block[0].startswith("$ python3 train.py")
                    and "\n".join(block) not in answers]
        self.assertGreaterEqual(len(examples), 2)
        for name, line, command, shown in examples:
            with self.subTest(command=command):
                found = run_shown(command, shown)
                if found:
                    self.fail(f"{name} line {line}, `{command}`: {found}.\n{ON_PURPOSE}: "
                              f"run the command and copy what it prints.")

    def test_each_part_ends_with_two_or_three_exercises_and_their_answers(self):
        found = exercises(self.texts)
        for part in course(self.texts):
            with self.subTest(part.name):
                self.assertRegex(re.findall(r"^#+ .*", part.text, re.M)[-1], EXERCISES,
                                 f"{part.file}: {part.name} must end with its exercises")
                asked = [exercise for exercise in found if exercise.part == part.name]
                self.assertIn(len(asked), (2, 3), f"{part.name}: 2 or 3 exercises")
                for exercise in asked:
                    self.assertTrue(commands(exercise.answer), f"{exercise.file} line "
                                    f"{exercise.line}, {exercise.title!r}: its answer must "
                                    f"show a command or a session that a test runs")

    def test_every_answer_prints_what_it_shows(self):
        """Each exercise's answer is run as a learner would: its commands in a copy of the
        lab's folder (with the exercise's edit of the code made there, if it asks for
        one), one after another, and its Python sessions replayed there."""
        for exercise in exercises(self.texts):
            where = f"{exercise.file} line {exercise.line}, exercise {exercise.title!r}"
            with self.subTest(exercise.title), tempfile.TemporaryDirectory() as folder:
                for name in os.listdir(HERE):
                    if os.path.isfile(os.path.join(HERE, name)):
                        shutil.copy(os.path.join(HERE, name), folder)
                if exercise.edit:   # made for its commands: a session imports the lab's
                    self.assertNotIn("pycon", [kind for kind, _, _ in commands(exercise.answer)],
                                     f"{where}: an edit of the code is tried by commands")
                    name, old, new = exercise.edit
                    code = lab_file_text(name)
                    self.assertEqual(code.count(old), 1, f"{where}: `{old}` must be in "
                                     f"{name} once, to be changed")
                    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                        f.write(code.replace(old, new))
                for kind, command, shown in commands(exercise.answer):
                    found = (run_shown(command, shown, folder) if kind == "console"
                             else session_problems(command, exercise.title, folder))
                    if found:
                        self.fail(f"{where}: {found}\n{ON_PURPOSE}: run it and copy what it "
                                  f"prints.")

    def test_the_documents_show_the_real_code(self):
        excerpts = [(name, *found) for name, text in self.texts.items() for found in
                    re.findall(r"<!-- excerpt: (\w+)\.(\w+) -->\n```python\n(.*?)```", text,
                               re.DOTALL)]
        self.assertGreaterEqual(len(excerpts), 2)
        for name, module, function, code in excerpts:
            with self.subTest(excerpt=f"{module}.{function}"):
                source = inspect.getsource(getattr(importlib.import_module(module), function))
                self.assertTrue(code in source, f"{name}'s excerpt of {module}.{function} is "
                                f"not in its source any more. {ON_PURPOSE}: copy the lines "
                                f"again.")

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
        source = lab_file_text("prefill.py")
        lines = [len(inspect.getsourcelines(named)[0]) for named in (
            kv_cache.forward_step, kv_cache.feed, deep_model.forward_step, deep_model.DeepCache)]
        self.assertEqual(code_lines(texts), {
            "the lesson": lines[0] + lines[1],
            "Part 2": source[:EXPERIMENT_RULE.search(source).start()].count("\n")
            + lines[2] + lines[3]})

    def test_a_line_shown_must_match_except_times_and_elided_lines(self):
        printed = ["uncached: 198 rows, 0.067 s", "a", "b", "c", "identical: yes"]
        self.assertIsNone(mismatch(["uncached: 198 rows, 1.234 s", "...", "identical: yes"],
                                   printed))
        self.assertIn("line 1", mismatch(["uncached: 225 rows, 0.067 s", "..."], printed))
        self.assertIn("gives more", mismatch(printed[:3], printed))
        self.assertIn("does not give", mismatch(["...", "identical: NO"], printed))

    def test_the_reference_quotes_the_checkpoint_figures(self):
        meta = lab_json("best.json")["meta"]
        val, baseline = meta["val_loss"], meta["unigram_baseline"]
        text = lab_file_text("reference.md")
        for figure in (f"| {baseline:.4f} nats per token |",
                       f"| {val:.4f} nats per token, {val / baseline:.1%} of the baseline |",
                       f"best validation loss {val:.4f} = {val / baseline:.1%} of the unigram "
                       f"baseline (epoch {meta['epoch']})"):
            with self.subTest(figure=figure):
                self.assertTrue(figure in text, f"not in reference.md. {ON_PURPOSE}.")



if __name__ == "__main__":
    unittest.main()
