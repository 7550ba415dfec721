"""What servers do with the KV cache. Part 2 of the lesson: prefill a prompt in one pass,
keep caches in a pool of fixed-size blocks that sequences share, and shrink the cache
with fewer bits or a window, where exactness is given up on purpose. Part 3: serve many
requests from one pool (continuous batching, preemption, a prefix cache that outlives
requests), check drafted tokens in one call (speculative decoding), and keep a cache in
a file.

Everything here reads and writes caches through the interface of kv_cache.KVCache, so
kv_cache.forward_step works on every one of them, and its results can be compared with
the lesson's, bit for bit, with ==.

    python3 serving.py "zoe went to the park." --save-cache zoe.json
    python3 serving.py "zoe went to the park." --load-cache zoe.json   (--help: the flags)
"""
import argparse
import hashlib
import json
import math
import os
import struct
import sys
from array import array
from collections import Counter, OrderedDict, deque

import checkpoint
import generate
import model
from checkpoint import read_json, write_atomically
from kv_cache import (KVCache, _check_owner, _fork_for_prompt, _held_prefix, feed, forward_step,
                      generate_cached)
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
    prefill call per chunk (servers call it chunked prefill); the logits of each. A
    refused chunk (a pool out of blocks) leaves the chunks before it in the cache."""
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


class Block:
    """One block of a pool: the tokens, keys and values of up to block_size positions; how
    many block tables hold it; and, once it is full, its place in the prefix index: the
    tokens of every position from 0 to its end, which its keys and values depend on."""

    def __init__(self):
        self.tokens, self.keys, self.values = [], [], []
        self.ref_count = 0
        self.prefix = None


class BlockPool:
    """Room for the keys and values of a fixed number of blocks of block_size positions
    each, shared by the sequences made from it, as vLLM's PagedAttention keeps its cache.
    Each sequence has a block table (the blocks holding its positions, in order) and only
    asks the pool: the pool alone takes, shares and releases blocks, counts the tables
    holding each, and keeps the prefix index, where a full block can be found again by
    the tokens it and every block before it hold. A full block nobody holds stays in the
    index, on the free list, until a new block is needed: the least recently released
    goes first (a prefix cache that outlives requests)."""

    def __init__(self, params, blocks, block_size):
        model.check_shapes(params)
        for name, value in (("blocks", blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.params = params
        self.columns = model.columns(params)
        self.block_size = block_size
        self.blocks = [Block() for _ in range(blocks)]
        self.prefix_index = {}   # tokens of positions 0 to a full block's end -> block ids
        self.free_list = OrderedDict.fromkeys(range(blocks))   # the next one taken first
        self.prefix_hits = self.evictions = 0

    @property
    def ref_counts(self):
        """How many block tables hold each block."""
        return [block.ref_count for block in self.blocks]

    def free_blocks(self):
        """Blocks no table holds: empty, or full and cached until they are needed."""
        return len(self.free_list)

    def sequence(self, ids=()):
        """A new sequence starting with the longest run of full blocks in the pool that
        hold the first tokens of ids (prefix reuse): feed it the rest of ids."""
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"ids must be a list of token IDs, got {type(ids).__name__}")
        if ids:
            model.check_ids(ids)
        seq = PagedSequence(self)
        for block_id in self.find(ids):
            self.share(block_id)
            seq.table.append(block_id)
        seq.length = len(seq.table) * self.block_size
        self.prefix_hits += len(seq.table)
        return seq

    def find(self, ids):
        """The longest run of cached full blocks holding the first tokens of ids."""
        found = []
        for end in range(self.block_size, len(ids) + 1, self.block_size):
            holders = self.prefix_index.get(tuple(ids[:end]))
            if not holders:
                break
            found.append(holders[0])
        return found

    def check_room(self, blocks):
        """Refuse to go on if more blocks are needed than are free."""
        if blocks > self.free_blocks():
            raise ValueError(f"the pool is out of blocks: it has {len(self.blocks)} blocks of "
                             f"{self.block_size} positions, {self.free_blocks()} free, and "
                             f"{blocks} more are needed; free a sequence or make a larger pool")

    def take(self, tokens=(), keys=(), values=()):
        """A free block for one table, holding copies of the given positions; a cached
        block taken for it leaves the prefix index (it is evicted)."""
        self.check_room(1)
        block_id, _ = self.free_list.popitem(last=False)
        block = self.blocks[block_id]
        if block.prefix is not None:
            self._unindex(block_id)
            self.evictions += 1
        block.tokens, block.keys, block.values = list(tokens), list(keys), list(values)
        block.ref_count = 1
        return block_id

    def share(self, block_id):
        """One more table holds the block (a cached block leaves the free list)."""
        if self.blocks[block_id].ref_count == 0:
            del self.free_list[block_id]
        self.blocks[block_id].ref_count += 1

    def release(self, block_id):
        """One table less holds the block. When none does, a full block stays findable at
        the back of the free list; any other is emptied and goes to its front."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_list[block_id] = None
            if block.prefix is None:
                block.tokens, block.keys, block.values = [], [], []
                self.free_list.move_to_end(block_id, last=False)

    def append(self, block_id, token_id, k, v, prefix):
        """One more position in a block that one table holds; prefix: the tokens of its
        sequence so far, under which the block is indexed when it fills up."""
        block = self.blocks[block_id]
        block.tokens.append(token_id)
        block.keys.append(k)
        block.values.append(v)
        if len(block.tokens) == self.block_size:
            block.prefix = tuple(prefix)
            self.prefix_index.setdefault(block.prefix, []).append(block_id)

    def truncate(self, block_id, length):
        """Keep the first length positions of a block that one table holds."""
        block = self.blocks[block_id]
        del block.tokens[length:], block.keys[length:], block.values[length:]
        self._unindex(block_id)   # no longer full

    def _unindex(self, block_id):
        block = self.blocks[block_id]
        if block.prefix is not None:
            holders = self.prefix_index[block.prefix]
            holders.remove(block_id)
            if not holders:
                del self.prefix_index[block.prefix]
            block.prefix = None


