"""The quick checks of the lab's layers, for the tests: the lesson's cache first, then
each Part on the layers it builds on (LAYERS). Each check feeds the cases where its
module's mistakes show, and returns None if they hold, else why not: a Wrong, whose one
line names the quantity that differs and where (story, position, block, request), and
whose detail gives what was fed and both values. verdicts.py runs each at most once in a
test run and decides what the tests built on it do.

Each check imports its Part's module itself, when it runs: a Part that cannot even be
imported (a syntax error) is then that layer's verdict, and the layers beside it run.
"""
import copy
import os
import random
import tempfile
from collections import namedtuple

import kv_cache
import model
from kv_cache import KVCache, feed
from support import (OPENINGS, PARAMS, STORIES, TOK, cached_rows, filled_cache,
                     first_difference, snapshot, where_rows_differ)


class Wrong(str):
    """A check's verdict when it fails: one line (the str itself), naming the quantity that
    differs and where; and its detail, for the layer's own QuickCheck: what was fed, and
    both values."""

    def __new__(cls, line, detail=""):
        wrong = super().__new__(cls, line)
        wrong.detail = detail
        return wrong


STEPS = []   # what the running check is doing (step), so that an exception can say it


def step(what):
    """Say what the running check does next ("finding the prefix again"): an exception it
    raises from here on is named with it."""
    STEPS.append(what)


def excerpt(values, width=100):
    """A list of numbers (or anything) as a line of at most width characters."""
    text = repr(values)
    return text if len(text) <= width else text[:width - 5] + " ...]"


def differ(what, got, expected, source, names=("position", "logit"), fed=""):
    """None if got == expected, else a Wrong naming the first number that differs by its
    indices (names: what each level of nesting counts, "position 9, logit 3"), with both
    numbers; its detail shows what was fed and the two vectors that hold the difference."""
    if got == expected:
        return None
    where, mine, wanted = first_difference(got, expected)
    indices = [int(i) for i in where.strip("[]").split("][")] if where.startswith("[") else []
    place = ", ".join(f"{name} {i}" for name, i in zip(names, indices)) or where
    outer_got, outer_wanted = got, expected
    for i in indices[:-1]:
        outer_got, outer_wanted = outer_got[i], outer_wanted[i]
    detail = (f"  fed: {fed}\n" if fed else "") + (
        f"  {source} gave: {excerpt(outer_got)}\n  expected:  {excerpt(outer_wanted)}")
    return Wrong(f"{what}, at {place}: {mine} from {source}, {wanted} expected", detail)


def module_of(name):
    """The test module of layer name (from its command: python3 -m unittest test_x)."""
    return LAYERS[name].command.split()[-1].split(".")[0]


def _lesson():
    """Every row of the first test story, fed through the cache, is model.forward's."""
    return where_rows_differ(PARAMS, TOK.encode(STORIES[0]))


def _prefill():
    """The first test story prefilled 3 tokens at a time gives forward_step's rows."""
    import prefill
    ids = TOK.encode(STORIES[0])
    return differ("the first test story prefilled in chunks of 3",
                   prefill.prefill_in_chunks(PARAMS, KVCache(PARAMS), ids, 3),
                   cached_rows(PARAMS, ids), "prefill")


