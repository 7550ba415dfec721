"""Where exactness is given up on purpose (Part 3, section 17): caches that keep less.
QuantizedCache stores each key and value in fewer bits; WindowCache keeps only the first
sinks positions and the last window ones. Both change the logits, and the experiment
measures by how much: the ladder, from exact to the fewest bytes.
"""
import contextlib
import importlib
import math
import os
import struct
import sys
from array import array
from collections import namedtuple

import model
import svg
from cache_protocol import check_positions
from documents import plain, shown, table
from instruments import largest_gap, sums_in_another_order
from generate import Generation
from kv_cache import KVCache, feed
from stories import common_start, story_ids
from trace_records import TIMED

FORMATS = ("float64", "float32", "float16", "int8", "int4")


def _pack(fmt, vector):
    """One key or value as fmt stores it: a tuple of arrays or bytes (for int8 and int4,
    the levels and their scale). Refused, before anything is stored, if fmt cannot hold
    a number of it (or, for int8 and int4, its scale) as a finite number."""
    if not all(map(math.isfinite, vector)):
        raise ValueError(f"{fmt} cannot store a vector holding {_first_bad(vector)!r}")
    if fmt == "float64":
        return (array("d", vector),)
    if fmt in ("float32", "float16"):
        code, largest = ("f", "3.4e38") if fmt == "float32" else ("e", "65504")
        try:
            packed = struct.pack(f"<{len(vector)}{code}", *vector)
        except OverflowError:
            raise ValueError(f"a number of {model.excerpt(vector)} is beyond {fmt}'s largest, "
                             f"{largest}; use a wider format") from None
        return (array("f", vector),) if fmt == "float32" else (packed,)
    if fmt == "int4" and len(vector) % 2:
        raise ValueError(f"int4 packs two numbers a byte, so a vector of {len(vector)} "
                         f"cannot be stored")
    top = 127 if fmt == "int8" else 7
    try:   # the scale is kept as a 32-bit float
        struct.pack("<f", max(map(abs, vector)) / top)
    except OverflowError:
        raise ValueError(f"the scale of {model.excerpt(vector)} is beyond float32's largest, "
                         f"3.4e38, so {fmt} cannot store it; use float64") from None
    scale = array("f", [max(map(abs, vector)) / top])
    levels = [max(-top, min(top, round(x / scale[0]))) if scale[0] else 0 for x in vector]
    if fmt == "int8":
        return (array("b", levels), scale)
    pairs = zip(levels[::2], levels[1::2])   # each level + 8 is 1..15: four bits
    return (bytes((low + 8) | ((high + 8) << 4) for low, high in pairs), scale)


def _first_bad(vector):
    return next(x for x in vector if not math.isfinite(x))


def _unpack(fmt, stored):
    """The floats a stored key or value stands for."""
    if fmt in ("float64", "float32"):
        return list(stored[0])
    if fmt == "float16":
        return list(struct.unpack(f"<{len(stored[0]) // 2}e", stored[0]))
    data, scale = stored
    if fmt == "int8":
        return [level * scale[0] for level in data]
    return [(((byte >> shift) & 15) - 8) * scale[0] for byte in data for shift in (0, 4)]


def _stored_bytes(stored):
    return sum(len(part) * getattr(part, "itemsize", 1) for part in stored)


