"""One pool for a hybrid model's cache (Part 6): full layers and window layers keep their
keys and values in numbered blocks of one pool, each group of like layers with its own
block table, as vLLM's hybrid KV cache manager keeps them.

The model's shape gives each layer's window (deep_params.layer_windows): a window layer of
window W reads at position n only positions n - W + 1 to n (model.band), a full layer all
of them (model.causal), and a layer that reads another's cache (kv_from) keeps none. vLLM
cuts each kind's layers that keep a cache into groups of as many layers as the rarest
kind has, so that a block of any group is one page of the same bytes
(https://github.com/vllm-project/vllm/blob/main/docs/design/hybrid_kv_cache_manager.md).
A block of a group holds, for its block_size positions, every layer of that group's keys
and values; a group's block table lists its blocks in position order.

Freeing. After each step, with n positions computed, the next row of a window layer reads
from n - W + 1 on. vLLM's SlidingWindowManager (vllm/v1/core/single_type_kv_cache_manager.py,
remove_skipped_blocks) frees a window group's blocks before last_useful_token // block_size,
where last_useful_token = n - W + 1, and puts a null entry (None here) in the table. A full
group frees nothing until its sequence ends. A pool that keeps every block and only masks
(frees=False) gives the same rows and holds the blocks of every position: what llama.cpp did
for Gemma's window layers until its SWA cache
(https://github.com/ggml-org/llama.cpp/issues/12637, fixed by pull request 13194).

Prefix hits. A full block stays findable by its group and the tokens up to its end, on the
free list too, until a new block is needed and it is taken (the least recently freed
first). A request reuses L positions, a multiple of block_size and at most its tokens but
one (the last is computed for its logits: vllm/v1/core/kv_cache_manager.py), if each full
group holds every block before L and each window group the blocks of positions L - W + 1
to L - 1 (those before may be freed). vLLM's HybridKVCacheCoordinator
(vllm/v1/core/kv_cache_coordinator.py) finds the longest: the full groups scanned left to
right, to the first block one lacks; then, within that, the window groups right to left,
until ceil((W - 1) / block_size) blocks in a row are held.

To deep_model.forward_step a sequence of the pool is a DeepCache like any other, and its
rows equal deep_model.forward with each layer's own mask, bit for bit.
"""
import math
from collections import OrderedDict, namedtuple

import svg
from deep_model import DeepCache, deep_ids, forward, forward_step, layer_masks, own_mask
from deep_params import kv_layers, layer_windows
from documents import shown, table
from hybrid import WINDOW, tried_models
from model import CONTEXT, check_ids, check_int, excerpt
from paged import MAX_BLOCKS, NumberedBlocks

Group = namedtuple("Group", "window layers")   # window None: a group of full layers


def layer_groups(shape):
    """Cut the layers a model's cache keeps into groups of like layers, as vLLM does.

    shape is a model's (params["shape"]): its windows and kv_from. A layer that reads
    another's cache keeps none and is in no group (vLLM allocates nothing for it). Each
    kind's layers in order (full layers first), in groups of as many layers as the rarest
    kind has; the last of a kind may hold fewer (vLLM pads it to the same page)."""
    windows = layer_windows(shape)
    keeping = [layer for layer, read in enumerate(kv_layers(shape)) if read == layer]
    kinds = sorted({windows[layer] for layer in keeping}, key=lambda kind: kind is not None)
    by_kind = [[layer for layer in keeping if windows[layer] == kind] for kind in kinds]
    size = min(map(len, by_kind))
    return [Group(kind, layers[start:start + size]) for kind, layers in zip(kinds, by_kind)
            for start in range(0, len(layers), size)]


class Block:
    """One block of the pool: tokens, keys and values of up to block_size positions.

    keys[layer] and values[layer] hold a vector a position for every layer of the block's
    group. It counts the tables holding it; once full, its prefix is (its group, the tokens
    of every position up to its end), under which the pool finds it again."""

    def __init__(self):
        self.tokens, self.keys, self.values = [], {}, {}
        self.ref_count, self.prefix = 0, None