def where_sequence_differs(label, seq, reference):
    """None if the paged sequence seq holds, position by position, what reference (a
    KVCache fed the same tokens) holds, where its block table says: position p in block
    table[p // block_size], slot p % block_size. Else one line naming the position, the
    block and the slot, and what differs there."""
    size = seq.pool.block_size
    if seq.length != len(reference):
        return f"{label} holds {seq.length} positions, where the reference holds {len(reference)}"
    for position in range(len(reference)):
        block_id, slot = seq.table[position // size], position % size
        block = seq.pool.blocks[block_id]
        where = f"{label}, position {position} (block {block_id}, slot {slot})"
        if slot >= len(block.tokens):
            return f"{where}: the block holds only {len(block.tokens)} positions"
        for part in ("tokens", "keys", "values"):
            if getattr(block, part)[slot] != getattr(reference, part)[position]:
                return f"{where}: its {part[:-1]} is not the one a KVCache fed the same tokens holds"
    return None


def paged_scenario():
    """Write a sequence, fork it, let both sides write, and find its prefix again from a
    new sequence, all one forward_step at a time; None if every sequence holds what a
    KVCache fed its tokens holds, else where_sequence_differs's line for the first that
    does not (or the pool's refusal, which names the block and slot it guards)."""
    import paged
    ids = TOK.encode(OPENINGS[0] + " she was")
    pool = paged.BlockPool(PARAMS, 16, 4)

    def write(seq, tokens):
        for token_id in tokens:
            kv_cache.forward_step(PARAMS, seq, token_id, len(seq))
    try:
        parent = pool.sequence()
        write(parent, ids[:10])                  # blocks of 4, 4 and 2 positions
        fork = parent.copy()
        write(fork, ids[10:12])                  # into the shared, partly filled block
        write(parent, TOK.encode(" tom"))
        found = pool.sequence(ids[:10])          # a prefix hit: the two full blocks
        write(found, ids[len(found):10])
    except ValueError as refused:                # the pool's own guards
        return f"the pool refused: {refused}"
    for label, seq, tokens in (("the parent", parent, ids[:10] + TOK.encode(" tom")),
                               ("the fork", fork, ids[:12]), ("the prefix hit", found, ids[:10])):
        why = where_sequence_differs(label, seq, filled_cache(tokens))
        if why:
            return why
    return None


def _lossy():
    """A float64 QuantizedCache gives forward_step's rows; a WindowCache, those of the
    full pass with its band mask."""
    import lossy
    ids = TOK.encode(STORIES[0])
    return (differ("a float64 QuantizedCache on the first test story",
                    feed(PARAMS, lossy.QuantizedCache(PARAMS, "float64"), ids),
                    cached_rows(PARAMS, ids), "the cache")
            or differ("WindowCache(params, 8, 2) on the first test story",
                       feed(PARAMS, lossy.WindowCache(PARAMS, 8, 2), ids),
                       model.forward(PARAMS, ids, model.band(8, 2))[0], "the cache"))


def in_batches(params, caches, ids, seed=0):
    """Feed each cache its ids through batched.forward_rows, in steps that mix, at random
    from seed, a chunk of one cache's next tokens with one next token of each other
    cache: the rows of each cache, in position order."""
    import batched
    rng = random.Random(seed)
    rows = [[] for _ in caches]
    while any(len(cache) < len(own) for cache, own in zip(caches, ids)):
        items, owners = [], []
        for index, (cache, own) in enumerate(zip(caches, ids)):
            count = min(rng.choice((0, 1, 1, 3)), len(own) - len(cache))
            for position in range(len(cache), len(cache) + count):
                items.append((cache, own[position], position))
                owners.append(index)
        if items:
            for index, logits in zip(owners, batched.forward_rows(params, items)):
                rows[index].append(logits)
    return rows


def where_batches_differ(params, caches, ids, seed=0):
    """None if each cache's rows, fed in_batches, are forward_step's, else (in one line)
    the first number that differs, or why forward_rows refused."""
    try:
        rows = in_batches(params, caches, ids, seed=seed)
    except ValueError as refused:
        return f"forward_rows refused: {refused}"
    for index, (got, own) in enumerate(zip(rows, ids)):
        why = differ(f"sequence {index}", got, feed(params, KVCache(params), own), "forward_rows")
        if why:
            return why
    return None


def _batched():
    """Three test stories fed in mixed batches give forward_step's rows."""
    ids = [TOK.encode(story) for story in STORIES[:3]]
    return where_batches_differ(PARAMS, [KVCache(PARAMS) for _ in ids], ids)


def _serving():
    """Requests served from a pool that preempts, and one whose whole prompt the pool
    holds from an earlier request (blocks of 1), give generate_cached's results."""
    import paged
    import serving
    runs = (([{"prompt": prompt, "max_new_tokens": 12} for prompt in OPENINGS[:3]]
             + [{"prompt": OPENINGS[3], "max_new_tokens": 12, "temperature": 1.0, "seed": 3}],
             paged.BlockPool(PARAMS, 14, 4), 4),
            ([{"prompt": OPENINGS[0], "max_new_tokens": 4}] * 2, paged.BlockPool(PARAMS, 40, 1), 1))
    for requests, pool, max_batch in runs:
        served, counts = serving.serve(PARAMS, TOK, requests, pool, max_batch)
        for index, (request, result) in enumerate(zip(requests, served)):
            if result != kv_cache.generate_cached(PARAMS, TOK, **request):
                return (f"request {index} ({request}) came back as {result['text']!r}, not "
                        f"generate's (blocks of {pool.block_size}, {counts['preemptions']} "
                        f"preemptions, {counts['prefix_hits']} prefix hits)")
    return None


def _speculative():
    """Speculative decoding of one opening, greedy and sampled, gives generate_cached's."""
    import speculative
    for settings in ({}, {"temperature": 1.0, "seed": 1}):
        got = speculative.generate_speculative(PARAMS, TOK, OPENINGS[0], max_new_tokens=16,
                                               **settings)
        if got != kv_cache.generate_cached(PARAMS, TOK, OPENINGS[0], max_new_tokens=16,
                                           **settings):
            return f"generate_speculative({OPENINGS[0]!r}, {settings}) gave {got['text']!r}"
    return None


def _cache_files():
    """A cache saved to a file loads as the very cache."""
    import cache_files
    cache = filled_cache(TOK.encode(STORIES[0]))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "cache.json")
        cache_files.save_cache(cache, path)
        loaded = cache_files.load_cache(PARAMS, path)
    return differ("a saved and loaded cache (length, tokens, keys, values)",
                   snapshot(loaded), snapshot(cache), "the file")


