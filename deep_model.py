"""A deeper model, for what the lesson's one-block, one-head model can only describe:
several blocks (layers), several attention heads, and grouped-query attention, where
several query heads share one key-value head (kv_heads = heads is plain multi-head
attention, kv_heads = 1 multi-query attention). Random weights, no training: enough to
show that its cache, one list of keys and values per layer, is exact too.

Every row does the lesson's arithmetic (model.py's shared operations, one math.fsum per
dot product), per layer and per head. Head h of width d = width / heads reads columns
h*d .. (h+1)*d - 1 of q, and key-value head h // (heads / kv_heads) of k and v; the heads'
outputs are placed side by side in that order before Wo.

With positions="rotary" there is no position table: in every layer, q and k are turned
by their position (RoFormer, Su et al., 2021; Llama), base 10,000: pair (2i, 2i + 1) of
each head by the angle position x 10000^(-2i/d) (Hugging Face's Llama turns the halves
(i, i + d/2): the same model, Wq's and Wk's columns reordered). A query turned by i and a
key turned by j meet at the angle i - j: only the distance counts.

With latent= (multi-head latent attention, MLA: DeepSeek-V2, 2024, section 2.1) a layer
keeps per position one latent vector c_kv of that width (h1 times Wdkv, layer-normed) and
rebuilds every head's key and value from it (c_kv times Wuk and Wuv: head h's columns
h*d ..). With rotary positions each head's key also carries a small rotary key k_r that
all heads share, turned by its position, and its query a rotary part of its own:
head h's query is q_h then q_r_h, its key k_h then k_r. The cache keeps c_kv and k_r only,
and this module's forward_step rebuilds the keys and values at every step, in the full
pass's order; latent_attention.py reads the latents directly instead.

What a shape may be, and the parameters of one, are deep_params.py's.
"""
import math

from deep_params import check_params, init_params, kv_layers, layer_windows
from model import (CONTEXT, WIDTH, add, band, causal, check_ids, check_mask,
                   check_token_id, dot, is_int, layernorm, linear, relu, softmax_row)

BASE = 10000.0   # of the rotary angles


def columns_by_block(params):
    """Each block's matrices, and the output layer, by columns (ready for linear)."""
    def cols(matrix):
        return [list(column) for column in zip(*matrix)]
    return ([{name: cols(value) for name, value in block.items() if name.startswith("W")}
             for block in params["blocks"]], cols(params["W_out"]))


def heads_of(shape):
    """The sizes of a shape's attention heads, as a tuple of five.

    (heads, head width d, a head's key width (d, and the rotary key's width), query heads
    per key-value head, 1 / sqrt(key width))."""
    d = shape["width"] // shape["heads"]
    d_key = d + shape["rotary_key"]
    return shape["heads"], d, d_key, shape["heads"] // shape["kv_heads"], 1 / math.sqrt(d_key)


def angles(shape):
    """The rotary angles of a unit of position, for a model of this shape.

    thetas, one for each pair of q or k, and r_thetas, one for each pair of a rotary query
    or key; [] and [] with learned positions."""
    if shape["positions"] != "rotary":
        return [], []
    d, r = shape["width"] // shape["heads"], shape["rotary_key"]
    # the pair from column c of q or k is pair (c % d) / 2 of its head; of a rotary query
    # or key, pair (c % r) / 2
    return ([BASE ** (-(c % d) / d) for c in range(0, shape["width"], 2)],
            [BASE ** (-(c % r) / r) for c in range(0, shape["heads"] * r, 2)])


def _joined(a, b, heads):
    """Each head's part of a, then its part of b (each cut into heads equal parts)."""
    da, db = len(a) // heads, len(b) // heads
    return [x for h in range(heads) for x in a[h * da:(h + 1) * da] + b[h * db:(h + 1) * db]]


def compressed(h1, block, cols, position, r_thetas):
    """What a latent layer keeps of a position: its latent c_kv and its rotary key k_r.

    c_kv is h1 times Wdkv, then its layer norm; k_r is h1 times Wkr, turned by position
    ([] without a rotary key)."""
    c_kv = layernorm(linear(h1, cols["Wdkv"]), block["lnc_g"], block["lnc_b"])
    k_r = rotate(linear(h1, cols["Wkr"]), position, r_thetas) if "Wkr" in cols else []
    return c_kv, k_r


def latent_query(q, h1, cols, position, thetas, r_thetas, heads):
    """A latent layer's query, from q = h1 Wq.

    Each head's q_h then its rotary part (h1 times Wqr, turned by position); without a
    rotary key, q turned (rotary) or q."""
    if "Wqr" in cols:
        return _joined(q, rotate(linear(h1, cols["Wqr"]), position, r_thetas), heads)
    return rotate(q, position, thetas) if thetas else q


