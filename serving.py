"""What servers do with the KV cache (Part 2 of the lesson): prefill a prompt in one pass,
keep caches in a pool of fixed-size blocks that sequences share, and shrink the cache
with fewer bits or a window, where exactness is given up on purpose.

Everything here reads and writes caches through the interface of kv_cache.KVCache, so
kv_cache.forward_step works on every one of them, and its results can be compared with
the lesson's, bit for bit, with ==.
"""
import math
import struct
from array import array

import generate
import model
from kv_cache import KVCache, _check_owner, _held_prefix
from model import SCALE, add, dot, layernorm, linear, relu, softmax_row


def prefill(params, cache, token_ids, start):
    """Next-token logits for each of token_ids, at positions start, start + 1, ..., in one
    pass, as servers prefill a prompt: every new position's key and value join the cache
    first, then new position i attends to positions 0..i (the causal mask, offset by the
    start). start must be the number of positions the cache holds."""
    _check_owner(cache, params)
    if isinstance(start, bool) or not isinstance(start, int) or start != len(cache):
        raise ValueError(f"expected start {len(cache)}, got {start!r}: the cache holds "
                         f"{len(cache)} positions, so new tokens start at position "
                         f"{len(cache)} (an int)")
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        raise ValueError(f"token_ids must be a non-empty list of token IDs, got {token_ids!r}")
    if start + len(token_ids) > model.CONTEXT:
        raise ValueError(f"positions {start} to {start + len(token_ids) - 1} go beyond the "
                         f"{model.CONTEXT} positions of the model's table")
    for index, token_id in enumerate(token_ids):
        model.check_token_id(token_id, f"token_ids[{index}] =")
    if not cache.keeps_every_position:
        raise ValueError(f"prefill needs a cache that keeps every position, and a "
                         f"{type(cache).__name__} drops some; feed it one token at a time")
    cols = cache.columns
    x0_and_q, new_keys, new_values = [], [], []
    for i, t in enumerate(token_ids, start):
        x0 = add(params["tok_emb"][t], params["pos_emb"][i])
        h1 = layernorm(x0, params["ln1_g"], params["ln1_b"])
        q, k, v = linear(h1, cols["Wq"]), linear(h1, cols["Wk"]), linear(h1, cols["Wv"])
        x0_and_q.append((x0, q))
        new_keys.append(k)
        new_values.append(v)
    cache.extend(list(token_ids), new_keys, new_values)   # all of them, before attention
    held_keys, held_values = cache.keys, cache.values
    logits = []
    for i, (x0, q) in enumerate(x0_and_q, start):
        keys, values = held_keys[:i + 1], held_values[:i + 1]   # positions 0..i only
        scores = [dot(q, k_j) * SCALE for k_j in keys]
        weights = softmax_row(scores)
        mixed = [dot(weights, column) for column in zip(*values)]
        x1 = add(x0, linear(mixed, cols["Wo"]))
        h2 = layernorm(x1, params["ln2_g"], params["ln2_b"])
        a = relu(add(linear(h2, cols["W1"]), params["b1"]))
        x2 = add(x1, add(linear(a, cols["W2"]), params["b2"]))   # the MLP output plus its bias first
        hf = layernorm(x2, params["lnf_g"], params["lnf_b"])
        logits.append(add(linear(hf, cols["W_out"]), params["b_out"]))
    return logits


