"""The small kit the Parts draw their SVG pictures with: a page, a panel with linear or
logarithmic axes, lines, bars, dots and a legend. SVG is text, so the standard library
writes it. A document marks each picture with the function that draws it from the record
(documents.py), and python3 trace_kv.py --write writes the file beside it.

Each drawn point carries a <title> with the figure it stands for, which a browser shows
when the pointer rests on it (and test_pictures reads back against the record).

A picture reads its part of the record through checked() first, and the kit bounds what
it writes: whatever a hand-edited record holds, the picture is a small, valid XML document,
or a ValueError names the key and what is wrong with it.
"""
import math
import re
import reprlib
from xml.sax.saxutils import escape as _escape_markup

WIDTH, HEIGHT = 720, 400
COLORS = ("#c0392b", "#2471a3", "#229954", "#b9770e", "#7d3c98", "#566573", "#d35400")
LARGEST = 10 ** 12     # a number beyond any run of this lab: a record holding one is refused
COUNT = (0, LARGEST)   # the shape (checked) of a count in the record
MOST_ITEMS = 64        # the longest list of the record a picture draws an item of each of
MOST_CHARACTERS = 200  # a longer text is cut, with an ellipsis
# What XML 1.0 forbids in a document (control characters, lone surrogates, U+FFFE and U+FFFF)
_SHOWN = reprlib.Repr()   # a wrong value, shown in a short line: [{...}, {...}, ...]
_SHOWN.maxlevel = 1
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def checked(record, shape, where=""):
    """record, refused with a ValueError that names the key and what is wrong unless it
    has shape: {key: shape} a dict holding at least those keys; [shape] a list of 1 to
    MOST_ITEMS items; str a string; (low, high) a finite number from low to high (a bool is
    not one); (low, high, None) such a number or None."""
    name = f"the record's {where}" if where else "the record"
    if isinstance(shape, dict):
        if not isinstance(record, dict):
            raise ValueError(f"{name} is {_SHOWN.repr(record)}, not an object of keys")
        for key, inner in shape.items():
            if key not in record:
                raise ValueError(f"{name} has no key {key!r}")
            checked(record[key], inner, f"{where}.{key}" if where else key)
    elif isinstance(shape, list):
        if not isinstance(record, list) or not 1 <= len(record) <= MOST_ITEMS:
            raise ValueError(f"{name} is {_SHOWN.repr(record)}, not a list of 1 to "
                             f"{MOST_ITEMS} items")
        for i, item in enumerate(record):
            checked(item, shape[0], f"{where}[{i}]")
    elif shape is str:
        if not isinstance(record, str):
            raise ValueError(f"{name} is {_SHOWN.repr(record)}, not a string")
    elif not (record is None and len(shape) == 3) and (
            isinstance(record, bool) or not isinstance(record, (int, float))
            or not shape[0] <= record <= shape[1]):
        raise ValueError(f"{name} is {_SHOWN.repr(record)}, not a number from {shape[0]:,} "
                         f"to {shape[1]:,}" + (" (or null)" if len(shape) == 3 else ""))
    return record


def escape(words):
    """words as XML text: its markup escaped, what XML forbids written as Python would
    (\\x1b), and cut to MOST_CHARACTERS with an ellipsis."""
    if len(words) > MOST_CHARACTERS:
        words = words[:MOST_CHARACTERS - 1] + "…"
    return _escape_markup(_NOT_XML.sub(lambda m: ascii(m[0])[1:-1], words))


def ticks(most):
    """Ticks from 0 to most or just past it, a step of 1, 2 or 5 times a power of ten apart:
    at most 11 of them, whatever most is (up to LARGEST)."""
    step = next(factor * 10 ** power for power in range(16) for factor in (1, 2, 5)
                if most <= 10 * factor * 10 ** power)
    return list(range(0, math.ceil(most / step) * step + 1, step))


def number(value):
    return f"{value:.1f}".rstrip("0").rstrip(".")


def text(x, y, words, size=12, anchor="start", **attributes):
    extra = "".join(f' {name.replace("_", "-")}="{value}"' for name, value in attributes.items())
    return (f'<text x="{number(x)}" y="{number(y)}" font-size="{size}" '
            f'text-anchor="{anchor}"{extra}>{escape(words)}</text>')


