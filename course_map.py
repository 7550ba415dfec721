"""The README's map of the course, counted: each Part's words and minutes, its lines of
code, what it shows and how long it takes with its code, by one set of rules.

The map's cells and each Part's opening ("With its code, N to M minutes.") are figure
marks that python3 trace_kv.py --write fills (documents.py), each naming its Part by the
file its row links: <!--fig course_map.prose(part2-prefill-and-paging.md)-->. The
figures depend on the documents and the lab's code, not on the record: the documents
are the folder's being written, the code the lab's, as imported. The rules, as
CONTRIBUTING.md's "How the course map is counted" tells them:

- prose: the words of a Part's text without code blocks, tables, indented formula
  blocks, comments and link targets, a marked figure as one word, at 130 words a minute;
- lines: those of the modules a Part adds, each from its top to the rule that opens its
  experiment, and of every other function and class of the lab it names in backticks,
  each counted once, in the first Part that names it; rounded to 10;
- minutes: the prose's, the lines at 10 and at 5 a minute, a minute for each table,
  diagram, picture and diff, 5 for an exercise and 10 for one that asks for an edit of
  the code; each end rounded to 5 minutes.
"""
import collections
import functools
import importlib
import inspect
import math
import os
import re

import documents
from documents import FIGURE, LAB, README

Part = collections.namedtuple("Part", "name file link offset text words time")
MAP_ROW = re.compile(r"^\| \[([^\]]+)\]\(([\w.-]*)(?:#([\w-]+))?\)[^|\n]* \| [^|\n]* \| "
                     r"([^|\n]*) \| ([^|\n]*) \|$", re.M)
EXERCISES = r"^#+ Exercises$"   # each Part ends with them
SECTION = re.compile(r"^#+ \d+\. ", re.M)        # a numbered section: the course's
WORDS_A_MINUTE = 130   # prose full of figures and cross-references, read with care
MENTION = re.compile(r"\]\((\w+)\.py\)|`(?:(\w+)\.)?(\w+)(?:\([^`]*\))?`")   # a link, a name
EXPERIMENT_RULE = re.compile(r"^# ---- (the experiment|what Part)", re.M)
SHOWN = ("diff", "table", "diagram", "picture")   # in the order the map lists them


# ---- the figure marks: a cell of the map, or an opening's minutes --------------------

def prose(record, timing, part, folder=LAB):
    """The map's prose cell for the Part whose row links the file part.

    As "2,842 words, about 22 minutes"."""
    return _figures_of(part, folder)["prose"]


def minutes(record, timing, part, folder=LAB):
    """The minutes the Part in the file part takes with its code.

    As "85 to 105 minutes" (its opening says them, and its row of the map)."""
    return _figures_of(part, folder)["minutes"]


def with_code(record, timing, part, folder=LAB):
    """The map's last cell for the Part in the file part: its minutes, lines and contents.

    As "80 to 135 minutes, about 550 lines, 3 tables, a diagram and 2 exercises"."""
    return _figures_of(part, folder)["with_code"]


def next_part(record, timing, part, folder=LAB):
    """The link to the row after the one of the file part, in the map's order.

    As "[Part 3: keeping less](part3-keeping-less.md)": each Part's "Next:" link."""
    return _neighbour(part, folder, 1)


def previous_part(record, timing, part, folder=LAB):
    """The link to the Part before the one of the file part, in the map's order.

    As "[Part 2](part2-prefill-and-paging.md)" (the name before its colon): a Part's
    first line, and the Reference's link to the course's last Part."""
    return _neighbour(part, folder, -1)


def _neighbour(part, folder, step):
    rows = parts(dict(the_documents(folder)))
    files = [row.file for row in rows]
    if part not in files:
        raise KeyError(f"no row of {README}'s map links {part}")
    at = files.index(part) + step
    if not 0 <= at < len(rows):
        raise KeyError(f"{part}'s row is the map's {'last' if step > 0 else 'first'}")
    name = rows[at].name if step > 0 else rows[at].name.split(":")[0].split(" (")[0]
    return f"[{name}]({rows[at].link})"