def deep_label(params):
    """A deep_model model's shape in words: "the 2-layer grouped-query model (4 heads,
    2 kv heads, rotary positions)", with its latent and rotary key if it has them."""
    shape = params["shape"]
    heads, kv_heads = shape["heads"], shape["kv_heads"]
    kind = ("latent" if shape["latent"] else "multi-head" if kv_heads == heads
            else "multi-query" if kv_heads == 1 else "grouped-query")
    latent = ""
    if shape["latent"]:
        latent = f", latent {shape['latent']}" + (f", rotary key {shape['rotary_key']}"
                                                  if shape["rotary_key"] else "")
    return (f"the {shape['layers']}-layer {kind} model ({heads} head{'s' * (heads > 1)}, "
            f"{kv_heads} kv head{'s' * (kv_heads > 1)}, {shape['positions']} positions{latent})")


def cut(params, layers):
    """A deep_model model's params with only its first layers (the same weights)."""
    return dict(params, shape=dict(params["shape"], layers=layers),
                blocks=params["blocks"][:layers])


def by_layer(params, compare):
    """compare(params), None or a Wrong, for a deep_model model; if it fails, again for
    the model cut after each layer in turn, so as to name the first layer whose rows go
    wrong: a Wrong that names the model and that layer, then the cut model's line."""
    why = compare(params)
    if why is None:
        return None
    layers = params["shape"]["layers"]
    wrong = layers - 1
    for layer in range(layers - 1):
        earlier = compare(cut(params, layer + 1))
        if earlier:
            why, wrong = earlier, layer
            break
    below = ("" if wrong == 0 else " (layer 0 alone agrees)" if wrong == 1
             else f" (layers 0 to {wrong - 1} alone agree)")
    return Wrong(f"{deep_label(params)}, wrong from layer {wrong} on{below}: {why}", why.detail)