class PagedSequence(KVCache):
    """One sequence whose positions live in a BlockPool's blocks. To forward_step and
    prefill it is a cache like any other: tokens, keys and values read as lists over its
    positions, and new positions go into its last block or into new ones. A fork shares
    every block, the partly filled last one too, until one of them writes there: then the
    writer first takes a copy of it (copy on write)."""

    def __init__(self, pool):
        self.pool = pool
        self.params = pool.params
        self.columns = pool.columns
        self.table = []        # block ids, in position order
        self.length = 0        # positions held: all of the table's blocks but the last,
        self.freed = False     # and the first length % block_size of the last (or all)

    def _check_live(self):
        if self.freed:
            raise ValueError("this sequence was freed and its blocks returned to the pool; "
                             "start a new one with pool.sequence()")

    def _held(self, part):
        self._check_live()
        return [item for block_id in self.table
                for item in getattr(self.pool.blocks[block_id], part)][:self.length]

    @property
    def tokens(self):
        return self._held("tokens")

    @property
    def keys(self):
        return self._held("keys")

    @property
    def values(self):
        return self._held("values")

    def __len__(self):
        self._check_live()
        return self.length

    def _in_last_block(self):
        """How many of this sequence's positions its last block holds (0 without one)."""
        return self.length - (len(self.table) - 1) * self.pool.block_size if self.table else 0

    def _room_in_last_block(self):
        return self.pool.block_size - self._in_last_block() if self.table else 0

    def _last_block_is_shared(self):
        return bool(self.table) and self.pool.blocks[self.table[-1]].ref_count > 1

    def blocks_needed(self, positions):
        """How many blocks keeping that many more positions takes from the pool."""
        self._check_live()
        room = self._room_in_last_block()
        copy = positions > 0 and room > 0 and self._last_block_is_shared()
        return math.ceil(max(0, positions - room) / self.pool.block_size) + copy

    def extend(self, token_ids, keys, values):
        """Keep several more positions: the last block first, then new blocks; a block
        that fills up joins the prefix index. Before writing into its last block the
        sequence makes it its own: a copy if another table holds it too, or cut to its
        own positions if a crop left it longer. Refused, with nothing changed, when the
        pool lacks the blocks."""
        pool = self.pool
        pool.check_room(self.blocks_needed(len(token_ids)))
        if token_ids and self._room_in_last_block():
            kept, last = self._in_last_block(), pool.blocks[self.table[-1]]
            if self._last_block_is_shared():
                copied = pool.take(last.tokens[:kept], last.keys[:kept], last.values[:kept])
                pool.release(self.table[-1])
                self.table[-1] = copied
            elif len(last.tokens) > kept:
                pool.truncate(self.table[-1], kept)
        tokens = self.tokens
        for token_id, k, v in zip(token_ids, keys, values):
            if not self._room_in_last_block():
                self.table.append(pool.take())
            tokens.append(token_id)
            pool.append(self.table[-1], token_id, k, v, tokens)
            self.length += 1

    def copy(self):
        """A fork: a new sequence holding the same blocks, each shared until written."""
        self._check_live()
        fork = PagedSequence(self.pool)
        fork.table, fork.length = list(self.table), self.length
        for block_id in fork.table:
            self.pool.share(block_id)
        return fork

    def _forget_from(self, length):
        """Release the blocks past length, the last first (so that the pool evicts a
        sequence's tail before its start). A block that length cuts in two stays as it is
        until this sequence writes to it (it reads only its first positions)."""
        kept_blocks = math.ceil(length / self.pool.block_size)
        for block_id in reversed(self.table[kept_blocks:]):
            self.pool.release(block_id)
        self.table, self.length = self.table[:kept_blocks], length

    def free(self):
        """End the sequence: its blocks go back to the pool unless another table holds
        them (the last block first). Freeing it again does nothing."""
        if not self.freed:
            self._forget_from(0)
            self.freed = True


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
            raise ValueError(f"a number of {vector} is beyond {fmt}'s largest, {largest}; "
                             f"use a wider format") from None
        return (array("f", vector),) if fmt == "float32" else (packed,)
    if fmt == "int4" and len(vector) % 2:
        raise ValueError(f"int4 packs two numbers a byte, so a vector of {len(vector)} "
                         f"cannot be stored")
    top = 127 if fmt == "int8" else 7
    try:   # the scale is kept as a 32-bit float
        struct.pack("<f", max(map(abs, vector)) / top)
    except OverflowError:
        raise ValueError(f"the scale of {vector} is beyond float32's largest, 3.4e38, so "
                         f"{fmt} cannot store it; use float64") from None
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



