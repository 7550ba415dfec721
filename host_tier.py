"""A host tier (Part 7, section 37): a second tier of blocks in the host's memory, so that
a block the pool would forget is copied out instead of dropped, and copied back when a
request needs it again, in place of recomputing its rows.

A pool of blocks forgets a full block when it needs the block for something else (it
evicts the least recently released: section 20). A preempted request's full blocks wait
on the free list for just that (section 21), and so do a finished request's. A
TieredPool copies such a block to its HostTier before it is taken; a new sequence whose
tokens the device no longer holds, but the tier does, gets the tier's copy loaded into a
free block instead of computing those rows again. A copy holds the very numbers the
block held, so a loaded block is the block a recompute would give, bit for bit, and
serve's results stay generate's. What the tier changes is work: rows recomputed become
bytes moved, blocks x the bytes a block.

A block moves as one or more buffers, each one copy on a real machine: laid out by
layer (a buffer for each layer's keys and one for its values, vLLM's older layout) it
takes 2 x layers copies; laid out as one block (every layer's keys and values side by
side, the layout vLLM 0.12 allocates when its offloading connector asks for it) it
takes one. The bytes are the same.
"""
import math
from collections import OrderedDict

import deep_model
import model
import serving
import svg
from documents import shown, table
from bandwidth import cache_bytes_per_token
from one_gpu import A100, MODELS, prefill_flops, prefill_seconds
from kv_cache import KVCache, feed
from paged import BlockPool

LAYOUTS = ("by layer", "one block")
BYTES_PER_NUMBER = 8   # the lab keeps 64-bit floats