def stepped_rows(label, step_function, weights, cache, ids):
    """The rows of step_function(weights, cache, token_id, position) for each of ids in
    turn, each call a step (step), so that an exception names the model and the position."""
    rows = []
    for position, token_id in enumerate(ids):
        step(f"{label}: {step_function.__name__} of token {token_id} at position {position}, "
             f"which should give the full pass's row")
        rows.append(step_function(weights, cache, token_id, position))
    return rows


def deep_rows(params, ids, mask=None, label=None):
    """The rows of a deep_model fed ids one token at a time through a new cache (with
    mask, causal unless given), and the cache; each step named with label (the model's
    deep_label unless given)."""
    import deep_model
    cache = deep_model.DeepCache(params, mask or deep_model.causal)
    return stepped_rows(label or deep_label(params), deep_model.forward_step, params, cache,
                        ids), cache


def where_deep_rows_differ(params, ids, mask=None):
    """None if every row of a deep_model fed ids through its cache (deep_rows) equals its
    full pass's, else a Wrong naming the model, the first layer whose rows differ, the
    position and the logit, with both numbers (by_layer)."""
    import deep_model
    mask = mask or deep_model.causal
    rebuilt = " (its keys and values rebuilt from the cached latents)"

    def compare(weights):
        rows, _ = deep_rows(weights, ids, mask)
        step(f"{deep_label(weights)}: its full pass (deep_model.forward)")
        return differ("the cached row" + (rebuilt if weights["shape"]["latent"] else ""),
                      rows, deep_model.forward(weights, ids, mask), "forward_step",
                      fed=f"token IDs {ids}, one at a time through a new DeepCache"
                          + ("" if mask is deep_model.causal else ", with a mask"))
    return by_layer(params, compare)


def where_rotate_turns_wrong():
    """None if deep_model.rotate turns the pairs (1, 0) and (0, 1) by their angles
    (position x theta) to (cos, sin) and (-sin, cos), as a turn does, exactly (each
    number a sum of one product and a zero); else a Wrong naming the number."""
    import math
    import deep_model
    position, thetas = 3, [0.5, 0.25]
    first, second = (position * theta for theta in thetas)
    step("turning the pairs (1, 0) and (0, 1) with deep_model.rotate")
    return differ(f"deep_model.rotate's turn of the pairs (1, 0) and (0, 1) by the angles "
                  f"{first:g} and {second:g}", deep_model.rotate([1.0, 0.0, 0.0, 1.0],
                                                                 position, thetas),
                  [math.cos(first), math.sin(first), -math.sin(second), math.cos(second)],
                  "rotate", names=("number",),
                  fed=f"x = [1.0, 0.0, 0.0, 1.0], position {position}, thetas {thetas}: a "
                      f"turn by the angle a takes (1, 0) to (cos a, sin a), (0, 1) to "
                      f"(-sin a, cos a)")


def where_heads_of_wrong(params):
    """None if deep_model.heads_of gives, for params' shape, what its docstring says: the
    heads, the head width d, a head's key width (d and the rotary key), the query heads a
    key-value head serves and 1 / sqrt(key width); else a Wrong naming the entry."""
    import math
    import deep_model
    shape = params["shape"]
    d = shape["width"] // shape["heads"]
    d_key = d + shape["rotary_key"]
    step(f"{deep_label(params)}: its heads (deep_model.heads_of)")
    return differ(f"{deep_label(params)}: deep_model.heads_of (heads, head width, key width, "
                  f"query heads a kv head serves, 1 / sqrt(key width))",
                  list(deep_model.heads_of(shape)),
                  [shape["heads"], d, d_key, shape["heads"] // shape["kv_heads"],
                   1 / math.sqrt(d_key)], "heads_of", names=("entry",), fed=f"shape {shape}")