class QuantizedCache(KVCache):
    """A cache that stores each key and value compactly, in one of FORMATS.

    It turns them back into floats when attention reads them: float64 and float32 in arrays,
    float16 as IEEE half floats (struct's "e"), int8 and int4 as integer levels with one
    32-bit scale per key or value. The scale maps the largest magnitude to the top level
    (127 or 7); every number goes to the nearest level, ties to the even one, as Python's
    round does on every machine."""

    def __init__(self, params, fmt):
        if fmt not in FORMATS:
            raise ValueError(f"unknown cache format {fmt!r}; the formats are "
                             f"{', '.join(FORMATS)}")
        self._belong_to(params)
        self.format = fmt
        self.stores_exactly = fmt == "float64"   # a float64 array holds each float as it is
        self.tokens, self.stored_keys, self.stored_values = [], [], []
        self.keys, self.values = [], []   # what they stand for, unpacked once

    def __len__(self):
        return len(self.stored_keys)

    def stored(self, vector):
        """vector as the cache gives it back once kept: in its format, and back."""
        return _unpack(self.format, _pack(self.format, vector))

    def extend(self, token_ids, keys, values):
        check_positions(token_ids, keys, values)
        stored_keys = [_pack(self.format, k) for k in keys]   # all packed before any is kept
        stored_values = [_pack(self.format, v) for v in values]
        self.tokens += token_ids
        self.stored_keys += stored_keys
        self.stored_values += stored_values
        self.keys += [_unpack(self.format, stored) for stored in stored_keys]
        self.values += [_unpack(self.format, stored) for stored in stored_values]

    def _forget_from(self, length):
        del self.tokens[length:], self.stored_keys[length:], self.stored_values[length:]
        del self.keys[length:], self.values[length:]

    def bytes_per_position(self):
        """The bytes its keys and values take per position: numbers and scales, measured."""
        if not len(self):
            raise ValueError("the cache holds no position yet")
        stored = self.stored_keys + self.stored_values
        return sum(map(_stored_bytes, stored)) / len(self)


class WindowCache(KVCache):
    """A cache that keeps the keys and values of the first sinks and last window positions.

    It keeps them in buffers of fixed size, as Mistral's rotating cache and StreamingLLM's
    attention sinks do; position i then attends to those only (model.band is the same mask
    on the full pass). It keeps every token ID, to check prefixes. Feed it one token at a
    time: each new position has a window of its own."""

    keeps_every_position = stores_exactly = False

    def __init__(self, params, window, sinks=0):
        model.band(window, sinks)   # refuses a bad window or sinks
        self._belong_to(params)
        self.window, self.sinks = window, sinks
        self.tokens = []                         # every token fed, one per position
        self.sink_keys, self.sink_values = [], []
        self.ring_keys, self.ring_values = [None] * window, [None] * window

    def __len__(self):
        return len(self.tokens)

    def _kept(self):
        """The positions it holds: the sinks, then the last window positions."""
        return model.band(self.window, self.sinks)(len(self) - 1) if len(self) else []

    def _slot(self, position):
        return (position - self.sinks) % self.window

    @property
    def keys(self):
        return [self.sink_keys[p] if p < self.sinks else self.ring_keys[self._slot(p)]
                for p in self._kept()]

    @property
    def values(self):
        return [self.sink_values[p] if p < self.sinks else self.ring_values[self._slot(p)]
                for p in self._kept()]

    def extend(self, token_ids, keys, values):
        check_positions(token_ids, keys, values)
        for token_id, k, v in zip(token_ids, keys, values):
            position = len(self)
            if position < self.sinks:
                self.sink_keys.append(k)
                self.sink_values.append(v)
            else:
                self.ring_keys[self._slot(position)] = k
                self.ring_values[self._slot(position)] = v
            self.tokens.append(token_id)

    def crop(self, length):
        """Forget every position from length on, if the window still holds what that needs.

        Refused where the window has already dropped a position that length would need."""
        held = len(self)
        if model.is_int(length) and length < held \
                and held > self.sinks + self.window and length > self.sinks:
            raise ValueError(f"crop length must be {held}, or at most {self.sinks} (the "
                             f"sinks held), got {length!r}: the window has dropped positions "
                             f"{self.sinks} to {held - self.window - 1}, which a shorter "
                             f"sequence would attend to")
        super().crop(length)

    def _forget_from(self, length):
        del self.tokens[length:], self.sink_keys[length:], self.sink_values[length:]


# ---- the experiment (a stage of trace_kv.py, one rung a case) ----------------------

# (window, sinks); 12 and 20 keep as many positions as 8 and 16 with 4 sinks
WINDOWS = ((8, 0), (8, 4), (12, 0), (16, 4), (20, 0))
RUNGS = (("exact lists, sums in another order", "reordered"),
         *((fmt, fmt) for fmt in FORMATS[1:]),
         *((f"window {w}, sinks {s}", (w, s)) for w, s in WINDOWS))


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "ladder": {
        "stories": svg.COUNT,
        "rungs": [{
            "cache": str, "bytes_per_position": (*svg.COUNT, None),
            "positions_kept": (*svg.COUNT, None), "largest_logit_gap": svg.COUNT,
            "greedy_stories_changed": svg.COUNT, "sampled_stories_changed": svg.COUNT}]},
}


