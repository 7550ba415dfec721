"""The KV cache: keep every position's key and value instead of recomputing them.

In a causal model, position i attends only to positions 0..i, so once a position's key
and value are computed they never change, however many tokens follow. The uncached
generator (generate.py) recomputes them all at every step; here each step computes one
new row, appends its key and value to the cache, and attends over the cache.

    python3 kv_cache.py "zoe went to the park."       compares the two generators
    python3 kv_cache.py --show "mia was sad."   shows the cached one step by step
    (--help lists the flags)

The lesson's experiment, the stages that trace_kv.py runs on the 60 test openings, is
trace_lesson.py's.
"""
import sys
import lab_files
if __name__ == "__main__":   # first: Ctrl-C while the modules below load ends in one line
    lab_files.ctrl_c_in_one_line()

import argparse
import copy
import time

import generate
import model
from cache_protocol import CacheProtocol, check_positions
from instruments import recording
from model import SCALE, add, dot, layernorm, linear, relu, softmax_row


class KVCache(CacheProtocol):
    """The keys and values of one sequence so far, for the very params it was made for.

    forward_step appends a key and a value a position and reads them all back: all the
    lesson asks of it. What Parts 2 to 5 ask of every cache, this one included, is written
    once, in cache_protocol.py."""

    def __init__(self, params):
        self._belong_to(params)
        self.tokens = []                       # the token ID at each position
        self.keys = []                         # one key (WIDTH floats) per position
        self.values = []                       # one value (WIDTH floats) per position

    def _belong_to(self, params):
        model.check_shapes(params)
        self.params = params
        self.columns = model.columns(params)   # the weight matrices, ready for linear()

    def __len__(self):
        return len(self.keys)

    def append(self, token_id, k, v):
        """Keep one more position: its token, key and value."""
        self.extend([token_id], [k], [v])

    def extend(self, token_ids, keys, values):
        """Keep several more positions, in order."""
        check_positions(token_ids, keys, values)
        self.tokens += token_ids
        self.keys += keys
        self.values += values

    def copy(self):
        """An independent cache holding the same positions: a fork of this sequence.

        It has copies of the lists this one keeps (the rows in them never change in place)."""
        fork = copy.copy(self)
        for name, kept in vars(self).items():
            if isinstance(kept, list):
                setattr(fork, name, kept[:])
        return fork

    def crop(self, length):
        """Forget every position from length on (rewind the sequence to length tokens)."""
        model.check_int("crop length", length, 0, len(self), " (the positions held)")
        self._forget_from(length)

    def _forget_from(self, length):
        del self.tokens[length:], self.keys[length:], self.values[length:]

    def free(self):
        """End the sequence: forget every position (a paged sequence returns its blocks)."""
        self.crop(0)


