"""Attention read block by block (Part 4, section 23), as engines' kernels read a cache.

forward_step takes a row's attention in one go: every score, one softmax, one correctly
rounded sum for each number. A GPU kernel cannot hold a long row of scores, so
FlashAttention (Dao et al., 2022) reads the keys and values a block at a time with an
online softmax (Milakov and Gimelshein, 2018): a running maximum, a running sum of
exponentials and a partial output, the last two rescaled whenever a block raises the
maximum. And one query's row is too little work to fill a GPU, so Flash-Decoding and
PagedAttention v2 split the positions into parts that run side by side, each returning
its maximum, its sum and its partial output, merged by their log-sum-exp. Each is the
same math in another order, so not the same bits. The third kind here is exact: partials
that merge to forward_step's bits at any split count, for two more passes over the cache.

Each kind is an attention for batched.forward_rows (and so for serving.serve): a function
of (q, keys, values, rows) that gives the row's mixed values, rows being the number of
rows its step computes, from which heuristic chooses its split count as
FlashAttention-2 does.
"""
import math
import sys
import svg
from math import exp, fsum

from batched import exact_attention, forward_rows
from documents import bold, plain, shown, table
from instruments import largest_gap
from kv_cache import KVCache
from model import SCALE, check_int, dot
from paged import BlockPool
from stories import story_ids

BLOCK = 4        # positions a block, as the experiment's pool keeps them
PROCESSORS = 8   # the processors a step's rows and parts share (heuristic fills them)
MOST_PARTIALS = 2100 // 53 + 2   # floats span 2**-1074 to 2**1024, 53 bits a partial


def _scores(q, keys):
    try:
        return [dot(q, k_j) * SCALE for k_j in keys]
    except ValueError:   # fsum's "-inf + inf in fsum", which names no input
        raise ValueError("q and keys hold infinities whose products meet with both signs in a "
                         "score: inf - inf has no value (a key of -inf masks a position only "
                         "against a query of numbers >= 0)") from None


def _masked(scores):
    """Whether every score is -inf: a masked block or part, which weighs nothing, as its
    zero weights do in softmax_row (a NaN among them is no mask: it makes every weight
    NaN there, so it must reach the sums here too, which max alone would skip)."""
    return all(s == -math.inf for s in scores)


def _check_row(q, keys, values):
    """Refuse a row with no keys, as softmax_row does (a kernel would divide 0 by 0); a
    query not as wide as the keys (its dot products would stop early); a key without its
    value."""
    if not keys:
        raise ValueError("the attention got no keys: the row attends to no position (a "
                         "position attends at least to itself)")
    if len(q) != len(keys[0]):
        raise ValueError(f"q has {len(q)} numbers, and each key {len(keys[0])}: a query is "
                         f"as wide as the keys it reads")
    if len(values) != len(keys):
        raise ValueError(f"the attention got {len(values)} values for {len(keys)} keys: one "
                         f"value a key")


def online(q, keys, values, rows=1):
    """Read attention in one pass, BLOCK positions at a time, holding at most a block of scores.

    The output so far (not yet divided by the sum) and the sum are rescaled by exp(old
    maximum - new maximum) whenever a block raises the maximum. A block whose scores are all
    -inf (masked) adds nothing, as its zero weights do in softmax_row."""
    _check_row(q, keys, values)
    top, total, out = -math.inf, 0.0, [0.0] * len(values[0])
    for first in range(0, len(keys), BLOCK):
        scores = _scores(q, keys[first:first + BLOCK])
        if _masked(scores):
            continue
        new_top = max(top, *scores)
        rescale = exp(top - new_top)              # 0.0 at the first block
        weights = [exp(s - new_top) for s in scores]
        total = total * rescale + fsum(weights)
        out = _summed(lambda: [o * rescale + dot(weights, column) for o, column
                               in zip(out, zip(*values[first:first + BLOCK]))], values)
        top = new_top
    if top == -math.inf:   # every score -inf: softmax_row's 0 / 0 (NaN) too
        return [math.nan] * len(out)
    return [o / total for o in out]