def prefill_in_chunks(params, cache, ids, size):
    """Feed the tokens of ids that the cache does not hold yet, size at a time, one
    prefill call per chunk (servers call it chunked prefill); the logits of each."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"chunk size must be an int >= 1, got {size!r}")
    return [logits for first in range(_held_prefix(cache, ids), len(ids), size)
            for logits in prefill(params, cache, ids[first:first + size], first)]


def generate_one_pass(params, tok, prompt, max_new_tokens=60, temperature=0.0, top_k=None,
                      seed=0):
    """generate_cached with the whole prompt prefilled in one call of prefill, then one
    token per call: the same arguments and result as generate.generate."""
    cache = KVCache(params)
    ids = generate.check_request(tok, prompt, max_new_tokens, temperature, top_k, seed)

    def next_logits(ids):
        return prefill_in_chunks(params, cache, ids, model.CONTEXT)[-1]
    return generate.generate_with(next_logits, tok, ids, max_new_tokens, temperature, top_k,
                                  seed)


class BlockPool:
    """Room for the keys and values of a fixed number of blocks of block_size positions
    each, shared by the sequences made from it, as vLLM's PagedAttention keeps its cache.
    Each sequence has a block table (the blocks holding its positions, in order); a full
    block can be in several tables at once, counted in refs, and is found again by its
    tokens and the block before it (the prefix index)."""

    def __init__(self, params, blocks, block_size):
        model.check_shapes(params)
        for name, value in (("blocks", blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.params = params
        self.columns = model.columns(params)
        self.block_size = block_size
        self.blocks = [None] * blocks   # a block: ([tokens], [keys], [values]); None if free
        self.refs = [0] * blocks        # how many block tables hold each block
        self.index = {}                 # (previous block, its tokens) -> a full block
        self.indexed_as = {}            # a full block -> its key in index

    def free_blocks(self):
        return self.refs.count(0)

    def sequence(self, ids=()):
        """A new sequence starting with the longest run of full blocks in the pool whose
        tokens begin ids (prefix reuse): feed it the rest of ids."""
        seq = PagedSequence(self)
        previous = None
        for first in range(0, len(ids) - len(ids) % self.block_size, self.block_size):
            block = self.index.get((previous, tuple(ids[first:first + self.block_size])))
            if block is None:
                break
            self.refs[block] += 1
            seq.table.append(block)
            previous = block
        return seq

    def _check_room(self, blocks, freed=0):
        """Refuse to go on if blocks more are needed than are free (or are about to be)."""
        if blocks > self.free_blocks() + freed:
            raise ValueError(f"the pool is out of blocks: it has {len(self.blocks)} blocks of "
                             f"{self.block_size} positions, {self.free_blocks()} free, and "
                             f"{blocks} more are needed; free a sequence or make a larger pool")

    def _take(self, tokens=(), keys=(), values=()):
        """A free block, holding copies of the given positions."""
        block = self.refs.index(0)
        self.blocks[block] = (list(tokens), list(keys), list(values))
        self.refs[block] = 1
        return block

    def _release(self, block):
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.blocks[block] = None
            self._unindex(block)

    def _unindex(self, block):
        key = self.indexed_as.pop(block, None)
        if key is not None:
            del self.index[key]


class PagedSequence(KVCache):
    """One sequence whose positions live in a BlockPool's blocks. To forward_step and
    prefill it is a cache like any other: tokens, keys and values read as lists over its
    positions, and new positions go into its last block or into new ones."""

    def __init__(self, pool):
        self.pool = pool
        self.params = pool.params
        self.columns = pool.columns
        self.table = []        # block ids, in position order
        self.freed = False

    def _check_live(self):
        if self.freed:
            raise ValueError("this sequence was freed and its blocks returned to the pool; "
                             "start a new one with pool.sequence()")

    def _blocks(self):
        self._check_live()
        return [self.pool.blocks[block] for block in self.table]

    @property
    def tokens(self):
        return [t for block in self._blocks() for t in block[0]]

    @property
    def keys(self):
        return [k for block in self._blocks() for k in block[1]]

    @property
    def values(self):
        return [v for block in self._blocks() for v in block[2]]

    def __len__(self):
        return sum(len(block[0]) for block in self._blocks())

    def _room_in_last_block(self):
        """Free slots of the last block, which only this sequence may write to."""
        if not self.table:
            return 0
        return self.pool.block_size - len(self.pool.blocks[self.table[-1]][0])

    def extend(self, token_ids, keys, values):
        """Keep several more positions: the last block first, then new blocks; a block
        that fills up joins the prefix index. Refused, with nothing changed, when the pool
        lacks the blocks."""
        self._check_live()
        size = self.pool.block_size
        room = self._room_in_last_block()
        self.pool._check_room(math.ceil(max(0, len(token_ids) - room) / size))
        for token_id, k, v in zip(token_ids, keys, values):
            if self._room_in_last_block() == 0:
                self.table.append(self.pool._take())
            block = self.pool.blocks[self.table[-1]]
            block[0].append(token_id)
            block[1].append(k)
            block[2].append(v)
            if len(block[0]) == size:
                previous = self.table[-2] if len(self.table) > 1 else None
                key = (previous, tuple(block[0]))
                if key not in self.pool.index:
                    self.pool.index[key] = self.table[-1]
                    self.pool.indexed_as[self.table[-1]] = key

    def copy(self):
        """A fork: a new sequence sharing this one's full blocks, with its own copy of a
        partly filled last block (copy on write)."""
        self._check_live()
        partial = 0 < self._room_in_last_block() < self.pool.block_size
        self.pool._check_room(1 if partial else 0)
        fork = PagedSequence(self.pool)
        fork.table = list(self.table)
        for block in fork.table[:-1] if partial else fork.table:
            self.pool.refs[block] += 1
        if partial:
            fork.table[-1] = self.pool._take(*self.pool.blocks[self.table[-1]])
        return fork

    def _forget_from(self, length):
        """Return the blocks past length. The block that length cuts in two (if any)
        keeps its first positions; if another table shares it, this sequence gets its own
        copy of them instead (copy on write)."""
        kept_blocks = math.ceil(length / self.pool.block_size)
        dropped = self.table[kept_blocks:]
        in_last_block = length - (kept_blocks - 1) * self.pool.block_size
        cut = self.table[kept_blocks - 1] if length and in_last_block < len(
            self.pool.blocks[self.table[kept_blocks - 1]][0]) else None
        copy_needed = cut is not None and self.pool.refs[cut] > 1
        freed = sum(self.pool.refs[block] == 1 for block in dropped)
        self.pool._check_room(1 if copy_needed else 0, freed)
        for block in dropped:
            self.pool._release(block)
        self.table = self.table[:kept_blocks]
        if cut is None:
            return
        tokens, keys, values = (part[:in_last_block] for part in self.pool.blocks[cut])
        if copy_needed:
            self.pool._release(cut)
            self.table[-1] = self.pool._take(tokens, keys, values)
        else:
            self.pool.blocks[cut] = (tokens, keys, values)
            self.pool._unindex(cut)   # no longer full

    def free(self):
        """End the sequence: its blocks go back to the pool unless another table holds them."""
        for block in self.table:
            self.pool._release(block)
        self.table = []
        self.freed = True


FORMATS = ("float64", "float32", "float16", "int8", "int4")


def _pack(fmt, vector):
    """One key or value as fmt stores it: a tuple of arrays or bytes (for int8 and int4,
    the levels and their scale)."""
    if fmt in ("float64", "float32"):
        return (array("d" if fmt == "float64" else "f", vector),)
    if fmt == "float16":
        try:
            return (struct.pack(f"<{len(vector)}e", *vector),)
        except OverflowError:
            raise ValueError(f"a number of {vector} is beyond float16's largest, 65504; "
                             f"use a wider format") from None
    if fmt == "int4" and len(vector) % 2:
        raise ValueError(f"int4 packs two numbers a byte, so a vector of {len(vector)} "
                         f"cannot be stored")
    top = 127 if fmt == "int8" else 7
    scale = array("f", [max(map(abs, vector)) / top])   # kept as a 32-bit float
    levels = [max(-top, min(top, round(x / scale[0]))) if scale[0] else 0 for x in vector]
    if fmt == "int8":
        return (array("b", levels), scale)
    pairs = zip(levels[::2], levels[1::2])   # each level + 8 is 1..15: four bits
    return (bytes((low + 8) | ((high + 8) << 4) for low, high in pairs), scale)


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
    """A cache that stores each key and value compactly, in one of FORMATS, and turns
    them back into floats when attention reads them: float64 and float32 in arrays,
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
        self.tokens, self.stored_keys, self.stored_values = [], [], []

    @property
    def keys(self):
        return [_unpack(self.format, stored) for stored in self.stored_keys]

    @property
    def values(self):
        return [_unpack(self.format, stored) for stored in self.stored_values]

    def __len__(self):
        return len(self.stored_keys)

    def extend(self, token_ids, keys, values):
        stored_keys = [_pack(self.format, k) for k in keys]   # all packed before any is kept
        stored_values = [_pack(self.format, v) for v in values]
        self.tokens += token_ids
        self.stored_keys += stored_keys
        self.stored_values += stored_values

    def _forget_from(self, length):
        del self.tokens[length:], self.stored_keys[length:], self.stored_values[length:]

    def bytes_per_position(self):
        """The bytes its keys and values take per position: numbers and scales, measured."""
        if not len(self):
            raise ValueError("the cache holds no position yet")
        stored = self.stored_keys + self.stored_values
        return sum(map(_stored_bytes, stored)) / len(self)


class WindowCache(KVCache):
    """A cache that keeps the keys and values of the first sinks positions and of the
    last window ones, in buffers of fixed size, as Mistral's rotating cache and
    StreamingLLM's attention sinks do; position i then attends to those only (model.band
    is the same mask on the full pass). It keeps every token ID, to check prefixes. Feed
    it one token at a time: each new position has a window of its own."""

    keeps_every_position = False

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
        """Forget every position from length on; refused where the window has already
        dropped a position that length would need."""
        held = len(self)
        if isinstance(length, int) and not isinstance(length, bool) and length < held \
                and held > self.sinks + self.window and length > self.sinks:
            raise ValueError(f"crop length must be {held}, or at most {self.sinks} (the "
                             f"sinks held), got {length!r}: the window has dropped positions "
                             f"{self.sinks} to {held - self.window - 1}, which a shorter "
                             f"sequence would attend to")
        super().crop(length)

    def _forget_from(self, length):
        del self.tokens[length:], self.sink_keys[length:], self.sink_values[length:]