def page(title, body):
    """A whole SVG document: a white page (it reads on a dark page too) with a title."""
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif" '
        f'role="img">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        text(WIDTH / 2, 24, title, 15, "middle", font_weight="bold"),
        *body, "</svg>", ""])


def _tick(value):
    """A tick's label: a count with its thousands separated, a tiny gap as a power of ten."""
    return f"1e{round(math.log10(value))}" if 0 < value < 0.01 else f"{value:,}"


class Panel:
    """A chart's box on the page and its axes: linear or logarithmic, from low to high."""

    def __init__(self, box, xs, ys, xlog=False, ylog=False):
        self.left, self.top, self.width, self.height = box
        self.xs, self.ys, self.xlog, self.ylog = xs, ys, xlog, ylog

    def _place(self, value, span, log, start, length):
        low, high = (math.log10(end) for end in span) if log else span
        share = ((math.log10(value) if log else value) - low) / (high - low)
        return start + share * length

    def x(self, value):
        return self._place(value, self.xs, self.xlog, self.left, self.width)

    def y(self, value):
        return self._place(value, self.ys, self.ylog, self.top + self.height, -self.height)

    def axes(self, xticks, yticks, xlabel, ylabel, xlabels=None, ylabels=None):
        """The frame, grid lines at the ticks, their labels (by _tick, or the functions
        given) and the axes' names."""
        right, bottom = self.left + self.width, self.top + self.height
        away = 18 + 6 * max((len((ylabels or _tick)(value)) for value in yticks), default=0)
        parts = [f'<rect x="{self.left}" y="{self.top}" width="{self.width}" '
                 f'height="{self.height}" fill="none" stroke="#444"/>']
        for value in xticks:
            x = number(self.x(value))
            parts += [f'<line x1="{x}" y1="{self.top}" x2="{x}" y2="{bottom}" stroke="#ddd"/>',
                      text(float(x), bottom + 16, (xlabels or _tick)(value), 11, "middle")]
        for value in yticks:
            y = number(self.y(value))
            parts += [f'<line x1="{self.left}" y1="{y}" x2="{right}" y2="{y}" stroke="#ddd"/>',
                      text(self.left - 6, float(y) + 4, (ylabels or _tick)(value), 11, "end")]
        parts += [text(self.left + self.width / 2, bottom + 34, xlabel, 12, "middle"),
                  text(self.left - away, self.top + self.height / 2, ylabel, 12, "middle",
                        transform=f"rotate(-90 {number(self.left - away)} "
                                  f"{number(self.top + self.height / 2)})")]
        return parts

    def line(self, points, color, dashed=False):
        """A line through (x, y, title) points, each drawn as a dot that names its figure."""
        path = " ".join(f"{number(self.x(x))},{number(self.y(y))}" for x, y, _ in points)
        parts = [f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"'
                 + (' stroke-dasharray="6 4"' if dashed else "") + "/>"]
        return parts + [self.dot(x, y, title, color) for x, y, title in points]

    def bar(self, x0, y0, x1, y1, color, title):
        """A filled rectangle between two corners in the axes' values, naming its figure."""
        left, right = sorted((self.x(x0), self.x(x1)))
        top, bottom = sorted((self.y(y0), self.y(y1)))
        return (f'<rect x="{number(left)}" y="{number(top)}" width="{number(right - left)}" '
                f'height="{number(bottom - top)}" fill="{color}"><title>{escape(title)}'
                f'</title></rect>')

    def dot(self, x, y, title, color):
        return (f'<circle cx="{number(self.x(x))}" cy="{number(self.y(y))}" r="4" '
                f'fill="{color}"><title>{escape(title)}</title></circle>')


def legend(x, y, entries, size=12):
    """Colored swatches and their names, one under another from (x, y)."""
    parts = []
    for i, (name, color) in enumerate(entries):
        parts += [f'<rect x="{x}" y="{y + 18 * i - 9}" width="14" height="10" fill="{color}"/>',
                  text(x + 20, y + 18 * i, name, size)]
    return parts


def bytes_label(value):
    """A count of bytes in the largest unit under it: 1 kB = 1,000 B."""
    for size, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if value >= size:
            return f"{value / size:,.3g} {unit}"
    return f"{value:,.0f} B"
