"""The course's documents (README.md and each Part's Markdown file): the figures, tables
and pictures they quote from the record, each marked with the code that gives it, so that
every figure lives in one place. python3 trace_kv.py --write fills every mark from
kv-trace.json and kv-time.json, on any machine; test_readme checks them all in one loop.
A Part draws its own tables and pictures, in its own module; this module only fills the
marks, and holds the Markdown helpers they are drawn with (shown, table, bold, plain, code).

The marks are comments a reader does not see:

    <!--fig PATH-->20,509<!--/-->        one figure, within a line: the entry PATH of
                                          the record, or a figure computed by the code
    <!--block MODULE.NAME-->              on a line of its own: the lines after it, up to
    | ... |                               the next blank line, are NAME(record, timing)'s,
                                          a function of the lab's module MODULE
    <!--picture MODULE.NAME-->            on the line before a picture: the SVG file it
    ![caption](kv-name.svg)               shows is NAME(record, timing)'s

PATH is the record's keys joined by dots (kv-trace.json's; time.KEY for kv-time.json's);
an item of a list is picked by its number or by its fields (rungs.cache=int4,
runs.drafter=x&lookahead=4). MODULE.NAME() is the figure NAME(record, timing) computes
from several entries, and MODULE.NAME(ARG) the figure NAME(record, timing, ARG) gives
for ARG, a text (course_map.prose(part3-keeping-less.md): the course map's cell for the
Part in that file). PATH:SPEC formats the figure with that format spec (shown says how
it is printed without one). A function drawn by running the lab's code rather than from
the record takes a keyword argument, folder: the lab folder being written, whose model and
corpus it runs (NAME(record, timing, folder=folder)).
"""
import importlib
import inspect
import os
import re

from svg import optional

LAB = os.path.dirname(os.path.abspath(__file__))
README, TRACE, TIMES = "README.md", "kv-trace.json", "kv-time.json"
FIGURE = re.compile(r"<!--fig ([^>\n]*?)-->([^<\n]*)<!--/-->")   # within one line
BLOCK = re.compile(r"^<!--block ([\w.]+)-->\n(.*?)(?=^$)", re.M | re.S)
PICTURE = re.compile(r"^<!--picture ([\w.]+)-->\n!\[[^\]\n]*\]\(([\w.-]+\.svg)\)$", re.M)
COMPUTED = re.compile(r"(\w+)\.(\w+)\(([^()]*)\)$")   # a PATH that names a function


def documents(folder=LAB):
    """The course's documents in folder: its Markdown files, in the order ls shows them."""
    return sorted(name for name in os.listdir(folder) if name.endswith(".md"))


def drawing(name):
    """Find the function that MODULE.NAME names, in the lab's module MODULE.

    A ValueError says what is missing."""
    module, _, function = name.rpartition(".")
    if not module or not os.path.isfile(os.path.join(LAB, f"{module}.py")):
        raise ValueError(f"{name} names no module of the lab (MODULE.NAME, MODULE a .py file "
                         f"beside documents.py)")
    found = getattr(importlib.import_module(module), function, None)
    if not callable(found):
        raise ValueError(f"{module}.py has no function {function}")
    return found


def drawn(name, record, timing, folder=LAB, *given):
    """Give what MODULE.NAME gives: NAME(record, timing, *given).

    For one drawn by running the lab's code rather than from the record (it takes a folder),
    from folder's files."""
    draw = drawing(name)
    if "folder" in inspect.signature(draw).parameters:
        return draw(record, timing, *given, folder=folder)
    return draw(record, timing, *given)


def entry(path, record, timing, folder=LAB):
    """Give the value at PATH (without its :SPEC) in the record or the timing.

    Or the figure MODULE.NAME() or MODULE.NAME(ARG) computes. A KeyError says which key or
    item is missing."""
    computed = COMPUTED.match(path)
    if computed:
        return drawn(f"{computed[1]}.{computed[2]}", record, timing, folder,
                     *([computed[3]] if computed[3] else []))
    root, _, rest = path.partition(".")
    value, keys = (timing, rest.split(".")) if root == "time" else (record, path.split("."))
    for key in keys:
        if isinstance(value, list):
            wanted = dict(pair.split("=", 1) for pair in key.split("&")) if "=" in key else None
            matches = ([item for item in value if all(str(item.get(field)) == text
                                                      for field, text in wanted.items())]
                       if wanted else [value[int(key)]])
            if len(matches) != 1:
                raise KeyError(f"{key!r} picks {len(matches)} items of the list, not one")
            value = matches[0]
        elif not isinstance(value, dict) or key not in value:
            raise KeyError(f"{path} has no {key!r}")
        else:
            value = value[key]
    return value


def figure(mark, record, timing, folder=LAB):
    """What the mark PATH[:SPEC] stands for, as the documents print it."""
    path, _, spec = mark.partition(":")
    return shown(entry(path, record, timing, folder), spec)


def rendered(text, record, timing, folder=LAB):
    """Write every marked figure and block of text from the record and the timing.

    Those drawn by running the lab's code are drawn from folder's files."""
    text = FIGURE.sub(lambda m: f"<!--fig {m[1]}-->{figure(m[1], record, timing, folder)}"
                                f"<!--/-->", text)
    return BLOCK.sub(lambda m: "".join(line + "\n" for line in (
        f"<!--block {m[1]}-->", *drawn(m[1], record, timing, folder))), text)