def the_documents(folder=LAB):
    """{file: its text} for every document of the course in folder."""
    texts = {}
    for name in documents.documents(folder):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            texts[name] = f.read()
    return texts


def _figures_of(part, folder):
    figures = _figures(tuple(the_documents(folder).items()))
    if part not in figures:
        raise KeyError(f"no row of {README}'s map links {part} (a Part's file), or it has "
                       f"no code to count")
    return figures[part]


@functools.lru_cache(maxsize=4)   # the marks of one set of documents, counted once
def _figures(texts):
    """{a Part's file: {"prose", and for a Part with code "minutes" and "with_code"}}."""
    texts = dict(texts)
    lines, found = code_lines(texts), exercises(texts)
    asked = collections.Counter(exercise.part for exercise in found)
    edits = collections.Counter(exercise.part for exercise in found if exercise.edit)
    figures = {}
    for part in parts(texts):
        words = len(prose_words(part.text))
        figures[part.file] = {"prose": f"{words:,} words, about "
                                       f"{round(words / WORDS_A_MINUTE)} minutes"}
        if part.name not in lines:
            continue
        counted = {**shown_items(part.text), "exercise": asked[part.name]}
        rest = (round(words / WORDS_A_MINUTE) + sum(counted.values())
                + 4 * asked[part.name] + 5 * edits[part.name])   # 5 an exercise, 10 an edit
        about = int(lines[part.name] / 10 + 0.5) * 10
        took = "{} to {} minutes".format(*(5 * round((rest + about / pace) / 5)
                                           for pace in (10, 5)))
        items = [_counted(counted[kind], kind) for kind in (*SHOWN, "exercise")
                 if counted[kind]]
        code = " of code" if part.name == course(texts)[0].name else ""
        figures[part.file].update(minutes=took, with_code=(
            f"{took}, about {about} lines{code}, "
            + (f"{', '.join(items[:-1])} and {items[-1]}" if len(items) > 1 else items[0])))
    return figures


def _counted(n, kind):
    """"a table", "an exercise", "3 tables"."""
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}" if n == 1 else f"{n} {kind}s"


# ---- the documents' Parts, their prose and what they show ----------------------------

def parts(texts):
    """Each row of the README's map of the course, in order.

    A row gives its name, its file, and its text (the whole file; for a row that links a
    heading, from that heading on), with the row's prose and time cells."""
    found = []
    for name, file, heading, words, time in MAP_ROW.findall(texts[README]):
        text = texts[file or README]
        offset = heading_offsets(text)[heading] if heading else 0
        link = (file or README) + (f"#{heading}" if heading else "")
        found.append(Part(name, file or README, link, offset, text[offset:], words, time))
    return found


def course(texts):
    """The Parts with numbered sections, exercises and code (the Reference has none)."""
    return [part for part in parts(texts) if SECTION.search(part.text)]


def opening(part):
    """A Part's text before its first numbered section."""
    return part.text[:SECTION.search(part.text).start()]


def prose_words(text, start=None, end=None):
    """The words of the prose of text, from the heading start up to the heading end.

    start and end are regular expressions. Left out: code blocks, tables, indented formula
    blocks, comments and link targets; a marked figure counts as one word, whatever a run
    writes there."""
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
    """GitHub's anchor of a heading.

    Lowercase, punctuation dropped but hyphens and spaces, spaces to hyphens (a link's
    target kept, its address dropped)."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def heading_offsets(text):
    """{anchor: where its heading starts} for every heading of text outside code blocks.

    A repeated anchor gets -1, -2 ... as on GitHub."""
    plain = re.sub(r"^```.*?^```$", lambda f: " " * len(f[0]), text, flags=re.M | re.S)
    found = {}
    for heading in re.finditer(r"^#+ (.*)$", plain, re.M):
        name, n = anchor(heading[1]), 1
        while name in found:
            name, n = f"{anchor(heading[1])}-{n}", n + 1
        found[name] = heading.start()
    return found


def shown_items(text):
    """The tables, diagrams (```text blocks), pictures and diffs a Part's text shows."""
    return {"table": len(re.findall(r"^\|(?:---\|)+$", text, re.M)),
            "diagram": len(re.findall(r"^```text$", text, re.M)),
            "picture": len(re.findall(r"^!\[", text, re.M)),
            "diff": len(re.findall(r"^```diff$", text, re.M))}


