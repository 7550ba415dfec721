"""The small kit the Parts draw their SVG pictures with: a page, a panel with linear or
logarithmic axes, lines, bars, markers and a legend. SVG is text, so the standard library
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
from collections import namedtuple
from xml.sax.saxutils import escape as _escape_markup

WIDTH, HEIGHT = 720, 400
COLORS = ("#c0392b", "#2471a3", "#229954", "#b9770e", "#7d3c98", "#566573", "#d35400")
MARKERS = ("circle", "square", "triangle", "diamond",
           "open circle", "open square", "open triangle", "open diamond", "plus")
LARGEST = 10 ** 12     # a number beyond any run of this lab: a record holding one is refused
COUNT = (0, LARGEST)   # the shape (checked) of a count in the record
NUMBER = (-LARGEST, LARGEST)   # of a number that may be negative
MOST_ITEMS = 64        # the longest list of the record a picture draws an item of each of
MOST_CHARACTERS = 200  # a longer text is cut, with an ellipsis
# What XML 1.0 forbids in a document (control characters, lone surrogates, U+FFFE and U+FFFF)
_SHOWN = reprlib.Repr()   # a wrong value, shown in a short line: [{...}, {...}, ...]
_SHOWN.maxlevel = 1
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def checked(record, shape, where="", strict=False):
    """Give record back if it has shape; else a ValueError names the key and what is wrong.

    Shapes: {key: shape} a dict holding at least those keys (exactly those, if strict; a
    key whose shape is optional(shape) may be missing); [shape] a list of 1 to MOST_ITEMS
    items, [shape, (low, high)] one of low to high items; str a string; bool a bool;
    (low, high) a finite number from low to high (a bool is not one); (low, high, None)
    such a number or None."""
    name = f"the record's {where}" if where else "the record"
    if isinstance(shape, dict):
        if not isinstance(record, dict):
            raise ValueError(f"{name} is {_SHOWN.repr(record)}, not an object of keys")
        for key, inner in shape.items():
            if key in record:
                checked(record[key], inner.shape if isinstance(inner, optional) else inner,
                        f"{where}.{key}" if where else key, strict)
            elif not isinstance(inner, optional):
                raise ValueError(f"{name} has no key {key!r}")
        unknown = [key for key in record if key not in shape] if strict else []
        if unknown:
            raise ValueError(f"{name} has a key {_SHOWN.repr(unknown[0])} that is not declared")
    elif isinstance(shape, list):
        low, high = shape[1] if len(shape) == 2 else (1, MOST_ITEMS)
        if not isinstance(record, list) or not low <= len(record) <= high:
            raise ValueError(f"{name} is {_SHOWN.repr(record)}, not a list of {low} to "
                             f"{high} items")
        for i, item in enumerate(record):
            checked(item, shape[0], f"{where}[{i}]", strict)
    elif shape is str or shape is bool:
        if not isinstance(record, shape):
            raise ValueError(f"{name} is {_SHOWN.repr(record)}, not a "
                             f"{'string' if shape is str else 'bool'}")
    elif not (record is None and len(shape) == 3) and (
            isinstance(record, bool) or not isinstance(record, (int, float))
            or not shape[0] <= record <= shape[1]):
        raise ValueError(f"{name} is {_SHOWN.repr(record)}, not a number from {shape[0]:,} "
                         f"to {shape[1]:,}" + (" (or null)" if len(shape) == 3 else ""))
    return record


def picked(shape, *keys):
    """The part of a dict's shape (checked's) that holds keys: what a function reads of it."""
    return {key: shape[key] for key in keys}


def found(items, where, **fields):
    """The items of a checked list of dicts whose fields have these values, at least one.

    Else a ValueError names the list (where: its key in the record) and the fields."""
    chosen = [item for item in items if all(item.get(k) == v for k, v in fields.items())]
    if not chosen:
        raise ValueError(f"the record's {where} has no item with "
                         + ", ".join(f"{key} {value!r}" for key, value in fields.items()))
    return chosen


class optional(namedtuple("optional", "shape")):
    """The shape of a dict's key that may be missing: optional(shape) in a dict's shape."""


def escape(words):
    """Write words as XML text, cut to MOST_CHARACTERS with an ellipsis.

    Its markup is escaped, and what XML forbids written as Python would (\\x1b)."""
    if len(words) > MOST_CHARACTERS:
        words = words[:MOST_CHARACTERS - 1] + "…"
    return _escape_markup(_NOT_XML.sub(lambda m: ascii(m[0])[1:-1], words))


def ticks(most):
    """Give ticks from 0 to most or just past it, a step of 1, 2 or 5 times a power of ten apart.

    At most 11 of them, whatever most is (up to LARGEST)."""
    step = next(factor * 10 ** power for power in range(16) for factor in (1, 2, 5)
                if most <= 10 * factor * 10 ** power)
    return list(range(0, math.ceil(most / step) * step + 1, step))


def number(value):
    """Write a coordinate with at most one decimal and no trailing zeros."""
    return f"{value:.1f}".rstrip("0").rstrip(".")


def text(x, y, words, size=12, anchor="start", **attributes):
    """Write words at the page's (x, y) as an SVG text element, with extra attributes."""
    extra = "".join(f' {name.strip("_").replace("_", "-")}="{value}"'   # class_: class
                    for name, value in attributes.items())
    return (f'<text x="{number(x)}" y="{number(y)}" font-size="{size}" '
            f'text-anchor="{anchor}"{extra}>{escape(words)}</text>')