def _summed(sums, values):
    """sums() of values, refusing clearly what overflows a float: a kernel's output not yet
    divided by its sum (up to BLOCK or a part's values, each times up to 1) can overflow
    where forward_step's (the weights divided first) does not; and inf and -inf in a column
    of values."""
    try:
        return sums()
    except OverflowError:
        raise ValueError(f"values too large for this attention: its sums of values not yet "
                         f"divided by the softmax's sum overflow a float (beyond "
                         f"{sys.float_info.max:g}); keep values within 1e300, or use "
                         f"an exact kind") from None
    except ValueError:
        _refuse_both_infinities(values)
        raise


def _refuse_both_infinities(values):
    """Refuse values holding inf and -inf in one column, where a sum failed with fsum's
    ValueError ("-inf + inf in fsum", which names no input)."""
    if any(math.inf in column and -math.inf in column for column in zip(*values)):
        raise ValueError("values hold inf and -inf in one column: their weighted sum, inf - "
                         "inf, has no value; keep values finite") from None


def parts_of(length, parts):
    """Give the positions of each of at most parts parts of a row of length positions.

    Runs of whole blocks, as even as blocks allow (so a row may get fewer parts than
    asked)."""
    check_int("length", length, 1)
    check_int("parts", parts, 1)
    per_part = math.ceil(math.ceil(length / BLOCK) / parts) * BLOCK
    return [range(first, min(first + per_part, length)) for first in range(0, length, per_part)]


def _part(q, keys, values):
    """One part's maximum score, its sum of exp(score - maximum), and its output: the
    values weighted by those exps, not yet divided by any sum."""
    scores = _scores(q, keys)
    if _masked(scores):   # no weight (exp(-inf - -inf) would be NaN)
        return -math.inf, 0.0, [0.0] * len(values[0])
    top = max(scores)
    weights = [exp(s - top) for s in scores]
    return top, fsum(weights), _summed(lambda: [dot(weights, column) for column in zip(*values)],
                                       values)


def split(parts):
    """Give the attention of a kernel that splits each row into parts run side by side.

    The parts are parts_of's; it merges them: each part's sum and output brought to the
    common maximum, times exp(its maximum - the common one), then summed, the output divided
    by the sum. (A part's log-sum-exp is its maximum + log(its sum): the same merge, in
    logs.)"""
    check_int("parts", parts, 1)

    def attention(q, keys, values, rows=1):
        _check_row(q, keys, values)
        found = [_part(q, keys[p.start:p.stop], values[p.start:p.stop])
                 for p in parts_of(len(keys), parts)]
        top = max(part_top for part_top, _, _ in found)
        if top == -math.inf:   # every score -inf: softmax_row's 0 / 0 (NaN) too
            return [math.nan] * len(values[0])
        factors = [exp(part_top - top) for part_top, _, _ in found]
        total = fsum(part_total * f for (_, part_total, _), f in zip(found, factors))
        return _summed(lambda: [fsum(o * f for o, f in zip(outputs, factors)) / total
                                for outputs in zip(*(part_out for _, _, part_out in found))],
                       values)
    return attention


def exact_partials(terms):
    """Give a few floats whose exact sum is the terms' exact sum, as math.fsum keeps inside.

    After Shewchuk, 1997, found here with fsum itself: the correctly rounded sum, then the
    correctly rounded sum of what it missed, and so on until nothing is missed. Each fsum is
    exact in what it is given, so the floats found so far and the remainder always add up to
    the terms' sum; a few rounds leave no remainder (each remainder is at most 2**-53 times
    the last, so never more than MOST_PARTIALS). Terms that sum to NaN or an infinity give
    just that sum, as fsum does; a sum beyond the largest float is refused."""
    terms, partials = list(terms), []
    for _ in range(MOST_PARTIALS):
        try:
            missed = fsum(terms + [-p for p in partials])
        except OverflowError:
            raise ValueError(f"terms sum beyond the largest float ({sys.float_info.max:g}): "
                             f"they have no exact partials") from None
        if not missed:
            return partials
        if not math.isfinite(missed):   # only the first sum can be (NaN is truthy)
            return [missed]
        partials.append(missed)
    raise ValueError(f"exact_partials found no exact sum in {MOST_PARTIALS} rounds")