class PromptLookup:
    """The drafter of prompt lookup decoding: the tokens that followed the latest earlier
    occurrence of the story's last n tokens (n = longest down to 1) in the story itself."""

    def __init__(self, longest=3):
        self.longest = longest

    def propose(self, ids, lookahead):
        """Up to lookahead tokens to check after ids; none if nothing matches."""
        for n in range(min(self.longest, len(ids) - 1), 0, -1):
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start:start + n] == ids[-n:]:
                    return ids[start + n:start + n + lookahead]
        return []


class NgramDrafter:
    """A drafter learned from stories (say, the training stories): after the story's last
    n tokens (n = longest down to 1, the longest seen), the token that most often
    followed them there (the smallest ID of a tie), drafted one after another."""

    def __init__(self, stories, longest=3):
        seen = {}
        for ids in stories:
            for n in range(1, longest + 1):
                for start in range(len(ids) - n):
                    followers = seen.setdefault(tuple(ids[start:start + n]), Counter())
                    followers[ids[start + n]] += 1
        self.longest = longest
        self.next = {gram: min(followers, key=lambda t: (-followers[t], t))
                     for gram, followers in seen.items()}

    def propose(self, ids, lookahead):
        """Up to lookahead tokens to check after ids."""
        story = list(ids)
        for _ in range(lookahead):
            grams = (tuple(story[-n:]) for n in range(min(self.longest, len(story)), 0, -1))
            token = next((self.next[gram] for gram in grams if gram in self.next), None)
            if token is None:
                break
            story.append(token)
        return story[len(ids):]


