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
import json
import math
import os
import random
import struct
import tempfile
from collections import namedtuple

import kv_cache
import model
from instruments import replaced
from kv_cache import KVCache, feed
from support import (OPENINGS, PARAMS, STORIES, TOK, cached_rows, filled_cache,
                     first_difference, random_model, snapshot, where_rows_differ)


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


def where_cache_differs(label, cache, reference, source):
    """None if cache holds the tokens, keys and values reference holds, else a Wrong
    naming the first part and position that differ, with both numbers."""
    for part in ("tokens", "keys", "values"):
        why = differ(f"{label}: its {part}", list(getattr(cache, part)),
                     list(getattr(reference, part)), source,
                     names=("position", "number"), fed=f"token IDs {list(reference.tokens)}")
        if why:
            return why
    return None


PREFILL_HELD = 7   # the positions a cache already holds when _prefill prefills the rest


def saying_each_chunk(label):
    """A stand-in for prefill.prefill (instruments.replaced): each call first says, as the
    check's step, the positions of the chunk it prefills, so that an exception names them."""
    def stand_in(real):
        def prefill(params, cache, token_ids, start):
            step(f"{label}: prefilling the chunk of positions {start} to "
                 f"{start + len(token_ids) - 1} (expected: forward_step's rows)")
            return real(params, cache, token_ids, start)
        return prefill
    return stand_in


def _prefill():
    """The first test story (30 tokens) prefilled in chunks of 4 (the last one short), 5
    (which divide it) and the whole story at once, each into a new cache, and in chunks of
    4 after a cache already holds its first PREFILL_HELD tokens: every row and the cache
    after are forward_step's."""
    import prefill
    ids = TOK.encode(STORIES[0])
    step("feeding the first test story one forward_step at a time")
    reference = KVCache(PARAMS)
    expected = feed(PARAMS, reference, ids)
    for held, size in ((0, 4), (0, 5), (0, model.CONTEXT), (PREFILL_HELD, 4)):
        short = len(ids[held:]) % size
        label = (f"the first test story ({len(ids)} tokens) prefilled "
                 + (f"in chunks of {size}" + (f" (the last of {short})" if short else "")
                    if size < len(ids) else f"in one chunk (size {size})")
                 + (f" after a cache holds its first {held} tokens" if held else ""))
        step(f"{label}: feeding the first {held} one forward_step at a time")
        cache = KVCache(PARAMS)
        rows = feed(PARAMS, cache, ids[:held])
        with replaced(prefill, "prefill", saying_each_chunk(label)):
            rows += prefill.prefill_in_chunks(PARAMS, cache, ids, size)
        if len(rows) != len(expected):
            return Wrong(f"{label}: {len(rows) - held} rows from prefill, "
                         f"{len(expected) - held} expected (one for each position from {held})",
                         f"  fed: token IDs {ids}")
        why = (differ(label, rows, expected, "prefill",
                      fed=f"token IDs {ids}, {held} held, chunks of {size} from position {held}")
               or where_cache_differs(label, cache, reference, "prefill"))
        if why:
            return why
    return None