def ladder_rung(lab, rung, runs):
    """Measure one way of keeping the cache (RUNGS[rung]) on every opening (measure).

    With its bytes per position (measured, for the compact formats) or the positions it
    keeps (for a window)."""
    name, kind = RUNGS[rung]

    def make(prompt_tokens):
        if kind == "reordered":
            return KVCache(lab.params)
        if isinstance(kind, tuple):
            return WindowCache(lab.params, *kind)
        return QuantizedCache(lab.params, kind)
    with sums_in_another_order() if kind == "reordered" else contextlib.nullcontext():
        measured, cache = measure(lab, runs, make)
    return {"cache": name,
            "bytes_per_position": cache.bytes_per_position() if kind in FORMATS else None,
            "positions_kept": sum(kind) if isinstance(kind, tuple) else None, **measured}


def measure(lab, runs, make, each_story=None):
    """Measure a kind of cache (make() starts one) on every opening against the exact rows.

    Gives the largest logit gap against the exact rows over every position of the greedy
    stories (their tokens fed through that cache), and how many greedy and sampled stories
    change their text (a greedy story changes where a fed row's best token is not the next
    one; a sampled one is generated again through that cache, with its own random numbers,
    up to the first token it chooses otherwise). make(prompt_tokens) starts the cache for a
    prompt of that many tokens. The sampled story goes on from a copy of the greedy one's
    cache where the two part: before that they feed the same tokens, so their rows are the
    same rows, computed once. each_story(cache, ids, rows, prompt_tokens), if given, is told
    each greedy story's cache, the token IDs fed and their rows. Returns (the three figures,
    the last greedy story's cache)."""
    params, tok, prompts = lab.params, lab.tok, lab.prompts
    gap = 0.0
    greedy_changed = sampled_changed = 0
    for index, (prompt, result, rows) in enumerate(zip(prompts, runs.greedy, runs.greedy_rows)):
        sampled = runs.sampled[index]   # as generate made it: seed index
        ids, prompt_tokens = story_ids(tok, prompt, result), len(tok.encode(prompt))
        sampled_ids = story_ids(tok, prompt, sampled)
        shared = common_start(ids, sampled_ids)   # positions both stories feed alike
        cache = make(prompt_tokens)
        fed = feed(params, cache, ids[:shared])
        parting = cache.copy()                    # where the sampled story goes its own way
        fed += feed(params, cache, ids[:-1])
        if each_story:
            each_story(cache, ids[:-1], fed, prompt_tokens)
        gap = max(gap, largest_gap(fed, rows))
        chosen = range(prompt_tokens - 1, len(fed))   # rows that chose
        greedy_changed += any(fed[p].index(max(fed[p])) != ids[p + 1] for p in chosen)
        generation = Generation(tok, ids[:prompt_tokens], len(sampled["steps"]), 1.0,
                                None, index)
        sampled_changed += _strays(params, parting, generation, sampled_ids, fed[:shared])
    return {"largest_logit_gap": gap, "greedy_stories_changed": greedy_changed,
            "sampled_stories_changed": sampled_changed}, cache


def _strays(params, cache, generation, story, rows):
    """Whether generation, continued from story's prompt for as many tokens as story has,
    chooses another token than story's somewhere. It chooses as generate_cached does (the
    same random numbers) from rows[p], the row of position p, while rows has one (the
    rows the stories share), then from the rows of what it feeds through cache; up to the
    first other token: from there on it is another story, so that is where it stops."""
    while not generation.stopped:
        fed = len(generation.ids)
        generation.choose(rows[fed - 1] if fed <= len(rows) else
                          feed(params, cache, generation.ids)[-1])
        if generation.ids[-1] != story[fed]:
            return True
    return False


def ladder(lab, rungs):
    """Give a ladder's record: every rung, and on how many openings.

    The ladder: this one's, or eviction.py's."""
    return {"stories": len(lab.prompts), "rungs": rungs}


# ---- what Part 3 shows of it (documents.py fills its marks) --------------------------

