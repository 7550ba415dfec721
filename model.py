"""A one-block transformer in plain Python: token and position embeddings, one
pre-norm attention layer with a single head, one ReLU MLP, and a final layer norm.

Every dot product is one correctly rounded sum (math.fsum), and every row does the same
operations in the same order, so a row's result does not depend on how many other rows
are computed with it. That is what lets the KV cache (kv_cache.py) reproduce this
forward pass bit for bit. The backward pass at the end is what training uses.
"""
import functools
import math
import random
import reprlib
from collections import namedtuple
from math import fsum
from operator import mul

VOCAB_SIZE = 96
CONTEXT = 64          # positions, so the longest input is 64 tokens
WIDTH = 16
HIDDEN = 64           # MLP hidden width
EPS = 1e-5            # layer-norm epsilon
SCALE = 1 / math.sqrt(WIDTH)
MAX_WEIGHT = 1e30     # beyond it a row's sums (of up to six weights multiplied) could overflow

SHAPES = {
    "tok_emb": (VOCAB_SIZE, WIDTH), "pos_emb": (CONTEXT, WIDTH),
    "ln1_g": (WIDTH,), "ln1_b": (WIDTH,),
    "Wq": (WIDTH, WIDTH), "Wk": (WIDTH, WIDTH), "Wv": (WIDTH, WIDTH), "Wo": (WIDTH, WIDTH),
    "ln2_g": (WIDTH,), "ln2_b": (WIDTH,),
    "W1": (WIDTH, HIDDEN), "b1": (HIDDEN,), "W2": (HIDDEN, WIDTH), "b2": (WIDTH,),
    "lnf_g": (WIDTH,), "lnf_b": (WIDTH,),
    "W_out": (WIDTH, VOCAB_SIZE), "b_out": (VOCAB_SIZE,),
}
MATRICES = ("Wq", "Wk", "Wv", "Wo", "W1", "W2", "W_out")


def _rows(params, name):
    """The rows of a parameter: a matrix's rows, or a vector as a single row."""
    return [params[name]] if len(SHAPES[name]) == 1 else params[name]


def check_shapes(params):
    """Refuse params with a missing or extra name or a matrix or vector of the wrong shape."""
    if not isinstance(params, dict):
        raise ValueError(f"params must be a dict of lists, got {type(params).__name__}")
    missing, extra = sorted(set(SHAPES) - set(params)), sorted(set(params) - set(SHAPES))
    if missing:
        raise ValueError(f"params missing {missing}")
    if extra:
        raise ValueError(f"params with unexpected names {extra}")
    for name, shape in SHAPES.items():
        check_shape(params[name], shape, name)


def check_shape(value, shape, name):
    """Refuse a parameter that does not have this shape.

    shape is (rows, columns) for a list of lists, (entries,) for a list."""
    rows = [value] if len(shape) == 1 else value
    if (not isinstance(rows, list) or len(rows) != (1 if len(shape) == 1 else shape[0])
            or not all(isinstance(r, list) and len(r) == shape[-1] for r in rows)):
        raise ValueError(f"params: {name} must have shape {' x '.join(map(str, shape))}")


def check_params(params):
    """Refuse params of the wrong shape, or holding anything but floats the rows can sum.

    Each value must be a finite float of at most MAX_WEIGHT in size."""
    check_shapes(params)
    for name in SHAPES:
        check_values(name, _rows(params, name))


def check_values(name, rows):
    """Refuse rows (lists of numbers) holding anything but floats no larger than MAX_WEIGHT.

    With weights beyond it, a row's sums of products could overflow a float."""
    for r in rows:   # a NaN fails the first test, or makes the fsum of the floats NaN
        if (set(map(type, r)) != {float} or not max(map(abs, r)) <= MAX_WEIGHT
                or math.isnan(fsum(r))):
            bad = next(v for v in r if type(v) is not float or not abs(v) <= MAX_WEIGHT)
            if type(bad) is float and math.isfinite(bad):
                raise ValueError(f"params: {name} holds {bad!r}, larger than {MAX_WEIGHT:g}: "
                                 f"a row's sums of weights that large could overflow a float")
            raise ValueError(f"params: {name} holds {excerpt(bad)}, not a finite float")


def init_params(seed):
    """Fresh parameters from a seed.

    Embeddings random with std 0.5, weight matrices with std 1/sqrt(inputs), layer-norm
    gains 1, biases 0. seed: an int (check_seed)."""
    check_seed(seed)
    rng = random.Random(seed)
    params = {}
    for name, shape in SHAPES.items():
        if len(shape) == 1:
            params[name] = [1.0 if name.endswith("_g") else 0.0] * shape[0]
        else:
            std = 0.5 if name.endswith("_emb") else 1 / math.sqrt(shape[0])
            params[name] = [[rng.gauss(0.0, std) for _ in range(shape[1])]
                            for _ in range(shape[0])]
    return params


