"""Fewer bits, as engines store them (Part 3, section 19): keys by channel, values by token.

KIVI (arXiv 2402.02750) found that a model's keys have outlier channels (a few numbers
of every key much larger than the rest) and its values do not. So GroupedCache
quantizes each key's channel over a group of positions (one zero point and one scale
for each channel of a group) and each value on its own (one of each per value), and
keeps the most recent positions exact: they wait, as floats, until the residual is full,
and are then quantized together. With rotate, every key and value is first turned by a
Hadamard matrix, as llama.cpp does, spreading an outlier over all 16 numbers; attention
reads them turned back. lossy.py's int8 and int4, one scale per vector, are the rungs to
beat, at the same bytes; RotatedCache is lossy.py's QuantizedCache turned the same way, as
llama.cpp turns before its one-scale formats.
"""
import math
import sys
from array import array

import model
import documents
import lossy
import svg
from cache_protocol import check_positions
from documents import plain, shown
from instruments import largest_gap
from kv_cache import KVCache, feed
from kivi import check_sizes, given_back, keys_by_channel, stored_bytes, value_by_token
from lossy import QuantizedCache, Series, declared, measure

FLUSHES = ("groups", "requantize")
FLOAT32_MAX = 3.4028234663852886e38
SPREAD = 4   # a turned number is at most 4 times the largest of its vector (16 x 0.25)


def _sylvester(n):
    """Sylvester's Hadamard matrix of size n (a power of 2): entries 1 and -1, rows orthogonal."""
    h = [[1]]
    while len(h) < n:
        h = [row + row for row in h] + [row + [-x for x in row] for row in h]
    return h


# Scaled by 1 / sqrt(16) = 1/4, it is orthonormal and symmetric, so it is its own inverse:
# turned(turned(x)) is x, but for the rounding of the sums. Each entry, +-0.25, is exact.
HADAMARD = [[x / math.sqrt(model.WIDTH) for x in row] for row in _sylvester(model.WIDTH)]


def turned(vector):
    """vector, of 16 numbers, times the Hadamard matrix (each number a correctly rounded sum)."""
    if len(vector) != model.WIDTH:   # a shorter one's products would stop early
        raise ValueError(f"turned takes a vector of {model.WIDTH} numbers (the Hadamard "
                         f"matrix's size), got {len(vector)}")
    return [model.dot(row, vector) for row in HADAMARD]


def _refuse_unless_storable(vector, kind, largest, how):
    """Refuse, naming it, a key or value that a kind of cache cannot store (how): not 16
    numbers, one not finite, or one beyond largest."""
    if len(vector) != model.WIDTH:
        raise ValueError(f"a key or value of {len(vector)} numbers cannot be stored: a "
                         f"{kind} keeps {model.WIDTH} numbers each (the head width)")
    bad = next((x for x in vector if not math.isfinite(x)), None)
    if bad is not None:
        raise ValueError(f"a {kind} cannot store a vector holding {bad!r}")
    if max(map(abs, vector)) > largest:
        raise ValueError(f"a number of {model.excerpt(vector)} is beyond {largest:.3g}, the "
                         f"largest this {kind} can store {how}")


