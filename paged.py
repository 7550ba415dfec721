"""A paged cache (Part 2, section 16): the keys and values of many sequences in one pool
of fixed-size blocks, as vLLM's PagedAttention keeps them. A sequence holds a block
table, the blocks of its positions in order; sequences that begin with the same tokens
share those full blocks, and a fork shares every block until one side writes (copy on
write). To forward_step a paged sequence is a cache like any other.
"""
import math
from collections import OrderedDict

import generate
import model
import svg
from cache_protocol import check_positions
from documents import LAB, shown, table
from kv_cache import KVCache, feed, generate_cached
from stories import story_ids

BLOCK_SIZES = (4, 8, 16)   # the experiment's block sizes, positions per block
MAX_BLOCKS = 100_000       # a pool makes its blocks at once: a billion would fill the memory


class Block:
    """One block of a pool, holding the tokens, keys and values of up to block_size positions.

    It counts how many block tables hold it. Once full, it has a key in the prefix index:
    the tokens of every position from 0 to its end (a deeper model's keys depend on them
    all). And computed_by: None for the lab's exact arithmetic, else the product of the
    engine's kernel that computed it (it rounds otherwise), so that only a sequence computed
    alike finds it."""

    def __init__(self):
        self.tokens, self.keys, self.values = [], [], []
        self.ref_count, self.prefix, self.computed_by = 0, None, None


class NumberedBlocks:
    """What every pool of numbered blocks does the same: count, share and release them.

    A pool has blocks (each with a ref_count and a prefix, None until it is full and
    findable), block_size and free_list (an OrderedDict of the block ids no table holds,
    the next one taken first); _empty(block_id) empties a block it gets back."""

    @property
    def ref_counts(self):
        """How many block tables hold each block."""
        return [block.ref_count for block in self.blocks]

    def free_blocks(self):
        """Blocks no table holds: empty, or full and findable until they are needed."""
        return len(self.free_list)

    def check_free(self, blocks):
        """Refuse to go on, naming the blocks short, unless that many blocks are free."""
        if blocks > self.free_blocks():
            raise ValueError(f"the pool is out of blocks: it has {len(self.blocks)} blocks of "
                             f"{self.block_size} positions, {self.free_blocks()} free, and "
                             f"{blocks} more {'is' if blocks == 1 else 'are'} needed; free a "
                             f"sequence or make a larger pool")

    def block(self, block_id):
        """The block of block_id, refusing an id the pool does not have."""
        model.check_int("block id", block_id, 0, len(self.blocks) - 1)
        return self.blocks[block_id]

    def share(self, block_id):
        """One more table holds the block (a findable block leaves the free list)."""
        block = self.block(block_id)
        if block.ref_count == 0:
            if block.prefix is None:
                raise ValueError(f"block {block_id} is free and holds nothing to share")
            del self.free_list[block_id]
        block.ref_count += 1

    def release(self, block_id):
        """Let one table less hold the block.

        When none does, a full block stays findable at the back of the free list; any other
        is emptied and goes to its front."""
        block = self.block(block_id)
        if block.ref_count == 0:
            raise ValueError(f"block {block_id} is held by no table: release a block once "
                             f"for each table that took or shared it")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_list[block_id] = None
            if block.prefix is None:
                self._empty(block_id)
                self.free_list.move_to_end(block_id, last=False)


