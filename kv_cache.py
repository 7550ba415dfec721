"""The KV cache: keep every position's key and value instead of recomputing them.

In a causal model, position i attends only to positions 0..i, so once a position's key
and value are computed they never change, however many tokens follow. The uncached
generator (generate.py) recomputes them all at every step; here each step computes one
new row, appends its key and value to the cache, and attends over the cache.

    python3 kv_cache.py "mia found a shell at the beach."    (--help lists the flags)
"""
import argparse
import copy
import sys
import time

import checkpoint
import generate
import model
from model import SCALE, add, dot, layernorm, relu, row, softmax_row


class KVCache:
    """The keys and values of one sequence so far, for the params it was made for."""

    def __init__(self, params):
        model.check_shapes(params)
        self.params = params
        self.columns = model.columns(params)   # the weight matrices, ready for row()
        self.tokens = []                       # the token ID at each position
        self.keys = []                         # one key (WIDTH floats) per position
        self.values = []                       # one value (WIDTH floats) per position

    def __len__(self):
        return len(self.keys)

    def copy(self):
        """An independent cache holding the same positions: a fork of this sequence."""
        fork = copy.copy(self)   # the same params and columns; rows are never changed in place
        fork.tokens, fork.keys, fork.values = self.tokens[:], self.keys[:], self.values[:]
        return fork

    def crop(self, length):
        """Forget every position from length on (rewind the sequence to length tokens)."""
        if isinstance(length, bool) or not isinstance(length, int) \
                or not 0 <= length <= len(self):
            raise ValueError(f"crop length must be an int from 0 to {len(self)} "
                             f"(the positions held), got {length!r}")
        del self.tokens[length:], self.keys[length:], self.values[length:]


def _check_owner(cache, params):
    """A cache belongs to the very params object it was made for (a copy is another model)."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache, got {type(cache).__name__}; "
                         f"start one with KVCache(params)")
    if cache.params is not params:
        raise ValueError("this cache was made for different parameters; "
                         "start a new cache with KVCache(params)")


def forward_step(params, cache, token_id, position):
    """Next-token logits for token_id at position, the next one after the cache's;
    appends this position's key and value to the cache.

    The row is model.forward's, line for line; only the keys and values differ in where
    they come from: here, the cache."""
    _check_owner(cache, params)
    if isinstance(position, bool) or not isinstance(position, int) or position != len(cache):
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
    q, k, v = row(h1, cols["Wq"]), row(h1, cols["Wk"]), row(h1, cols["Wv"])
    cache.tokens.append(token_id)
    cache.keys.append(k)        # before attention: a position attends to itself too
    cache.values.append(v)
    keys, values = cache.keys, cache.values      # positions 0..position, from the cache
    scores = [dot(q, k_j) * SCALE for k_j in keys]
    weights = softmax_row(scores)
    mixed = [dot(weights, column) for column in zip(*values)]
    x1 = add(x0, row(mixed, cols["Wo"]))
    h2 = layernorm(x1, params["ln2_g"], params["ln2_b"])
    a = relu(add(row(h2, cols["W1"]), params["b1"]))
    x2 = add(x1, add(row(a, cols["W2"]), params["b2"]))   # the MLP output plus its bias first
    hf = layernorm(x2, params["lnf_g"], params["lnf_b"])
    return add(row(hf, cols["W_out"]), params["b_out"])


def feed(params, cache, ids):
    """Feed the tokens of ids that the cache does not hold yet, one forward_step each
    (positions len(cache) to len(ids) - 1); their rows of logits, in order."""
    return [forward_step(params, cache, ids[position], position)
            for position in range(len(cache), len(ids))]


def work(prompt_tokens, generated_tokens):
    """Rows and attention scores each generator computes for a prompt of prompt_tokens
    tokens and generated_tokens chosen tokens (one model call per chosen token)."""
    for name, value in (("prompt_tokens", prompt_tokens), ("generated_tokens", generated_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    # Without the cache, call s runs the model on all n = prompt_tokens + s tokens in hand.
    calls = range(prompt_tokens, prompt_tokens + generated_tokens)
    # With it, every position is fed once, except the last chosen token (never fed back).
    fed = prompt_tokens + generated_tokens - 1 if generated_tokens else 0
    return {
        "uncached_rows": sum(calls),
        "cached_rows": fed,
        "uncached_scores": sum(n * (n + 1) // 2 for n in calls),   # row i has i + 1 scores
        "cached_scores": fed * (fed + 1) // 2,
    }


def generate_cached(params, tok, prompt, max_new_tokens=60, temperature=0.0, top_k=None,
                    seed=0, cache=None):
    """Same arguments and result as generate.generate, computing one new row per step.
    Given a cache that holds the start of the prompt, starts from a copy of it."""
    if cache is None:
        cache = KVCache(params)
    ids = generate.check_request(tok, prompt, max_new_tokens, temperature, top_k, seed)
    cache = _fork_for_prompt(params, cache, ids, tok)

    def next_logits(ids):
        # The whole prompt on the first call (prefill), then only the token chosen last
        # (decode).
        return feed(params, cache, ids)[-1]
    return generate.generate_with(next_logits, tok, ids, max_new_tokens, temperature,
                                  top_k, seed)


def _fork_for_prompt(params, cache, ids, tok):
    """A copy of cache to continue the prompt ids from, after checking that the cache
    belongs to params and holds a prefix of ids."""
    _check_owner(cache, params)
    if len(cache.tokens) != len(cache):
        raise ValueError(f"the cache holds {len(cache)} keys but {len(cache.tokens)} tokens: "
                         f"its lists were changed by hand; start a new cache")
    for position, (held, wanted) in enumerate(zip(cache.tokens, ids)):
        if held != wanted:
            raise ValueError(f"the cache is not a prefix of the prompt: at position {position} "
                             f"it holds {tok.vocab[held]!r}, the prompt has {tok.vocab[wanted]!r}")
    if len(cache) > len(ids):
        raise ValueError(f"the cache holds {len(cache)} tokens, more than the prompt's "
                         f"{len(ids)}; crop it to a prefix of the prompt first")
    fork = cache.copy()
    if len(fork) == len(ids):
        # The scores for the first new token come from the last prompt position's row,
        # which the cache does not keep: forget that position and feed it again.
        fork.crop(len(ids) - 1)
    return fork


def main(argv=None):
    parser = argparse.ArgumentParser(description="Continue a story with and without the KV "
                                                 "cache, and compare the two.")
    generate.add_generation_flags(parser)
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
    generate.print_result(cached)
    counts = work(len(tok.encode(args.prompt)), len(cached["steps"]))
    for path, seconds in (("uncached", middle - start), ("cached", end - middle)):
        print(f"{path:>8}: {counts[path + '_rows']:6,} rows, "
              f"{counts[path + '_scores']:8,} attention scores, {seconds:.3f} s")
    print(f"identical: {'yes' if cached == uncached else 'NO'}")


if __name__ == "__main__":
    checkpoint.run_command(main)
