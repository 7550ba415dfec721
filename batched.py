"""Batched rows (Part 4, section 22): the rows of several requests computed together, as
a server's step computes them. Each weight matrix is applied once to every row of the
batch (a matrix times a matrix); each row attends over its own cache.

How a matrix product adds its terms is the product's business, passed in as product:

- exact, the lab's: each output one correctly rounded fsum, whatever the batch, so
  every row is forward_step's, bit for bit;
- by_batch, a GPU library's kernel with its rounding exaggerated: each dot product cut
  into more pieces the fewer rows the product has (split-K: the pieces keep every
  processor busy), each piece's sum rounded to a 16-bit float and then the pieces'
  total too, so what a row gets depends on how many rows came with it;
- by_batch_float32, the same kernel as engines run it (they add in 32 bits): the same
  pieces, each piece's sum and their total rounded to a 32-bit float, and the output
  once to a 16-bit float;
- batch_invariant: the pieces of by_batch for a full batch, whatever the batch, so a
  row gets the same numbers in every batch, though not the exact ones.
"""
import math
import struct
from collections import Counter
from math import fsum
from operator import mul

import model
from kv_cache import check_cache
from model import SCALE, add, dot, layernorm, linear, relu, softmax_row

PROCESSORS = 4   # by_batch cuts each dot product so that rows x pieces fills them
FORMATS = {16: ("e", 65504.0), 32: ("f", 3.4028234663852886e38)}   # struct's code, largest


def _check_product(rows, cols):
    """Refuse no rows, and a row that is not as long as every column (zip would stop early)."""
    if not isinstance(rows, (list, tuple)) or not rows:
        raise ValueError(f"rows must be a non-empty list of rows, got {model.excerpt(rows)}")
    for index, x in enumerate(rows):
        if len(x) != len(cols[0]):
            raise ValueError(f"rows[{index}] has {len(x)} numbers, and each column of the "
                             f"matrix {len(cols[0])}: a row takes one number per input")


def exact(rows, cols):
    """rows times the matrix given by its columns, each output one fsum (model.linear)."""
    _check_product(rows, cols)
    return [linear(x, cols) for x in rows]