# ---- the operations every path shares --------------------------------------------

def dot(a, b):
    """Sum of a[k] * b[k], correctly rounded: the result does not depend on the order."""
    return fsum(map(mul, a, b))


def columns(params):
    """Each weight matrix as a list of its columns, so linear() can take dot products."""
    return {name: [list(col) for col in zip(*params[name])] for name in MATRICES}


def linear(x, cols):
    """The vector x times a matrix given by its columns: one dot product per column.

    That is x W, a linear layer without a bias."""
    return [fsum(map(mul, x, col)) for col in cols]   # dot(x, col), inlined: the hot loop


def add(a, b):
    """Element by element a + b, in that order."""
    return [p + q for p, q in zip(a, b)]


def relu(z):
    """z where it is positive, else 0.0."""
    return [value if value > 0 else 0.0 for value in z]


def layernorm(x, g, b):
    """Normalize one row to mean 0 and variance 1, then scale by g and shift by b."""
    n = len(x)
    mean = fsum(x) / n
    d = [value - mean for value in x]
    s = math.sqrt(fsum([e * e for e in d]) / n + EPS)
    return [e / s * gk + bk for e, gk, bk in zip(d, g, b)]


def layernorm_forward(rows, g, b):
    """Layer norm of each row: (the normalized rows, the input rows).

    The backward pass (_layernorm_backward) recomputes each row's mean and spread from its
    input row, so the inputs are all it keeps."""
    return [layernorm(x, g, b) for x in rows], rows


def softmax_row(scores):
    """Probabilities from scores: subtract the max, exponentiate, divide by the sum."""
    if not scores:
        raise ValueError("softmax_row got no scores: the row attends to no position (a "
                         "position attends at least to itself)")
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = fsum(exps)
    return [e / total for e in exps]


# ---- checks every entry point shares ------------------------------------------------

def excerpt(value):
    """value as a message quotes it: short, however large it is.

    As for an int of 400 digits, or a list nested a thousand deep."""
    if is_int(value) and value.bit_length() > 160:   # Python refuses to print 4,300 digits
        return f"an int of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return reprlib.repr(value)