class GroupedCache(KVCache):
    """A cache that quantizes as KIVI does: keys per channel a group, values per token.

    Keys over groups of group positions (keys_by_channel), values each (value_by_token), at 2, 4 or
    8 bits (64: none). The newest stay exact (float64): a new one finding residual waiting
    quantizes them first, so each row reads its own key and value exact, and 1 to residual of the
    newest. flush "groups" quantizes their groups once (KIVI); "requantize", all held again, from
    the floats given back (Hugging Face's QuantizedCache), in groups of group from 0, the last
    perhaps short. rotate turns (turned) keys and values before quantizing, and back after. What
    attention reads is computed once a flush. A flush changes what it gives back for the positions
    it quantizes, so prefill and batched rows (several at once) refuse it (fixed_once_kept)."""

    stores_exactly = fixed_once_kept = False

    def __init__(self, params, bits, group, residual, rotate=False, flush="groups"):
        check_sizes(bits, group, residual)
        if not isinstance(rotate, bool):
            raise ValueError(f"rotate must be True or False, got {model.excerpt(rotate)}")
        if flush not in FLUSHES:
            raise ValueError(f"flush must be 'groups' or 'requantize', got "
                             f"{model.excerpt(flush)}")
        if flush == "groups" and residual % group:
            raise ValueError(f"residual {residual} is not a multiple of group {group}: a "
                             f"flush quantizes whole groups, each once (as KIVI asks too); "
                             f"use flush='requantize' to quantize a short group again later")
        self._belong_to(params)
        self.bits, self.group, self.residual = bits, group, residual
        self.rotate, self.flush = rotate, flush
        self.tokens = []
        self.key_groups, self.stored_values = [], []   # as stored: keys a group, values each
        self.exact_keys, self.exact_values = [], []    # the newest positions, as stored
        self.keys, self.values = [], []   # what attention reads, at each flush
        self.requantized = self.moved = 0   # numbers quantized again; and given back changed

    def __len__(self):
        return len(self.tokens)

    def stored(self, vector):
        """Give vector as the cache gives it back once kept: exact, as the newest position.

        A later flush rounds it with its group."""
        self._check(vector)
        return list(vector)

    def _check(self, vector):
        """Refuse a key or value this cache cannot store, naming it."""
        largest = (sys.float_info.max if self.bits == 64 else FLOAT32_MAX / 2) / (
            SPREAD if self.rotate else 1)
        _refuse_unless_storable(vector, "GroupedCache", largest, "turned" if self.bits == 64
                                else "with a 32-bit zero point and scale")

    def extend(self, token_ids, keys, values):
        check_positions(token_ids, keys, values)
        for vector in [*keys, *values]:   # all checked before any is kept
            self._check(vector)
        for token_id, k, v in zip(token_ids, keys, values):
            if len(self.exact_keys) == self.residual:
                self._flush()
            self.tokens.append(token_id)
            self.exact_keys.append(array("d", k))
            self.exact_values.append(array("d", v))
            self.keys.append(list(k))
            self.values.append(list(v))

    def _flush(self):
        """Quantize the residual exact positions: their groups, or all held anew ("requantize")."""
        start = len(self.stored_values) if self.flush == "groups" else 0
        keys, values = self.keys[start:], self.values[start:]
        if self.rotate:
            keys, values = list(map(turned, keys)), list(map(turned, values))
        groups = [keys_by_channel(keys[at:at + self.group], self.bits)
                  for at in range(0, len(keys), self.group)]
        stored_values = [value_by_token(v, self.bits) for v in values]
        keys_back = [k for g in groups for k in given_back(g, self.bits, True)]
        values_back = [given_back(v, self.bits, False)[0] for v in stored_values]
        if self.rotate:
            keys_back, values_back = list(map(turned, keys_back)), list(map(turned, values_back))
        again = len(self.stored_values) - start   # positions quantized before, again now
        self.requantized += 2 * again * model.WIDTH
        self.moved += sum(a != b for old, new in zip(self.keys[start:start + again] +
                                                    self.values[start:start + again],
                                                    keys_back[:again] + values_back[:again])
                          for a, b in zip(old, new))
        del self.key_groups[start // self.group:]
        self.key_groups += groups
        self.stored_values[start:] = stored_values
        self.keys[start:], self.values[start:] = keys_back, values_back
        self.exact_keys.clear()
        self.exact_values.clear()

    def crop(self, length):
        """Forget every position from length on, refusing to cut into the quantized ones.

        Those left were quantized with some forgotten (a shorter sequence holds them exact)."""
        held = len(self.stored_values)
        if model.is_int(length) and 0 < length <= held:
            raise ValueError(f"crop length must be 0, or from {held + 1} to {len(self)}, got "
                             f"{length}: positions 0 to {held - 1} are quantized, and a "
                             f"sequence of {length} would not have quantized them yet")
        super().crop(length)

    def _forget_from(self, length):
        if not length:
            self.key_groups.clear()
            self.stored_values.clear()
        held = len(self.stored_values)
        del self.exact_keys[length - held:], self.exact_values[length - held:]
        del self.tokens[length:], self.keys[length:], self.values[length:]

    def stored_bytes(self):
        """Count the bytes it stores: (quantized positions', exact positions').

        The quantized: packed levels and every zero point and scale; the exact: their floats."""
        return (sum(map(stored_bytes, self.key_groups + self.stored_values)),
                stored_bytes(self.exact_keys + self.exact_values))

    def bytes_per_position(self):
        """The bytes its keys and values take per position (stored_bytes)."""
        if not len(self):
            raise ValueError("the cache holds no position yet")
        return sum(self.stored_bytes()) / len(self)


class RotatedCache(QuantizedCache):
    """A QuantizedCache that turns each key and value before storing it, and back after.

    As llama.cpp turns before its block formats (q8_0, q4_0: one scale a block of 32
    numbers), each vector is turned (turned), kept in fmt with one scale a vector
    (lossy.py), and given back turned again. It takes the format's bytes; at float64 it
    gives back each vector within rounding, not exactly."""

    def __init__(self, params, fmt):
        super().__init__(params, fmt)
        self.stores_exactly = False

    def stored(self, vector):
        """vector as the cache gives it back once kept: turned, in its format, turned back."""
        return turned(QuantizedCache.stored(self, self._turned(vector)))

    def extend(self, token_ids, keys, values):
        keys, values = [self._turned(k) for k in keys], [self._turned(v) for v in values]
        held = len(self)
        QuantizedCache.extend(self, token_ids, keys, values)   # all packed before any is kept
        self.keys[held:] = map(turned, self.keys[held:])
        self.values[held:] = map(turned, self.values[held:])

    def _turned(self, vector):
        """vector turned, refused first if it is not 16 finite numbers that turn within
        float64 (a turned number is at most SPREAD times the largest)."""
        _refuse_unless_storable(vector, "RotatedCache", sys.float_info.max / SPREAD, "turned")
        return turned(vector)


# ---- the experiment (a stage of trace_kv.py, one rung a case) ----------------------

# The stories hold 30 to 64 positions, so a residual of 16 and groups of 8 or 16 (KIVI's
# 128 and 32, Hugging Face's 128 and 64, would leave most stories exact): a story of 30
# quantizes 16 positions. 4 bits in groups of 8 take int8's 40 bytes a quantized position,
# 2 bits in groups of 16 int4's 24.
RESIDUAL = 16
RUNGS = (("KIVI 4-bit, groups of 8", dict(bits=4, group=8, residual=RESIDUAL)),
         ("KIVI 2-bit, groups of 16", dict(bits=2, group=16, residual=RESIDUAL)),
         ("rotated 4-bit, groups of 8", dict(bits=4, group=8, residual=RESIDUAL, rotate=True)),
         ("rotated 2-bit, groups of 16", dict(bits=2, group=16, residual=RESIDUAL, rotate=True)))
# and RotatedCaches, beside the ladder's one-scale formats (its int4: the same bytes)
ONE_SCALE_RUNGS = (("rotated int4, one scale a vector", "int4"),)
CASES = range(len(RUNGS) + len(ONE_SCALE_RUNGS))   # the stage's: RUNGS, then ONE_SCALE_RUNGS


def side_by_side(record):
    """Give section 19's series by bytes a position: one-scale RotatedCaches, KIVI's, rotated."""
    series = {"rotated, one scale": [rung for _, rung in declared(
        record, RECORDS, "quantization", ONE_SCALE_RUNGS, "one_scale_rungs")]}
    for (_, settings), rung in declared(record, RECORDS, "quantization", RUNGS):
        series.setdefault("rotated" if settings.get("rotate") else "KIVI", []).append(rung)
    return [Series("bytes_per_position", name, rungs, False) for name, rungs in series.items()]


def full_context(lab):
    """The first 64 tokens of the test stories: a full context."""
    return [t for story in lab.test for t in lab.tok.encode(story)][:model.CONTEXT]


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
CHANGED = {"positions_kept": (*svg.COUNT, None),   # what a rung changes, and how much
           **dict.fromkeys(("largest_logit_gap", "greedy_stories_changed",
                            "sampled_stories_changed"), svg.COUNT)}
REQUANTIZED = dict.fromkeys(("positions", "quantized", "numbers_requantized", "numbers_moved",
                            "largest_key_error", "largest_key_error_quantized_once"), svg.COUNT)
RECORDS = {
    "quantization": {
        "stories": svg.COUNT,
        "rungs": [{
            "cache": str, "rotate": bool, "flush": str,
            **dict.fromkeys(("bits", "group", "residual", "bytes_per_position",
                             "bytes_per_quantized_position"), svg.COUNT),
            **CHANGED, "numbers_requantized": svg.COUNT, "numbers_moved": svg.COUNT}],
        "one_scale_rungs": [{
            "cache": str, "format": str, "rotate": bool, "bytes_per_position": svg.COUNT,
            **CHANGED}],
        "turned_only": {
            "positions": svg.COUNT, "rows_equal": bool, "largest_logit_gap": svg.COUNT},
        "key_channel_peaks": svg.COUNT, "value_channel_peaks": svg.COUNT,
        "compounding": REQUANTIZED, "whole_groups": REQUANTIZED,
        "prompt_rows": dict.fromkeys(
            ("residual", "prompt_rows", "rows_reading_quantized_keys",
             "stories_choosing_the_first_token_from_them"), svg.COUNT)},
}


def rung(lab, case, runs):
    """Measure one GroupedCache (RUNGS[case]) on every opening (lossy.measure), and its bytes.

    Bytes per position with a full context held (counted), per quantized position there; numbers
    re-quantized and changed (greedy stories, summed); past RUNGS, a RotatedCache
    (one_scale_rung)."""
    if case >= len(RUNGS):
        return one_scale_rung(lab, *ONE_SCALE_RUNGS[case - len(RUNGS)], runs)
    name, settings = RUNGS[case]
    counts = {"numbers_requantized": 0, "numbers_moved": 0}

    def each_story(cache, ids, rows, prompt_tokens):
        counts["numbers_requantized"] += cache.requantized
        counts["numbers_moved"] += cache.moved
    measured, _ = measure(lab, runs, lambda prompt_tokens: GroupedCache(lab.params, **settings),
                          each_story)
    full = GroupedCache(lab.params, **settings)
    feed(lab.params, full, full_context(lab))
    return {"cache": name, "rotate": False, "flush": "groups", **settings,
            "bytes_per_position": full.bytes_per_position(),
            "bytes_per_quantized_position": full.stored_bytes()[0] / len(full.stored_values),
            "positions_kept": None, **measured, **counts}


def one_scale_rung(lab, name, fmt, runs):
    """Measure a RotatedCache of format fmt on every opening, as the ladder's formats are.

    With its bytes per position (measured)."""
    measured, cache = measure(lab, runs, lambda prompt_tokens: RotatedCache(lab.params, fmt))
    return {"cache": name, "format": fmt, "rotate": True,
            "bytes_per_position": cache.bytes_per_position(), "positions_kept": None,
            **measured}


def prompt_rows_reading_quantized_keys(prompt_lengths, residual=RESIDUAL):
    """Count the prompt rows reading quantized keys, for prompts of these lengths.

    Fed a token at a time through a GroupedCache of that residual: prompt rows; those reading
    quantized keys (keeping position residual quantizes those before it); stories whose last prompt
    row (picking the first token) is one. KIVI and Hugging Face read exact keys, then quantize."""
    return {"residual": residual, "prompt_rows": sum(prompt_lengths),
            "rows_reading_quantized_keys": sum(max(0, n - residual) for n in prompt_lengths),
            "stories_choosing_the_first_token_from_them": sum(n > residual
                                                              for n in prompt_lengths)}


# Re-quantizing gives a group its own levels back (its smallest number is level 0, its
# largest the top), so errors compound only where a group grows: a residual of 12 leaves
# the last group of 16 short at each flush.
COMPOUNDING = dict(bits=2, group=16, residual=12, flush="requantize")
WHOLE_GROUPS = dict(bits=2, group=16, residual=16, flush="requantize")   # none grows


TURNED_ONLY = dict(bits=64, group=16, residual=16, rotate=True)   # no levels: the rotation


def rungs(lab, results):
    """Give the stage's record: every rung, and what a full context shows.

    Every rung (GroupedCaches', then RotatedCaches') and on how many openings; which prompt rows
    read quantized keys; on a full context, a GroupedCache(TURNED_ONLY)'s largest logit gap, how
    far the keys' and values' channel peaks differ (outliers), and what re-quantizing does to a
    group that grows (compounding) and to groups that do not (whole_groups)."""
    exact, turned_only = KVCache(lab.params), GroupedCache(lab.params, **TURNED_ONLY)
    exact_rows = feed(lab.params, exact, full_context(lab))
    rows = feed(lab.params, turned_only, full_context(lab))
    return {"stories": len(lab.prompts), "rungs": results[:len(RUNGS)],
            "one_scale_rungs": results[len(RUNGS):],
            "turned_only": {"positions": len(rows), "rows_equal": rows == exact_rows,
                            "largest_logit_gap": largest_gap(rows, exact_rows)},
            **outliers(exact), "compounding": compounding(exact, COMPOUNDING),
            "whole_groups": compounding(exact, WHOLE_GROUPS),
            "prompt_rows": prompt_rows_reading_quantized_keys(
                [len(lab.tok.encode(prompt)) for prompt in lab.prompts])}


def outliers(exact):
    """Give, for keys and for values, the largest channel peak (magnitude) over the smallest."""
    def ratio(vectors):
        peaks = [max(map(abs, channel)) for channel in zip(*vectors)]
        return max(peaks) / min(peaks)
    return {"key_channel_peaks": ratio(exact.keys), "value_channel_peaks": ratio(exact.values)}


def compounding(exact, settings):
    """Feed a cache's keys and values through a re-quantizing GroupedCache(**settings).

    Gives the numbers re-quantized and those changed; and the largest error of a key it gives back
    against the exact keys, beside that of the same groups quantized once."""
    cache = GroupedCache(exact.params, **settings)
    cache.extend(exact.tokens, exact.keys, exact.values)
    held, group, bits = len(cache.stored_values), settings["group"], settings["bits"]
    once = [key for at in range(0, held, group) for key in given_back(
        keys_by_channel(exact.keys[at:min(at + group, held)], bits), bits, True)]

    def error(keys):
        return max(abs(a - b) for key, wanted in zip(keys, exact.keys) for a, b in zip(key, wanted))
    return {"positions": len(cache), "quantized": held, "numbers_requantized": cache.requantized,
            "numbers_moved": cache.moved, "largest_key_error": error(cache.keys[:held]),
            "largest_key_error_quantized_once": error(once)}


# ---- what Part 3 shows of it (documents.py fills its marks) --------------------------

def table(record, timing):
    """Section 19's table: int8, int4 (one scale a vector), RotatedCaches', then GroupedCaches'."""
    svg.checked(record, {**lossy.RECORDS, **RECORDS})
    ladder = dict(declared(record, lossy.RECORDS, "ladder", lossy.RUNGS))   # by declaration
    one_scale = [dict(ladder[fmt, fmt], cache=f"{fmt}, one scale a vector")
                 for fmt in ("int8", "int4")]
    one_scale += record["quantization"]["one_scale_rungs"]
    rows = [[plain(r["cache"]), "none", "—", shown(r["bytes_per_position"], "g"),
             shown(r["bytes_per_position"], "g"), shown(r["largest_logit_gap"]),
             r["greedy_stories_changed"], r["sampled_stories_changed"]] for r in one_scale]
    rows += [[plain(r["cache"]), f"1 to {r['residual']}", plain(r["flush"]),
              shown(r["bytes_per_quantized_position"], "g"), shown(r["bytes_per_position"], "g"),
              shown(r["largest_logit_gap"]), r["greedy_stories_changed"],
              r["sampled_stories_changed"]] for r in record["quantization"]["rungs"]]
    stories = record["quantization"]["stories"]
    return documents.table(["the cache", "newest kept exact", "flush",
                            "bytes per quantized position", "bytes per position, 64 held",
                            "largest logit gap", f"greedy stories changed (of {stories})",
                            f"sampled stories changed (of {stories})"], rows)