def generate_speculative(params, tok, prompt, max_new_tokens=60, temperature=0.0,
                         top_k=None, seed=0, lookahead=4, cache=None, drafter=None):
    """Same arguments and result as generate.generate, with speculative decoding: after
    each chosen token, a draft of up to lookahead more (propose) is checked in one call
    of prefill; the model chooses each next token from the rows in order, with its own
    random numbers, exactly as it would one at a time, and a drafted token counts only
    where it is the token chosen. The positions after the first that is not are rolled
    back with crop. The drafter is prompt lookup in the story unless another is given
    (anything with propose(ids, lookahead), such as an NgramDrafter). Given a cache that
    holds the start of the prompt, starts from a copy of it (one that cannot roll back is
    refused before anything is generated)."""
    drafter = drafter or PromptLookup()
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
        raise ValueError(f"lookahead must be an int >= 1, got {lookahead!r}")
    if cache is None:
        cache = KVCache(params)
    elif isinstance(cache, KVCache) and not cache.keeps_every_position:
        raise ValueError(f"speculative decoding rolls rejected positions back with crop, "
                         f"and a {type(cache).__name__} drops positions a crop may need; "
                         f"pass a cache that keeps every position")
    ids = generate.check_request(tok, prompt, max_new_tokens, temperature, top_k, seed)
    cache = _fork_for_prompt(params, cache, ids, tok)
    try:
        generation = generate.Generation(tok, ids, max_new_tokens, temperature, top_k, seed)
        if generation.stopped:
            return generation.result()
        rows = prefill_in_chunks(params, cache, ids, model.CONTEXT)[-1:]
        while True:
            for row in rows:      # each row predicts the token after the one it read
                drafted = len(cache) - len(ids)   # ids: the story so far, chosen included
                generation.choose(row)
                if generation.stopped or drafted <= 0 \
                        or ids[-1] != cache.tokens[len(ids) - 1]:
                    break
            if generation.stopped:
                return generation.result()
            cache.crop(len(ids) - 1)              # roll back every position not chosen
            draft = drafter.propose(ids, min(lookahead, model.CONTEXT - len(ids),
                                             max_new_tokens - len(generation.steps) - 1))
            rows = prefill(params, cache, [ids[-1], *draft], len(ids) - 1)
    finally:
        cache.free()   # the copy is this call's own


CACHE_FORMAT = "kv-lab-cache-1"


def weights_signature(params):
    """A hash of every parameter's floats, written exactly (repr): two params objects
    have the same signature only if they hold the same weights."""
    data = json.dumps([params[name] for name in sorted(params)])
    return hashlib.sha256(data.encode("utf-8")).hexdigest()[:16]


def save_cache(cache, path):
    """Write the tokens, keys and values of a KVCache or a paged sequence to path (JSON,
    floats exact), with the signature of the weights they were computed with, atomically."""
    if type(cache) not in (KVCache, PagedSequence):
        raise ValueError(f"save_cache saves a KVCache or a paged sequence, whose keys and "
                         f"values are exact and complete, got {type(cache).__name__}")
    record = {"format": CACHE_FORMAT, "weights": weights_signature(cache.params),
              "tokens": cache.tokens, "keys": cache.keys, "values": cache.values}
    write_atomically(path, json.dumps(record, separators=(",", ":")) + "\n")


def load_cache(params, path):
    """A new KVCache for params holding what save_cache wrote to path; refused, naming the
    file, if it is not a cache file of this lab, was computed with other weights (its
    keys and values would give stale logits), or is truncated or corrupted."""
    model.check_shapes(params)
    record = read_json(path, CACHE_FORMAT, "a KV cache file of this lab")
    if record.get("weights") != weights_signature(params):
        raise ValueError(f"{path}: computed with other weights (signature "
                         f"{record.get('weights')!r}, these weights are "
                         f"{weights_signature(params)!r}): its keys and values would give "
                         f"stale logits; save the cache again with these params (python3 "
                         f"serving.py PROMPT --save-cache FILE)")
    tokens, keys, values = (record.get(name) for name in ("tokens", "keys", "values"))
    problem = _cache_problem(tokens, keys, values)
    if problem:
        raise ValueError(f"{path}: a corrupted cache file: {problem}")
    cache = KVCache(params)
    cache.extend(tokens, keys, values)
    return cache