class BlockPool(NumberedBlocks):
    """Keep the keys and values of a fixed number of blocks, each of block_size positions.

    The blocks are shared by the sequences made from the pool (each holds a block table: the
    blocks of its positions, in order), which ask it: it alone takes, shares and releases
    blocks, counts the tables holding each, and keeps the prefix index, where a full block
    is found again by the tokens of every position up to its end. A full block nobody holds
    stays there, on the free list, until a new block is needed: the least recently released
    goes first (a prefix cache that outlives requests). It alone says whether blocks are
    there: for several sequences at once (room_for), for a new sequence (room_for_sequence),
    for one of so many positions (could_hold)."""

    def __init__(self, params, blocks, block_size):
        model.check_shapes(params)
        model.check_int("blocks", blocks, 1, MAX_BLOCKS, " (each is made with the pool)")
        model.check_int("block_size", block_size, 1, model.CONTEXT, " (the model's positions)")
        self.params = params
        self.columns = model.columns(params)
        self.block_size = block_size
        self.blocks = [Block() for _ in range(blocks)]
        self.prefix_index = {}   # tokens of positions 0 to a full block's end -> block ids
        self.free_list = OrderedDict.fromkeys(range(blocks))   # the next one taken first
        self.prefix_hits = self.evictions = 0

    def sequence(self, ids=(), computed_by=None):
        """Start a new sequence on the pool's longest cached prefix of ids.

        The prefix is the longest run of full blocks in the pool that hold the first tokens
        of ids and were computed as the sequence will be (prefix reuse): feed it the rest of
        ids. computed_by: None for the lab's exact arithmetic (forward_step, prefill,
        batched.exact), or the product of the kernel that will compute its rows."""
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"ids must be a list of token IDs, got {type(ids).__name__}")
        if ids:
            model.check_ids(ids)
        seq = PagedSequence(self, computed_by)
        for block_id in self.find(ids, computed_by):
            self.share(block_id)
            seq.table.append(block_id)
        seq.length = len(seq.table) * self.block_size
        self.prefix_hits += len(seq.table)
        return seq

    def find(self, ids, computed_by=None):
        """Give the longest run of cached full blocks holding the first tokens of ids.

        Only blocks computed by computed_by count (another kernel's keys round otherwise:
        never mixed in)."""
        found = []
        for end in range(self.block_size, len(ids) + 1, self.block_size):
            holders = [block_id for block_id in self.prefix_index.get(tuple(ids[:end]), ())
                       if self.blocks[block_id].computed_by is computed_by]
            if not holders:
                break
            # a block some table holds already, before a cached one nobody holds (which
            # would leave the free list, and hold the same positions twice)
            found.append(min(holders, key=lambda block_id: self.blocks[block_id].ref_count == 0))
        return found

    def room_for(self, demands):
        """Say whether the free blocks hold what demands need together.

        demands is a list of (sequence, more positions); the need is each sequence's
        blocks_needed (a copy on write counts), summed."""
        return self._blocks_for(demands) <= self.free_blocks()

    def check_room(self, demands):
        """Refuse to go on, naming the blocks short, unless room_for(demands)."""
        self.check_free(self._blocks_for(demands))

    def _blocks_for(self, demands):
        return sum(seq.blocks_needed(positions) for seq, positions in demands)

    def room_for_sequence(self, ids, positions, computed_by=None):
        """Say whether a new sequence for ids could then hold that many positions.

        The sequence is pool.sequence(ids, computed_by); it needs the blocks past its cached
        prefix, out of the free blocks that prefix would not take back."""
        cached = self.find(ids, computed_by)
        taken_back = sum(self.blocks[block_id].ref_count == 0 for block_id in cached)
        needed = self.blocks_to_hold(positions) - len(cached)
        return needed <= self.free_blocks() - taken_back

    def could_hold(self, positions):
        """Say whether a new sequence of that many positions fits in the blocks free now.

        Cached blocks count: they are taken back when needed."""
        return self.blocks_to_hold(positions) <= self.free_blocks()

    def blocks_to_hold(self, positions):
        """The blocks a sequence of that many positions holds."""
        return math.ceil(positions / self.block_size)

    def take(self, tokens=(), keys=(), values=(), computed_by=None):
        """Give a free block for one table, holding copies of the given positions.

        At most block_size positions, computed by computed_by; a cached block taken for it
        leaves the prefix index (it is evicted)."""
        if not len(tokens) == len(keys) == len(values) <= self.block_size:
            raise ValueError(f"a block holds up to {self.block_size} positions, one token, "
                             f"key and value each; got {len(tokens)} tokens, {len(keys)} "
                             f"keys and {len(values)} values")
        self.check_free(1)
        block_id, _ = self.free_list.popitem(last=False)
        block = self.blocks[block_id]
        if block.prefix is not None:
            self._unindex(block_id)
            self.evictions += 1
        block.tokens, block.keys, block.values = list(tokens), list(keys), list(values)
        block.ref_count, block.computed_by = 1, computed_by
        return block_id

    def _empty(self, block_id):
        block = self.blocks[block_id]
        block.tokens, block.keys, block.values = [], [], []

    def append(self, block_id, token_id, k, v, prefix):
        """Write one more position into a block that one table holds.

        prefix: the tokens of its sequence so far, under which the block is indexed when it
        fills up."""
        block = self.block(block_id)
        slot = len(block.tokens)
        if slot == self.block_size or block.ref_count != 1:
            why = "full" if slot == self.block_size else f"held by {block.ref_count} tables"
            raise ValueError(f"block {block_id}, slot {slot}: a position is written only into "
                             f"a block one table holds that is not full, and this one is {why}")
        block.tokens.append(token_id)
        block.keys.append(k)
        block.values.append(v)
        if len(block.tokens) == self.block_size:
            block.prefix = tuple(prefix)
            self.prefix_index.setdefault(block.prefix, []).append(block_id)

    def truncate(self, block_id, length):
        """Keep the first length positions of a block that one table holds."""
        block = self.block(block_id)
        model.check_int("length", length, 0, len(block.tokens))
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