def pack(layers, layout):
    """The buffers a block moves in, each a flat list of numbers: one copy each.

    layers holds, for each layer, (keys, values): a vector a position. "by layer": each
    layer's keys, then its values, a buffer each; "one block": all of them in one."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {model.excerpt(layout)}")
    buffers = [[x for vector in part for x in vector]
               for keys, values in layers for part in (keys, values)]
    return buffers if layout == "by layer" else [[x for buffer in buffers for x in buffer]]


def unpack(buffers, layout, positions, width):
    """The (keys, values) of each layer that pack laid out, width numbers a vector."""
    if layout == "one block":
        size = positions * width
        buffers = [buffers[0][start:start + size] for start in range(0, len(buffers[0]), size)]
    parts = [[buffer[p * width:(p + 1) * width] for p in range(positions)]
             for buffer in buffers]
    return [(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]


class HostTier:
    """Keep copies of full blocks in host memory, forgetting the least recently used.

    It holds at most blocks copies. A copy is found by the kernel that computed the block
    (None for the exact arithmetic) and its prefix, the tokens from position 0 to its end,
    as the pool's prefix index finds a block. moved counts what went each way: blocks,
    copies (buffers) and bytes."""

    def __init__(self, blocks, layout="one block"):
        model.check_int("host blocks", blocks, 0, None, " (the blocks the host tier holds)")
        pack([], layout)   # the layout, checked
        self.blocks, self.layout = blocks, layout
        self.held = OrderedDict()   # (kernel, prefix) -> (tokens, buffers)
        self.moved = {way: {"blocks": 0, "copies": 0, "bytes": 0}
                      for way in ("to host", "to device")}

    def holds(self, kernel, prefix):
        """Whether the tier has a copy of the block of prefix computed by kernel."""
        return (kernel, prefix) in self.held

    def _count(self, way, buffers):
        moved = self.moved[way]
        moved["blocks"] += 1
        moved["copies"] += len(buffers)
        moved["bytes"] += BYTES_PER_NUMBER * sum(map(len, buffers))

    def store(self, kernel, prefix, tokens, layers):
        """Copy a block out (unless the tier holds it already, or holds nothing)."""
        key = (kernel, prefix)
        if not self.blocks or key in self.held:
            return
        buffers = pack(layers, self.layout)
        self.held[key] = (list(tokens), buffers)
        self._count("to host", buffers)
        if len(self.held) > self.blocks:
            self.held.popitem(last=False)

    def load(self, kernel, prefix, width):
        """Copy a block back: (its tokens, its layers' keys and values)."""
        key = (kernel, prefix)
        tokens, buffers = self.held[key]
        self.held.move_to_end(key)
        self._count("to device", buffers)
        return list(tokens), unpack(buffers, self.layout, len(tokens), width)


class TieredPool(BlockPool):
    """A BlockPool with a HostTier of host_blocks blocks beneath it.

    A full block about to be taken for something else (evicted) is copied to the tier
    first; a new sequence whose prefix goes on in the tier, where the device has forgotten
    it, gets those blocks loaded into free blocks (each found by its kernel too), then
    begins as BlockPool.sequence begins. Everything else is BlockPool's."""

    def __init__(self, params, blocks, block_size, host_blocks, layout="one block"):
        self.host = HostTier(host_blocks, layout)
        super().__init__(params, blocks, block_size)

    def take(self, tokens=(), keys=(), values=(), computed_by=None):
        """BlockPool.take, copying the block it evicts (if it does) to the host tier."""
        evicted = self.blocks[next(iter(self.free_list))] if self.free_list else None
        if evicted is not None and evicted.prefix is not None:
            kept = (evicted.computed_by, evicted.prefix, evicted.tokens,
                    [(evicted.keys, evicted.values)])
        else:
            kept = None
        block_id = super().take(tokens, keys, values, computed_by)   # refused: nothing moved
        if kept:
            self.host.store(*kept)
        return block_id

    def sequence(self, ids=(), computed_by=None):
        """Start a new sequence as BlockPool.sequence does, after loading blocks from the tier.

        The blocks loaded are those of ids the tier holds and the device does not, while
        blocks are free."""
        if not isinstance(ids, (list, tuple)):
            return super().sequence(ids, computed_by)   # which refuses it
        if ids:
            model.check_ids(ids)
        held = self._load_prefix(ids, computed_by)
        try:
            return super().sequence(ids, computed_by)
        finally:
            for block_id in held:
                self.release(block_id)

    def _load_prefix(self, ids, computed_by):
        """Hold each block of the longest prefix of ids on the device or in the tier, loading
        the tier's; give their ids (held once each, so that no load evicts them)."""
        held = []
        for end in range(self.block_size, len(ids) + 1, self.block_size):
            prefix = tuple(ids[:end])
            found = self.find(ids[:end], computed_by)
            if len(found) == end // self.block_size:
                self.share(found[-1])
                block_id = found[-1]
            elif self.host.holds(computed_by, prefix) and self.free_blocks():
                tokens, [(keys, values)] = self.host.load(computed_by, prefix, model.WIDTH)
                block_id = self.take(tokens, keys, values, computed_by)
                self.blocks[block_id].prefix = prefix
                self.prefix_index.setdefault(prefix, []).append(block_id)
            else:
                break
            held.append(block_id)
        return held


# ---- when loading pays, on real hardware --------------------------------------------

# Links a tier is read over, one way. NVIDIA's A100 data sheet lists "PCIe Gen4: 64GB/s",
# both directions together: 32 GB/s each way. An SGLang user's file tier (HiCache's file
# backend, sglang #26886) read at more than 1,200 MB/s (iostat), once set to write-through
# with a smaller host tier.
LINKS = ({"link": "host memory over PCIe 4.0 x16", "bytes_per_second": 32e9},
         {"link": "a file tier at 1.2 GB/s", "bytes_per_second": 1.2e9})


def load_seconds(real_model, tokens, link):
    """Give the least time loading the cache of tokens tokens over link takes.

    Its bytes (cache_bytes_per_token, 2 bytes a number) at the link's bandwidth."""
    model.check_int("tokens", tokens, 1)
    return tokens * cache_bytes_per_token(real_model) / link["bytes_per_second"]


def recompute_seconds(real_model, tokens, gpu=A100):
    """Give the least time recomputing the cache of tokens tokens takes on a busy gpu.

    Its prefill's FLOPs (one_gpu.prefill_flops) at the GPU's peak rate: the best case for
    recomputing, in a server whose step reads the weights for other requests anyway.
    Alone on the GPU a prefill also reads every weight (one_gpu.prefill_seconds)."""
    return prefill_flops(real_model, tokens) / gpu["flops_per_second"]


def loading_pays_from(real_model, link, gpu=A100):
    """Give the shortest prompt from which loading its cache beats recomputing it.

    Over link, on gpu, at every longer prompt up to the model's context window; None if
    no prompt within it does. A prefill's FLOPs grow as a n^2 + b n + c
    (one_gpu.prefill_flops: attention's a n^2), a load's bytes as n; loading beats
    recomputing past the larger root of their difference, found here and then settled on
    whole tokens by comparing the two."""
    rate, per_token = gpu["flops_per_second"], cache_bytes_per_token(real_model)
    f1, f2, f3 = (prefill_flops(real_model, n) for n in (1, 2, 3))
    a = (f3 - 2 * f2 + f1) / 2
    b = f2 - f1 - 3 * a - rate * per_token / link["bytes_per_second"]
    c = f1 - (f2 - f1 - 3 * a) - a
    disc = b * b - 4 * a * c
    n = 1 if disc < 0 else max(1, math.floor((-b + math.sqrt(disc)) / (2 * a)) + 1)
    pays = lambda tokens: load_seconds(real_model, tokens, link) < recompute_seconds(
        real_model, tokens, gpu)
    while n > 1 and pays(n - 1):
        n -= 1
    while not pays(n):
        n += 1
    return n if n <= real_model["context_window"] else None


def loading_wins_alone_up_to(real_model, link, gpu=A100):
    """Give the longest prompt up to which loading its cache beats a prefill alone on gpu.

    A prefill alone takes its FLOPs at the peak rate or its bytes (every weight, once) at
    the memory's bandwidth, whichever is longer (one_gpu.prefill_seconds), so a short
    prefix recomputes no faster than the weights are read. Loading wins at every length
    from 1 to the one given (0: not even at 1); None if it wins at every length within the
    context window (as it does wherever loading_pays_from gives 1)."""
    if loading_pays_from(real_model, link, gpu) == 1:
        return None
    n = 0
    while load_seconds(real_model, n + 1, link) < prefill_seconds(real_model, n + 1, gpu):
        n += 1
    return n


# ---- the experiment (a stage of trace_kv.py) ---------------------------------------

HOST_BLOCKS = (16, 512)   # host tiers beneath section 21's small pool: small, and ample
DEEP_LAYERS = 4           # the deeper model whose block is packed in each layout
LAYOUT_MODELS = ("the lab's", "a deeper one")

# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
_MOVED = {"blocks": svg.COUNT, "copies": svg.COUNT, "bytes": svg.COUNT}
RECORDS = {
    "host_tier": {
        "requests": svg.COUNT, "device_blocks": svg.COUNT,
        "tiers": [{
            "host_blocks": svg.COUNT, "steps": svg.COUNT, "rows": svg.COUNT,
            "recomputed_rows": svg.COUNT, "preemptions": svg.COUNT,
            "to_host": _MOVED, "to_device": _MOVED, "identical": svg.COUNT}],
        "layouts": [{
            "model": str, "layers": svg.COUNT, "layout": str, "copies_a_block": svg.COUNT,
            "numbers_a_block": svg.COUNT, "unpacked_equal": bool}],
        "loading_pays": [{
            "model": str, "link": str, "load_us_per_token": svg.COUNT,
            "recompute_us_at_1": svg.COUNT, "from_tokens": (*svg.COUNT, None),
            "alone_up_to_tokens": (*svg.COUNT, None)}]},
}


def _layout_rows(name, layers):
    """For one block's layers, (keys, values) each: copies and numbers in each layout."""
    rows = []
    for layout in LAYOUTS:
        buffers = pack(layers, layout)
        rows.append({"model": name, "layers": len(layers), "layout": layout,
                     "copies_a_block": len(buffers),
                     "numbers_a_block": sum(map(len, buffers)),
                     "unpacked_equal": unpack(buffers, layout, len(layers[0][0]),
                                              len(layers[0][0][0])) == layers})
    return rows


def experiment(lab, runs, many):
    """Serve section 21's 120 requests from its small pool with a host tier beneath it.

    For each of HOST_BLOCKS: what serving did, the blocks, copies and bytes moved each way,
    and how many results are generate's (the tier of 0 blocks is many_requests' small
    pool). Then a block of 4 positions packed in each layout, on the lab's model and on a
    deeper one of DEEP_LAYERS layers; and when loading pays for the real models over
    LINKS on an A100."""
    requests = ([{"prompt": prompt} for prompt in lab.prompts]   # section 21's, in its order
                + [{"prompt": prompt, "temperature": 1.0, "seed": index}
                   for index, prompt in enumerate(lab.prompts)])
    results = runs.greedy + runs.sampled
    small = many["small pool"]
    tiers = [{"host_blocks": 0, **{key: small[key] for key in (
        "steps", "rows", "recomputed_rows", "preemptions")},
        "to_host": dict.fromkeys(_MOVED, 0), "to_device": dict.fromkeys(_MOVED, 0),
        "identical": small["identical"]}]
    for host_blocks in HOST_BLOCKS:
        pool = TieredPool(lab.params, serving.SMALL_POOL, 4, host_blocks)
        served, counts = serving.serve(lab.params, lab.tok, requests, pool, serving.MAX_BATCH)
        tiers.append({"host_blocks": host_blocks, **{key: counts[key] for key in (
            "steps", "rows", "recomputed_rows", "preemptions")},
            "to_host": pool.host.moved["to host"], "to_device": pool.host.moved["to device"],
            "identical": sum(a == b for a, b in zip(served, results))})
    ids = lab.tok.encode(lab.prompts[0])[:4]
    lesson = KVCache(lab.params)
    feed(lab.params, lesson, ids)
    deep = deep_model.DeepCache(deep_model.init_params(DEEP_LAYERS, 4, 2, 16, 0))
    for position, token_id in enumerate(ids):
        deep_model.forward_step(deep.params, deep, token_id, position)
    layouts = (_layout_rows(LAYOUT_MODELS[0], [(lesson.keys, lesson.values)])
               + _layout_rows(LAYOUT_MODELS[1], [(layer["keys"], layer["values"])
                                                  for layer in deep.layers]))
    loading = [{"model": real["model"], "link": link["link"],
                "load_us_per_token": load_seconds(real, 1, link) * 1e6,
                "recompute_us_at_1": recompute_seconds(real, 1) * 1e6,
                "from_tokens": loading_pays_from(real, link),
                "alone_up_to_tokens": loading_wins_alone_up_to(real, link)}
               for real in MODELS for link in LINKS]
    return {"requests": len(requests), "device_blocks": serving.SMALL_POOL, "tiers": tiers,
            "layouts": layouts, "loading_pays": loading}


# ---- what Part 7 shows of it (documents.py fills its marks) --------------------------

def tiers_table(record, timing):
    """Section 37's table: section 21's small pool with host tiers of each size beneath it."""
    h = svg.checked(record, {"host_tier": RECORDS["host_tier"]})["host_tier"]
    return table(["host tier (blocks of 4)", "rows", "rows recomputed", "blocks copied to the "
                  "host", "blocks loaded back", "bytes moved, both ways", "steps",
                  "identical to `generate`"],
                 [[shown(t["host_blocks"]) if t["host_blocks"] else "none (section 21)",
                   shown(t["rows"]), shown(t["recomputed_rows"]),
                   shown(t["to_host"]["blocks"]), shown(t["to_device"]["blocks"]),
                   shown(t["to_host"]["bytes"] + t["to_device"]["bytes"]), shown(t["steps"]),
                   f"**{t['identical']} of {h['requests']}**"] for t in h["tiers"]])


def bytes_a_block(record, timing):
    """The bytes each block moved to the host took, in the tiers' run (one figure)."""
    tier = svg.checked(record, {"host_tier": RECORDS["host_tier"]})["host_tier"]["tiers"][-1][
        "to_host"]
    if not tier["blocks"]:
        raise ValueError("the record's host_tier.tiers: its last tier moved no block to the "
                         "host")
    return shown(tier["bytes"] // tier["blocks"])


def layouts_table(record, timing):
    """Section 37's table of layouts: the copies and bytes of one block of 4 positions."""
    rows = svg.checked(record, {"host_tier": RECORDS["host_tier"]})["host_tier"]["layouts"]
    for i, row in enumerate(rows):
        if row["model"] not in LAYOUT_MODELS or row["layout"] not in LAYOUTS:
            raise ValueError(f"the record's host_tier.layouts[{i}] must be of a model of "
                             f"{LAYOUT_MODELS} and a layout of {LAYOUTS}")
    return table(["model", "layers", "layout", "copies a block", "bytes a block",
                  "unpacked as packed"],
                 [[row["model"], shown(row["layers"]), row["layout"],
                   shown(row["copies_a_block"]),
                   shown(BYTES_PER_NUMBER * row["numbers_a_block"]),
                   shown(row["unpacked_equal"])] for row in rows])


def loading_table(record, timing):
    """Section 37's table: when loading a prefix's cache beats recomputing it, on an A100."""
    def where(row, context):
        if row["from_tokens"] == 1:
            return "from the first token"
        if row["from_tokens"] is None:
            return f"never within its {context:,} tokens"
        return f"from {shown(row['from_tokens'])} tokens (of {context:,})"
    rows = svg.checked(record, {"host_tier": RECORDS["host_tier"]})["host_tier"]["loading_pays"]
    models, links = {real["model"]: real for real in MODELS}, [link["link"] for link in LINKS]
    for i, row in enumerate(rows):
        if row["model"] not in models or row["link"] not in links:
            raise ValueError(f"the record's host_tier.loading_pays[{i}] must be of a model of "
                             f"{list(models)} and a link of {links}")
    return table(["model (cache a token)", "link", "loading a token, µs",
                  "recomputing a one-token prefix, busy GPU, µs",
                  "loading beats recomputing, busy GPU",
                  "alone on the GPU, loading also wins"],
                 [[f"{row['model']} ({cache_bytes_per_token(models[row['model']]) // 1024} "
                   f"KiB)", row["link"], shown(row["load_us_per_token"]),
                   shown(row["recompute_us_at_1"]),
                   where(row, models[row["model"]]["context_window"]),
                   "at every length" if row["alone_up_to_tokens"] is None else
                   f"up to {shown(row['alone_up_to_tokens'])} tokens"] for row in rows])


def tiers_picture(record, timing):
    """Draw section 37's picture: rows recomputed and bytes moved, by the tier's size.

    One bar a tier of the record, each panel from 0 (the tier of 0 blocks has no bytes)."""
    tiers = svg.checked(record, {"host_tier": RECORDS["host_tier"]})["host_tier"]["tiers"]
    if not tiers:
        raise ValueError("the record's host_tier.tiers has no tier to draw")
    panels = (("rows recomputed", [t["recomputed_rows"] for t in tiers], svg.COLORS[0], False),
              ("bytes moved, both ways", [t["to_host"]["bytes"] + t["to_device"]["bytes"]
                                          for t in tiers], svg.COLORS[1], True))
    body = []
    for left, (name, values, color, in_bytes) in zip((90, 450), panels):
        yticks = (svg.byte_ticks if in_bytes else svg.ticks)(max(4, *values))
        panel = svg.Panel((left, 50, 250, 270), (0, len(tiers)), (0, yticks[-1]))
        body += panel.axes([], yticks, "blocks in the host tier", name,
                           ylabels=svg.bytes_label if in_bytes else None)
        for i, (tier, value) in enumerate(zip(tiers, values)):
            body.append(svg.text(panel.x(i + 0.5), panel.y(0) + 16, f"{tier['host_blocks']:,}",
                                 11, "middle"))
            body.append(panel.bar(i + 0.2, 0, i + 0.8, value, color,
                                  f"a tier of {tier['host_blocks']:,} blocks: {value:,} {name}"))
    return svg.page("A host tier: rows recomputed become bytes moved", body)