def _cache_problem(tokens, keys, values):
    """What is wrong with a cache file's lists, or None."""
    if not all(isinstance(part, list) for part in (tokens, keys, values)):
        return "tokens, keys and values must be lists"
    if not len(tokens) == len(keys) == len(values) <= model.CONTEXT:
        return (f"{len(tokens)} tokens, {len(keys)} keys and {len(values)} values, where "
                f"each must have one per position, at most {model.CONTEXT}")
    for position, token_id in enumerate(tokens):
        if isinstance(token_id, bool) or not isinstance(token_id, int) \
                or not 0 <= token_id < model.VOCAB_SIZE:
            return f"token {position} is {token_id!r}, outside the vocabulary"
    for name, vectors in (("key", keys), ("value", values)):
        for position, vector in enumerate(vectors):
            if not isinstance(vector, list) or len(vector) != model.WIDTH or \
                    not all(type(x) is float and math.isfinite(x) for x in vector):
                return (f"the {name} of position {position} is not {model.WIDTH} finite "
                        f"floats")
    return None


def serve(params, tok, requests, pool, max_batch, log=None):
    """Run requests (each a dict of generate.generate's keyword arguments, prompt
    included) to completion from one pool, with continuous batching as servers do: at
    each step every running request chooses one token and is fed it (one decode row); a
    waiting request is admitted, its tokens prefilled in one pass, as soon as the batch
    and the pool have room; a finished one leaves at once. When a running request needs
    a block and none is free, the most recently admitted one is preempted by recompute:
    its blocks are freed, and when it is admitted again its prompt and the tokens it had
    chosen are prefilled again (its random numbers go on where they were: none is drawn
    twice). Returns (results, counts): each result exactly generate.generate's for its
    request, in request order, and what serving did. log(step, request index, event), if
    given, is told each "prefill", "decode", "preempted" and "finished" as it happens."""
    log = log or (lambda step, index, event: None)
    if not isinstance(pool, BlockPool) or pool.params is not params:
        raise ValueError("pool must be a BlockPool made for these params")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    if not isinstance(requests, (list, tuple)):
        raise ValueError(f"requests must be a list of dicts, got {type(requests).__name__}")
    served = [_Served(params, tok, index, request, pool)
              for index, request in enumerate(requests)]    # every request checked first
    waiting = deque(request for request in served if not request.generation.stopped)
    running = []
    counts = dict.fromkeys(("steps", "rows", "recomputed_rows", "preemptions", "peak_blocks",
                            "prefix_hits"), 0)
    while waiting or running:
        while waiting and len(running) < max_batch and waiting[0].admit(counts):
            running.append(waiting.popleft())
            log(counts["steps"] + 1, running[-1].index, "prefill")
        counts["steps"] += 1
        for request in list(running):
            if request not in running:
                continue                        # preempted earlier in this step
            request.generation.choose(request.logits)
            if request.generation.stopped:
                running.remove(request)
                request.seq.free()
                log(counts["steps"], request.index, "finished")
                continue
            while not request.decode(counts):
                victim = running.pop()          # the most recently admitted
                victim.preempt()
                waiting.appendleft(victim)
                counts["preemptions"] += 1
                log(counts["steps"], victim.index, "preempted")
                if victim is request:
                    break
            else:
                log(counts["steps"], request.index, "decode")
        counts["peak_blocks"] = max(counts["peak_blocks"], len(pool.blocks) - pool.free_blocks())
    return [request.generation.result() for request in served], counts