def page(title, body, height=HEIGHT):
    """Give a whole SVG document: a white page with a title.

    The white page reads on a dark page too; it is taller than HEIGHT if a legend needs
    it."""
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="Helvetica, Arial, sans-serif" '
        f'role="img">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
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
        """Draw the frame, grid lines at the ticks, their labels and the axes' names.

        The labels are _tick's, or the functions given."""
        right, bottom = self.left + self.width, self.top + self.height
        away = 18 + 6 * max((len((ylabels or _tick)(value)) for value in yticks), default=0)
        parts = [f'<rect x="{self.left}" y="{self.top}" width="{self.width}" '
                 f'height="{self.height}" fill="none" stroke="#444"/>']
        for value in xticks:
            x = number(self.x(value))
            parts += [f'<line x1="{x}" y1="{self.top}" x2="{x}" y2="{bottom}" stroke="#ddd"/>',
                      text(float(x), bottom + 16, (xlabels or _tick)(value), 11, "middle",
                           class_="x tick")]
        for value in yticks:
            y = number(self.y(value))
            parts += [f'<line x1="{self.left}" y1="{y}" x2="{right}" y2="{y}" stroke="#ddd"/>',
                      text(self.left - 6, float(y) + 4, (ylabels or _tick)(value), 11, "end",
                           class_="y tick")]
        parts += [text(self.left + self.width / 2, bottom + 34, xlabel, 12, "middle"),
                  text(self.left - away, self.top + self.height / 2, ylabel, 12, "middle",
                        transform=f"rotate(-90 {number(self.left - away)} "
                                  f"{number(self.top + self.height / 2)})")]
        return parts

    def line(self, points, color, dashed=False, marker="circle", shift=0):
        """Draw a line through (x, y, title) points, each a marker that names its figure.

        shift: pixels to the right of its place, if given, so as not to hide another
        line."""
        places = [(self.x(x) + shift, self.y(y), title) for x, y, title in points]
        return ([_polyline([(x, y) for x, y, _ in places], color, dashed)]
                + [mark(x, y, marker, color, title) for x, y, title in places])

    def bar(self, x0, y0, x1, y1, color, title):
        """A filled rectangle between two corners in the axes' values, naming its figure."""
        left, right = sorted((self.x(x0), self.x(x1)))
        top, bottom = sorted((self.y(y0), self.y(y1)))
        return (f'<rect x="{number(left)}" y="{number(top)}" width="{number(right - left)}" '
                f'height="{number(bottom - top)}" fill="{color}"><title>{escape(title)}'
                f'</title></rect>')

    def dot(self, x, y, title, color, marker="circle"):
        return mark(self.x(x), self.y(y), marker, color, title)


