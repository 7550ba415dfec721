"""A layer whose cache is a state (Part 6, section 36): recurrent layers beside attention.

An attention layer keeps a key and a value for every position: its cache grows with the
sequence. A recurrent layer keeps one state a head, a head width by a head width of
numbers, and folds each new position into it, its gate g first:

    S_t = g_t S_{t-1} + k_t v_t^T        o_t = q_t S_t

g_t = sigmoid(h1 Wg + bg), in (0, 1), is how much of the state the position keeps, one a
head. That is Mamba-2's recurrence, a scalar decay a head (Dao and Gu, 2024,
arXiv:2405.21060: h_t = a_t h_{t-1} + B_t x_t, y_t = C_t h_t), gated linear attention with
one gate a head (GLA, arXiv:2312.06635), and Gated DeltaNet, Qwen3-Next's layer, without
its delta rule (arXiv:2412.06464). Each entry of a new state is one correctly rounded sum
of its two products, each output one dot product (updated, read), so the token-by-token
path and the full pass, the same operations in the same order, give the same floats.
Hybrids mix the kinds (recurrent_params.pattern_kinds): Jamba one attention layer to
seven Mamba layers, Qwen3-Next one to three Gated DeltaNet layers.

What a state saves: it is the same size at every length. What it loses: positions. The
keys and values of positions 0 to p - 1 serve any request that starts with those p
tokens, so a prefix cache shares any length; a state is the sum of all the positions
before it, and cannot be cut back. To resume at p, a server must have saved the state
there: it saves one every C positions (a checkpoint), and a request resumes from the last
one within the prefix it shares, at most its tokens less one (the last is computed for
its logits, as vLLM does). A request whose shared prefix holds none reuses nothing (vLLM
issue #40696). Going back, as speculative decoding's rollback does, asks the same: only
to a checkpoint.

Engines prefill a recurrent layer in chunks (Mamba-2's SSD algorithm, GLA's chunkwise
form): within a chunk, a masked matrix product with the decays, exps of differences of
the running sum of log g; between chunks, the state carried. The same mathematics in
another order: rows that differ in the last bits (measured, not called exact).
"""
import math
from itertools import accumulate
from os.path import commonprefix

import svg
from deep_model import (angles, attend, check_cache_step, columns_by_block, deep_ids, heads_of,
                        mlp_residual, output_logits, rotate)
from documents import shown, table
from instruments import largest_gap
from model import CONTEXT, VOCAB_SIZE, add, check_ids, check_int, dot, layernorm, linear
from recurrent_params import (REAL_CACHE, Checkpoint, check_checkpoint, check_params, init_params,
                              kv_numbers, pattern_kinds, real_caches, state_numbers, zero_state)


# ---- the recurrence, one head at a time ------------------------------------------------

def gates(h1, cols, block):
    """Each head's gate for a position, g = sigmoid(h1 Wg + bg): in (0, 1), or 0.0 or 1.0."""
    z = add(linear(h1, cols["Wg"]), block["bg"])
    return [1 / (1 + math.exp(-each)) if each >= 0 else math.exp(each) / (1 + math.exp(each))
            for each in z]


def updated(state, g, k, v):
    """One head's state after a position: S[a][b] = g S[a][b] + k[a] v[b], the gate first.

    Each entry one correctly rounded sum of its two products; a new list (none is changed
    in place, so a checkpoint may keep the old one)."""
    return [[dot((g, k_a), (s, v_b)) for s, v_b in zip(row, v)] for row, k_a in zip(state, k)]


def read(q, state):
    """One head's output, q S: output b is dot(q, column b of S)."""
    return [dot(q, column) for column in zip(*state)]


# ---- the full pass, and the chunked form engines prefill with ---------------------------