def where_lesson_differs(ids):
    """None if a 1-layer, 1-head deep_model holding the lesson's trained weights gives the
    lesson's rows (model.forward's), fed ids through its cache; else a Wrong naming the
    position and the logit. The deeper model does the lesson's arithmetic per layer and
    per head, so this meets what its two paths share (and would share a mistake in)."""
    step("holding the lesson's weights in a 1-layer, 1-head deep_model")
    block = {name: PARAMS[name] for name in ("ln1_g", "ln1_b", "Wq", "Wk", "Wv", "Wo", "ln2_g",
                                             "ln2_b", "W1", "b1", "W2", "b2")}
    params = {"shape": {"layers": 1, "heads": 1, "kv_heads": 1, "width": model.WIDTH,
                        "positions": "learned", "latent": None, "rotary_key": 0},
              "blocks": [block], **{name: PARAMS[name] for name in ("tok_emb", "pos_emb", "lnf_g",
                                                                     "lnf_b", "W_out", "b_out")}}
    label = f"{deep_label(params)} holding the lesson's weights"
    rows, _ = deep_rows(params, ids, label=label)
    step("the lesson's full pass (model.forward)")
    return differ(f"{label}: the cached row",
                  rows, model.forward(PARAMS, ids)[0], "forward_step",
                  fed=f"token IDs {ids}; expected: the lesson's model.forward")


DEEP_MODELS = ((2, 4, 2, 16, 0), (2, 4, 1, 16, 0, "rotary"), (2, 4, 4, 16, 0, "learned", 8),
               (2, 4, 4, 16, 0, "rotary", 8))   # deep_model.init_params's arguments


def _deep_model():
    """The deeper model's cached rows are its full pass's and the lesson's; a turn is a turn.

    Feeds deep_model.rotate the pairs (1, 0) and (0, 1) (where_rotate_turns_wrong); the
    first 12 tokens of the first test story through a 1-layer, 1-head deep_model holding
    the lesson's weights, whose rows are the lesson's (where_lesson_differs); then through
    the cache of 2-layer models of grouped-query attention (4 heads, 2 kv heads, learned
    positions), multi-query attention (rotary) and latent attention (learned, and rotary
    with a rotary key): their heads as heads_of's docstring says (where_heads_of_wrong),
    and every row == the full pass's (where_deep_rows_differ)."""
    import deep_model
    ids = TOK.encode(STORIES[0])[:12]
    why = where_rotate_turns_wrong() or where_lesson_differs(ids)
    for args in DEEP_MODELS:
        if why:
            return why
        step(f"making a model of deep_model.init_params{args}")
        params = deep_model.init_params(*args)
        why = where_heads_of_wrong(params) or where_deep_rows_differ(params, ids)
    return why


def where_held_differs(params, ids, kept):
    """None if a cache held (context_shift._held) from the keys and values of a cache fed
    the first kept of ids, fed the rest, gives the rows of the fed cache fed the rest;
    else a Wrong naming the model, the row and the logit."""
    import context_shift
    import deep_model
    label = deep_label(params)
    step(f"{label}: feeding {kept} tokens, and holding its keys and values in a new cache "
         f"(context_shift._held)")
    fed = deep_model.DeepCache(params)
    context_shift._fed(params, fed, ids[:kept])
    held = context_shift._held(params, fed.tokens, [(layer["keys"], layer["values"])
                                                    for layer in fed.layers])
    step(f"{label}: feeding the held cache the next {len(ids) - kept} tokens, which should "
         f"give the fed cache's rows")
    return differ(f"{label}, a cache held from the keys and values of the first {kept} "
                  f"tokens (context_shift._held) and fed the next {len(ids) - kept} (row r is "
                  f"position {kept} + r)", context_shift._fed(params, held, ids[kept:]),
                  context_shift._fed(params, fed, ids[kept:]), "the held cache",
                  names=("row", "logit"), fed=f"token IDs {ids}")