def check_pool(pool, params):
    """Refuse anything but a BlockPool made for these very params."""
    if not isinstance(pool, BlockPool) or pool.params is not params:
        got = "one made for others" if isinstance(pool, BlockPool) else type(pool).__name__
        raise ValueError(f"pool must be a BlockPool made for these params, got {got}")


class PagedSequence(KVCache):
    """One sequence whose positions live in a BlockPool's blocks.

    To forward_step and prefill it is a cache like any other: tokens, keys and values read
    as lists over its positions, and new positions go into its last block or into new ones.
    A fork shares every block, the partly filled last one too, until one of them writes
    there: then the writer first takes a copy of it (copy on write). Its room is its pool's
    (room_owner)."""

    def __init__(self, pool, computed_by=None):
        self.pool, self.params, self.columns = pool, pool.params, pool.columns
        self.computed_by = computed_by   # how its rows are computed (BlockPool.sequence)
        self.table = []        # block ids, in position order
        self.length = 0        # positions held: all of the table's blocks but the last,
        self.freed = False     # and the first length % block_size of the last (or all)

    @property
    def room_owner(self):
        return self.pool

    def check_computed_by(self, kernel):
        """Refuse rows computed otherwise than this sequence's (BlockPool.sequence)."""
        if kernel is not self.computed_by:
            held, given = (getattr(k, "__name__", repr(k)) if k else "the exact arithmetic"
                           for k in (self.computed_by, kernel))
            raise ValueError(f"this paged sequence is for rows computed by {held}, and these "
                             f"would be computed by {given}: its pool finds a full block again "
                             f"only for a sequence computed alike; start one for {given} with "
                             f"pool.sequence(ids, computed_by={kernel and given})")

    def _check_live(self):
        if self.freed:
            raise ValueError("this sequence was freed and its blocks returned to the pool; "
                             "start a new one with pool.sequence()")

    def _held(self, part):
        self._check_live()
        return [item for block_id in self.table
                for item in getattr(self.pool.blocks[block_id], part)][:self.length]

    tokens = property(lambda self: self._held("tokens"))   # read as lists over positions
    keys = property(lambda self: self._held("keys"))
    values = property(lambda self: self._held("values"))

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

    def room_left(self):
        """What limits the positions the sequence can keep, in words."""
        return (f"its pool has {self.pool.free_blocks()} of its {len(self.pool.blocks)} blocks "
                f"of {self.pool.block_size} positions free; free a sequence or make a larger "
                f"pool")

    def extend(self, token_ids, keys, values):
        """Keep several more positions: the last block first, then new blocks.

        A block that fills up joins the prefix index. Before writing into its last block the
        sequence makes it its own: a copy if another table holds it too, or cut to its own
        positions if a crop left it longer. Refused, with nothing changed, when the pool
        lacks the blocks."""
        check_positions(token_ids, keys, values)
        pool = self.pool
        pool.check_room([(self, len(token_ids))])
        if token_ids and self._room_in_last_block():
            kept, last = self._in_last_block(), pool.blocks[self.table[-1]]
            if self._last_block_is_shared():
                copied = pool.take(last.tokens[:kept], last.keys[:kept], last.values[:kept],
                                   self.computed_by)
                pool.release(self.table[-1])
                self.table[-1] = copied
            elif len(last.tokens) > kept:
                pool.truncate(self.table[-1], kept)
        tokens = self.tokens
        for token_id, k, v in zip(token_ids, keys, values):
            if not self._room_in_last_block():
                self.table.append(pool.take(computed_by=self.computed_by))
            tokens.append(token_id)
            pool.append(self.table[-1], token_id, k, v, tokens)
            self.length += 1

    def copy(self):
        """A fork: a new sequence holding the same blocks, each shared until written."""
        self._check_live()
        fork = PagedSequence(self.pool, self.computed_by)
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
        """End the sequence, giving its blocks back to the pool.

        A block goes back unless another table holds it (the last block first). Freeing it
        again does nothing."""
        if not self.freed:
            self._forget_from(0)
            self.freed = True