def forward(params, ids, chunk=None):
    """Next-token logits for every position of ids, layer by layer: the full pass.

    An attention layer as deep_model's (rotary q and k, each position attending to 0 to
    itself); a recurrent layer by its recurrence, position after position, or with chunk
    (an int) in the chunked form, chunk positions at a time (chunked)."""
    check_params(params)
    check_ids(ids)
    if chunk is not None:
        check_int("chunk", chunk, 1, None, " (positions a chunk)")
    shape = params["shape"]
    heads, d, _, group, scale = heads_of(shape)
    thetas, _ = angles(shape)
    block_cols, out_cols = columns_by_block(params)
    xs = [params["tok_emb"][token_id] for token_id in ids]
    for block, cols, kind in zip(params["blocks"], block_cols, shape["kinds"]):
        h1s = [layernorm(x0, block["ln1_g"], block["ln1_b"]) for x0 in xs]
        qs = [linear(h1, cols["Wq"]) for h1 in h1s]
        ks = [linear(h1, cols["Wk"]) for h1 in h1s]
        vs = [linear(h1, cols["Wv"]) for h1 in h1s]
        parts = [slice(head * d, (head + 1) * d) for head in range(heads)]
        mixed = [[] for _ in ids]
        if kind == "recurrent" and chunk:
            mixed = chunked(qs, ks, vs, [gates(h1, cols, block) for h1 in h1s],
                            zero_state(shape), chunk)
        elif kind == "recurrent":
            states = zero_state(shape)
            for i, h1 in enumerate(h1s):
                g = gates(h1, cols, block)
                states = [updated(states[head], g[head], ks[i][part], vs[i][part])
                          for head, part in enumerate(parts)]
                mixed[i] = [o for state, part in zip(states, parts)
                            for o in read(qs[i][part], state)]
        else:
            qs = [rotate(q, i, thetas) for i, q in enumerate(qs)]
            ks = [rotate(k, j, thetas) for j, k in enumerate(ks)]
            for i, q in enumerate(qs):
                for head, part in enumerate(parts):
                    kv = parts[head // group]                # the key-value head it reads
                    mixed[i] += attend(q[part], None, scale, [k_j[kv] for k_j in ks[:i + 1]],
                                       [v_j[kv] for v_j in vs[:i + 1]])[0]
        for i, x0 in enumerate(xs):
            xs[i] = mlp_residual(add(x0, linear(mixed[i], cols["Wo"])), block, cols)
    return [output_logits(params, x2, out_cols) for x2 in xs]


def chunked(qs, ks, vs, gs, states, size):
    """A recurrent layer's output at every position, size positions a chunk, as engines do.

    From each head's states before the first position. In a chunk that starts from state
    S, with b_i the running sum of log g over the chunk up to i: o_i = exp(b_i) q_i S plus
    the sum over j <= i of exp(b_i - b_j) (q_i . k_j) v_j (a masked, decayed matrix
    product); the state carried to the next chunk is exp(b_n) S plus the sum over j of
    exp(b_n - b_j) k_j v_j^T, n the chunk's last position."""
    d = len(qs[0]) // len(states)
    mixed = [[] for _ in qs]
    for start in range(0, len(qs), size):
        span = range(start, min(start + size, len(qs)))
        for h, part in enumerate(slice(h * d, (h + 1) * d) for h in range(len(states))):
            b = list(accumulate(math.log(gs[i][h]) for i in span))
            for n, i in enumerate(span):
                carried = [math.exp(b[n]) * o for o in read(qs[i][part], states[h])]
                scores = [math.exp(b[n] - b[m]) * dot(qs[i][part], ks[j][part])
                          for m, j in enumerate(span[:n + 1])]
                within = [dot(scores, column)
                          for column in zip(*[vs[j][part] for j in span[:n + 1]])]
                mixed[i] += add(carried, within)
            decays = [math.exp(b[-1] - b_j) for b_j in b]
            states[h] = [[math.exp(b[-1]) * s + dot([w * ks[j][part][a]
                                                     for w, j in zip(decays, span)],
                                                    [vs[j][part][c] for j in span])
                          for c, s in enumerate(row)] for a, row in enumerate(states[h])]
    return mixed


# ---- the cache: a state a recurrent layer, keys and values an attention layer ------------

class RecurrentCache:
    """What one sequence keeps: a state a recurrent layer, keys and values an attention layer.

    layers[L] is {"state": a head width x head width list a head}, the same size at every
    length, or {"keys": [...], "values": [...]}, a vector a position. With
    checkpoint_every C, what it holds after every C positions is kept too (a Checkpoint,
    in checkpoints by its length); crop goes back only to one of them, or to 0."""

    def __init__(self, params, checkpoint_every=None):
        check_params(params)
        if checkpoint_every is not None:
            check_int("checkpoint_every", checkpoint_every, 1, CONTEXT,
                      " (the positions between saved states; None saves none)")
        self.params, self.every, self.checkpoints = params, checkpoint_every, {}
        self.block_columns, self.out_columns = columns_by_block(params)
        self._hold(Checkpoint((), [{"state": zero_state(params["shape"])} if kind == "recurrent"
                                   else {"keys": [], "values": []}
                                   for kind in params["shape"]["kinds"]]))

    def _hold(self, checkpoint):
        """Hold what checkpoint holds (its lists copied: the cache appends to its own)."""
        self.tokens = list(checkpoint.tokens)
        self.layers = [{part: list(held) for part, held in layer.items()}
                       for layer in checkpoint.layers]

    def __len__(self):
        return len(self.tokens)

    def numbers(self, part):
        """The numbers the layers hold in part: "state" (every head's rows), "keys" or "values"."""
        return sum(len(row) for layer in self.layers for held in layer.get(part, [])
                   for row in (held if part == "state" else [held]))

    def keep(self, token_id, new):
        """Keep a step's token and each layer's new state, or key and value; then a checkpoint.

        Called once a step has computed every layer, so that nothing can fail after."""
        self.tokens.append(token_id)
        for layer, kept in zip(self.layers, new):
            if "state" in kept:
                layer["state"] = kept["state"]
            else:
                layer["keys"].append(kept["keys"])
                layer["values"].append(kept["values"])
        held = len(self.tokens)
        if self.every and held % self.every == 0:
            self.checkpoints[held] = self.checkpoint()

    def checkpoint(self):
        """What the cache holds now, as a Checkpoint (a state is shared: none is changed)."""
        return Checkpoint(tuple(self.tokens), [{part: list(held) for part, held in
                                                layer.items()} for layer in self.layers])

    def crop(self, length):
        """Go back to length positions: to a checkpoint the cache keeps, exactly, or to 0.

        A state cannot be undone: any other length is refused, the cache unchanged."""
        check_int("crop length", length, 0, len(self), " (the positions held)")
        if length == len(self):
            return
        if length and length not in self.checkpoints:
            raise ValueError(f"crop length {length}: a recurrent layer's state cannot go back "
                             f"to {length} positions; this cache holds the state after "
                             f"{len(self)} and checkpoints after {sorted(self.checkpoints)}: "
                             f"crop to one of those (or 0), or keep a checkpoint every "
                             f"position (checkpoint_every=1)")
        self._hold(self.checkpoints[length] if length else RecurrentCache(self.params).checkpoint())
        self.checkpoints = {n: kept for n, kept in self.checkpoints.items() if n <= length}

    @classmethod
    def resumed(cls, params, checkpoint, checkpoint_every=None):
        """A new cache holding what checkpoint holds, its checkpoints to come every C."""
        cache = cls(params, checkpoint_every)
        check_checkpoint(params, checkpoint)
        cache._hold(checkpoint)
        return cache


def check_step(params, cache, token_id, position):
    """Refuse, before anything is computed, a step that cannot be taken.

    What deep_model.forward_step refuses, in its order: a cache made for other params, a
    position out of order or past the table, a token outside the vocabulary."""
    check_cache_step(RecurrentCache, params, cache, token_id, position)


def forward_step(params, cache, token_id, position):
    """Next-token logits for token_id at position, the next one after the cache's.

    Runs it through every layer: a recurrent layer folds it into each head's state, gate
    first, and reads the new state; an attention layer reads every key and value held and
    its own. Once all are computed, the cache keeps the new states, keys and values.
    Refuses, before computing anything, what check_step refuses."""
    check_step(params, cache, token_id, position)
    shape = params["shape"]
    heads, d, _, group, scale = heads_of(shape)
    thetas, _ = angles(shape)
    x0 = params["tok_emb"][token_id]
    parts = [slice(head * d, (head + 1) * d) for head in range(heads)]
    new = []   # each layer's new state, or key and value
    for block, cols, kind, layer in zip(params["blocks"], cache.block_columns, shape["kinds"],
                                        cache.layers):
        h1 = layernorm(x0, block["ln1_g"], block["ln1_b"])
        q = linear(h1, cols["Wq"])
        k = linear(h1, cols["Wk"])
        v = linear(h1, cols["Wv"])
        mixed = []
        if kind == "recurrent":
            g = gates(h1, cols, block)
            states = [updated(layer["state"][head], g[head], k[part], v[part])
                      for head, part in enumerate(parts)]
            mixed = [o for state, part in zip(states, parts) for o in read(q[part], state)]
            new.append({"state": states})
        else:
            q, k = rotate(q, position, thetas), rotate(k, position, thetas)
            keys, values = layer["keys"] + [k], layer["values"] + [v]   # itself too
            for head, part in enumerate(parts):
                kv = parts[head // group]                    # the key-value head it reads
                mixed += attend(q[part], None, scale, [k_j[kv] for k_j in keys],
                                [v_j[kv] for v_j in values])[0]
            new.append({"keys": k, "values": v})
        x0 = mlp_residual(add(x0, linear(mixed, cols["Wo"])), block, cols)
    logits = output_logits(params, x0, cache.out_columns)
    cache.keep(token_id, new)   # every layer computed: nothing can go wrong now
    return logits


class CheckpointStore:
    """The checkpoints of the sequences a server has run, found by their tokens.

    Prefix caching for a model with recurrent layers: a request resumes from the longest
    checkpoint whose tokens start it, at most its tokens less one (vLLM computes the last
    for its logits: vllm/v1/core/kv_cache_manager.py)."""

    def __init__(self):
        self.found = {}   # a checkpoint's tokens -> the checkpoint

    def add(self, cache):
        """Keep every checkpoint cache holds (the first kept of the same tokens stays)."""
        for checkpoint in cache.checkpoints.values():
            self.found.setdefault(checkpoint.tokens, checkpoint)

    def find(self, ids):
        """The longest checkpoint whose tokens start ids, at most len(ids) - 1; None if none."""
        for length in range(len(ids) - 1, 0, -1):
            if tuple(ids[:length]) in self.found:
                return self.found[tuple(ids[:length])]
        return None


def greedy_story(params, store, prompt, new_tokens, checkpoint_every):
    """Continue prompt greedily by new_tokens, resuming from store's longest checkpoint.

    Every token of the story is fed, the last chosen too; then the cache's checkpoints join
    the store. Gives the story, the rows computed (from the checkpoint on) and the cache."""
    check_ids(prompt)
    check_int("new_tokens", new_tokens, 0)
    found = store.find(prompt)
    cache = (RecurrentCache(params, checkpoint_every) if found is None
             else RecurrentCache.resumed(params, found, checkpoint_every))
    story, rows = list(prompt), []
    while True:
        rows += [forward_step(params, cache, story[p], p) for p in range(len(cache), len(story))]
        if len(story) == len(prompt) + new_tokens:
            store.add(cache)
            return story, rows, cache
        story.append(max(range(VOCAB_SIZE), key=rows[-1].__getitem__))


# ---- the experiment (for a stage of trace_kv.py) --------------------------------------

CHUNKS = (4, 16, 64)        # 64: the whole story in one chunk, the parallel form
EVERY = (1, 4, 16, 32)      # checkpoint intervals; 32 is more than a prompt's 19 tokens
SHARED, OWN, NEW = 13, 6, 2  # a prefix all requests share, each its own, then generated


def tried_model():
    """The experiment's hybrid: Qwen3-Next's pattern on 4 layers, 4 heads, 1 kv head, width 16."""
    return init_params(pattern_kinds("qwen3-next", 4), 4, 1, 16, 0)


def prefix_requests(lab):
    """Four prompts: the first test story's first SHARED tokens, then a next story's first OWN."""
    stories = [lab.tok.encode(story) for story in lab.test[:5]]
    return [stories[0][:SHARED] + story[:OWN] for story in stories[1:]]


def attention_reuse(prompts):
    """The positions each prompt could reuse from those before it were every layer attention.

    The longest prefix it shares with an earlier one, at most its tokens less one."""
    return [min(len(prompt) - 1, max([len(commonprefix([prompt, earlier]))
                                      for earlier in prompts[:r]], default=0))
            for r, prompt in enumerate(prompts)]


def checkpoint_runs(params, prompts):
    """Serve prompts in turn through a CheckpointStore, once for each interval of EVERY.

    Each continued greedily by NEW tokens: the positions each reuses, the checkpoints
    stored and their numbers, and whether every row computed equals the full pass's."""
    full, runs = {}, []
    for every in EVERY:
        store, reused, equal = CheckpointStore(), [], True
        for prompt in prompts:
            story, rows, _ = greedy_story(params, store, prompt, NEW, every)
            reused.append(len(story) - len(rows))
            if tuple(story) not in full:
                full[tuple(story)] = forward(params, story)
            equal = equal and rows == full[tuple(story)][reused[-1]:]
        runs.append({"every": every, "positions_reused": reused,
                     "checkpoints_stored": len(store.found),
                     "numbers_stored": len(store.found) * state_numbers(params["shape"]),
                     "rows_equal_to_the_full_pass": equal})
    return runs


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
COUNTS = [svg.COUNT]
RECORDS = {"recurrent": {
    "positions": svg.COUNT, "kinds": [str], "rows_compared": svg.COUNT, "rows_equal": bool,
    "largest_logit_gap": svg.COUNT,
    "lengths": [{**dict.fromkeys(("length", "state_numbers", "kv_numbers"), svg.COUNT),
                 "formula": COUNTS}],
    "chunked": [{"chunk": svg.COUNT, "largest_logit_gap": svg.COUNT}],
    "prefix": {
        **dict.fromkeys(("shared", "prompt", "new_tokens"), svg.COUNT),
        "attention_reuse": COUNTS,
        "checkpoints": [{"every": svg.COUNT, "positions_reused": COUNTS,
                         "checkpoints_stored": svg.COUNT, "numbers_stored": svg.COUNT,
                         "rows_equal_to_the_full_pass": bool}]},
    "real_models": [REAL_CACHE]}}


def experiment(lab):
    """Run tried_model() along deep_ids(lab): rows, bytes, chunks, checkpoints, real models.

    Its rows fed token by token against the full pass (==); the numbers its states and
    its keys and values hold at several lengths, counted and by formula; the chunked
    form's largest gap from the token-by-token rows; prefix_requests served through
    checkpoints (checkpoint_runs), against what an attention-only cache could share."""
    ids, params = deep_ids(lab), tried_model()
    shape, cache, rows, lengths = params["shape"], RecurrentCache(params), [], []
    for position, token_id in enumerate(ids):
        rows.append(forward_step(params, cache, token_id, position))
        if len(cache) in (1, 16, len(ids)):
            lengths.append({"length": len(cache), "state_numbers": cache.numbers("state"),
                            "kv_numbers": cache.numbers("keys") + cache.numbers("values"),
                            "formula": [state_numbers(shape), kv_numbers(shape, len(cache))]})
    full, prompts = forward(params, ids), prefix_requests(lab)
    return {"positions": len(ids), "kinds": shape["kinds"], "rows_compared": len(rows),
            "rows_equal": rows == full, "largest_logit_gap": largest_gap(rows, full),
            "lengths": lengths,
            "chunked": [{"chunk": chunk, "largest_logit_gap": largest_gap(
                rows, forward(params, ids, chunk))} for chunk in CHUNKS],
            "prefix": {"shared": SHARED, "prompt": len(prompts[0]), "new_tokens": NEW,
                       "attention_reuse": attention_reuse(prompts),
                       "checkpoints": checkpoint_runs(params, prompts)},
            "real_models": real_caches()}


# ---- what Part 6 shows of it (documents.py fills its marks) --------------------------

def _entry(record):
    """The record's recurrent entry: what the tables read of it, checked as declared."""
    return svg.checked(record, {"recurrent": svg.picked(
        RECORDS["recurrent"], "kinds", "lengths", "prefix")})["recurrent"]


def lengths_table(record, timing):
    """Section 36's table of what the cache holds at each length: states, keys and values."""
    entry = _entry(record)
    kinds = entry["kinds"]
    rows = [[f"{held['length']:,}", f"{held['state_numbers']:,} ({held['formula'][0]:,})",
             f"{held['kv_numbers']:,} ({held['formula'][-1]:,})",
             svg.bytes_label(8 * (held["state_numbers"] + held["kv_numbers"]))]
            for held in entry["lengths"]]
    return table(["positions held", f"numbers the states of the {kinds.count('recurrent')} "
                  f"recurrent layers hold (by formula)", f"numbers the keys and values of "
                  f"the {kinds.count('attention')} attention layer hold (by formula)",
                  "bytes in all, as 8-byte floats"], rows)


def checkpoints_table(record, timing):
    """Section 36's table: the positions each request reuses, a checkpoint every C positions."""
    prefix = _entry(record)["prefix"]
    rows = [[f"every {run['every']:,} positions" if run["every"] > 1 else "every position",
             ", ".join(map(str, run["positions_reused"])),
             f"{run['checkpoints_stored']:,}", f"{run['numbers_stored']:,}",
             shown(run.get("rows_equal_to_the_full_pass") is True)]
            for run in prefix["checkpoints"]]
    rows.append(["none: attention layers alone", ", ".join(map(str, prefix["attention_reuse"])),
                 "—", "—", "—"])
    return table(["a checkpoint", "positions each request reuses", "checkpoints stored",
                  "numbers they hold", "rows equal to the full pass"], rows)