def ladder_table(record, timing):
    """Section 17's table: every rung of the ladder beside the exact lists, and what it costs."""
    svg.checked(record, RECORDS)
    svg.checked(timing, svg.picked(TIMED, "cache_bytes_per_position"), "time")
    rows = [["exact, in lists (the reference)",
             f"{timing['cache_bytes_per_position']:,} as CPython objects", "all", "0.0", 0, 0]]
    rows += [[plain(rung["cache"]), shown(rung["bytes_per_position"], "g"),
              "all" if rung["positions_kept"] is None else rung["positions_kept"],
              shown(rung["largest_logit_gap"]), rung["greedy_stories_changed"],
              rung["sampled_stories_changed"]] for rung in record["ladder"]["rungs"]]
    stories = record["ladder"]["stories"]
    return table(["the cache", "bytes per position", "positions kept", "largest logit gap",
                  f"greedy stories changed (of {stories})",
                  f"sampled stories changed (of {stories})"], rows)


FLOOR = 1e-16   # where the picture's log scale of gaps starts: a gap of 0.0 has no bar


def ladder_picture(record, timing):
    """Draw section 17's picture: each rung of the ladder, its memory and its largest logit gap.

    As in its table: the bytes it holds for a full context of 64 positions (its measured
    bytes a position, or the positions it keeps as the exact lists' 8-byte numbers) and the
    largest logit gap it gives (a log scale); red where it changed a greedy story."""
    svg.checked(record, {"cache_floats_per_position": (1, svg.LARGEST), **RECORDS})
    exact = record["cache_floats_per_position"] * 8
    stories = record["ladder"]["stories"]
    rungs = [{"cache": "exact lists", "bytes_per_position": exact, "positions_kept": None,
              "largest_logit_gap": 0.0, "greedy_stories_changed": 0}] + record["ladder"]["rungs"]
    held = svg.byte_ticks(exact * 64)
    memory = svg.Panel((215, 50, 160, 290), (0, held[-1]), (len(rungs), 0))
    gaps = svg.Panel((440, 50, 200, 290), (FLOOR, 1e3), (len(rungs), 0), xlog=True)
    body = (memory.axes(held, [], "bytes held for 64 positions", "", xlabels=svg.bytes_label)
            + gaps.axes([FLOOR, 1e-12, 1e-8, 1e-4, 1], [], "largest logit gap (log scale)", ""))
    for i, rung in enumerate(rungs):
        size = (rung["bytes_per_position"] or exact) * (rung["positions_kept"] or 64)
        gap, changed = rung["largest_logit_gap"], rung["greedy_stories_changed"]
        color = svg.COLORS[0] if changed else svg.COLORS[2]
        what = f"{rung['cache']}: {changed} of {stories} greedy stories changed"
        body += [memory.bar(0, i + 0.2, size, i + 0.8, color, f"{what}; {size:,.0f} bytes"),
                 svg.text(memory.left - 6, memory.y(i + 0.5) + 4, rung["cache"], 11, "end"),
                 svg.text(gaps.x(max(gap, FLOOR)) + 4, gaps.y(i + 0.5) + 4,
                          f"{changed} changed" if gap else "exact", 10)]
        if gap:
            body.append(gaps.bar(FLOOR, i + 0.2, gap, i + 0.8, color,
                                 f"{what}; largest gap {gap:.4g}"))
    return svg.page(f"The ladder: what a cache keeps, and what it costs ({stories} openings)",
                    body + svg.legend(180, 393, [("no greedy story changed", svg.COLORS[2])])
                    + svg.legend(420, 393, [("some greedy stories changed", svg.COLORS[0])]))


SHIFT = 3   # pixels between the series of a panel, side by side, so that none hides another

Series = namedtuple("Series", "axis name rungs dashed")
Series.__doc__ = """A line of section 19's picture: the record's key it is drawn against
("positions_kept" or "bytes_per_position"), its name in the legend, its rungs (the
record's), and whether it is dashed (a baseline: the ladder's own)."""


def declared(record, records, stage, declarations, key="rungs"):
    """Give the rungs of record[stage][key], each beside the declaration it was measured from.

    The rungs are checked as the stage's module declares them (records: its RECORDS);
    declarations: the stage's, in its cases' order, so that no code reads a rung's kind back
    from its label. Refused, naming the key, if the record holds another number of rungs
    than the stage declares."""
    rungs = svg.checked(record, {stage: {key: records[stage][key]}})[stage][key]
    if len(rungs) != len(declarations):
        raise ValueError(f"the record's {stage}.{key} holds {len(rungs)} rungs, and the stage "
                         f"declares {len(declarations)}: write the record again "
                         f"(python3 trace_kv.py --write)")
    return list(zip(declarations, rungs))