def exact(parts):
    """Give the attention of a kernel whose parts merge to forward_step's bits.

    The first pass finds each part's maximum (the row's is theirs); the second, each part's
    exps from the row's maximum, as exact partials of their sum; the third, each part's
    weights (exp / the row's sum) times its values, as exact partials of each column's sum.
    fsum of all the parts' partials is the correctly rounded sum of all the terms:
    forward_step's."""
    check_int("parts", parts, 1)

    def attention(q, keys, values, rows=1):
        _check_row(q, keys, values)
        cuts = [(keys[p.start:p.stop], values[p.start:p.stop]) for p in parts_of(len(keys), parts)]
        top = max(max(_scores(q, part_keys)) for part_keys, _ in cuts)
        total = fsum([x for part_keys, _ in cuts
                      for x in exact_partials(exp(s - top) for s in _scores(q, part_keys))])
        columns = [[] for _ in values[0]]
        try:
            for part_keys, part_values in cuts:
                weights = [exp(s - top) / total for s in _scores(q, part_keys)]
                for column, part_column in zip(columns, zip(*part_values)):
                    column += exact_partials(w * v for w, v in zip(weights, part_column))
            return [fsum(column) for column in columns]
        except ValueError:   # fsum's, or exact_partials' (a sum beyond the largest float)
            _refuse_both_infinities(values)
            raise
    return attention


def split_count(rows, length):
    """Give the parts a kernel in FlashAttention-2's manner splits a row of length positions into.

    That is when its step computes rows rows on PROCESSORS processors: one if the rows alone
    fill 80% of them; else, of the counts up to PROCESSORS and the row's blocks that change
    how many blocks a part gets, the fewest whose waves (rows x parts / PROCESSORS, rounded
    up) are at least 85% as full as the fullest count's."""
    check_int("rows", rows, 1)
    check_int("length", length, 1)
    if rows >= 0.8 * PROCESSORS:
        return 1
    blocks = math.ceil(length / BLOCK)
    counts = [p for p in range(1, min(PROCESSORS, blocks) + 1)
              if p == 1 or math.ceil(blocks / p) != math.ceil(blocks / (p - 1))]

    def fullness(parts):
        waves = rows * parts / PROCESSORS
        return waves / math.ceil(waves)
    best = max(map(fullness, counts))
    return next(p for p in counts if fullness(p) >= 0.85 * best)


def heuristic(q, keys, values, rows):
    """Read attention as split does, with split_count(rows, positions) parts.

    The engines' choice, which makes a row's bits depend on how many rows share its step."""
    return split(split_count(rows, len(keys)))(q, keys, values, rows)


# ---- the experiment (a stage of trace_kv.py) ---------------------------------------

KINDS = {"online": online, **{f"split {parts}": split(parts) for parts in (1, 2, 4, 8, 16)},
         **{f"exact {parts}": exact(parts) for parts in (1, 8)}}


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "blockwise": {
        "stories": svg.COUNT, "longest_row": svg.COUNT,
        "kinds": [{
            "kind": str, "parts": (*svg.COUNT, None), "largest_logit_gap": svg.COUNT,
            "greedy_stories_changed": svg.COUNT, "scores_held": svg.COUNT}]},
}


