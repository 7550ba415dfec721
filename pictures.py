"""The README's pictures: SVG figures drawn from the record (kv-trace.json) and the
constants of the code, written beside it by python3 trace_kv.py --write. SVG is text, so
the standard library writes it: a few rectangles, lines, circles and labels.

Each drawn point carries a <title> with the figure it stands for, which a browser shows
when the pointer rests on it (and test_pictures reads back against the record).
PICTURES maps each file to the function that draws it from the record.
"""
import math
from xml.sax.saxutils import escape

import bandwidth
from tables import real_cache_bytes

WIDTH, HEIGHT = 720, 400
COLORS = ("#c0392b", "#2471a3", "#229954", "#b9770e", "#7d3c98", "#566573", "#d35400")


def _number(value):
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _text(x, y, words, size=12, anchor="start", **attributes):
    extra = "".join(f' {name.replace("_", "-")}="{value}"' for name, value in attributes.items())
    return (f'<text x="{_number(x)}" y="{_number(y)}" font-size="{size}" '
            f'text-anchor="{anchor}"{extra}>{escape(words)}</text>')


def _svg(title, body):
    """A whole SVG document: a white page (it reads on a dark page too) with a title."""
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif" '
        f'role="img">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        _text(WIDTH / 2, 24, title, 15, "middle", font_weight="bold"),
        *body, "</svg>", ""])


def _tick(value):
    """A tick's label: a count with its thousands separated, a tiny gap as a power of ten."""
    return f"1e{round(math.log10(value))}" if 0 < value < 0.01 else f"{value:,}"


class _Panel:
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
            x = _number(self.x(value))
            parts += [f'<line x1="{x}" y1="{self.top}" x2="{x}" y2="{bottom}" stroke="#ddd"/>',
                      _text(float(x), bottom + 16, (xlabels or _tick)(value), 11, "middle")]
        for value in yticks:
            y = _number(self.y(value))
            parts += [f'<line x1="{self.left}" y1="{y}" x2="{right}" y2="{y}" stroke="#ddd"/>',
                      _text(self.left - 6, float(y) + 4, (ylabels or _tick)(value), 11, "end")]
        parts += [_text(self.left + self.width / 2, bottom + 34, xlabel, 12, "middle"),
                  _text(self.left - away, self.top + self.height / 2, ylabel, 12, "middle",
                        transform=f"rotate(-90 {_number(self.left - away)} "
                                  f"{_number(self.top + self.height / 2)})")]
        return parts

    def line(self, points, color, dashed=False):
        """A line through (x, y, title) points, each drawn as a dot that names its figure."""
        path = " ".join(f"{_number(self.x(x))},{_number(self.y(y))}" for x, y, _ in points)
        parts = [f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"'
                 + (' stroke-dasharray="6 4"' if dashed else "") + "/>"]
        return parts + [self.dot(x, y, title, color) for x, y, title in points]

    def bar(self, x0, y0, x1, y1, color, title):
        """A filled rectangle between two corners in the axes' values, naming its figure."""
        left, right = sorted((self.x(x0), self.x(x1)))
        top, bottom = sorted((self.y(y0), self.y(y1)))
        return (f'<rect x="{_number(left)}" y="{_number(top)}" width="{_number(right - left)}" '
                f'height="{_number(bottom - top)}" fill="{color}"><title>{escape(title)}'
                f'</title></rect>')

    def dot(self, x, y, title, color):
        return (f'<circle cx="{_number(self.x(x))}" cy="{_number(self.y(y))}" r="4" '
                f'fill="{color}"><title>{escape(title)}</title></circle>')


def _legend(x, y, entries, size=12):
    """Colored swatches and their names, one under another from (x, y)."""
    parts = []
    for i, (name, color) in enumerate(entries):
        parts += [f'<rect x="{x}" y="{y + 18 * i - 9}" width="14" height="10" fill="{color}"/>',
                  _text(x + 20, y + 18 * i, name, size)]
    return parts


# ---- the pictures ---------------------------------------------------------------------