def where_shift_strays(seed=0):
    """None if the shift itself holds, within ROUNDING, else a Wrong naming the layer, the
    position and the number of the first kept key that strays.

    In a 1-layer rotary model (4 heads, 2 kv heads, seed) fed its SEQUENCE random tokens
    (context_shift._random_tokens), the keys of the kept positions turned back by DROPPED
    (context_shift._turned_back) are met with the keys that a new cache fed the kept
    tokens computes at their new positions."""
    import context_shift
    import deep_model
    from instruments import recording
    params = deep_model.init_params(1, 4, 2, model.WIDTH, seed, "rotary")
    dropped = context_shift.DROPPED
    ids = context_shift._random_tokens(seed)[:context_shift.SEQUENCE]
    label = deep_label(params)
    step(f"{label}: feeding {len(ids)} random tokens, and a new cache the last "
         f"{len(ids) - dropped} (the recompute)")
    fed, recomputed = deep_model.DeepCache(params), deep_model.DeepCache(params)
    with recording(deep_model, "rotate") as turns:
        context_shift._fed(params, fed, ids)
    context_shift._fed(params, recomputed, ids[dropped:])
    step(f"{label}: turning the kept keys back by {dropped} (context_shift._turned_back), "
         f"which should give the recompute's keys, within rounding")
    return strayed(f"{label}, its oldest {dropped} of {len(ids)} positions dropped: a kept "
                   f"key as context_shift._turned_back turns it (back by {dropped}: position "
                   f"p was position p + {dropped})",
                   context_shift._turned_back(fed, turns[0].args[2]),
                   [layer["keys"] for layer in recomputed.layers], "the shift",
                   names=("layer", "position", "number"),
                   fed=f"token IDs {ids}; expected: the keys of a new cache fed the kept "
                       f"{ids[dropped:]}, computed at their new positions")


def where_shift_record_wrong(seed=0):
    """None if context_shift._shift of a 1-layer rotary model (4 heads, 2 kv heads, seed;
    without the cases elsewhere) records what one layer gives: its cached rows the full
    pass's, its keys turned back within rounding of those turned once, those turned once
    the recompute's, and its shifted cache continued within rounding of the turned-once
    one and exactly as the recompute (in one layer the recompute is the turned-once
    cache); else a Wrong naming the entry of the record, and both values."""
    import context_shift
    label = (f"context_shift._shift(1, 2, {seed}, False), of the 1-layer grouped-query model "
             f"(4 heads, 2 kv heads, rotary positions)")
    step(f"{label}: running it")
    case = context_shift._shift(1, 2, seed, False)
    rounding = case["rounding"]
    for name, holds, wanted in (
            ("largest_logit_gap", case["largest_logit_gap"] == 0.0,
             "0.0 (the cached rows are the full pass's)"),
            ("key_gap_rotated_back_vs_rotated_once",
             case["key_gap_rotated_back_vs_rotated_once"] <= ROUNDING,
             f"at most rounding, {ROUNDING:g}"),
            ("layer_1_keys_rotated_once_equal_recomputed",
             case["layer_1_keys_rotated_once_equal_recomputed"] is True,
             "True (a key turned once to its new position is the recompute's)"),
            ("rounding", rounding["largest_logit_gap"] <= ROUNDING
             and rounding["continuation_changed"] is False,
             f"a largest_logit_gap of at most {ROUNDING:g}, the continuation unchanged"),
            ("against_recompute", case["against_recompute"] == rounding,
             f"{rounding} (its rounding's: the recompute is the turned-once cache)")):
        if not holds:
            return Wrong(f"{label}: its {name} is {case[name]!r}, where one layer gives {wanted}",
                         f"  fed: context_shift._shift(1, 2, {seed}, False)\n"
                         f"  _shift gave: {excerpt(case, 2000)}")
    return None


def _context_shift():
    """A held cache goes on as the fed one; a shifted key is the one at its new position.

    Feeds 2-layer models of learned and of rotary positions the first 10 tokens of the
    first test story: a cache held from the keys and values of the first 6
    (context_shift._held) goes on as the cache it was kept from (where_held_differs). Then
    a 1-layer rotary model random tokens: its kept keys turned back by the dropped
    positions are within rounding of those computed at the new positions
    (where_shift_strays), and context_shift._shift records what one layer gives
    (where_shift_record_wrong)."""
    import deep_model
    ids = TOK.encode(STORIES[0])[:10]
    for positions in ("learned", "rotary"):
        why = where_held_differs(deep_model.init_params(2, 4, 2, 16, 0, positions), ids, 6)
        if why:
            return why
    return where_shift_strays() or where_shift_record_wrong()