def story_kinds(lab, index, runs):
    """Compare every kind of KINDS with forward_step's exact rows along one greedy story.

    Opening index's greedy story is fed through a paged sequence (blocks of BLOCK) with
    forward_step's exact rows; at each row that chooses a token, every kind of KINDS reads
    the same query, keys and values, and where its mixed values differ, the row is computed
    again with them (batched.forward_rows): per kind, the largest gap between its logits and
    the exact ones, and whether the story would change there (its best token is not the
    story's next)."""
    params, prompt = lab.params, lab.prompts[index]
    found = {name: {"largest_logit_gap": 0.0, "changed": False} for name in KINDS}
    ids = story_ids(lab.tok, prompt, runs.greedy[index])
    first = len(lab.tok.encode(prompt)) - 1
    sequence = BlockPool(params, math.ceil(len(ids) / BLOCK), BLOCK).sequence()
    for position, token_id in enumerate(ids[:-1]):
        read = []

        def exact_read(q, keys, values, rows):   # forward_step's attention, its input kept
            read.append(((q, keys, values), exact_attention(q, keys, values, rows)))
            return read[0][1]
        held = _holding(params, sequence) if position >= first else None
        logits, = forward_rows(params, [(sequence, token_id, position)], attention=exact_read)
        if held is None:
            continue
        if _best(logits) != ids[position + 1]:   # the premise: the story is greedy
            raise ValueError(f"opening {index}: the greedy story's token at position "
                             f"{position + 1} is not the best of the exact logits")
        (q, keys, values), mixed = read[0]
        mixes = {name: kind(q, keys, values, 1) for name, kind in KINDS.items()}
        rows = _rows_mixing(params, held, token_id, position, mixed, logits, mixes.values())
        for name, other_mixed in mixes.items():
            other = rows[tuple(other_mixed)]
            if other is not logits:
                found[name]["largest_logit_gap"] = max(found[name]["largest_logit_gap"],
                                                       largest_gap([other], [logits]))
                found[name]["changed"] |= _best(other) != ids[position + 1]
    return {**found, "longest_row": len(ids) - 1}


def _holding(params, sequence):
    """A KVCache holding the positions sequence holds, to compute a row from again."""
    cache = KVCache(params)
    cache.extend(list(sequence.tokens), sequence.keys, sequence.values)
    return cache


def _rows_mixing(params, held, token_id, position, mixed, logits, mixes):
    """The row (batched.forward_rows) of token_id at position after the positions held,
    for each of mixes as its attention's mixed values, by those values: logits for mixed,
    the others computed together, each on a copy of held."""
    others = list({tuple(m): m for m in mixes if m != mixed}.values())
    given = iter(others)
    rows = forward_rows(params, [(held.copy(), token_id, position) for _ in others],
                        attention=lambda *read: next(given)) if others else []
    return {tuple(mixed): logits, **{tuple(m): row for m, row in zip(others, rows)}}


def _best(row):
    """The token greedy generation chooses from row: the first highest score's."""
    return max(range(len(row)), key=row.__getitem__)


def kinds_table(lab, per_story):
    """Sum up each kind over the 60 greedy stories.

    The largest logit gap, the stories that change, and the most scores it holds at once in
    the longest row (a block, a part, or for forward_step the whole row)."""
    longest = max(story["longest_row"] for story in per_story)
    table = []
    for name in KINDS:
        parts = int(name.split()[1]) if " " in name else None
        table.append({"kind": name.split()[0], "parts": parts,
                      "largest_logit_gap": max(s[name]["largest_logit_gap"] for s in per_story),
                      "greedy_stories_changed": sum(s[name]["changed"] for s in per_story),
                      "scores_held": len(parts_of(longest, parts)[0]) if parts
                      else min(BLOCK, longest)})
    return {"stories": len(per_story), "longest_row": longest, "kinds": table}


# ---- what Part 4 shows of it (documents.py fills its marks) --------------------------

def reads_table(record, timing):
    """Section 23's table: each attention read's logit gap, stories changed and scores held."""
    b = svg.checked(record, RECORDS)["blockwise"]
    return table(["attention read", "parts", "largest logit gap", "greedy stories changed",
                  f"scores held at once, longest row ({b['longest_row']} positions)"],
                 [[plain(k["kind"]), k["parts"] or "—", bold(shown(k["largest_logit_gap"]))
                   if k["kind"] == "exact" else shown(k["largest_logit_gap"]),
                   f"{k['greedy_stories_changed']} of {b['stories']}", k["scores_held"]]
                  for k in b["kinds"]])


def split_counts(record, timing):
    """FlashAttention-2's split counts for batches of 1, 2, 4 and 8 rows of 64 positions."""
    return "{}, {}, {} and {}".format(*(split_count(rows, 64) for rows in (1, 2, 4, 8)))


def stories_changed(record, timing):
    """The greedy stories changed, summed over every kind of attention read."""
    return sum(k["greedy_stories_changed"] for k in record["blockwise"]["kinds"])
