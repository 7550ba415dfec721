"""The KV cache: keep every position's key and value instead of recomputing them.

In a causal model, position i attends only to positions 0..i, so once a position's key
and value are computed they never change, however many tokens follow. The uncached
generator (generate.py) recomputes them all at every step; here each step computes one
new row, appends its key and value to the cache, and attends over the cache.

    python3 kv_cache.py "mia found a shell."    (see --help for the sampling flags)
"""
import generate
import model


class KVCache:
    """The keys and values of one sequence so far, for the params it was made for."""

    def __init__(self, params):
        self.params = params
        self.columns = model.columns(params)   # the weight matrices, ready for row()
        self.keys = []                         # one key (WIDTH floats) per position
        self.values = []                       # one value (WIDTH floats) per position

    def __len__(self):
        return len(self.keys)


def forward_step(params, cache, token_id, position):
    """Next-token logits for token_id at position, the next one after the cache's;
    appends this position's key and value to the cache."""
    if cache.params is not params:
        raise ValueError("this cache was made for different parameters; "
                         "start a new cache with KVCache(params)")
    if isinstance(position, bool) or not isinstance(position, int) or position != len(cache):
        raise ValueError(f"expected position {len(cache)}, got {position}: the cache holds "
                         f"{len(cache)} positions, so the next token goes at position "
                         f"{len(cache)} (an int); for a new sequence, start a new cache")
    if position >= model.CONTEXT:
        raise ValueError(f"position {position} is beyond the {model.CONTEXT} positions "
                         f"of the model's table")
    model.check_token_id(token_id)
    x0, _, q, k, v = model.embed_and_project(params, cache.columns, token_id, position)
    cache.keys.append(k)
    cache.values.append(v)
    _, mixed = model.attend(q, cache.keys, cache.values)   # every position so far, from the cache
    return model.mlp_and_logits(params, cache.columns, x0, mixed)[-1]


def generate_cached(params, tok, prompt, max_new_tokens=60, temperature=0.0, top_k=None,
                    seed=0):
    """Same arguments and result as generate.generate, computing one new row per step."""
    cache = KVCache(params)

    def next_logits(ids):
        # Feed the tokens the cache does not hold yet: the whole prompt on the first call
        # (prefill), then only the token chosen last (decode).
        for position in range(len(cache), len(ids)):
            logits = forward_step(params, cache, ids[position], position)
        return logits
    return generate.generate_with(next_logits, tok, prompt, max_new_tokens, temperature,
                                  top_k, seed)