def check_cache(cache, params, kernel=None):
    """Refuse anything but a cache made for these very params that takes kernel's rows.

    A copy of params is another model; kernel None means forward_step's arithmetic."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache, got {type(cache).__name__}; "
                         f"start one with KVCache(params)")
    if cache.params is not params:
        raise ValueError("this cache was made for different parameters; "
                         "start a new cache with KVCache(params)")
    cache.check_computed_by(kernel)


def forward_step(params, cache, token_id, position):
    """Next-token logits for token_id at position, the next one after the cache's.

    It appends this position's key and value to the cache. The row is model.forward's, line
    for line; only the keys and values differ in where they come from: here, the cache."""
    check_cache(cache, params)
    if not model.is_int(position) or position != len(cache):
        raise ValueError(f"expected position {len(cache)}, got {position!r}: the cache holds "
                         f"{len(cache)} positions, so the next token goes at position "
                         f"{len(cache)} (an int); for a new sequence, start a new cache")
    if position >= model.CONTEXT:
        raise ValueError(f"position {position} is beyond the {model.CONTEXT} positions "
                         f"of the model's table")
    model.check_token_id(token_id)
    cols = cache.columns
    x0 = add(params["tok_emb"][token_id], params["pos_emb"][position])
    h1 = layernorm(x0, params["ln1_g"], params["ln1_b"])
    q, k, v = linear(h1, cols["Wq"]), linear(h1, cols["Wk"]), linear(h1, cols["Wv"])
    cache.append(token_id, k, v)        # before attention: a position attends to itself too
    keys, values = cache.keys, cache.values      # positions 0..position, from the cache
    scores = [dot(q, k_j) * SCALE for k_j in keys]
    weights = softmax_row(scores)
    cache.attended(weights)             # what this row read (a cache that evicts chooses by it)
    mixed = [dot(weights, column) for column in zip(*values)]
    x1 = add(x0, linear(mixed, cols["Wo"]))
    h2 = layernorm(x1, params["ln2_g"], params["ln2_b"])
    a = relu(add(linear(h2, cols["W1"]), params["b1"]))
    x2 = add(x1, add(linear(a, cols["W2"]), params["b2"]))   # the MLP output plus its bias first
    hf = layernorm(x2, params["lnf_g"], params["lnf_b"])
    return add(linear(hf, cols["W_out"]), params["b_out"])


def feed(params, cache, ids):
    """Feed the tokens of ids that the cache does not hold yet; the logits of each, in order.

    One forward_step each, positions len(cache) to len(ids) - 1. A refused step leaves the
    positions fed before it in the cache, each whole."""
    check_cache(cache, params)
    return [forward_step(params, cache, ids[position], position)
            for position in range(held_prefix(cache, ids), len(ids))]


def held_prefix(cache, ids):
    """How many tokens of ids the cache holds.

    It first checks that ids is a list of token IDs and that the cache's tokens are its
    first."""
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"ids must be a list of token IDs, got {type(ids).__name__}")
    held = len(cache)
    if list(cache.tokens) != list(ids[:held]):
        raise ValueError(f"the cache holds {held} tokens that do not begin ids; feed a "
                         f"cache only the sequence it holds (a new one needs a new cache)")
    return held


def work(prompt_tokens, generated_tokens):
    """Rows and attention scores each generator computes for a prompt and its continuation.

    The prompt has prompt_tokens tokens, the continuation generated_tokens chosen tokens
    (one model call per chosen token)."""
    model.check_int("prompt_tokens", prompt_tokens, 0)
    model.check_int("generated_tokens", generated_tokens, 0)
    # Without the cache, call s runs the model on all n = prompt_tokens + s tokens in hand:
    # n rows, and n (n + 1) / 2 scores (row i has i + 1), summed over the calls by formula.
    p, g = prompt_tokens, generated_tokens

    def scores_below(m):   # the scores of the calls with n = 0 .. m - 1 (tetrahedral)
        return (m - 1) * m * (m + 1) // 6
    # With it, every position is fed once, except the last chosen token (never fed back).
    fed = p + g - 1 if g else 0
    return {
        "uncached_rows": g * p + g * (g - 1) // 2,
        "cached_rows": fed,
        "uncached_scores": scores_below(p + g) - scores_below(p),
        "cached_scores": fed * (fed + 1) // 2,
    }


def generate_cached(params, tok, prompt, max_new_tokens=60, temperature=0.0, top_k=None,
                    seed=0, cache=None):
    """Same arguments and result as generate.generate, computing one new row per step.

    Given a cache that holds the start of the prompt, it starts from a copy of it."""
    if cache is None:
        cache = KVCache(params)
    ids = generate.check_request(tok, prompt, max_new_tokens, temperature, top_k, seed)
    cache = fork_for_prompt(params, cache, ids, tok,
                            min(len(ids) + max_new_tokens, model.CONTEXT) - 1)

    def next_logits(ids):
        # The whole prompt on the first call (prefill), then only the token chosen last
        # (decode).
        return feed(params, cache, ids)[-1]
    try:
        return generate.generate_with(next_logits, tok, ids, max_new_tokens, temperature,
                                      top_k, seed)
    finally:
        cache.free()   # the copy is this call's own


def fork_for_prompt(params, cache, ids, tok, most=model.CONTEXT):
    """A copy of cache to continue the prompt ids from, once checked.

    The cache must belong to params, hold a prefix of ids, and have room for as many as
    most positions (what the generation may hold), so that a refusal comes before anything
    changes."""
    check_cache(cache, params)
    if len(cache.tokens) != len(cache):
        raise ValueError(f"the cache holds {len(cache)} keys but {len(cache.tokens)} tokens, "
                         f"where it must hold one of each per position; start a new cache")
    for position, (held, wanted) in enumerate(zip(cache.tokens, ids)):
        if held != wanted:
            raise ValueError(f"the cache is not a prefix of the prompt: at position {position} "
                             f"it holds {tok.vocab[held]!r}, the prompt has {tok.vocab[wanted]!r}")
    if len(cache) > len(ids):
        raise ValueError(f"the cache holds {len(cache)} tokens, more than the prompt's "
                         f"{len(ids)}; give a prompt that begins with all of them, or crop "
                         f"the cache to a prefix of the prompt first")
    fork = cache.copy()
    if len(fork) == len(ids):
        # The logits for the first new token come from the last prompt position's row,
        # which the cache does not keep: forget that position and feed it again.
        try:
            fork.crop(len(ids) - 1)
        except ValueError as refused:
            fork.free()
            raise ValueError(f"the cache holds the whole prompt, and its copy cannot give "
                             f"the last position back to feed it again: {refused}") from None
    more = most - len(fork)
    if not fork.room_for(more):
        fork.free()
        raise ValueError(f"the cache has no room for the {more} more positions "
                         f"this generation may need ({most} in all, for a prompt of {len(ids)} "
                         f"tokens and its max_new_tokens): {cache.room_left()}")
    return fork


SHADES = ".:-=+*#%@"   # attention weight, from the least in a row to the most


def show_steps(params, tok, prompt, settings):
    """Print the cached generator's run one forward_step a line.

    A line gives the position and token fed, the keys and values the new row attends to,
    the rows each generator computes for that step, the token chosen, and the new row's
    attention weights over the held positions, one character each. It sees forward_step
    only through its arguments and its one call of softmax_row (the attention weights),
    never through its local names."""
    with recording(sys.modules[__name__], "forward_step", "softmax_row") as calls:
        result = generate_cached(params, tok, prompt, *settings)
    first_choice = len(tok.encode(prompt)) - 1    # the last prompt position chooses first
    print(f"One printed line per forward_step, that is, per row the cached generator\n"
          f"computes. pos, token: the position and the token fed there; positions 0 to "
          f"{first_choice}\nare the prompt (prefill), and from {first_choice} on each row's "
          f"logits choose the next\ntoken (chose), fed at the next position (decode). held: "
          f"the keys and values\nin the cache, one more each step. uncached: the rows the "
          f"generator without a\ncache computes for the same choice, positions 0 to pos "
          f"again ('-': it computes\nnothing before the prompt is whole); cached: 1. "
          f"attention: the row's weight on\neach held position, one character a position, "
          f"scaled to the row's largest\n({SHADES[-1]!r}; {SHADES[0]!r} is under a ninth of "
          f"it).\n")
    steps, weights = [], []
    for call in calls:   # a step's softmax_row returns before the step itself
        if call.name == "softmax_row":
            weights.append(call.result)
        else:
            steps.append((call.args[2], weights))
            weights = []
    if not steps:
        print("(no row was computed: nothing was generated)\n")
        return
    if any(len(w) != 1 for _, w in steps):
        print("(--show cannot find the attention weights: forward_step did not call "
              "softmax_row once a step)")
    print(f"{'pos':>3} {'token':<8} {'held':>4} {'uncached':>8} {'cached':>6}  {'chose':<8} "
          f"attention to positions 0..pos")
    for position, (token_id, found) in enumerate(steps):
        choosing = position >= first_choice
        chose = repr(result["steps"][position - first_choice]["token"]) if choosing else ""
        weights = found[0] if len(found) == 1 else []
        most = max(weights, default=0) or 1
        shades = "".join(SHADES[min(len(SHADES) - 1, int(w / most * len(SHADES)))]
                         for w in weights)
        print(f"{position:>3} {tok.vocab[token_id]!r:<8} {len(weights) or '?':>4} "
              f"{position + 1 if choosing else '-':>8} {1:>6}  {chose:<8} {shades}")
    print()


def main(argv=None):
    """Continue a story from the command line with and without the cache, or show its steps."""
    parser = argparse.ArgumentParser(description="Continue a story with and without the KV "
                                                 "cache, and compare the two.")
    generate.add_generation_flags(parser)
    parser.add_argument("--show", action="store_true",
                        help="watch the cached generator step by step: each position fed, "
                             "the cache growing, the rows each generator computes and the "
                             "new row's attention (a line is 45 characters plus one per "
                             "position: 80 columns hold 35 positions)")
    args = parser.parse_args(argv)
    settings = (args.max_new_tokens, args.temperature, args.top_k, args.seed)
    try:
        params, tok = generate.load_trained(args.folder)
        start = time.perf_counter()
        uncached = generate.generate(params, tok, args.prompt, *settings)
        middle = time.perf_counter()
        cached = generate_cached(params, tok, args.prompt, *settings)
        end = time.perf_counter()
    except (OSError, ValueError) as e:
        sys.exit(f"kv_cache.py: error: {e}")
    if args.show:
        show_steps(params, tok, args.prompt, settings)
        print(cached["text"].rstrip("\n"))
        print(f"stopped: {cached['stopped']}")
    else:
        generate.print_result(cached)
    counts = work(len(tok.encode(args.prompt)), len(cached["steps"]))
    for path, seconds in (("uncached", middle - start), ("cached", end - middle)):
        print(f"{path:>8}: {counts[path + '_rows']:6,} rows, "
              f"{counts[path + '_scores']:8,} attention scores, {seconds:.3f} s")
    print(f"identical: {'yes' if cached == uncached else 'NO'}")


if __name__ == "__main__":
    lab_files.run_command(main)