def is_int(value):
    """value is an int, and not a bool (to Python, True and False are the ints 1 and 0)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name, value, low, high=None, why=""):
    """Refuse anything but an int from low to high (or at least low, without high).

    The message says "{name} must be an int ..., got {value!r}"; why, if given, follows
    the range."""
    if not is_int(value) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"{name} must be an int {span}{why}, got {excerpt(value)}")


def check_seed(seed, name="seed"):
    """Refuse a seed that is not an int (random.Random would take None, 1.5 or "a")."""
    if not is_int(seed):
        raise ValueError(f"{name} must be an int, got {excerpt(seed)}")


def check_token_id(token_id, what="token ID"):
    """Refuse anything but an int from 0 to VOCAB_SIZE - 1 (a bool is not a token ID)."""
    if not is_int(token_id) or not 0 <= token_id < VOCAB_SIZE:
        raise ValueError(f"{what} {excerpt(token_id)} is outside the vocabulary "
                         f"(ints 0 to {VOCAB_SIZE - 1})")


def check_ids(ids):
    """Refuse an input the model cannot run: empty, too long, or a bad token ID."""
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"ids must be a list of token IDs, got {type(ids).__name__}")
    if not ids:
        raise ValueError("ids is empty: the model needs at least one token")
    if len(ids) > CONTEXT:
        raise ValueError(f"ids has {len(ids)} tokens, beyond the {CONTEXT} positions")
    for index, token_id in enumerate(ids):
        check_token_id(token_id, f"ids[{index}] =")


# ---- the full forward pass ----------------------------------------------------------

Saved = namedtuple("Saved", "x0 h1 q k v weights mixed x1 h2 a x2 hf")
Saved.__doc__ = """What forward keeps for the backward pass: for each of the row's named
values, a list with one entry per position."""


def causal(i):
    """The positions position i attends to: 0..i, never a later one."""
    return range(i + 1)


def band(window, sinks=0):
    """A mask of another shape: the first sinks positions and the last window ones.

    Position i attends to those: the sinks and i-window+1..i (what lossy.WindowCache
    keeps)."""
    check_int("window", window, 1)
    check_int("sinks", sinks, 0, window - 1, " (window - 1)")

    def mask(i):
        return [j for j in range(i + 1) if j < sinks or j > i - window]
    return mask


def check_mask(mask, positions, start=0):
    """Refuse a mask that does not give each position some positions it can attend to.

    Refused: not a function of a position, or one that gives a position (from start to
    positions - 1) nothing to attend to, or anything but positions it can attend to:
    mask(i) must be a non-empty list (or range) of ints from 0 to i. The causal mask is
    0..i itself, so it is not looked at."""
    if not callable(mask):
        raise ValueError(f"mask must be a function of a position, such as model.causal or "
                         f"model.band(8), got {excerpt(mask)}")
    if mask is causal:
        return
    for i in range(start, positions):
        attended = mask(i)
        if not isinstance(attended, (list, tuple, range)) or not attended \
                or not all(is_int(j) and 0 <= j <= i for j in attended):
            raise ValueError(f"mask({i}) gives {excerpt(attended)}: position {i} must attend "
                             f"to at least one of positions 0 to {i} (a list of ints), and to "
                             f"no other")


def refusing_overflow(forward):
    """forward, refusing by name the weights that overflow a float on the way.

    The overflow is fsum's "intermediate overflow" or "-inf + inf", from deep inside a
    row; the check runs only then, so the rows pay nothing for it."""
    @functools.wraps(forward)
    def checked(params, *args, **kwargs):
        try:
            return forward(params, *args, **kwargs)
        except (OverflowError, ValueError) as error:
            if not str(error).endswith("in fsum"):
                raise
            check_params(params)   # names the first weight too large, if one is
            raise ValueError(f"params: a row's sums overflow a float ({error}): the "
                             f"weights are too large for this model") from None
    return checked


@refusing_overflow
def forward(params, ids, mask=causal):
    """Next-token logits for every position of ids, and what the backward pass needs.

    First every position's query, key and value; then each position i attends to the
    keys and values of the positions mask(i), 0..i (causal) unless told otherwise, and
    goes on through the MLP. kv_cache.forward_step does the same row for one position,
    line for line. Training (the backward pass) uses the causal mask.
    """
    check_ids(ids)
    check_mask(mask, len(ids))
    cols = columns(params)
    saved = Saved(*([] for _ in Saved._fields))
    for position, token_id in enumerate(ids):
        x0 = add(params["tok_emb"][token_id], params["pos_emb"][position])
        h1 = layernorm(x0, params["ln1_g"], params["ln1_b"])
        q, k, v = linear(h1, cols["Wq"]), linear(h1, cols["Wk"]), linear(h1, cols["Wv"])
        _keep(saved, x0=x0, h1=h1, q=q, k=k, v=v)
    logits = []
    for i in range(len(ids)):
        x0, q = saved.x0[i], saved.q[i]
        keys, values = [saved.k[j] for j in mask(i)], [saved.v[j] for j in mask(i)]
        scores = [dot(q, k_j) * SCALE for k_j in keys]
        weights = softmax_row(scores)
        mixed = [dot(weights, column) for column in zip(*values)]
        x1 = add(x0, linear(mixed, cols["Wo"]))
        h2 = layernorm(x1, params["ln2_g"], params["ln2_b"])
        a = relu(add(linear(h2, cols["W1"]), params["b1"]))
        x2 = add(x1, add(linear(a, cols["W2"]), params["b2"]))   # the MLP output plus its bias first
        hf = layernorm(x2, params["lnf_g"], params["lnf_b"])
        logits.append(add(linear(hf, cols["W_out"]), params["b_out"]))
        _keep(saved, weights=weights, mixed=mixed, x1=x1, h2=h2, a=a, x2=x2, hf=hf)
    return logits, saved


def _keep(saved, **values):
    """Append each named value of one position to its list in saved."""
    for name, value in values.items():
        getattr(saved, name).append(value)


# ---- training: loss and backward pass ----------------------------------------------

def loss_and_grads(params, ids, targets):
    """Mean cross-entropy of predicting targets[i] after ids[:i + 1], and its gradients."""
    if len(targets) != len(ids):
        raise ValueError(f"targets has {len(targets)} token IDs but ids has {len(ids)}: "
                         f"one target per input position")
    for index, token_id in enumerate(targets):
        check_token_id(token_id, f"targets[{index}] =")
    logits, saved = forward(params, ids)
    n = len(ids)
    grads = {name: ([[0.0] * s[1] for _ in range(s[0])] if len(s) == 2 else [0.0] * s[0])
             for name, s in SHAPES.items()}
    loss, d_logits = 0.0, []
    for scores, target in zip(logits, targets):
        probs = softmax_row(scores)
        loss -= math.log(probs[target])
        probs[target] -= 1.0
        d_logits.append([p / n for p in probs])

    # From the logits back to the attention output, each position on its own.
    _accumulate(grads, "W_out", "b_out", saved.hf, d_logits)
    d_hf = _times_transpose(d_logits, params["W_out"])
    d_x2 = _layernorm_backward(params, grads, "lnf", saved.x2, d_hf)
    _accumulate(grads, "W2", "b2", saved.a, d_x2)
    d_z = [[g if av > 0 else 0.0 for g, av in zip(dr, ar)]
           for dr, ar in zip(_times_transpose(d_x2, params["W2"]), saved.a)]
    _accumulate(grads, "W1", "b1", saved.h2, d_z)
    d_h2 = _times_transpose(d_z, params["W1"])
    d_x1 = [add(d, e) for d, e in zip(d_x2, _layernorm_backward(params, grads, "ln2", saved.x1, d_h2))]
    _accumulate(grads, "Wo", None, saved.mixed, d_x1)
    d_mixed = _times_transpose(d_x1, params["Wo"])

    # Attention: position i's key and value also receive gradient from later positions.
    d_q = [[0.0] * WIDTH for _ in range(n)]
    d_k = [[0.0] * WIDTH for _ in range(n)]
    d_v = [[0.0] * WIDTH for _ in range(n)]
    for i in range(n):
        w, dm = saved.weights[i], d_mixed[i]
        d_w = [fsum(map(mul, dm, saved.v[j])) for j in range(i + 1)]
        centre = fsum(map(mul, w, d_w))
        d_s = [wj * (dwj - centre) * SCALE for wj, dwj in zip(w, d_w)]
        for j in range(i + 1):
            d_v[j] = [acc + w[j] * g for acc, g in zip(d_v[j], dm)]
            d_k[j] = [acc + d_s[j] * g for acc, g in zip(d_k[j], saved.q[i])]
            d_q[i] = [acc + d_s[j] * g for acc, g in zip(d_q[i], saved.k[j])]

    d_h1 = [add(add(p, r), s) for p, r, s in zip(_times_transpose(d_q, params["Wq"]),
                                                 _times_transpose(d_k, params["Wk"]),
                                                 _times_transpose(d_v, params["Wv"]))]
    for name, d in (("Wq", d_q), ("Wk", d_k), ("Wv", d_v)):
        _accumulate(grads, name, None, saved.h1, d)
    d_x0 = [add(d, e) for d, e in zip(d_x1, _layernorm_backward(params, grads, "ln1", saved.x0, d_h1))]
    for i, (t, d) in enumerate(zip(ids, d_x0)):
        grads["tok_emb"][t] = add(grads["tok_emb"][t], d)
        grads["pos_emb"][i] = add(grads["pos_emb"][i], d)
    return loss / n, grads


def _times_transpose(d_rows, W):
    """Each gradient row times the transpose of W: back from a layer's outputs to its inputs."""
    return [[fsum(map(mul, w_row, d)) for w_row in W] for d in d_rows]