class _Served:
    """One request in serve: its generation, its sequence in the pool while admitted, the
    logits for its next token, and how many of its positions were ever computed."""

    SETTINGS = {"max_new_tokens": 60, "temperature": 0.0, "top_k": None, "seed": 0}

    def __init__(self, params, tok, index, request, pool):
        if not isinstance(request, dict) or "prompt" not in request \
                or not set(request) <= {"prompt", *self.SETTINGS}:
            raise ValueError(f"request {index} must be a dict of generate's keyword arguments "
                             f"({', '.join(['prompt', *self.SETTINGS])}), got {request!r}")
        settings = dict(self.SETTINGS, **request)
        prompt = settings.pop("prompt")
        try:
            ids = generate.check_request(tok, prompt, **settings)
        except ValueError as refused:
            raise ValueError(f"request {index}: {refused}") from None
        fed = min(len(ids) + settings["max_new_tokens"], model.CONTEXT) - 1
        if math.ceil(fed / pool.block_size) > len(pool.blocks):
            raise ValueError(f"request {index} may need {math.ceil(fed / pool.block_size)} "
                             f"blocks of {pool.block_size} positions, and the pool has "
                             f"{len(pool.blocks)}: it could never run; make a larger pool")
        self.params, self.pool, self.index = params, pool, index
        self.generation = generate.Generation(tok, ids, **settings)
        self.seq, self.logits, self.computed = None, None, 0

    def admit(self, counts):
        """Prefill the tokens so far into a new sequence, in one pass, after the full
        blocks the pool has cached for them (never the last position: its logits are
        needed); False, with nothing changed, if the pool lacks room."""
        ids = self.generation.ids
        cached = self.pool.find(ids[:-1])
        cached_free = sum(self.pool.blocks[block_id].ref_count == 0 for block_id in cached)
        needed = math.ceil(len(ids) / self.pool.block_size) - len(cached)
        if needed > self.pool.free_blocks() - cached_free:
            return False
        self.seq = self.pool.sequence(ids[:-1])
        start = len(self.seq)
        self.logits = prefill(self.params, self.seq, ids[start:], start)[-1]
        counts["rows"] += len(ids) - start
        counts["recomputed_rows"] += max(0, self.computed - start)
        counts["prefix_hits"] += len(cached)
        self.computed = max(self.computed, len(ids))
        return True

    def decode(self, counts):
        """Feed the token just chosen (one row); False, with nothing changed, if the pool
        lacks the block it needs."""
        if self.seq.blocks_needed(1) > self.pool.free_blocks():
            return False
        ids = self.generation.ids
        self.logits = forward_step(self.params, self.seq, ids[-1], len(ids) - 1)
        counts["rows"] += 1
        self.computed = max(self.computed, len(ids))
        return True

    def preempt(self):
        """Give the blocks back; the generation keeps its tokens and random numbers."""
        self.seq.free()
        self.seq, self.logits = None, None


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Save the KV cache of a prompt to a file, or continue a prompt from a "
                    "cache file (in this process or another), and compare the story with "
                    "the uncached generator's.")
    generate.add_generation_flags(parser)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save-cache", metavar="FILE",
                      help="feed the prompt into a cache, save it to FILE, continue from it")
    mode.add_argument("--load-cache", metavar="FILE",
                      help="continue the prompt from the cache in FILE (it must hold the "
                           "start of the prompt, computed with these weights)")
    args = parser.parse_args(argv)
    settings = (args.max_new_tokens, args.temperature, args.top_k, args.seed)
    try:
        params, tok = generate.load_trained(args.folder)
        if args.save_cache:
            cache = KVCache(params)
            feed(params, cache, generate.check_request(tok, args.prompt, *settings))
            save_cache(cache, args.save_cache)
            done = f"saved {len(cache)} positions to {args.save_cache}"
        else:
            cache = load_cache(params, args.load_cache)
            done = f"continued from {len(cache)} positions of {args.load_cache}"
        result = generate_cached(params, tok, args.prompt, *settings, cache=cache)
        uncached = generate.generate(params, tok, args.prompt, *settings)
    except (OSError, ValueError) as e:
        sys.exit(f"serving.py: error: {e}")
    generate.print_result(result)
    print(f"{done} ({os.path.getsize(args.save_cache or args.load_cache):,} bytes)")
    print(f"identical to the uncached generator: {'yes' if result == uncached else 'NO'}")
    if result != uncached:
        sys.exit(1)


if __name__ == "__main__":
    checkpoint.run_command(main)