def side_by_side(record):
    """Give the ladder's series in section 19's picture, both dashed.

    Its windows by their sinks, against the positions kept, and its compact formats (one
    scale a vector) against the bytes."""
    kept, formats = {}, []
    for (_, kind), rung in declared(record, RECORDS, "ladder", RUNGS):
        if isinstance(kind, tuple):   # (window, sinks)
            kept.setdefault(f"a window, sinks {kind[1]}", []).append(rung)
        elif kind in FORMATS:
            formats.append(rung)
    return ([Series("positions_kept", name, rungs, True) for name, rungs in kept.items()]
            + [Series("bytes_per_position", "one scale a vector", formats, True)])


def keeping_less(folder=os.path.dirname(os.path.abspath(__file__))):
    """The modules whose caches keep less, in the order section 19's picture draws them.

    This module first (the ladder), then every other module in folder (the lab's) whose
    source declares side_by_side(record), by name: found by reading the files, as unittest
    finds tests, since importing trace_kv's stages here would make a circle."""
    found = [sys.modules[__name__]]
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py") and not name.startswith("test_") and name != "lossy.py":
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                if "\ndef side_by_side(record)" in f.read():
                    found.append(importlib.import_module(name[:-3]))
    return found


def side_by_side_picture(record, timing):
    """Draw section 19's picture: every rung that keeps less, side by side.

    From every stage that keeps less (keeping_less): the greedy stories changed against the
    positions kept (the windows, without and with 4 sinks, and each evicting kind of
    eviction.py), and against the bytes a position takes in a full context of 64, its exact
    positions included (the formats, and quantization.py's RotatedCaches and GroupedCaches
    by kind). Each series has a colour and a marker of its own, and is drawn SHIFT pixels
    right of the one before it."""
    stories = svg.checked(record, {"ladder": svg.picked(RECORDS["ladder"], "stories")})[
        "ladder"]["stories"]
    series = [line for module in keeping_less() for line in module.side_by_side(record)]
    by_kept, by_bytes = ([line for line in series if line.axis == axis]
                         for axis in ("positions_kept", "bytes_per_position"))
    body, drawn, rows = [], 0, 1
    for box, lines, key, label, xticks, xlabels in (
            ((80, 50, 250, 240), by_kept, "positions_kept", "positions kept", svg.ticks, None),
            ((440, 50, 250, 240), by_bytes, "bytes_per_position",
             "bytes a position, 64 held (exact ones too)", lambda most: svg.byte_ticks(most, 5),
             svg.bytes_label)):
        xs = [rung[key] for line in lines for rung in line.rungs]
        if not xs:
            raise ValueError(f"the record has no rung of {label} to draw")
        unplaced = [rung["cache"] for line in lines for rung in line.rungs if rung[key] is None]
        if unplaced:
            raise ValueError(f"the record's rung {unplaced[0]!r} has no {key} (null) to draw "
                             f"it by")
        panel = svg.Panel(box, (0, max(xs) * 1.05 or 1), (0, stories or 1))
        body += panel.axes(xticks(max(xs)), svg.ticks(stories), label,
                           f"greedy stories changed (of {stories})", xlabels=xlabels)
        entries = []
        for j, line in enumerate(lines):   # no two of 63 series alike
            color, marker = svg.COLORS[drawn % len(svg.COLORS)], svg.MARKERS[drawn % len(svg.MARKERS)]
            drawn += 1
            body += panel.line([(r[key], r["greedy_stories_changed"],
                                 f"{r['cache']}: {r['greedy_stories_changed']} of {stories} "
                                 f"greedy stories changed") for r in sorted(line.rungs, key=lambda
                                                                             r: r[key])],
                               color, line.dashed, marker, shift=SHIFT * (j - (len(lines) - 1) / 2))
            entries.append((line.name, color, marker, line.dashed))
        body += svg.legend(box[0], 347, entries, 11, columns=2)   # under the panel
        rows = max(rows, svg.legend_rows(entries, 2))
    return svg.page(f"Keeping less, every way: the greedy stories changed ({stories} openings)",
                    body, height=max(svg.HEIGHT, 347 + 18 * rows))