def _polyline(points, color, dashed):
    path = " ".join(f"{number(x)},{number(y)}" for x, y in points)
    return (f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"'
            + (' stroke-dasharray="6 4"' if dashed else "") + "/>")


def style(i):
    """The colour and marker of a picture's series i: no two of the first 63 alike."""
    return COLORS[i % len(COLORS)], MARKERS[i % len(MARKERS)]


def mark(x, y, marker, color, title=None):
    """Draw a marker centred on the page's (x, y): one of MARKERS, or "cross".

    Filled, or open (its coloured edge alone, so that a marker under it still shows; a plus,
    two strokes). Its class is its name, and its title, if given, the figure it stands
    for."""
    shape = marker.rpartition(" ")[2]
    stroked = shape in ("cross", "plus")
    paint = (f'fill="{color}"' if shape == marker and not stroked else
             f'fill="none" stroke="{color}" stroke-width="{2 if stroked else 1.5}"')
    corners = {"triangle": ((0, -4.5), (4.5, 3.5), (-4.5, 3.5)),
               "diamond": ((0, -5), (5, 0), (0, 5), (-5, 0))}
    if shape == "circle":
        tag, where = "circle", f'cx="{number(x)}" cy="{number(y)}" r="4"'
    elif shape == "square":
        tag, where = "rect", f'x="{number(x - 3.5)}" y="{number(y - 3.5)}" width="7" height="7"'
    elif shape == "cross":
        tag, where = "path", (f'd="M{number(x - 4)},{number(y - 4)} L{number(x + 4)},'
                              f'{number(y + 4)} M{number(x - 4)},{number(y + 4)} '
                              f'L{number(x + 4)},{number(y - 4)}"')
    elif shape == "plus":
        tag, where = "path", (f'd="M{number(x - 5)},{number(y)} L{number(x + 5)},{number(y)} '
                              f'M{number(x)},{number(y - 5)} L{number(x)},{number(y + 5)}"')
    else:
        tag, where = "polygon", 'points="{}"'.format(" ".join(
            f"{number(x + dx)},{number(y + dy)}" for dx, dy in corners[shape]))
    if title is None:
        return f'<{tag} class="{marker}" {where} {paint}/>'
    return f'<{tag} class="{marker}" {where} {paint}><title>{escape(title)}</title></{tag}>'


def legend(x, y, entries, size=12, columns=1, width=130):
    """Draw the names of what a picture draws and how each is drawn, a group of class legend.

    (name, color) a coloured swatch; (name, color, marker, dashed) a short line, dashed or
    not, and its marker. Column by column from (x, y), width apart, rows 18 apart."""
    rows = legend_rows(entries, columns)
    parts = ['<g class="legend">']
    for i, (name, color, *drawn) in enumerate(entries):
        left, top = x + width * (i // rows), y + 18 * (i % rows)
        if drawn:
            parts += [_polyline([(left - 2, top - 4), (left + 16, top - 4)], color, drawn[1]),
                      mark(left + 7, top - 4, drawn[0], color)]
        else:
            parts.append(f'<rect x="{left}" y="{top - 9}" width="14" height="10" '
                         f'fill="{color}"/>')
        parts.append(text(left + 22, top, name, size))
    return parts + ["</g>"]


def legend_rows(entries, columns=1):
    """Count the rows a legend of these entries takes in that many columns (at least one)."""
    return max(1, math.ceil(len(entries) / columns))


def bytes_label(value):
    """Write a count of bytes in the largest binary unit under it.

    1 KiB = 1,024 B, 1 MiB = 1,024 KiB, and so on; memory is counted so in every file of the
    course."""
    for power, unit in ((5, "PiB"), (4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if value >= 1024 ** power:
            value /= 1024 ** power
            return (f"{value:,.0f}" if value >= 100 or value == round(value)
                    else f"{value:.3g}") + f" {unit}"
    return f"{value:,.0f} B"


def byte_ticks(most, count=3):
    """Give ticks from 0 bytes to most or just past it, a power of two bytes apart.

    As 8 KiB or 32 B apart: at most count of them, whatever most is."""
    step = 2 ** max(0, math.ceil(math.log2(max(most, 1) / (count - 1))))
    return list(range(0, math.ceil(most / step) * step + 1, step))