def in_pieces(rows, cols, pieces, bits=16):
    """Multiply rows by the matrix given by its columns, as a kernel with split-K computes it.

    Each dot product is cut into pieces runs of consecutive terms, each run's sum (an fsum)
    rounded to the nearest float of bits (16 or 32), the runs' total (an fsum of those)
    rounded to it again, and that output, once, to the nearest 16-bit float. pieces: an int
    of at least 1."""
    _check_product(rows, cols)
    model.check_int("pieces", pieces, 1)
    if not model.is_int(bits) or bits not in FORMATS:
        raise ValueError(f"bits must be 16 or 32, got {model.excerpt(bits)}")
    if pieces == 1:                        # one run: its sum is the total, rounded once
        return [_output(_rounded(linear(x, cols), bits), bits) for x in rows]
    terms = len(cols[0])
    size = -(-terms // pieces)
    cuts = [slice(first, first + size) for first in range(0, terms, size)]
    cut_cols = [[col[cut] for col in cols] for cut in cuts]
    out = []
    for x in rows:
        sums = [_rounded([fsum(map(mul, x[cut], col)) for col in piece], bits)
                for cut, piece in zip(cuts, cut_cols)]
        out.append(_output(_rounded([fsum(run) for run in zip(*sums)], bits), bits))
    return out


def _output(totals, bits):
    """A row's outputs from its totals (rounded to bits): rounded to 16 bits, which
    16-bit totals already are."""
    return totals if bits == 16 else _rounded(totals, 16)


def _pieces(rows):
    """How many pieces by_batch cuts a dot product into for rows: PROCESSORS // rows, at
    least one (fewer rows, more pieces)."""
    return max(1, PROCESSORS // len(rows))


def by_batch(rows, cols):
    """in_pieces with _pieces(rows) pieces, every sum rounded to 16 bits."""
    _check_product(rows, cols)   # before _pieces counts the rows
    return in_pieces(rows, cols, _pieces(rows))


def by_batch_float32(rows, cols):
    """in_pieces with by_batch's pieces, every sum rounded to 32 bits, the output to 16."""
    _check_product(rows, cols)
    return in_pieces(rows, cols, _pieces(rows), bits=32)


def batch_invariant(rows, cols):
    """in_pieces with the pieces of a full batch (one), however many rows there are."""
    return in_pieces(rows, cols, 1)


def _rounded(numbers, bits):
    """Each number rounded to the nearest float of bits (IEEE half or single precision)."""
    code, largest = FORMATS[bits]
    try:
        return list(struct.unpack(f"{len(numbers)}{code}",
                                  struct.pack(f"{len(numbers)}{code}", *numbers)))
    except OverflowError:
        raise ValueError(f"a sum beyond {largest:g}, the largest {bits}-bit float: "
                         f"{max(numbers, key=abs)}") from None


def computed_by(product):
    """Give what a paged sequence whose rows product computes is made for.

    That is pool.sequence's computed_by: None for exact (forward_step's arithmetic), else
    the product itself."""
    return None if product is exact else product


def exact_attention(q, keys, values, rows=1):
    """Compute forward_step's attention of q over keys and values.

    The scores, their softmax and the weighted sums, each one correctly rounded sum (however
    many rows its step has)."""
    scores = [dot(q, k_j) * SCALE for k_j in keys]
    weights = softmax_row(scores)
    return [dot(weights, column) for column in zip(*values)]


def forward_rows(params, items, product=exact, attention=exact_attention):
    """Compute the next-token logits for each item (cache, token_id, position) together.

    Each weight matrix is applied once to every item's row, each row attending to its own
    cache's positions 0..position, the batch's new ones included, as attention(q, keys,
    values, the batch's rows) reads them (blockwise.py has engines' ways to). Items may
    share a cache (a prompt's tokens, in order). Refuses, before anything changes, what
    forward_step refuses, a paged sequence made for another product's rows (its pool shares
    blocks only among sequences computed alike) and a batch its caches have no room for; the
    caches keep the new keys and values only once every row is computed, so a refusal on the
    way (a key a cache cannot store, a sum a kernel cannot hold, an attention that gives
    other than WIDTH finite floats: ItemRefused) changes nothing either."""
    _check_items(params, items, computed_by(product))
    cols = items[0][0].columns
    x0s = [add(params["tok_emb"][token_id], params["pos_emb"][i]) for _, token_id, i in items]
    h1s = [layernorm(x0, params["ln1_g"], params["ln1_b"]) for x0 in x0s]
    qs, ks, vs = product(h1s, cols["Wq"]), product(h1s, cols["Wk"]), product(h1s, cols["Wv"])
    held = {}   # each cache's keys and values, and after them the batch's new ones
    for (cache, _, _), k, v in zip(items, ks, vs):
        keys, values = held.setdefault(id(cache), (list(cache.keys), list(cache.values)))
        keys.append(cache.stored(k))       # as the cache will give it back
        values.append(cache.stored(v))
    mixed = []
    for (cache, _, i), q in zip(items, qs):
        keys, values = held[id(cache)]
        mixed.append(attention(q, keys[:i + 1], values[:i + 1], len(items)))   # positions 0..i
    _check_mixed(mixed, attention, items)
    x1s = [add(x0, o) for x0, o in zip(x0s, product(mixed, cols["Wo"]))]
    h2s = [layernorm(x1, params["ln2_g"], params["ln2_b"]) for x1 in x1s]
    hidden = [relu(add(z, params["b1"])) for z in product(h2s, cols["W1"])]
    x2s = [add(x1, add(m, params["b2"]))          # the MLP output plus its bias first
           for x1, m in zip(x1s, product(hidden, cols["W2"]))]
    hfs = [layernorm(x2, params["lnf_g"], params["lnf_b"]) for x2 in x2s]
    logits = [add(z, params["b_out"]) for z in product(hfs, cols["W_out"])]
    for (cache, token_id, _), k, v in zip(items, ks, vs):
        cache.append(token_id, k, v)   # every row computed: the caches keep what they read
    return logits


class ItemRefused(ValueError):
    """A refusal of what forward_rows computed for one item of its batch.

    item: its index in items; why: the refusal in words (serving.serve names the item's
    request with it)."""

    def __init__(self, item, why):
        super().__init__(f"items[{item}]: {why}")
        self.item, self.why = item, why


def _check_mixed(mixed, attention, items):
    """Refuse what attention gave an item unless a row's mixed values, WIDTH finite floats.

    Fewer would leave Wo's product short; a NaN would make every logit NaN."""
    for item, (row, (_, _, position)) in enumerate(zip(mixed, items)):
        if not (isinstance(row, (list, tuple)) and len(row) == model.WIDTH
                and set(map(type, row)) == {float} and all(map(math.isfinite, row))):
            name = getattr(attention, "__name__", None) or model.excerpt(attention)
            raise ItemRefused(item, f"the attention {name} gave {model.excerpt(row)} at "
                                    f"position {position}, where a row's mixed values are "
                                    f"{model.WIDTH} finite floats")


def _check_items(params, items, kernel):
    """What forward_step checks, for every item in turn, counting the items before it
    that share its cache, and that each cache takes kernel's rows (check_cache); then that
    the owner of each cache's room (its own lists, a pool) has room for all its caches'
    items, asking each owner once."""
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"items must be a non-empty list of (cache, token_id, position), "
                         f"got {items!r}")
    earlier = Counter()
    for index, item in enumerate(items):
        if not isinstance(item, tuple) or len(item) != 3:
            raise ValueError(f"items[{index}] must be (cache, token_id, position), got {item!r}")
        cache, token_id, position = item
        check_cache(cache, params, kernel)
        if not cache.keeps_every_position:
            raise ValueError(f"items[{index}]: a {type(cache).__name__} drops positions, and "
                             f"a batched row attends to every one; feed it one token at a time")
        if not cache.fixed_once_kept:
            raise ValueError(f"items[{index}]: a {type(cache).__name__} changes the keys and "
                             f"values it holds when it quantizes a group, so rows batched "
                             f"together would read them otherwise than one at a time; feed "
                             f"it one token at a time")
        expected = len(cache) + earlier[id(cache)]
        if not model.is_int(position) or position != expected:
            raise ValueError(f"items[{index}]: expected position {expected}, got {position!r}")
        if position >= model.CONTEXT:
            raise ValueError(f"items[{index}]: position {position} is beyond the "
                             f"{model.CONTEXT} positions of the model's table")
        model.check_token_id(token_id, f"items[{index}]: token ID")
        earlier[id(cache)] += 1
    owners = {}   # each room owner, and what its caches' items demand of it
    for cache in {id(cache): cache for cache, _, _ in items}.values():
        owner = cache.room_owner
        owners.setdefault(id(owner), (owner, []))[1].append((cache, earlier[id(cache)]))
    for owner, demands in owners.values():
        owner.check_room(demands)