def _accumulate(grads, w_name, b_name, inputs, d_outputs):
    """Add the gradients of y = x W (+ b) over all positions: W gets x^T dy, b gets sum dy."""
    in_cols, out_cols = list(zip(*inputs)), list(zip(*d_outputs))
    grads[w_name] = [[acc + fsum(map(mul, xc, dc)) for acc, dc in zip(g_row, out_cols)]
                     for g_row, xc in zip(grads[w_name], in_cols)]
    if b_name:
        grads[b_name] = [acc + fsum(dc) for acc, dc in zip(grads[b_name], out_cols)]


def _layernorm_backward(params, grads, prefix, inputs, d_outputs):
    """Gradients of layer norm: adds to its gain and bias, returns the inputs' gradients."""
    gain, d_gain, d_bias = params[prefix + "_g"], grads[prefix + "_g"], grads[prefix + "_b"]
    d_inputs = []
    for x, dy in zip(inputs, d_outputs):
        n = len(x)
        mean = fsum(x) / n
        d = [value - mean for value in x]
        inv = 1 / math.sqrt(fsum([e * e for e in d]) / n + EPS)
        xhat = [e * inv for e in d]
        d_gain = [acc + dv * xh for acc, dv, xh in zip(d_gain, dy, xhat)]
        d_bias = add(d_bias, dy)
        d_xhat = [dv * gk for dv, gk in zip(dy, gain)]
        m1 = fsum(d_xhat) / n
        m2 = fsum(map(mul, d_xhat, xhat)) / n
        d_inputs.append([inv * (dx - m1 - xh * m2) for dx, xh in zip(d_xhat, xhat)])
    grads[prefix + "_g"], grads[prefix + "_b"] = d_gain, d_bias
    return d_inputs
