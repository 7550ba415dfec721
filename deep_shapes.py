"""The deeper model at twelve shapes (Part 5, section 26): its cache measured, and how far a
window reaches through its layers.

For 1 to 4 layers of multi-head (4 key-value heads), grouped-query (2) and multi-query (1)
attention: the largest gap between the cached rows and the full pass's, and the numbers the
cache keeps a position, counted and by formula (shape_entry); with a window of 8 in every
layer, how far a change of the first token reaches (window_reach). The stage of
trace_kv.py that records it, and the table Part 5 draws from that record.
"""
import sys

import svg
from deep_model import DEEP_SHAPES, deep_ids, fed_deep_model, forward
from documents import bold, shown, table
from instruments import largest_gap
from model import VOCAB_SIZE, WIDTH, band
from trace_records import TIMED

WINDOW = 8   # the window of every layer in window_reach


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "deep_models": {
        "positions": svg.COUNT,
        "shapes": [{
            "layers": svg.COUNT, "heads": svg.COUNT, "kv_heads": svg.COUNT,
            "largest_logit_gap": svg.COUNT, "floats_per_position": svg.COUNT,
            "formula": svg.COUNT, "bytes_per_position_as_8_byte_floats": svg.COUNT}],
        "window_through_layers": [{
            "layers": svg.COUNT, "window": svg.COUNT, "cached_equals_full_pass": bool,
            "last_position_token_0_reaches": svg.COUNT,
            "largest_logit_change_at_position_14": svg.COUNT}]},
}


def shape_entry(layers, kv_heads, ids):
    """One shape's figures: ids fed through its cache against its full pass, and its numbers.

    4 query heads; the numbers the cache keeps a position, counted in its lists, against
    2 (a key and a value) x layers x kv_heads x the head width."""
    params, rows, cache = fed_deep_model(layers, kv_heads, ids)
    floats = cache.floats_per_position()
    return {"layers": layers, "heads": 4, "kv_heads": kv_heads,
            "largest_logit_gap": largest_gap(rows, forward(params, ids)),
            "floats_per_position": floats,
            "formula": 2 * layers * kv_heads * (WIDTH // 4),
            "bytes_per_position_as_8_byte_floats": 8 * floats}


def window_reach(layers, ids):
    """How far a change of the first token reaches through layers, each of a WINDOW window.

    2 key-value heads: whether the cached rows are the masked full pass's, the last
    position whose row the change moves, and how far it moves position 14's logits."""
    mask, changed = band(WINDOW), [(ids[0] + 1) % VOCAB_SIZE] + ids[1:]
    params, rows, _ = fed_deep_model(layers, 2, ids, mask)
    full, other = forward(params, ids, mask), forward(params, changed, mask)
    reached = [p for p, (a, b) in enumerate(zip(full, other)) if a != b]
    return {"layers": layers, "window": WINDOW, "cached_equals_full_pass": rows == full,
            "last_position_token_0_reaches": reached[-1],
            "largest_logit_change_at_position_14": largest_gap([full[14]], [other[14]])}


def experiment(lab):
    """Measure deep_model's cache at each of DEEP_SHAPES, and a window's reach in 1 to 3 layers.

    Along deep_ids(lab): shape_entry for each shape, window_reach for 1, 2 and 3 layers."""
    ids = deep_ids(lab)
    return {"positions": len(ids),
            "shapes": [shape_entry(layers, kv_heads, ids) for layers, kv_heads in DEEP_SHAPES],
            "window_through_layers": [window_reach(layers, ids) for layers in (1, 2, 3)]}


def deep_cache_bytes(lab):
    """Bytes CPython uses per position for each shape of the experiment, its cache fed deep_ids().

    The lists and every float object: they depend on the Python, so they are
    kv-time.json's, measured by trace_lesson.timings."""
    ids = deep_ids(lab)
    measured = []
    for layers, kv_heads in DEEP_SHAPES:
        _, _, cache = fed_deep_model(layers, kv_heads, ids)
        objects = sum(sys.getsizeof(vectors) + sum(sys.getsizeof(vector)
                                                    + sum(map(sys.getsizeof, vector))
                                                    for vector in vectors)
                      for layer in cache.layers for vectors in layer.values())
        measured.append({"layers": layers, "kv_heads": kv_heads,
                         "bytes_per_position": round(objects / len(ids), 2)})
    return measured


# ---- what Part 5 shows of it (documents.py fills its marks) --------------------------

def shapes_table(record, timing):
    """Section 26's table: each kind of attention's gaps, and its numbers and bytes a position."""
    objects = svg.checked(timing, svg.picked(TIMED, "deep_model_cache_bytes_as_cpython_objects"),
                          "time")["deep_model_cache_bytes_as_cpython_objects"]
    svg.checked(record, RECORDS)
    rows = []
    for kv_heads, kind in ((4, "multi-head (4 key-value heads)"), (2, "grouped-query (2 "
                           "key-value heads)"), (1, "multi-query (1 key-value head)")):
        shapes = svg.found(record["deep_models"]["shapes"], "deep_models.shapes",
                           kv_heads=kv_heads)
        one_layer = svg.found(objects, "time.deep_model_cache_bytes_as_cpython_objects",
                              layers=1, kv_heads=kv_heads)[0]
        rows.append([kind, bold(" / ".join(shown(s["largest_logit_gap"]) for s in shapes)),
                     " / ".join(f"{s['floats_per_position']:g}" for s in shapes),
                     f"{shapes[0]['bytes_per_position_as_8_byte_floats']:g}",
                     f"{one_layer['bytes_per_position']:,}"])
    return table(["attention", "largest gap, cached against full pass, 1 / 2 / 3 / 4 layers",
                  "numbers per position, 1 / 2 / 3 / 4 layers", "bytes per position, one "
                  "layer, as 8-byte floats", "the same as CPython objects"], rows)