class HybridPool(NumberedBlocks):
    """Keep the keys and values of a hybrid model's sequences in one pool of numbered blocks.

    The model's shape gives each layer's window (window: that of its window layers, None
    if none); groups are layer_groups'. The pool alone takes, shares and releases blocks
    and counts the tables holding each; a full block nobody holds stays findable on the
    free list until it is taken again (paged.NumberedBlocks). frees=False keeps every
    block of a window group (only the mask hides them)."""

    def __init__(self, params, blocks, block_size, frees=True):
        by_columns = DeepCache(params)   # checks the params; its matrices by columns
        shape = params["shape"]
        if shape["latent"]:
            raise ValueError("params: a latent model keeps latents, not keys and values; "
                             "this pool holds keys and values")
        sizes = sorted(set(layer_windows(shape)) - {None})
        if len(sizes) > 1:
            raise ValueError(f"params: the model's windows are of {sizes} positions, and "
                             f"this pool takes one window size (full layers and one kind of "
                             f"window layer, as vLLM's simple hybrid)")
        self.groups = layer_groups(shape)
        check_int("blocks", blocks, len(self.groups), MAX_BLOCKS,
                  f" (a position takes a block in each of the {len(self.groups)} groups; each "
                  f"block is made with the pool)")
        check_int("block_size", block_size, 1, CONTEXT, " (the model's positions)")
        if not isinstance(frees, bool):
            raise ValueError(f"frees must be True or False, got {excerpt(frees)}")
        self.params, self.block_size, self.frees = params, block_size, frees
        self.masks = layer_masks(own_mask(shape), shape["layers"], 0)
        self.window = sizes[0] if sizes else None
        self.block_columns, self.out_columns = by_columns.block_columns, by_columns.out_columns
        self.blocks = [Block() for _ in range(blocks)]
        self.free_list = OrderedDict.fromkeys(range(blocks))   # the next one taken first
        self.prefix_index = {}   # (group, tokens 0 to a full block's end) -> its block id

    def page_bytes(self):
        """The bytes of one block, as 8-byte floats: vLLM's page.

        block_size positions x the layers of the largest group x a key and a value x the
        key-value heads x the head width."""
        shape = self.params["shape"]
        return (8 * self.block_size * max(len(group.layers) for group in self.groups) * 2
                * shape["kv_heads"] * (shape["width"] // shape["heads"]))

    def take(self):
        """Give a free block to one table, empty (a findable one taken leaves the index)."""
        self.check_free(1)
        block_id, _ = self.free_list.popitem(last=False)
        if self.blocks[block_id].prefix is not None:
            del self.prefix_index[self.blocks[block_id].prefix]
        self.blocks[block_id] = Block()
        self.blocks[block_id].ref_count = 1
        return block_id

    def _empty(self, block_id):
        self.blocks[block_id] = Block()

    def write(self, block_id, group, token_id, vectors, tokens):
        """Write one more position into a block of group: its token, keys and values.

        vectors[layer] holds each layer's key and value; tokens are its sequence's so far. A
        block that fills up is findable under (group, tokens), unless another block is
        there already."""
        block = self.blocks[block_id]
        block.tokens.append(token_id)
        for layer, new in vectors.items():
            block.keys.setdefault(layer, []).append(new["keys"])
            block.values.setdefault(layer, []).append(new["values"])
        prefix = (group, tuple(tokens))
        if len(block.tokens) == self.block_size and prefix not in self.prefix_index:
            block.prefix, self.prefix_index[prefix] = prefix, block_id

    def cached(self, group, ids, index):
        """The block of group holding block index of ids, findable in the pool, or None."""
        return self.prefix_index.get((group, tuple(ids[:(index + 1) * self.block_size])))

    def _held(self, groups, ids, index):
        """Each of groups' block holding block index of ids, or None if one lacks it."""
        found = [self.cached(group, ids, index) for group in groups]
        return None if None in found else found

    def find(self, ids):
        """Find the longest prefix of ids that every group holds, as vLLM finds it.

        Gives its length and each group's block table for it (None where a window group
        needs no block). At most len(ids) - 1 positions, whole blocks: the full groups
        scanned left to right, then the window groups within that (_window_hit)."""
        full = [g for g, group in enumerate(self.groups) if group.window is None]
        windowed = [g for g, group in enumerate(self.groups) if group.window is not None]
        hit = []
        for index in range(max(0, len(ids) - 1) // self.block_size):
            found = self._held(full, ids, index)
            if found is None:
                break
            hit.append(found)
        if windowed:
            window_hit = self._window_hit(ids, windowed, len(hit))
            hit = [found + (blocks or [None] * len(windowed))
                   for found, blocks in zip(hit, window_hit)]
        tables = [[] for _ in self.groups]
        for found in hit:
            for g, block_id in zip(full + windowed, found):
                tables[g].append(block_id)
        return len(hit) * self.block_size, tables

    def _window_hit(self, ids, groups, most):
        """The window groups' blocks of the longest hit of at most most blocks, a list a block.

        Scanned right to left until ceil((W - 1) / block_size) blocks in a row are held
        (SlidingWindowManager.find_longest_cache_hit); the blocks before them are not needed
        (None). With none such, the run held from block 0, if any. A window of 1 reads no
        earlier position: every length is a hit."""
        needed = math.ceil((self.window - 1) / self.block_size)
        found, run = [None] * most, 0
        if needed == 0:
            return found
        for index in range(most - 1, -1, -1):
            blocks = self._held(groups, ids, index)
            if blocks is None:
                run = 0
                continue
            found[index], run = blocks, run + 1
            if run >= needed:
                return found[:index + run]
        return found[:run]

    def sequence(self, ids=()):
        """Start a new sequence for ids on the longest prefix every group holds (find).

        It shares those blocks and holds their positions: feed it the rest of ids."""
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"ids must be a list of token IDs, got {type(ids).__name__}")
        if ids:
            check_ids(ids)
        length, tables = self.find(ids)
        for table in tables:
            for block_id in table:
                if block_id is not None:
                    self.share(block_id)
        return HybridSequence(self, ids[:length], tables)


class HybridSequence(DeepCache):
    """One sequence of a HybridPool: to deep_model.forward_step, a DeepCache like any other.

    tables[g] is group g's block table, None where a window group freed a block. Its
    layers read as lists over its positions (None where freed, so that a read of one
    fails); keep writes a step's keys and values into each group's last block, then frees
    what the windows left behind."""

    def __init__(self, pool, tokens, tables):
        self.pool, self.params, self.mask = pool, pool.params, pool.masks
        self.block_columns, self.out_columns = pool.block_columns, pool.out_columns
        self.tokens, self.tables, self.freed = list(tokens), tables, False

    def _check_live(self):
        if self.freed:
            raise ValueError("this sequence was freed and its blocks returned to the pool; "
                             "start a new one with pool.sequence()")

    def __len__(self):
        self._check_live()
        return len(self.tokens)

    @property
    def layers(self):
        """Each layer's keys and values, lists over the positions held (None where freed)."""
        self._check_live()
        size, layers = self.pool.block_size, [{} for _ in self.mask]   # {}: reads another's
        for group, table in zip(self.pool.groups, self.tables):
            blocks = [None if block_id is None else self.pool.blocks[block_id]
                      for block_id in table]
            for layer in group.layers:
                layers[layer] = {part: [None if blocks[p // size] is None else
                                        getattr(blocks[p // size], part)[layer][p % size]
                                        for p in range(len(self.tokens))]
                                 for part in ("keys", "values")}
        return layers

    def positions_read(self, position):
        """The held positions each layer's row at position attends to: its mask's."""
        return [mask(position) for mask in self.mask]

    def blocks_held(self):
        """How many blocks each group's table holds (its entries but None)."""
        self._check_live()
        return [sum(block_id is not None for block_id in table) for table in self.tables]

    def keep(self, token_id, new):
        """Write a step's token and vectors (a dict a layer) into each group's last block.

        At a block's start, a new block for every group first: refused, with nothing
        changed, if the pool has not that many free. Then free_skipped."""
        self._check_live()
        pool = self.pool
        if len(self.tokens) % pool.block_size == 0:
            pool.check_free(len(self.tables))
            for table in self.tables:
                table.append(pool.take())
        self.tokens.append(token_id)
        for g, (group, table) in enumerate(zip(pool.groups, self.tables)):
            pool.write(table[-1], g, token_id, {layer: new[layer] for layer in group.layers},
                       self.tokens)
        self.free_skipped()

    def free_skipped(self):
        """Free the window groups' blocks that no later row reads, as vLLM does.

        As SlidingWindowManager.remove_skipped_blocks: with n positions computed, the next
        row reads from last_useful_token = n - W + 1 on, so the blocks before
        last_useful_token // block_size are released and their entries made None (vLLM's
        null block), back to one already None. Not in a full group, nor in a pool that
        keeps every block."""
        pool = self.pool
        for group, table in zip(pool.groups, self.tables):
            if group.window is None or not pool.frees:
                continue
            last_useful_token = len(self.tokens) - group.window + 1
            for index in range(last_useful_token // pool.block_size - 1, -1, -1):
                if table[index] is None:
                    break
                pool.release(table[index])
                table[index] = None

    def free(self):
        """End the sequence, giving its blocks back to the pool, each table's last first.

        A block goes back unless another table holds it. Freeing again does nothing."""
        if not self.freed:
            for table in self.tables:
                for block_id in reversed(table):
                    if block_id is not None:
                        self.pool.release(block_id)
            self.freed = True


def greedy_story(pool, prompt, new_tokens):
    """Continue prompt greedily by new_tokens through a new sequence of pool.

    The sequence starts on the pool's longest hit for prompt; every token of the story is
    fed, the last chosen too (so that a later request may find it). Gives the story, the
    rows computed (from the hit on) and the sequence."""
    check_ids(prompt)
    check_int("new_tokens", new_tokens, 0)
    seq, story, rows = pool.sequence(prompt), list(prompt), []
    while True:
        rows += [forward_step(pool.params, seq, story[p], p)
                 for p in range(len(seq), len(story))]
        if len(story) == len(prompt) + new_tokens:
            return story, rows, seq
        story.append(max(range(len(rows[-1])), key=rows[-1].__getitem__))


# ---- the experiment (for a stage of trace_kv.py) -------------------------------------

def freeing_against_keeping(params, ids, block_size):
    """Feed ids through a pool that frees window blocks and one that keeps every block.

    For each way: the blocks its window groups and its full groups hold after every step
    and at the end, the bytes of a block (a page of 8-byte floats), and whether every row
    equals deep_model.forward's with each layer's own mask (==)."""
    compared, rows = {}, {}
    for way, frees in (("freeing", True), ("keeping", False)):
        groups = layer_groups(params["shape"])
        pool = HybridPool(params, len(groups) * math.ceil(len(ids) / block_size), block_size,
                          frees)
        seq, held, rows[way] = pool.sequence(), [], []
        for position, token_id in enumerate(ids):
            rows[way].append(forward_step(params, seq, token_id, position))
            held.append(seq.blocks_held())
        by_kind = [[sum(n for n, group in zip(step, groups) if (group.window is None) == full)
                    for step in held] for full in (False, True)]
        compared[way] = {"window_blocks_by_step": by_kind[0],
                         "full_blocks_by_step": by_kind[1],
                         "window_blocks_at_the_end": by_kind[0][-1],
                         "full_blocks_at_the_end": by_kind[1][-1],
                         "page_bytes": pool.page_bytes()}
    masked = forward(params, ids, pool.masks)
    for way, result in compared.items():
        result["rows_equal_to_the_masked_pass"] = rows[way] == masked
    return compared


BLOCK_SIZE = 2   # against a window of 4 (hybrid.WINDOW), as 16 against gpt-oss's 128


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
WAYS = ("freeing", "keeping")
WAY = {"window_blocks_by_step": [svg.COUNT], "full_blocks_by_step": [svg.COUNT],
       **dict.fromkeys(("window_blocks_at_the_end", "full_blocks_at_the_end", "page_bytes"),
                       svg.COUNT),
       "rows_equal_to_the_masked_pass": bool}   # one way's figures, for one model
RECORDS = {"hybrid_pool": {
    **dict.fromkeys(("positions", "window", "block_size"), svg.COUNT),
    "models": dict.fromkeys(("gpt-oss", "gemma-3", "shared"), dict.fromkeys(WAYS, WAY))}}


def experiment(lab):
    """Compare freeing and keeping along deep_ids for each of hybrid.tried_models().

    gpt-oss's pattern (with sinks), Gemma 3's, and gpt-oss's with a shared tail; windows of
    hybrid.WINDOW, blocks of BLOCK_SIZE (freeing_against_keeping)."""
    ids = deep_ids(lab)
    return {"positions": len(ids), "window": WINDOW, "block_size": BLOCK_SIZE,
            "models": {name: freeing_against_keeping(params, ids, BLOCK_SIZE)
                       for name, params in tried_models()}}


# ---- what Part 6 shows of it (documents.py fills its marks) --------------------------

def _models(record):
    """The record's hybrid_pool models, checked as declared: {name: {way: its figures}}."""
    models = svg.checked(record, RECORDS)["hybrid_pool"]["models"]
    return {name: models[name] for name in RECORDS["hybrid_pool"]["models"]}


def bytes_at_the_end(way):
    """The bytes of the blocks a pool holds after the last position, one way's figures."""
    return (way["window_blocks_at_the_end"] + way["full_blocks_at_the_end"]) * way["page_bytes"]


def freeing_table(record, timing):
    """Section 35's table: each model's blocks and bytes held at the end, freeing or keeping.

    Freeing the window blocks that fell behind, or keeping them all."""
    rows = []
    for name, ways in _models(record).items():
        cells = [name]
        for way in WAYS:
            cells += [f"{ways[way]['window_blocks_at_the_end']:,}",
                      f"{ways[way]['full_blocks_at_the_end']:,}",
                      svg.bytes_label(bytes_at_the_end(ways[way]))]
        rows.append(cells + [shown(all(ways[way]["rows_equal_to_the_masked_pass"]
                                       for way in WAYS))])
    header = ["model"]
    for way in WAYS:
        header += [f"{way}: window blocks", "full blocks", "bytes"]
    return table(header + ["rows equal to the masked pass, both ways"], rows)


def blocks_picture(record, timing):
    """Section 35's picture: the blocks each model's pool holds after each position.

    Freeing its window blocks (solid) or keeping them all (dashed)."""
    models = _models(record)
    steps = max(len(ways[way]["window_blocks_by_step"]) for ways in models.values()
                for way in WAYS)
    held = {(name, way): [w + f for w, f in zip(ways[way]["window_blocks_by_step"],
                                               ways[way]["full_blocks_by_step"])]
            for name, ways in models.items() for way in WAYS}
    most = max(max(blocks) for blocks in held.values())
    xticks, yticks = svg.ticks(steps), svg.ticks(max(most, 1))
    panel = svg.Panel((90, 50, 360, 290), (0, xticks[-1]), (0, yticks[-1]))
    body = panel.axes(xticks, yticks, "positions fed", "blocks the pool holds")
    entries = []
    for i, ((name, way), blocks) in enumerate(held.items()):
        color, marker = svg.style(i)
        chosen = sorted({*range(0, len(blocks), 8), len(blocks) - 1})
        body += panel.line([(n + 1, blocks[n], f"{name}, {way}: {blocks[n]:,} blocks after "
                                               f"{n + 1} positions") for n in chosen],
                           color, way == "keeping", marker)
        entries.append((f"{name}, {way}", color, marker, way == "keeping"))
    below = 70 + 18 * len(entries) + 4
    notes = [f"blocks of {record['hybrid_pool']['block_size']} positions;",
             "solid: window blocks behind the", "window freed; dashed: kept"]
    return svg.page("A pool that frees its window layers' old blocks holds a fraction",
                    body + svg.legend(480, 70, entries, 11)
                    + [svg.text(480, below + 18 * i, note, 11) for i, note in enumerate(notes)],
                    height=max(svg.HEIGHT, below + 18 * len(notes)))