def rebuilt(c_kv, k_r, position, cols, thetas, heads):
    """Every head's key and value, from what a latent layer keeps of a position.

    The key is c_kv times Wuk, each head's part followed by k_r; the value, c_kv times Wuv.
    With rotary positions but no k_r, the key is turned by its position (a design
    absorption cannot fold)."""
    k = linear(c_kv, cols["Wuk"])
    if thetas and not k_r:
        k = rotate(k, position, thetas)
    return _joined(k, k_r * heads, heads), linear(c_kv, cols["Wuv"])


def rotate(x, position, thetas):
    """x with each pair (x[2i], x[2i + 1]) turned by the angle position * thetas[i].

    As many pairs as both have; each number is one correctly rounded sum."""
    turned = []
    for i, theta in zip(range(len(x) // 2), thetas):
        a, b = x[2 * i], x[2 * i + 1]
        cos, sin = math.cos(position * theta), math.sin(position * theta)
        turned += [dot((a, b), (cos, -sin)), dot((a, b), (sin, cos))]
    return turned


def attend(q_h, sink, scale, keys, values):
    """One head's mixed values and attention weights: q_h's scores over keys, values weighted.

    keys and values are the head's parts of the positions it reads; each score is
    dot(q_h, k_j) * scale. With a sink (a learned logit of the head's, or None), the sink
    is a last score with no key and no value: softmaxed with the scores, its weight then
    dropped (gpt-oss's sdpa, gpt_oss/torch/model.py), so the weights sum to less than 1."""
    scores = [dot(q_h, k_j) * scale for k_j in keys]
    weights = softmax_row(scores) if sink is None else softmax_row(scores + [sink])[:-1]
    return [dot(weights, column) for column in zip(*values)], weights


def embedded(params, token_id, position):
    """A position's input row: its token's embedding, plus its position's unless rotary."""
    if params["shape"]["positions"] == "rotary":
        return params["tok_emb"][token_id]
    return add(params["tok_emb"][token_id], params["pos_emb"][position])


def mlp_residual(x1, block, cols):
    """x1 with its block's MLP added: the second half of every layer, whatever it read."""
    h2 = layernorm(x1, block["ln2_g"], block["ln2_b"])
    a = relu(add(linear(h2, cols["W1"]), block["b1"]))
    return add(x1, add(linear(a, cols["W2"]), block["b2"]))


def output_logits(params, x, out_cols):
    """A row's next-token logits from its last layer's output: the final norm, then W_out."""
    return add(linear(layernorm(x, params["lnf_g"], params["lnf_b"]), out_cols), params["b_out"])


def own_mask(shape):
    """The mask of a model of this shape: causal, or one a layer if a layer has a window.

    A layer of window W reads band(W): position i reads i - W + 1 to i, itself and the
    W - 1 before it (gpt-oss's sliding_window, lossy.WindowCache's window); a full layer
    reads causal."""
    windows = layer_windows(shape)
    if not any(windows):
        return causal
    return [causal if window is None else band(window) for window in windows]


def layer_masks(mask, layers, positions, start=0):
    """mask as one mask per layer: itself if it is a list, else mask in every layer.

    A list holds one mask a layer. Each is checked as model.check_mask checks one, for the
    positions from start to positions - 1 (a mask of a list named by its layer)."""
    if not isinstance(mask, list):
        check_mask(mask, positions, start)
        return [mask] * layers
    if len(mask) != layers:
        raise ValueError(f"mask must be a function of a position, or a list of one per "
                         f"layer ({layers}), got a list of {len(mask)}")
    for layer, each in enumerate(mask):
        try:
            check_mask(each, positions, start)
        except ValueError as error:
            raise ValueError(f"layer {layer}'s {error}") from None
    return mask


def forward(params, ids, mask=None):
    """Next-token logits for every position of ids, layer by layer.

    In each layer, first every position's q, k and v (a layer that reads an earlier one's
    cache, kv_from, takes that layer's k and v), then each position's heads attending to
    positions mask(i): mask may be a list, one mask a layer, and is the model's own_mask
    unless given."""
    check_params(params)
    check_ids(ids)
    shape = params["shape"]
    masks = layer_masks(own_mask(shape) if mask is None else mask, shape["layers"], len(ids))
    block_cols, out_cols = columns_by_block(params)
    heads, d, d_key, group, scale = heads_of(shape)
    thetas, r_thetas = angles(shape)
    xs = [embedded(params, token_id, position) for position, token_id in enumerate(ids)]
    kept = []   # each layer's ks and vs
    for block, cols, layer_mask, read in zip(params["blocks"], block_cols, masks,
                                             kv_layers(shape)):
        qs, ks, vs = [], [], []
        for position, x0 in enumerate(xs):
            h1 = layernorm(x0, block["ln1_g"], block["ln1_b"])
            q = linear(h1, cols["Wq"])
            if shape["latent"]:   # keys and values rebuilt from what the cache would keep
                q = latent_query(q, h1, cols, position, thetas, r_thetas, heads)
                c_kv, k_r = compressed(h1, block, cols, position, r_thetas)
                k, v = rebuilt(c_kv, k_r, position, cols, thetas, heads)
            elif "Wk" not in cols:   # the layer it reads made them (turned already)
                q = rotate(q, position, thetas) if thetas else q
                k, v = kept[read][0][position], kept[read][1][position]
            else:
                k = linear(h1, cols["Wk"])
                if thetas:
                    q, k = rotate(q, position, thetas), rotate(k, position, thetas)
                v = linear(h1, cols["Wv"])
            qs.append(q)
            ks.append(k)
            vs.append(v)
        kept.append((ks, vs))
        for i, x0 in enumerate(xs):
            keys, values = [ks[j] for j in layer_mask(i)], [vs[j] for j in layer_mask(i)]
            mixed = []
            for head, sink in zip(range(heads), block.get("sinks", [None] * heads)):
                kv = head // group                     # the key-value head it reads
                mixed_h, _ = attend(qs[i][head * d_key:(head + 1) * d_key], sink, scale,
                                    [k_j[kv * d_key:(kv + 1) * d_key] for k_j in keys],
                                    [v_j[kv * d:(kv + 1) * d] for v_j in values])
                mixed += mixed_h
            xs[i] = mlp_residual(add(x0, linear(mixed, cols["Wo"])), block, cols)
    return [output_logits(params, x2, out_cols) for x2 in xs]


class DeepCache:
    """What one sequence keeps, per layer: each position's keys and values, or its latent.

    layers[L]["keys"] and ["values"] hold, for each position, the key and the value of
    layer L's kv_heads key-value heads side by side; in a latent model,
    layers[L]["latents"] and ["rotary_keys"] hold its latent and its rotary key instead; a
    layer that reads an earlier layer's cache (kv_from) holds nothing, {}. mask(i), the
    model's own_mask unless given, is which held positions position i attends to (mask
    may be a list, one mask a layer). With rotary positions a key is kept after its
    rotation by its own position, so a later query, rotated by its own, reads it as it is;
    the rotation adds no number.

    A deep cache's protocol, beyond the lists: positions_read(position), the positions each
    layer's row at position attends to; keep(token_id, new), a step's vectors; and
    attended(layer, weights_by_head), told by forward_step, once the whole step has
    succeeded, what each layer's heads read: one list of attention weights a head, over
    that layer's reads in their order (a cache that evicts by attention chooses by them; a
    DeepCache ignores them)."""

    def __init__(self, params, mask=None):
        check_params(params)
        shape = params["shape"]
        mask = own_mask(shape) if mask is None else mask
        layer_masks(mask, shape["layers"], 0)   # functions; what they give, each step
        self.params, self.mask, self.tokens = params, mask, []
        self.block_columns, self.out_columns = columns_by_block(params)
        parts = ("latents", "rotary_keys") if shape["latent"] else ("keys", "values")
        self.layers = [{part: [] for part in parts} if read == layer else {}
                       for layer, read in enumerate(kv_layers(shape))]

    def __len__(self):
        return len(self.tokens)

    def floats_per_position(self):
        """The numbers the cache keeps per position, counted in its lists.

        A position a layer dropped, None there, counts none."""
        if not self.tokens:
            raise ValueError("the cache holds no position yet")
        return sum(len(vector) for layer in self.layers for vectors in layer.values()
                   for vector in vectors if vector is not None) / len(self)

    def positions_read(self, position):
        """The held positions each layer's row at position attends to: its mask's."""
        return [mask(position) for mask in layer_masks(self.mask, len(self.layers), 0)]

    def attended(self, layer, weights_by_head):
        """Nothing to keep: a DeepCache evicts nothing, whatever the rows read."""

    def keep(self, token_id, new):
        """Append token_id, and to each layer's lists the vectors of new (one dict a layer).

        Called once a step has computed every layer, so that nothing can fail after."""
        self.tokens.append(token_id)
        for layer, kept in zip(self.layers, new):
            for part, vector in kept.items():
                layer[part].append(vector)


def check_step(params, cache, token_id, position):
    """Refuse, before anything is computed, a step that cannot be taken.

    What kv_cache.forward_step refuses, in its order: a cache made for other params, a
    position out of order or past the table, a token outside the vocabulary; and a mask
    that gives the position no held positions."""
    check_cache_step(DeepCache, params, cache, token_id, position)
    layer_masks(cache.mask, len(cache.layers), position + 1, position)


def check_cache_step(kind, params, cache, token_id, position):
    """Refuse a step's cache, position and token that no cache of kind can take.

    In this order: a cache that is not a kind made for params, a position out of order or
    past the table, a token outside the vocabulary."""
    if not isinstance(cache, kind) or cache.params is not params:
        raise ValueError(f"this cache was made for different parameters; start a new "
                         f"cache with {kind.__name__}(params)")
    if not is_int(position) or position != len(cache):
        raise ValueError(f"expected position {len(cache)}, got {position!r}")
    if position >= CONTEXT:
        raise ValueError(f"position {position} is beyond the {CONTEXT} positions of the "
                         f"model's table")
    check_token_id(token_id)


def forward_step(params, cache, token_id, position):
    """Next-token logits for token_id at position, the next one after the cache's.

    Runs it through every layer; once all are computed, keeps the token and each layer's key
    and value, or latent and rotary key (keys and values rebuilt from them at every step);
    none for a layer that reads another's (kv_from). Refuses, before computing anything,
    what check_step refuses; if anything else goes wrong, the cache is unchanged."""
    check_step(params, cache, token_id, position)
    shape = params["shape"]
    heads, d, d_key, group, scale = heads_of(shape)
    thetas, r_thetas = angles(shape)
    x0 = embedded(params, token_id, position)
    new, weights_read = [], []   # each layer's vectors for this position; its heads' weights
    for block, cols, read, attended in zip(params["blocks"], cache.block_columns,
                                           kv_layers(shape), cache.positions_read(position)):
        layer = cache.layers[read]   # its own lists, or those of the layer it reads
        h1 = layernorm(x0, block["ln1_g"], block["ln1_b"])
        q = linear(h1, cols["Wq"])
        if shape["latent"]:   # keep the latent; rebuild every attended key and value
            q = latent_query(q, h1, cols, position, thetas, r_thetas, heads)
            c_kv, k_r = compressed(h1, block, cols, position, r_thetas)
            held = list(zip(layer["latents"] + [c_kv], layer["rotary_keys"] + [k_r]))
            keys, values = zip(*[rebuilt(*held[j], j, cols, thetas, heads) for j in attended])
            new.append({"latents": c_kv, "rotary_keys": k_r})
        else:
            if "Wk" in cols:   # a key and a value of its own
                k = linear(h1, cols["Wk"])
                if thetas:
                    q, k = rotate(q, position, thetas), rotate(k, position, thetas)
                v = linear(h1, cols["Wv"])
            else:   # the ones the layer it reads made for this position (turned already)
                q = rotate(q, position, thetas) if thetas else q
                k, v = new[read]["keys"], new[read]["values"]
            held_keys = layer["keys"] + [k]        # a position attends to itself too
            held_values = layer["values"] + [v]
            keys = [held_keys[j] for j in attended]
            values = [held_values[j] for j in attended]
            new.append({"keys": k, "values": v} if "Wk" in cols else {})
        mixed = []
        weights_read.append([])
        for head, sink in zip(range(heads), block.get("sinks", [None] * heads)):
            kv = head // group                     # the key-value head it reads
            mixed_h, weights = attend(q[head * d_key:(head + 1) * d_key], sink, scale,
                                      [k_j[kv * d_key:(kv + 1) * d_key] for k_j in keys],
                                      [v_j[kv * d:(kv + 1) * d] for v_j in values])
            weights_read[-1].append(weights)
            mixed += mixed_h
        x0 = mlp_residual(add(x0, linear(mixed, cols["Wo"])), block, cols)
    logits = output_logits(params, x0, cache.out_columns)
    cache.keep(token_id, new)   # every layer computed: nothing can go wrong now
    for layer, weights_by_head in enumerate(weights_read):   # a cache that evicts chooses by
        cache.attended(layer, weights_by_head)               # what each layer read
    return logits


# ---- the experiment (a stage of trace_kv.py) ---------------------------------------

def deep_ids(lab):
    """The first 64 tokens of the test stories (16 in a quick run of fewer openings)."""
    positions = CONTEXT if len(lab.prompts) == len(lab.test) else 16
    return [t for story in lab.test for t in lab.tok.encode(story)][:positions]


def fed_deep_model(layers, kv_heads, ids, mask=causal):
    """A deep_model of layers and kv_heads, and its rows and cache after feeding it ids.

    4 query heads, the lab's width, seed 0; ids fed one token at a time."""
    params = init_params(layers, 4, kv_heads, WIDTH, 0)
    cache = DeepCache(params, mask)
    return params, [forward_step(params, cache, token_id, position)
                    for position, token_id in enumerate(ids)], cache


DEEP_SHAPES = tuple((layers, kv_heads) for layers in (1, 2, 3, 4) for kv_heads in (4, 2, 1))