ROUNDING = 1e-12   # far above the absorbed path's gaps (about 1e-15), far below a mistake's


def first_gap(got, expected, where=()):
    """Where two equally nested lists of numbers first differ by more than ROUNDING, as
    (indices, got's number, expected's, True), or where two of their lists differ in
    length, as (indices, both lengths in words, False); None if nowhere."""
    if isinstance(got, list) and isinstance(expected, list):
        if len(got) != len(expected):
            return where, f"{len(got)} items", f"{len(expected)} items", False
        for index, (a, b) in enumerate(zip(got, expected)):
            found = first_gap(a, b, where + (index,))
            if found:
                return found
        return None
    return None if abs(got - expected) <= ROUNDING else (where, got, expected, True)


def strayed(what, got, expected, source, names=("position", "logit"), fed=""):
    """As differ, within ROUNDING: None if every number of got is within ROUNDING of
    expected's, else a Wrong naming the first that is not by its indices, with both
    numbers and their gap; its detail shows what was fed and the two vectors that hold it."""
    found = first_gap(got, expected)
    if found is None:
        return None
    indices, mine, wanted, numbers = found
    place = ", ".join(f"{name} {i}" for name, i in zip(names, indices)) or "the lists"
    outer_got, outer_wanted = got, expected
    for i in (indices[:-1] if numbers else indices):
        outer_got, outer_wanted = outer_got[i], outer_wanted[i]
    gap = f" ({abs(mine - wanted):.3g} apart, more than rounding, {ROUNDING:g})" if numbers else ""
    return Wrong(f"{what}, at {place}: {mine} from {source}, {wanted} expected{gap}",
                 (f"  fed: {fed}\n" if fed else "") + f"  {source} gave: {excerpt(outer_got)}\n"
                 f"  expected:  {excerpt(outer_wanted)}")


def where_absorbed_strays(params, ids):
    """None if a latent model's rows read through latent_attention.absorbed_step (fed
    ids one at a time through a new cache) stay within ROUNDING of its full pass's, else
    a Wrong naming the model, the first layer whose rows stray (by_layer), the position
    and the logit, with both numbers."""
    import deep_model
    import latent_attention

    def compare(weights):
        label = deep_label(weights)
        step(f"{label}: folding it (latent_attention.fold)")
        folded = latent_attention.fold(weights)
        rows = stepped_rows(label, latent_attention.absorbed_step, folded,
                            deep_model.DeepCache(weights), ids)
        step(f"{label}: its full pass (deep_model.forward)")
        return strayed("the absorbed path's row (read in latent space)", rows,
                       deep_model.forward(weights, ids), "absorbed_step",
                       fed=f"token IDs {ids}, one at a time through a new DeepCache")
    return by_layer(params, compare)


def _latent_attention():
    """A latent model's rows, rebuilt and absorbed (within rounding), are its full pass's.

    Feeds the first 12 tokens of the first test story through 2-layer latent models (4
    heads, latent 8), of learned positions and of rotary ones with a rotary key: the rows
    of deep_model.forward_step (keys and values rebuilt) == the full pass's, and those of
    latent_attention.absorbed_step (read in latent space) within ROUNDING of them."""
    import deep_model
    ids = TOK.encode(STORIES[0])[:12]
    for positions in ("learned", "rotary"):
        params = deep_model.init_params(2, 4, 4, 16, 0, positions, 8)
        why = where_deep_rows_differ(params, ids) or where_absorbed_strays(params, ids)
        if why:
            return why
    return None