def pictures(text, record, timing, folder=LAB):
    """{file: its SVG text} for every picture text marks, drawn from the record."""
    return {file: drawn(name, record, timing, folder) for name, file in PICTURE.findall(text)}


def line_of(text, at):
    """Give the number of the line of text that holds the character at index at."""
    return text.count("\n", 0, at) + 1


def unknown_names(text, shape, time_shape):
    """List a line for each mark of text that names nothing; fast, nothing is run or drawn.

    Names nothing: a function the lab does not have, or a record entry that the record's
    declared shape (svg.checked's: the stages' declarations) or the timing's (time_shape,
    for time.PATH) does not hold at some depth."""
    problems = []
    marks = ([(found, COMPUTED.match(found[1].partition(":")[0]))
              for found in FIGURE.finditer(text)]
             + [(found, True) for found in BLOCK.finditer(text)]
             + [(found, True) for found in PICTURE.finditer(text)])
    for found, names_code in marks:
        where = f"line {line_of(text, found.start())}, {found[0].splitlines()[0]}"
        path = found[1].partition(":")[0]
        if names_code:
            try:
                drawing(path if names_code is True else f"{names_code[1]}.{names_code[2]}")
            except ValueError as e:
                problems.append(f"{where}: {e}")
        else:
            timed = path.startswith("time.")
            problem = path_problem(path[5:] if timed else path, time_shape if timed else shape,
                                   "kv-time.json" if timed else "the record")
            if problem:
                problems.append(f"{where}: {problem}")
    return problems


def path_problem(path, shape, name):
    """What PATH (keys joined by dots) names nothing of in shape (svg.checked's), or None.

    name: what shape is the shape of, for the message."""
    keys = path.split(".")
    for depth, key in enumerate(keys):
        at = f"{name}'s {'.'.join(keys[:depth])}" if depth else name
        if isinstance(shape, dict):
            if key not in shape and depth:
                return (f"no entry {key!r} in {at}, as its stage declares it (its keys: "
                        f"{', '.join(shape)[:300]})")
            if key not in shape:
                return (f"no entry {key!r} in {at}, as its stages declare it (a new Part's "
                        f"stage needs its line in trace_kv.STAGES and its module's RECORDS)")
            shape = shape[key].shape if isinstance(shape[key], optional) else shape[key]
        elif isinstance(shape, list):
            fields = [pair.partition("=")[0] for pair in key.split("&")] if "=" in key else []
            if not fields and not key.isdigit():
                return f"{at} is a list: {key!r} is neither an item's number nor field=value"
            unknown = [field for field in fields
                       if not isinstance(shape[0], dict) or field not in shape[0]]
            if unknown:
                return f"{at}'s items have no field {unknown[0]!r}"
            shape = shape[0]
        else:
            return f"{at} is a single value: it has no {key!r}"
    return None


# ---- the Markdown helpers the Parts draw with ----------------------------------------

def shown(figure, spec=""):
    """Write a figure as the documents print it.

    None as a dash; with spec, in that format spec; else an int with its thousands separated
    (20,509), a float to 4 significant digits (0.0 as 0.0), a bool as yes or no."""
    if figure is None:
        return "—"
    if spec:
        return format(figure, spec)
    if isinstance(figure, bool):
        return "yes" if figure else "no"
    if isinstance(figure, int):
        return f"{figure:,}"
    if isinstance(figure, float):
        return "0.0" if figure == 0 else f"{figure:.4g}"
    return str(figure)


def table(header, rows):
    """A Markdown table's lines: its header cells, and each row's cells.

    A cell's own | is escaped and its line breaks become spaces, so that no cell (a prompt
    from a record, say) can end its row or add a column."""
    def cell(value):
        return " ".join(str(value).splitlines()).replace("|", "\\|")
    return ([f"| {' | '.join(map(cell, header))} |".replace("|  |", "| |"),
             "|" + "---|" * len(header)]
            + [f"| {' | '.join(map(cell, cells))} |" for cells in rows])


def bold(text):
    """Write text in Markdown's bold."""
    return f"**{text}**"


def indented(stories):
    """Stories as an indented block, a line each: a story's own line breaks become spaces."""
    return [f"    {' '.join(story.splitlines())}" for story in stories]


MARKDOWN = re.compile(r"([\\`*_\[\]<>&~])")   # what Markdown or HTML acts on in a line of text


def plain(text):
    """Write text so that Markdown shows it as it is: its markup and HTML escaped.

    For a record's text in a table's cell (documents.table escapes its | and line breaks)."""
    return MARKDOWN.sub(r"\\\1", text)


def code(text):
    """Write text as Markdown code (`text`), whatever backticks it holds.

    Fenced by one backtick more than its longest run of them, spaced if it starts or ends
    with one."""
    fence = "`" * (1 + max(map(len, re.findall("`+", text)), default=0))
    padded = f" {text} " if text.startswith("`") or text.endswith("`") else text
    return f"{fence}{padded}{fence}"