def where_sequence_differs(label, seq, tokens):
    """None if the paged sequence seq holds, position by position, what a KVCache fed
    tokens holds, where its block table says: position p in block table[p // block_size],
    slot p % block_size. Else a Wrong naming the position, the block and the slot, and
    what differs there; its detail, the tokens, the table and both values."""
    reference, size = filled_cache(tokens), seq.pool.block_size
    fed = f"  {label}: token IDs {tokens}, block table {seq.table}"
    if seq.length != len(reference):
        return Wrong(f"{label} holds {seq.length} positions, where {len(reference)} were "
                     f"written", fed)
    for position in range(len(reference)):
        block_id, slot = seq.table[position // size], position % size
        block = seq.pool.blocks[block_id]
        where = f"{label}, position {position} (block {block_id}, slot {slot})"
        if slot >= len(block.tokens):
            return Wrong(f"{where}: the block holds only {len(block.tokens)} positions", fed)
        for part in ("tokens", "keys", "values"):
            held, wanted = getattr(block, part)[slot], getattr(reference, part)[position]
            if held != wanted:
                return Wrong(f"{where}: its {part[:-1]} is not the one a KVCache fed the same "
                             f"tokens holds", f"{fed}\n  the block holds: {excerpt(held)}\n"
                                              f"  a KVCache:       {excerpt(wanted)}")
    return None


def paged_scenario():
    """Sequences of one pool (blocks of 4) written one forward_step at a time: a parent of
    10 positions; its fork, writing into the partly filled block they share; the parent
    going on to 12; a new sequence finding the parent's first two blocks by their prefix;
    one opening with the tokens of the parent's second block (found nowhere: a block is
    found by every token from position 0, not by its own); and, once the parent and the
    fork are freed, one finding their three full blocks again, as a preempted request
    readmitted does. None if each holds, slot by slot, what a KVCache fed its tokens
    holds, each found as many blocks as hold its first tokens, and each block counts the
    tables that hold it; else a Wrong naming the sequence, the position and the block."""
    import paged
    ids = TOK.encode(OPENINGS[0] + " she was")
    pool = paged.BlockPool(PARAMS, 16, 4)

    def write(seq, tokens):
        for token_id in tokens[len(seq):]:
            kv_cache.forward_step(PARAMS, seq, token_id, len(seq))
        return seq

    def new(label, tokens, hits):
        step(f"starting {label} with pool.sequence({tokens})")
        seq = pool.sequence(tokens)
        if len(seq.table) != hits:
            raise LookupError(f"{label} found {len(seq.table)} cached block"
                              f"{'s' * (len(seq.table) != 1)} (table {seq.table}), where "
                              f"{hits} hold its first tokens")
        step(f"writing {label}, one forward_step a position")
        return write(seq, tokens)
    moved = ids[4:8] + ids[:4]
    try:
        parent = new("the parent", ids[:10], 0)                   # blocks of 4, 4 and 2
        step("forking the parent, and writing the fork into the block they share")
        fork = write(parent.copy(), ids[:12])
        step("writing the parent on, after its fork wrote")
        write(parent, ids[:10] + TOK.encode(" tom"))
        live = {"the prefix hit": (new("the prefix hit", ids[:10], 2), ids[:10]),
                "the sequence opening with the second block's tokens": (
                    new("the sequence opening with the second block's tokens", moved, 0), moved)}
        for label, seq, tokens in (("the parent", parent, ids[:10] + TOK.encode(" tom")),
                                   ("the fork", fork, ids[:12])):
            why = where_sequence_differs(label, seq, tokens)
            if why:
                return why
        step("freeing the parent and the fork")
        parent.free()
        fork.free()
        tokens = ids[:10] + TOK.encode(" tom")
        live["the readmitted parent"] = (new("the readmitted parent", tokens, 3), tokens)
    except LookupError as wrong_hit:
        return Wrong(str(wrong_hit), f"  while {STEPS[-1]}")
    except ValueError as refused:                   # the pool's own guards
        return Wrong(f"{STEPS[-1]}: {refused}")
    for label, (seq, tokens) in live.items():
        why = where_sequence_differs(label, seq, tokens)
        if why:
            return why
    for block_id, block in enumerate(pool.blocks):
        held = [label for label, (seq, _) in live.items() if block_id in seq.table]
        if block.ref_count != len(held):
            return Wrong(f"block {block_id} counts {block.ref_count} tables holding it, where "
                         f"{len(held)} do ({', '.join(held) or 'none'})",
                         "  " + "\n  ".join(f"{label}: block table {seq.table}"
                                            for label, (seq, _) in live.items()))
    return None


def as_stored(fmt, vector):
    """vector as a QuantizedCache of format fmt gives it back, by its docstring, worked out
    plainly: float32 and float16 through struct; int8 and int4 as the nearest of the levels
    -top..top (127 or 7, ties to the even one) of a scale, largest magnitude / top, kept
    as a 32-bit float."""
    if fmt == "float64":
        return list(vector)
    if fmt in ("float32", "float16"):
        code = "f" if fmt == "float32" else "e"
        return [struct.unpack(code, struct.pack(code, x))[0] for x in vector]
    top = 127 if fmt == "int8" else 7
    scale = struct.unpack("f", struct.pack("f", max(abs(x) for x in vector) / top))[0]
    return [max(-top, min(top, round(x / scale))) * scale if scale else 0.0 for x in vector]


BYTES_PER_POSITION = {"float64": 2 * 16 * 8, "float32": 2 * 16 * 4, "float16": 2 * 16 * 2,
                      "int8": 2 * (16 + 4), "int4": 2 * (8 + 4)}   # a key and a value:
# 16 numbers of 8, 4 or 2 bytes; 16 levels of a byte or of half a byte, and a 4-byte scale


def fed_one_by_one(params, cache, ids, label, expected):
    """The rows of ids fed through cache one forward_step at a time, each step said (step),
    with what its row is expected to be."""
    rows = []
    for position, token_id in enumerate(ids):
        step(f"{label}: feeding position {position} ({TOK.vocab[token_id]!r}; expected: "
             f"{expected})")
        rows.append(kv_cache.forward_step(params, cache, token_id, position))
    return rows


def _lossy():
    """The keys and values of the first test story (30 tokens) appended to a QuantizedCache
    of each format, one position at a time as forward_step appends them: every key and
    value it gives back (and stored()) is as_stored's, and it measures BYTES_PER_POSITION;
    the story fed through a float64 one gives forward_step's rows; fed through WindowCaches
    of 8 positions, without and with 2 sinks, the full pass's rows with model.band's mask."""
    import lossy
    ids = TOK.encode(STORIES[0])
    step("feeding the first test story through a KVCache")
    exact = KVCache(PARAMS)
    exact_rows = feed(PARAMS, exact, ids)
    for fmt in lossy.FORMATS:
        label = f"the first test story's keys and values in {fmt}"
        cache = lossy.QuantizedCache(PARAMS, fmt)
        if fmt == "float64":
            rows = fed_one_by_one(PARAMS, cache, ids, f"the first test story through a {fmt} "
                                  f"QuantizedCache", "forward_step's row")
        else:
            for position, kept in enumerate(zip(exact.tokens, exact.keys, exact.values)):
                step(f"{label}: appending position {position} to a QuantizedCache")
                cache.append(*kept)
        for part in ("keys", "values"):
            step(f"{label}: reading its {part} back")
            wanted = [as_stored(fmt, vector) for vector in getattr(exact, part)]
            fed = f"the {part} of the first test story's positions (token IDs {ids})"
            why = (differ(f"{label}: the {part} a QuantizedCache gives back",
                          getattr(cache, part), wanted, "the cache",
                          names=("position", "number"), fed=fed)
                   or differ(f"{label}: the {part} as QuantizedCache.stored gives them",
                             [cache.stored(vector) for vector in getattr(exact, part)], wanted,
                             "the cache", names=("position", "number"), fed=fed))
            if why:
                return why
        step(f"{label}: measuring a QuantizedCache's bytes a position")
        if cache.bytes_per_position() != BYTES_PER_POSITION[fmt]:
            return Wrong(f"{label}: a QuantizedCache measures {cache.bytes_per_position()} "
                         f"bytes a position, {BYTES_PER_POSITION[fmt]} expected (a key and a "
                         f"value of 16 numbers)")
        if fmt == "float64":
            why = differ(f"the first test story through a {fmt} QuantizedCache", rows,
                         exact_rows, "the cache", fed=f"token IDs {ids}")
            if why:
                return why
    for window, sinks in ((8, 0), (8, 2)):
        label = (f"the first test story through a window of {window} positions and {sinks} "
                 f"sinks (WindowCache(params, {window}, {sinks}))")
        rows = fed_one_by_one(PARAMS, lossy.WindowCache(PARAMS, window, sinks), ids, label,
                              f"the row of the full pass with model.band({window}, {sinks})")
        why = differ(label, rows, model.forward(PARAMS, ids, model.band(window, sinks))[0],
                     "the cache", fed=f"token IDs {ids}; the full pass's mask model.band"
                                      f"({window}, {sinks})")
        if why:
            return why
    return None


def story_name(index):
    """The name a check gives test story index (0: "the first test story")."""
    return f"the {('first', 'second', 'third', 'fourth')[index]} test story"


def in_batches(params, caches, ids, seed=0, steps=None):
    """Feed each cache its ids through batched.forward_rows, in steps that mix, at random
    from seed, a chunk of one cache's next tokens with one next token of each other
    cache: the rows of each cache, in position order. Each step's (cache index, position)
    pairs are appended to steps, if given, before the step runs."""
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
            if steps is not None:
                steps.append([(index, position) for index, (_, _, position)
                              in zip(owners, items)])
            for index, logits in zip(owners, batched.forward_rows(params, items)):
                rows[index].append(logits)
    return rows


def _batch_words(batch, labels):
    """A step's batch in words: how many rows, and whose positions."""
    owners = {}
    for index, position in batch:
        owners.setdefault(index, []).append(position)
    return f"a batch of {len(batch)} rows: " + "; ".join(
        f"{labels[index]}, position{'s' * (len(positions) > 1)} "
        f"{', '.join(map(str, positions))}" for index, positions in owners.items())


def where_batches_differ(params, caches, ids, seed=0, labels=None):
    """None if each cache's rows, fed in_batches, are forward_step's, else (a Wrong) the
    first number that differs, named by its sequence (labels[index], else "sequence
    index"), position and logit, and the batch that computed it; or the ValueError
    forward_rows raised (a refusal) and the batch it raised it for."""
    labels = labels or [f"sequence {index}" for index in range(len(ids))]
    steps = []
    try:
        rows = in_batches(params, caches, ids, seed=seed, steps=steps)
    except ValueError as refused:   # a refusal, or a planted mistake's ValueError
        return Wrong(f"forward_rows, at step {len(steps)} of the mixed batches (seed {seed}), "
                     f"{_batch_words(steps[-1], labels)}, raised ValueError: {refused}")
    for index, (got, own) in enumerate(zip(rows, ids)):
        wanted = feed(params, KVCache(params), own)
        why = differ(f"the logits of {labels[index]}, fed in mixed batches (seed {seed})", got,
                     wanted, "forward_rows", fed=f"token IDs {own}")
        if why and first_difference(got, wanted)[0].startswith("["):   # a row, not the count
            position = int(first_difference(got, wanted)[0][1:].split("]")[0])
            batch = next(number for number, batch in enumerate(steps, 1)
                         if (index, position) in batch)
            return Wrong(f"{why} (step {batch}, {_batch_words(steps[batch - 1], labels)})",
                         why.detail)
        if why:
            return why
    return None


KERNEL_ROW = [1.0] * 16
KERNEL_COLUMNS = [[1.0, 2 ** -24, 2 ** -26, 0.0, -1.0] + [0.0] * 11,
                  [1.0, 2 ** -11, 0.0, 0.0, 2 ** -40] + [0.0] * 11]
KERNEL_OUTPUTS = {   # (kernel, rows): each row's two outputs
    ("exact", 1): [2 ** -24 + 2 ** -26, 1 + 2 ** -11 + 2 ** -40],
    ("by_batch", 1): [0.0, 1.0],                 # each piece, and the total, to 16 bits
    ("by_batch", 3): [2 ** -24, 1 + 2 ** -10],   # one piece: the sum rounded once
    ("by_batch_float32", 1): [2 ** -23, 1.0],    # pieces and total to 32 bits, then 16
    ("by_batch_float32", 3): [2 ** -24, 1.0],
    ("batch_invariant", 1): [2 ** -24, 1 + 2 ** -10],
}


def where_kernels_round_otherwise():
    """None if each product kernel of batched.py gives KERNEL_OUTPUTS for rows of
    KERNEL_ROW times KERNEL_COLUMNS, else a Wrong naming the kernel, the batch, the row
    and the output. The two dot products have 16 terms, which a row alone cuts into four
    pieces of four terms and three rows leave in one, their terms chosen so that every
    rounding shows. Column 0: pieces adding to 1 + 2**-24 + 2**-26 and -1, so a first
    piece rounded to 32 bits (1 + 2**-23) leaves 2**-23, rounded to 16 bits (1.0)
    nothing; in one piece the sum is 2**-24 + 2**-26, which a 16-bit output makes 2**-24.
    Column 1: pieces adding to 1 + 2**-11 and 2**-40, a total just above halfway between
    the 16-bit floats 1 and 1 + 2**-10, and exactly halfway once rounded to 32 bits (a
    tie goes to the even one, 1.0)."""
    import batched
    for (kernel, rows), wanted in KERNEL_OUTPUTS.items():
        step(f"multiplying {rows} row(s) of 16 terms by two columns with batched.{kernel}")
        why = differ(f"batched.{kernel} on a batch of {rows} row{'s' * (rows > 1)} of 16 terms",
                     getattr(batched, kernel)([KERNEL_ROW] * rows, KERNEL_COLUMNS),
                     [wanted] * rows, kernel, names=("row", "output"),
                     fed=f"rows of {KERNEL_ROW}, columns {KERNEL_COLUMNS}")
        if why:
            return why
    return None


def _batched():
    """Three test stories fed in mixed batches (chunks of one story's next tokens beside
    one next token of each other) give forward_step's rows; and each product kernel rounds
    two dot products of 16 terms, alone and in a batch of 3, as its docstring says
    (where_kernels_round_otherwise)."""
    step("feeding three test stories through batched.forward_rows in mixed batches, "
         "expecting forward_step's rows")
    ids = [TOK.encode(story) for story in STORIES[:3]]
    return (where_batches_differ(PARAMS, [KVCache(PARAMS) for _ in ids], ids,
                                 labels=[story_name(index) for index in range(3)])
            or where_kernels_round_otherwise())


def parting(result, expected):
    """Where a generation parts from the one expected, in words: "at new token 5 ('x',
    where 'y' was expected)", or how it stopped otherwise. New tokens count from 1."""
    for number, (mine, theirs) in enumerate(zip(result["steps"], expected["steps"]), 1):
        if mine != theirs:
            return (f"at new token {number} ({mine['token']!r} with probability "
                    f"{mine['probability']}, where {theirs['token']!r} with "
                    f"{theirs['probability']} was expected)")
    return (f"in where it stopped (after {len(result['steps'])} new tokens, "
            f"{result['stopped']}; expected after {len(expected['steps'])}, "
            f"{expected['stopped']})")


def _serving():
    """Requests served from one pool, each against generate_cached: four (three greedy, one
    sampled) in 14 blocks of 4 with batches of up to 4, which must preempt and readmit;
    a request and another whose prompt starts with the first's, in blocks of 4, so that
    the second finds the first's full blocks; and one prompt twice in blocks of 1, one at
    a time, so that the second finds all but its last position. None if each result is
    generate_cached's and each run did what it is there for, else a Wrong naming the run,
    the request and the new token where it parts."""
    import paged
    import serving
    shared = OPENINGS[1] + " she was"
    runs = (("four requests that preempt", [{"prompt": prompt, "max_new_tokens": 12}
                                           for prompt in OPENINGS[:3]]
             + [{"prompt": OPENINGS[3], "max_new_tokens": 12, "temperature": 1.0, "seed": 3}],
             paged.BlockPool(PARAMS, 14, 4), 4, "readmitted_prefix_hits"),
            ("two requests sharing a prefix", [{"prompt": shared[:-8], "max_new_tokens": 6},
                                               {"prompt": shared, "max_new_tokens": 6,
                                                "temperature": 1.0, "seed": 1}],
             paged.BlockPool(PARAMS, 40, 4), 1, "prefix_hits"),
            ("one prompt twice", [{"prompt": OPENINGS[0], "max_new_tokens": 4}] * 2,
             paged.BlockPool(PARAMS, 40, 1), 1, "prefix_hits"))
    for label, requests, pool, max_batch, exercised in runs:
        where = f"{label} (blocks of {pool.block_size}, batches of up to {max_batch})"
        step(f"serving {where}")
        served, counts = serving.serve(PARAMS, TOK, requests, pool, max_batch, log=lambda s, i, e:
                                       step(f"serving {where}, after step {s}: request {i} {e}"))
        for index, (request, result) in enumerate(zip(requests, served)):
            expected = kv_cache.generate_cached(PARAMS, TOK, **request)
            if result != expected:
                return Wrong(f"{where}: request {index} parts from generate_cached's "
                             f"{parting(result, expected)}; {counts['preemptions']} "
                             f"preemptions, {counts['prefix_hits']} prefix hits",
                             f"  request {index}: {request}\n  served:   {result['text']!r}"
                             f"\n  expected: {expected['text']!r}")
        if not counts[exercised]:
            return Wrong(f"{where}: no {exercised.replace('_', ' ')[:-1]} in this run, "
                         f"which is there to make them", f"  counts: {counts}")
    return None


class OneWrongDrafter:
    """A drafter for the speculative check: the next tokens of a known story (truth),
    with the one at index calls % (lookahead + 1) changed to another token, so that its
    drafts are rejected at each place in turn (the first, the second, ...), and one in
    lookahead + 1 is accepted whole."""

    def __init__(self, truth):
        self.truth, self.calls = truth, 0

    def propose(self, ids, lookahead):
        draft = list(self.truth[len(ids):len(ids) + lookahead])
        wrong, self.calls = self.calls % (lookahead + 1), self.calls + 1
        if wrong < len(draft):
            draft[wrong] = (draft[wrong] + 1) % model.VOCAB_SIZE
        return draft


class _Strayed(Exception):
    """Raised from inside generate_speculative by the check's watch on prefill: the Wrong
    it found (args[0])."""


def _token(token_id):
    return f"{token_id} ({TOK.vocab[token_id]!r})"


def _accepted(draft, story):
    """How many of draft's tokens, from the first, are the story's."""
    return next((j for j, (a, b) in enumerate(zip(draft, story)) if a != b),
                min(len(draft), len(story)))


def where_speculation_strays(label, prompt, settings, drafter_for, lookahead, max_new_tokens=16):
    """None if generate_speculative(prompt, with settings, the drafter drafter_for(the
    story generate_cached gives) and lookahead) gives
    generate_cached's result, and every prefill call it makes finds the cache holding
    exactly generate's story so far: the prompt, then each draft's accepted tokens and
    the token chosen after them, every rejected position rolled back. Else a Wrong naming
    the run (label), the draft and the position, with both tokens or counts. Also the
    number of drafts whose rejected positions were rolled back."""
    import prefill
    import speculative
    from instruments import replaced
    from stories import story_ids
    step(f"{label}: generate_cached's result, for the story to expect")
    expected = kv_cache.generate_cached(PARAMS, TOK, prompt, max_new_tokens, **settings)
    story = story_ids(TOK, prompt, expected)
    drafter, calls, rolled_back = drafter_for(story), [], 0

    def watched(real):
        def checking_prefill(params, cache, token_ids, start):
            nonlocal rolled_back
            draft = f"draft {len(calls)}" if calls else "the prompt"
            where = f"{label}, before {draft} is checked (from position {start})"
            if calls:
                last_start, last_ids = calls[-1]
                accepted = _accepted(last_ids[1:], story[last_start + 1:])
                wanted = last_start + 1 + accepted
                if last_start + len(last_ids) > wanted:   # a rejected draft's positions
                    rolled_back += 1
                if len(cache) != wanted:
                    kept = len(cache) - wanted
                    after = ("the prompt" if len(calls) == 1 else f"draft {len(calls) - 1}, "
                             f"{accepted} of its {len(last_ids) - 1} tokens accepted")
                    raise _Strayed(Wrong(
                        f"{where}: the cache holds {len(cache)} positions, where generate's "
                        f"story so far leaves {wanted} (after {after}): "
                        + (f"{kept} rejected position(s) not rolled back" if kept > 0 else
                           f"{-kept} position(s) of the story rolled back too"),
                        f"  fed: {after.split(',')[0]} checked as {last_ids}, from position "
                        f"{last_start}\n  generate's story: "
                        f"{story}\n  the cache holds: {cache.tokens}"))
                if start != wanted:
                    raise _Strayed(Wrong(f"{where}: the draft is checked from position "
                                         f"{start}, where generate's story so far leaves "
                                         f"{wanted}"))
            held = first_difference(cache.tokens, story[:len(cache)])
            if held:
                position = int(held[0][1:-1])
                raise _Strayed(Wrong(f"{where}: the cache holds token "
                                     f"{_token(cache.tokens[position])} at position {position}, "
                                     f"where generate's story has {_token(story[position])}",
                                     f"  generate's story: {story}\n  the cache holds: "
                                     f"{cache.tokens}"))
            if start < len(story) and token_ids[0] != story[start]:
                raise _Strayed(Wrong(
                    f"{where}: the tokens checked start with {_token(token_ids[0])} at "
                    f"position {start} (the token chosen there), where generate's story has "
                    f"{_token(story[start])}",
                    f"  fed: {list(token_ids)} from position {start}\n  generate's story: "
                    f"{story}"))
            calls.append((start, list(token_ids)))
            rows = real(params, cache, token_ids, start)
            step(f"{label}: choosing tokens from the rows of {draft} (positions {start} to "
                 f"{start + len(token_ids) - 1}) and rolling back the rejected ones, "
                 f"expecting generate's story")
            return rows
        return checking_prefill
    step(f"{label}: running generate_speculative, expecting generate's story, each draft "
         f"checked from a cache holding the story so far")
    try:
        with replaced(prefill, "prefill", watched):
            got = speculative.generate_speculative(PARAMS, TOK, prompt, max_new_tokens,
                                                   lookahead=lookahead, drafter=drafter,
                                                   **settings)
    except _Strayed as strayed:
        return strayed.args[0], rolled_back
    fed = f"the prompt {prompt!r}, token IDs {TOK.encode(prompt)}"
    return (differ(f"{label}: the story's token IDs", story_ids(TOK, prompt, got), story,
                   "generate_speculative", names=("position",), fed=fed)
            or differ(f"{label}: the chosen tokens and their probabilities",
                      [[s["token"], s["probability"]] for s in got["steps"]],
                      [[s["token"], s["probability"]] for s in expected["steps"]],
                      "generate_speculative", names=("generated token", "entry"), fed=fed)
            or (None if got == expected else Wrong(
                f"{label}: the generation stopped for {got['stopped']!r}, where generate's "
                f"stopped for {expected['stopped']!r}"))), rolled_back


def _speculative():
    """The first opening, greedy and sampled, with a drafter that drafts the story with
    one token wrong, at each place of a draft in turn (OneWrongDrafter, lookahead 3), and
    greedy with the default drafter: each run gives generate_cached's result, and checks
    every draft from a cache holding exactly the story so far (where_speculation_strays).
    Each run with the wrong tokens must reject and roll back some drafts (counted)."""
    prompt = OPENINGS[0]
    for settings, drafted in (({}, "drafted with one token wrong"),
                              ({"temperature": 1.0, "seed": 1}, "drafted with one token wrong"),
                              ({}, "drafted by prompt lookup")):
        how = "greedy" if not settings else "sampled ({})".format(
            ", ".join(f"{key} {value}" for key, value in settings.items()))
        label = f"generate_speculative on the first opening ({prompt!r}), {how}, {drafted}"
        one_wrong = drafted.endswith("wrong")
        why, rolled_back = where_speculation_strays(
            label + (", lookahead 3" if one_wrong else ""), prompt, settings,
            OneWrongDrafter if one_wrong else lambda story: None, 3 if one_wrong else 4)
        if why:
            return why
        if one_wrong and not rolled_back:
            return Wrong(f"{label}: no draft was rejected and rolled back, so the check did "
                         f"not test the rollback")
    return None


def refusal(error, path):
    """What a refusal of the file at path says, without the file's name it opens with."""
    return str(error).replace(f"{path}: ", "")


def saved_and_loaded(params, cache, path, label):
    """The cache load_cache gives for params from the file save_cache writes of cache at
    path, and None; or None and a Wrong: the cache loaded is not the one saved, or load_cache
    refused it (the file named "the file")."""
    import cache_files
    step(f"{label}: saving it (save_cache; expected: it saves every cache that stores exactly)")
    cache_files.save_cache(cache, path)
    step(f"{label}: loading it (load_cache; expected: the very cache saved)")
    try:
        loaded = cache_files.load_cache(params, path)
    except ValueError as refused:
        return None, Wrong(f"{label}: load_cache refused the file save_cache wrote: "
                           f"{refusal(refused, path)}",
                           f"  fed: token IDs {list(cache.tokens)}")
    return loaded, where_cache_differs(f"{label}, saved and loaded", loaded, cache, "the file")


TAMPERED = 3   # the position whose value _cache_files changes in a file, signed again


def _cache_files():
    """Caches saved to a file and loaded: the first test story's KVCache, a paged sequence
    (blocks of 4) of a whole context (the test stories' first 64 tokens), another model's
    (random weights) KVCache of the first opening, each load as the very cache; the other
    model's file is refused by the trained weights as computed with other weights; a file
    with the value of position TAMPERED changed in its last bit, and signed again, is
    refused, naming that position."""
    import cache_files
    import paged
    story = TOK.encode(STORIES[0])
    context = [t for text in STORIES for t in TOK.encode(text)][:model.CONTEXT]
    other = random_model(random.Random(0), 1.0, 1.0)
    pool = paged.BlockPool(PARAMS, model.CONTEXT // 4, 4)
    cases = ((f"the first test story's cache ({len(story)} positions)", PARAMS, KVCache(PARAMS),
              story),
             (f"a paged sequence (blocks of 4) of the test stories' first {len(context)} "
              f"tokens, a whole context", PARAMS, pool.sequence(), context),
             ("another model's cache (random weights) of the first opening", other,
              KVCache(other), TOK.encode(OPENINGS[0])))
    with tempfile.TemporaryDirectory() as folder:
        story_file, context_file, other_file, tampered_file = (
            os.path.join(folder, f"{name}.json") for name in ("story", "context", "other",
                                                              "tampered"))
        for (label, params, cache, ids), file in zip(cases, (story_file, context_file,
                                                             other_file)):
            step(f"{label}: feeding it")
            feed(params, cache, ids)
            _, why = saved_and_loaded(params, cache, file, label)
            if why:
                return why
        step("loading another model's file with the trained weights (expected: refused, as "
             "computed with other weights)")
        try:
            cache_files.load_cache(PARAMS, other_file)
            return Wrong("another model's file (random weights) of the first opening loaded "
                         "with the trained weights, where load_cache must refuse it")
        except ValueError as refused:
            if "other weights" not in str(refused):
                return Wrong(f"another model's file (random weights) of the first opening was "
                             f"refused by the trained weights, but not as computed with other "
                             f"weights: {refusal(refused, other_file)}")
        step(f"the first test story's file with the value of position {TAMPERED} changed and "
             f"signed again (expected: refused, naming position {TAMPERED})")
        with open(story_file, encoding="utf-8") as f:
            record = json.load(f)
        value = record["values"][TAMPERED]
        value[0] = math.nextafter(value[0], math.inf)
        record["content"] = cache_files.content_signature(record["tokens"], record["keys"],
                                                          record["values"])
        with open(tampered_file, "w", encoding="utf-8") as f:
            json.dump(record, f)
        try:
            cache_files.load_cache(PARAMS, tampered_file)
            return Wrong(f"the first test story's file with the value of position {TAMPERED} "
                         f"changed in its last bit and signed again loaded, where load_cache "
                         f"must refuse it (it computes every key and value again)")
        except ValueError as refused:
            if f"position {TAMPERED}" not in str(refused):
                return Wrong(f"the first test story's file with the value of position "
                             f"{TAMPERED} changed and signed again was refused without naming "
                             f"position {TAMPERED}: {refusal(refused, tampered_file)}")
    return None


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


def reads_of(decode, weights, cache):
    """The distinct numbers decode() reads (instruments.count_reads) from the holders of
    weights and from those of cache, apart: {"weights": ..., "cache": ...}, as
    bandwidth.floats_read counts them."""
    from instruments import count_reads
    from_cache = []
    from_weights = count_reads(lambda: from_cache.append(count_reads(decode, *cache)),
                               *weights)
    return {"weights": from_weights, "cache": from_cache[0]}


def lesson_step_reads(ids):
    """What the lesson's step of ids[-1] reads (reads_of), on a copy of the trained model
    (count_reads watches the vectors it is given for good), its cache holding the rest."""
    params = copy.deepcopy(PARAMS)
    cache = KVCache(params)
    feed(params, cache, ids[:-1])
    return reads_of(lambda: kv_cache.forward_step(params, cache, ids[-1], len(ids) - 1),
                    [params, cache.columns], [cache.keys, cache.values])


def deep_step_reads(params, path, ids):
    """What the step of ids[-1] of a deep_model (for path "cached" or "rebuilt",
    deep_model.forward_step; for "absorbed", latent_attention.absorbed_step) reads
    (reads_of), its cache holding the rest. Watched for good: pass params made for it."""
    import deep_model
    import latent_attention
    cache = deep_model.DeepCache(params)
    folded = path == "absorbed" and latent_attention.fold(params)

    def decode(position):
        if folded:
            return latent_attention.absorbed_step(folded, cache, ids[position], position)
        return deep_model.forward_step(params, cache, ids[position], position)
    for position in range(len(ids) - 1):
        decode(position)
    return reads_of(lambda: decode(len(ids) - 1),
                    [params, cache.block_columns, cache.out_columns,
                     folded.blocks if folded else []], [cache.layers])


def _bandwidth():
    """A decode step's reads, counted apart from the weights and from the cache, against
    bandwidth.floats_read's: the lesson's model with 5 positions held; with 3 held, a
    2-layer grouped-query model (4 heads, 2 key-value heads) with rotary positions, and a
    2-layer latent model (latent 8, rotary key 2), its rebuilt and its absorbed path."""
    import bandwidth
    import deep_model
    ids = TOK.encode(STORIES[0])
    latent = ("a 2-layer latent model (latent 8, rotary key 2)", (2, 4, 4, 16, 0, "rotary", 8))
    for label, made, path, held in (
            ("the lesson's model", None, "cached", 5),
            ("a 2-layer grouped-query model (4 heads, 2 key-value heads, rotary positions)",
             (2, 4, 2, 16, 0, "rotary"), "cached", 3),
            (*latent, "rebuilt", 3), (*latent, "absorbed", 3)):
        where = f"{label}, its {path} step with {held} positions held"
        step(f"{where}: counting what it reads")
        if made is None:
            shape, read = bandwidth.LESSON, lesson_step_reads(ids[:held + 1])
        else:
            params = deep_model.init_params(*made)   # layers, heads, kv_heads, width, seed, ...
            shape, read = params["shape"], deep_step_reads(params, path, ids[:held + 1])
        step(f"{where}: bandwidth.floats_read({shape}, {held}, {path!r})")
        counted = bandwidth.floats_read(shape, held, path)
        for part in ("weights", "cache"):
            if read[part] != counted.get(part):
                return Wrong(f"{where} reads {read[part]} numbers of the {part}, and "
                             f"bandwidth.floats_read counts {counted.get(part)}",
                             f"  fed: the shape {shape}, {held} positions held, path {path!r}\n"
                             f"  the step read: {read}\n  floats_read:   {counted}")
    return None


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


def where_kind_reads_otherwise(name, kind, parts, label, reads, exact_bits):
    """None if the attention kind (named name, splitting a row into parts, or None for
    one pass) gives, for every (q, keys, values) of reads (the rows of label, in order),
    forward_step's mixed values, bit for bit if exact_bits, else within ROUNDING; else a
    Wrong naming the kind, the row, its length and parts, and the first value that strays,
    with both."""
    import batched
    import blockwise
    for row, (q, keys, values) in enumerate(reads):
        shape = f"{len(keys)} position{'s' * (len(keys) > 1)}"
        if parts:
            step(f"cutting row {row} of {label} ({shape}) into parts with "
                 f"blockwise.parts_of({len(keys)}, {parts}), expecting at most {parts} runs "
                 f"of whole blocks")
            cuts = blockwise.parts_of(len(keys), parts)
            if (len(cuts) > parts or [p for cut in cuts for p in cut] != list(range(len(keys)))
                    or any(cut.start % blockwise.BLOCK for cut in cuts)):
                return Wrong(f"the parts of row {row} of {label} ({shape}) for {name}, "
                             f"blockwise.parts_of({len(keys)}, {parts}): {cuts}, not at most "
                             f"{parts} runs of whole blocks of {blockwise.BLOCK} covering "
                             f"positions 0 to {len(keys) - 1} once each")
            shape += f", parts of {', '.join(str(len(cut)) for cut in cuts)}"
        step(f"reading row {row} of {label} ({shape}) with {name}, expecting "
             f"forward_step's mixed values")
        wanted, got = batched.exact_attention(q, keys, values), kind(q, keys, values, 1)
        strays = [index for index, (a, b) in enumerate(zip(got, wanted))
                  if (a != b if exact_bits else not abs(a - b) <= ROUNDING)]
        if strays or len(got) != len(wanted):
            index = strays[0] if strays else min(len(got), len(wanted))
            mine = got[index] if index < len(got) else "nothing"
            wanted_one = wanted[index] if index < len(wanted) else "nothing"
            gap = "" if exact_bits or not strays else (
                f" ({abs(got[index] - wanted[index]):.3g} apart, more than rounding)")
            return Wrong(f"the mixed values of {name}, at row {row} of {label} ({shape}), "
                         f"value {index}: {mine} from blockwise, {wanted_one} from "
                         f"forward_step's attention{gap}",
                         f"  fed: row {row}'s query and its {len(keys)} keys and values, as "
                         f"forward_rows reads them\n  query: {excerpt(q)}\n"
                         f"  {name} gave: {excerpt(got)}\n  expected:  {excerpt(wanted)}")
    return None


def _blockwise():
    """Every row of the first test story (1 to 30 positions), read by the online kind
    (blocks of 4) and split in 3 and in 5 parts (counts that divide few rows' blocks), by
    the split kind within ROUNDING of forward_step's attention, by the exact kind bit for
    bit."""
    import blockwise
    step("reading the first test story's rows through batched.forward_rows")
    reads = attention_reads(STORIES[0])
    for name, kind, parts, exact_bits in (
            ("the online kind", blockwise.online, None, False),
            ("the split kind in 3 parts", blockwise.split(3), 3, False),
            ("the split kind in 5 parts", blockwise.split(5), 5, False),
            ("the exact kind in 3 parts", blockwise.exact(3), 3, True),
            ("the exact kind in 5 parts", blockwise.exact(5), 5, True)):
        why = where_kind_reads_otherwise(name, kind, parts, "the first test story", reads,
                                         exact_bits)
        if why:
            return why
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