# ---- the experiment (a stage of trace_kv.py) --------------------------------------

# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
LAYOUTS = dict.fromkeys(("static, 64 per story", "blocks of 4", "blocks of 8", "blocks of 16"),
                       svg.COUNT)   # a figure for each way of reserving slots
RECORDS = {
    "paged": {
        "positions_held": svg.COUNT, "slots_reserved": LAYOUTS, "wasted_share": LAYOUTS,
        "prefix_sharing_blocks_of_4": dict.fromkeys(
            ("blocks_shared", "prompt_rows_without_sharing", "prompt_rows_with_sharing",
             "greedy_identical"), svg.COUNT)},
}


def experiment(lab, runs):
    """Count the slots a cache reserves for the 60 greedy stories, and share prefixes.

    Slots: one per position held, a whole context per story (a static cache), or whole
    blocks; then the openings prefilled into one pool of blocks of 4, sharing full blocks of
    common prefixes, continued greedily."""
    params, tok, prompts = lab.params, lab.tok, lab.prompts
    # A story's cache holds every position but the last chosen token, never fed back.
    held = [len(story_ids(tok, p, r)) - 1 for p, r in zip(prompts, runs.greedy)]
    reserved = {"static, 64 per story": model.CONTEXT * len(held)}
    reserved.update({f"blocks of {size}": sum(math.ceil(n / size) * size for n in held)
                     for size in BLOCK_SIZES})
    pool = BlockPool(params, (model.CONTEXT // 4 + 1) * len(prompts), 4)   # a context each, and a copy
    rows_without = rows_with = shared = identical = 0
    for prompt, result in zip(prompts, runs.greedy):
        ids = tok.encode(prompt)
        seq = pool.sequence(ids)
        shared += len(seq.table)
        rows_without += len(ids)
        rows_with += len(feed(params, seq, ids))
        identical += generate_cached(params, tok, prompt, cache=seq) == result
    return {"positions_held": sum(held), "slots_reserved": reserved,
            "wasted_share": {way: round(1 - sum(held) / slots, 3)
                             for way, slots in reserved.items()},
            "prefix_sharing_blocks_of_4": {
                "blocks_shared": shared, "prompt_rows_without_sharing": rows_without,
                "prompt_rows_with_sharing": rows_with, "greedy_identical": identical}}


# ---- what Part 2 shows of it (documents.py fills its marks) --------------------------

def slots_table(record, timing):
    """Section 16's table: the slots each way of reserving memory takes, and its waste."""
    labels, p = {"static, 64 per story": "a whole 64-position context per story (a static "
                                         "cache)"}, svg.checked(record, RECORDS)["paged"]
    return table(["how the cache reserves memory", "slots reserved", "wasted"],
                 [[labels.get(way, f"{way} positions"), shown(p["slots_reserved"][way]),
                   f"{p['wasted_share'][way]:.1%}"] for way in LAYOUTS])


def block_tables(record=None, timing=None, folder=LAB):
    """Draw section 16's picture of block tables from a real pool of blocks of 4.

    Not from the record: from folder's model, with one prompt fed, then a second that begins
    like it."""
    params, tok = generate.load_trained(folder)
    pool, named = BlockPool(params, 64, 4), {}
    for name, prompt in zip("AB", ("mia was sad. tom gave her a hug.", "mia was tired.")):
        named[name] = prompt, pool.sequence(tok.encode(prompt))
        feed(params, named[name][1], tok.encode(prompt))
    lines = ["block tables (sequences)", *(f"  {name}: {prompt!r}  ->  blocks "
                                          f"{', '.join(map(str, seq.table))}"
                                          for name, (prompt, seq) in named.items()),
             "BlockPool: blocks of 4 positions"]
    for block in sorted({block for _, seq in named.values() for block in seq.table}):
        tokens = ", ".join("space" if tok.vocab[t] == " " else tok.vocab[t]
                           for t in pool.blocks[block].tokens)
        held_by = " and ".join(name for name, (_, seq) in named.items() if block in seq.table)
        lines.append(f"  block {block}: {tokens:<24} refs {pool.ref_counts[block]}  "
                     f"(held by {held_by})")
    return ["```text", *lines, "```"]