def rows_and_scores(record):
    """Section 8: rows and attention scores computed to reach each length, with and
    without the cache (the record's cost_by_length)."""
    lengths = record["cost_by_length"]
    body = []
    for left, kind, unit in ((90, "rows", "rows computed"),
                             (450, "scores", "attention scores computed")):
        most = max(e[f"uncached_{kind}"] for e in lengths)
        step = 10 ** math.floor(math.log10(most))
        top = math.ceil(most / step) * step
        panel = _Panel((left, 50, 250, 270), (0, lengths[-1]["positions"]), (0, top))
        body += panel.axes([0] + [e["positions"] for e in lengths],
                           range(0, top + 1, top // 4), "positions reached", unit)
        for prefix, color, label in (("uncached", COLORS[0], "without the cache"),
                                     ("cached", COLORS[1], "with the cache")):
            body += panel.line([(e["positions"], e[f"{prefix}_{kind}"],
                                 f"{e['positions']} positions: {e[f'{prefix}_{kind}']:,} "
                                 f"{kind} {label}") for e in lengths], color)
    return _svg("What the cache saves: work to reach each length (one-token prompt)",
                body + _legend(100, 380, [("without the cache", COLORS[0])])
                + _legend(300, 380, [("with the cache", COLORS[1])]))


# Where each real model's line ends: its context window in tokens (Llama 2: 4,096;
# Llama 3: 8,192; DeepSeek-V3: 128K).
CONTEXT = {"Llama-2-7B": 4096, "Llama-3-70B": 8192, "DeepSeek-V3": 131072}


def _models(record):
    """(name, bytes a position, positions the line runs to, real) for the lesson's model,
    the 4-layer ones of Part 4 (8-byte floats, 64 positions) and the real models (2 bytes
    a number, to their context windows), DeepSeek-V3 also as if it cached its heads' own
    keys and values."""
    positions = record["deep_models"]["positions"]
    models = [("the lesson's model (1 layer)", record["cache_floats_per_position"] * 8,
               positions, False)]
    for shape in record["deep_models"]["shapes"]:
        if shape["layers"] == 4 and shape["kv_heads"] > 1:
            kind = {4: "multi-head", 2: "grouped-query 2"}[shape["kv_heads"]]
            models.append((f"4 layers, {kind}", shape["bytes_per_position_as_8_byte_floats"],
                           positions, False))
    kept, plain = real_cache_bytes()["DeepSeek-V3"]
    return models + [
        ("Llama-2-7B, multi-head", bandwidth.cache_bytes_per_token(bandwidth.LLAMA_2_7B),
         CONTEXT["Llama-2-7B"], True),
        ("Llama-3-70B, grouped-query 8", real_cache_bytes()["Llama-3-70B"][0],
         CONTEXT["Llama-3-70B"], True),
        ("DeepSeek-V3, latent", kept, CONTEXT["DeepSeek-V3"], True),
        ("DeepSeek-V3 as multi-head", plain, CONTEXT["DeepSeek-V3"], True)]


def _bytes(value):
    for size, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if value >= size:
            return f"{value / size:,.3g} {unit}"
    return f"{value:,.0f} B"


def cache_bytes(record):
    """Sections 9 and 23 to 25: a sequence's cache in bytes against the positions it holds,
    for the lab's models (to their 64 positions) and real ones (to their context windows),
    on log scales: every line is straight, of slope one, and the design moves it up or down."""
    panel = _Panel((100, 50, 330, 290), (1, 2 ** 17), (100, 1e12), xlog=True, ylog=True)
    body = panel.axes([1, 64, 4096, 2 ** 17], [1e3, 1e6, 1e9, 1e12],
                      "positions (tokens) held", "bytes of one sequence's cache",
                      ylabels=_bytes)
    legend = []
    for (name, per, last, real), color in zip(_models(record), COLORS):
        body += panel.line([(n, per * n, f"{name}: {_bytes(per * n)} at {n:,} "
                                         f"position{'s' * (n > 1)}") for n in (1, last)],
                           color, dashed=real)
        legend.append((f"{name}: {per:,.0f} B", color))
    notes = ["after each name, its bytes a position;", "solid: the lab's, 8 bytes a number, to",
             "its 64 positions (sections 23 to 25);", "dashed: real models, 2 bytes a number,",
             "to each one's context window;", "4 layers of multi-query: 256 B, hidden",
             "under the lesson's line; 1 kB = 1,000 B"]
    return _svg("The cache grows with the sequence; the design sets by how much",
                body + _legend(450, 70, legend, 11)
                + [_text(450, 70 + 18 * (len(legend) + i) + 4, note, 11)
                   for i, note in enumerate(notes)])


FLOOR = 1e-16   # where the log scale of gaps starts: a gap of 0.0 has no bar


def ladder(record):
    """Section 17: each rung of the ladder, as in its table, with the bytes it holds for a
    full context of 64 positions (its measured bytes a position, or the positions it keeps
    as the exact lists' 8-byte numbers) and the largest logit gap it gives (a log scale);
    red where it changed a greedy story."""
    exact = record["cache_floats_per_position"] * 8
    stories = record["ladder"]["stories"]
    rungs = [{"cache": "exact lists", "bytes_per_position": exact, "positions_kept": None,
              "largest_logit_gap": 0.0, "greedy_stories_changed": 0}] + record["ladder"]["rungs"]
    memory = _Panel((215, 50, 160, 290), (0, exact * 64), (len(rungs), 0))
    gaps = _Panel((440, 50, 200, 290), (FLOOR, 1e3), (len(rungs), 0), xlog=True)
    body = (memory.axes([0, exact * 32, exact * 64], [], "bytes held for 64 positions", "",
                        xlabels=_bytes)
            + gaps.axes([FLOOR, 1e-12, 1e-8, 1e-4, 1], [], "largest logit gap (log scale)", ""))
    for i, rung in enumerate(rungs):
        size = (rung["bytes_per_position"] or exact) * (rung["positions_kept"] or 64)
        gap, changed = rung["largest_logit_gap"], rung["greedy_stories_changed"]
        color = COLORS[0] if changed else COLORS[2]
        what = f"{rung['cache']}: {changed} of {stories} greedy stories changed"
        body += [memory.bar(0, i + 0.2, size, i + 0.8, color, f"{what}; {size:,.0f} bytes"),
                 _text(memory.left - 6, memory.y(i + 0.5) + 4, rung["cache"], 11, "end"),
                 _text(gaps.x(max(gap, FLOOR)) + 4, gaps.y(i + 0.5) + 4,
                       f"{changed} changed" if gap else "exact", 10)]
        if gap:
            body.append(gaps.bar(FLOOR, i + 0.2, gap, i + 0.8, color,
                                 f"{what}; largest gap {gap:.4g}"))
    return _svg(f"The ladder: what a cache keeps, and what it costs ({stories} openings)",
                body + _legend(180, 393, [("no greedy story changed", COLORS[2])])
                + _legend(420, 393, [("some greedy stories changed", COLORS[0])]))


def batched_stories(record):
    """Section 20: for the 60 sampled openings in the ample pool, the stories each kernel
    makes other than generate's, and other than its own with batches of 1, by batch."""
    runs = [run for run in record["batched_decode"]["runs"] if run["pool"] == "ample"]
    kernels = list(dict.fromkeys(run["kernel"] for run in runs))
    requests = record["batched_decode"]["requests"]
    batches = sorted({run["max_batch"] for run in runs})
    top = max(4, *(requests - run["stories_identical_to_generate"] for run in runs))
    body = []
    for left, key, label, kept in (
            (80, "stories_identical_to_generate", "not generate's", "are generate's"),
            (440, "stories_identical_to_batches_of_1", "not as with batches of 1",
             "are as with batches of 1")):
        panel = _Panel((left, 50, 250, 270), (0, len(batches)), (0, top))
        body += panel.axes([], range(top + 1), "batches of up to", f"stories {label} "
                           f"(of {requests})")
        for b, batch in enumerate(batches):
            body.append(_text(panel.x(b + 0.5), panel.y(0) + 16, str(batch), 11, "middle"))
            for k, kernel in enumerate(kernels):
                run = next((run for run in runs if (run["kernel"], run["max_batch"]) ==
                            (kernel, batch)), None)
                x = b + 0.1 + 0.8 * k / len(kernels)
                if run is None:   # a cross at the axis, not an empty place
                    body.append(_text(panel.x(x + 0.4 / len(kernels)), panel.y(0) - 3, "×",
                                      12, "middle", fill="#888"))
                    continue
                count = requests - run[key]
                body.append(panel.bar(x, 0, x + 0.8 / len(kernels), max(count, 0.04),
                                      COLORS[k], f"{kernel}, batches of up to {batch}: "
                                      f"{run[key]} of {requests} stories {kept}"))
    return _svg(f"Batched decode: the stories a kernel changes ({requests} sampled openings)",
                body + _legend(90, 370, list(zip(kernels, COLORS))[:2])
                + _legend(440, 370, list(zip(kernels, COLORS))[2:])
                + [_text(620, 388, "× not run", 12, fill="#888")])


PICTURES = {"kv-rows.svg": rows_and_scores, "kv-cache-bytes.svg": cache_bytes,
            "kv-ladder.svg": ladder, "kv-batches.svg": batched_stories}