Exercise = collections.namedtuple("Exercise", "part file line title edit answer")


def exercises(texts):
    """Every exercise of every Part.

    Each gives its Part, its file and line, its title, its edit of the code if it asks for
    one ((file, old, new): "in FILE.py, change `OLD` to `NEW`") and the text of its answer
    (its <details> block)."""
    found = []
    for part in course(texts):
        at = part.offset + re.search(EXERCISES, part.text, re.M).start()
        text = texts[part.file]
        for asked in re.finditer(r"^\*\*(\d+\. [^*]+)\*\*(.*?)^<details>(.*?)^</details>",
                                 text[at:], re.M | re.S):
            edit = re.search(r"in (\w+\.py),? change `([^`]+)`\s+to `([^`]+)`",
                             " ".join(asked[2].split()), re.I)
            found.append(Exercise(part.name, part.file,
                                  documents.line_of(text, at + asked.start()),
                                  asked[1], edit.groups() if edit else None, asked[3]))
    return found


# ---- the lines of code a Part walks through ------------------------------------------

def is_lab_module(name):
    """Whether name is a module of the lab (a .py file beside this one, not a test)."""
    return not name.startswith("test_") and os.path.isfile(os.path.join(LAB, f"{name}.py"))


def _lab_object(module, name):
    """The function or class name defined in the lab's module (not imported there), or
    None."""
    found = getattr(importlib.import_module(module), name, None)
    return found if ((inspect.isfunction(found) or inspect.isclass(found))
                     and found.__module__ == module) else None


def read_whole(part):
    """{module: its lines from its top to the rule that opens its experiment}.

    For the modules a Part's opening says it adds (a paragraph "The modules it adds ...")."""
    said = re.search(r"^The modules it adds.*?(?=\n\n)", opening(part), re.M | re.S)
    found = {}
    for module in re.findall(r"\]\((\w+)\.py\)", said[0] if said else ""):
        with open(os.path.join(LAB, f"{module}.py"), encoding="utf-8") as f:
            source = f.read()
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
    """{Part: lines of code}: the lab's code each Part adds or is first to name.

    The lines of the modules it adds, each to its experiment (read_whole), and the source lines
    (inspect) of every other function and class of the lab it names in backticks, as `name`,
    `name(...)` or `module.name` (a bare name is the one in the module linked or named last
    before it that defines one), each counted once, in the first Part that names it."""
    counted, lines = set(), {}
    for part in course(texts):
        whole = read_whole(part)
        lines[part.name] = sum(whole.values())
        for module, end in whole.items():   # what they define above the rule is read
            counted |= {(module, name) for name in vars(importlib.import_module(module))
                        if _starts_at(module, name) <= end}
        modules = []     # the lab's modules linked or named so far, in order
        for link, module, name in MENTION.findall(part.text):
            if is_lab_module(link or module):
                modules = [m for m in modules if m != (link or module)] + [link or module]
            if link or (module and module not in modules):   # `math.fsum`, `cache.crop`
                continue
            owner = next((m for m in ([module] if module else reversed(modules))
                          if _lab_object(m, name)), None)
            if owner and (owner, name) not in counted:
                counted.add((owner, name))
                lines[part.name] += len(inspect.getsourcelines(_lab_object(owner, name))[0])
    return lines