def _bandwidth():
    """The numbers a step of the lesson's model reads, counted, against the formula's."""
    import bandwidth
    from instruments import count_reads
    params = copy.deepcopy(PARAMS)
    cache = KVCache(params)
    feed(params, cache, TOK.encode(STORIES[0])[:5])
    read = count_reads(lambda: kv_cache.forward_step(params, cache, 5, 5), params, cache.columns,
                       cache.keys, cache.values)
    wanted = sum(bandwidth.floats_read(bandwidth.LESSON, 5).values())
    return None if read == wanted else (f"a step with 5 positions held reads {read} numbers, "
                                        f"and bandwidth.floats_read counts {wanted}")


def attention_reads(story):
    """The (q, keys, values) that every row of story, fed to the trained model in one
    batch by batched.forward_rows, hands its attention."""
    import batched
    cache, reads = KVCache(PARAMS), []
    batched.forward_rows(PARAMS, [(cache, token_id, position) for position, token_id
                                  in enumerate(TOK.encode(story))],
                         attention=lambda q, keys, values, rows: reads.append(
                             (q, keys, values)) or batched.exact_attention(q, keys, values))
    return reads


def _blockwise():
    """The exact kind split in 4 and the online kind, on a story's rows: forward_step's
    bits, and within ROUNDING of them."""
    import batched
    import blockwise
    for row, read in enumerate(attention_reads(STORIES[0])):
        wanted = batched.exact_attention(*read)
        if blockwise.exact(4)(*read) != wanted:
            return f"row {row}: the exact kind split in 4 is not forward_step's attention"
        gap = max(abs(a - b) for a, b in zip(blockwise.online(*read), wanted))
        if not gap <= ROUNDING:
            return f"row {row}: the online kind is {gap:.3g} from forward_step's attention"
    return None


Layer = namedtuple("Layer", "title builds_on command check")
Layer.__doc__ = """One layer of the lab: what it is, the layers it builds on, the command
that shows why it is wrong, and its quick check (None if it holds, else why not, in a
line), or None for a layer with no check of its own."""

LAYERS = {
    "lesson": Layer("the lesson (kv_cache.forward_step against model.forward)", (),
                    "python3 -m unittest test_kv_cache.Exactness", _lesson),
    "prefill": Layer("one-pass prefill (prefill.py)", ("lesson",),
                     "python3 -m unittest test_prefill", _prefill),
    "paged": Layer("the paged cache (paged.py)", ("lesson",),
                   "python3 -m unittest test_paged", paged_scenario),
    "lossy": Layer("the lossy caches (lossy.py)", ("lesson",),
                   "python3 -m unittest test_lossy", _lossy),
    "batched": Layer("batched rows (batched.py)", ("lesson", "paged"),
                     "python3 -m unittest test_batched", _batched),
    "serving": Layer("serving (serving.py)", ("prefill", "paged", "batched"),
                     "python3 -m unittest test_serving", _serving),
    "speculative": Layer("speculative decoding (speculative.py)", ("prefill",),
                         "python3 -m unittest test_speculative", _speculative),
    "cache_files": Layer("cache files (cache_files.py)", ("lesson", "paged"),
                         "python3 -m unittest test_cache_files", _cache_files),
    "deep_model": Layer("the deeper model (deep_model.py)", (),
                        "python3 -m unittest test_deep_model", _deep_model),
    "context_shift": Layer("the context shift (context_shift.py)", ("deep_model",),
                           "python3 -m unittest test_context_shift", _context_shift),
    "latent_attention": Layer("latent attention read in latent space (latent_attention.py)",
                              ("deep_model",), "python3 -m unittest test_latent_attention",
                              _latent_attention),
}
LAYERS["bandwidth"] = Layer("the numbers a step reads (bandwidth.py)",
                            ("lesson", "deep_model", "latent_attention"),
                            "python3 -m unittest test_bandwidth", _bandwidth)
LAYERS["blockwise"] = Layer("attention read block by block (blockwise.py)",
                            ("lesson", "batched"), "python3 -m unittest test_blockwise",
                            _blockwise)
LAYERS["every Part"] = Layer("every Part", tuple(LAYERS), "python3 -m unittest", None)
