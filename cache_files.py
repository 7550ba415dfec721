"""A prompt cache in a file (Part 4, section 25): a cache's tokens, keys and values
written as JSON (floats exact, as Python writes them), with a signature of the weights
they were computed with, so that a later process continues the prompt from the file,
bit for bit, and a file of other weights is refused.

    python3 cache_files.py "zoe went to the park." --save-cache zoe.json
    python3 cache_files.py "zoe went to the park." --load-cache zoe.json  (--help: flags)
"""
import os
import sys
import lab_files
if __name__ == "__main__":   # first: Ctrl-C while the modules below load ends in one line
    lab_files.ctrl_c_in_one_line()

import argparse
import hashlib
import json
import math
import tempfile

import generate
import model
import svg
from lab_files import read_json, write_atomically
from kv_cache import KVCache, feed, generate_cached
from stories import story_ids

CACHE_FORMAT = "kv-lab-cache-2"


def weights_signature(params):
    """Hash every parameter's floats, written exactly (repr).

    Two params objects have the same signature only if they hold the same weights."""
    model.check_shapes(params)
    data = json.dumps([params[name] for name in sorted(params)])
    return hashlib.sha256(data.encode("utf-8")).hexdigest()[:16]


def content_signature(tokens, keys, values):
    """Hash a cache's tokens, keys and values, written exactly.

    Any change to one number or token changes it."""
    data = json.dumps([tokens, keys, values])
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


def save_cache(cache, path):
    """Write the tokens, keys and values of a cache that stores them exactly to path.

    Such a cache: a KVCache, a paged sequence, a float64 QuantizedCache. JSON, floats exact,
    with the signature of the weights they were computed with and one of their own content,
    written atomically."""
    if not (isinstance(cache, KVCache) and cache.stores_exactly):
        raise ValueError(f"save_cache saves a cache whose keys and values are exact and "
                         f"complete (stores_exactly), and a {type(cache).__name__}'s are not")
    tokens, keys, values = cache.tokens, cache.keys, cache.values
    record = {"format": CACHE_FORMAT, "weights": weights_signature(cache.params),
              "content": content_signature(tokens, keys, values),
              "tokens": tokens, "keys": keys, "values": values}
    write_atomically(path, json.dumps(record, separators=(",", ":")) + "\n")


def load_cache(params, path):
    """Give a new KVCache for params holding what save_cache wrote to path.

    Refused, naming the file, if it is not a cache file of this lab, was computed with other
    weights (its keys and values would give stale logits), or is truncated or corrupted (any
    change to its tokens, keys or values: the file carries a signature of them). And since
    anyone can compute that signature again, every key and value is computed again from its
    token and position and compared with ==: a file that holds anything but what these
    weights compute for its tokens is refused."""
    model.check_shapes(params)
    record = read_json(path, CACHE_FORMAT, "a KV cache file of this lab")
    if record.get("weights") != weights_signature(params):
        raise ValueError(f"{path}: computed with other weights (signature "
                         f"{model.excerpt(record.get('weights'))}, these weights are "
                         f"{weights_signature(params)!r}): its keys and values would give "
                         f"stale logits; save the cache again with these params (python3 "
                         f"cache_files.py PROMPT --save-cache FILE)")
    tokens, keys, values = (record.get(name) for name in ("tokens", "keys", "values"))
    problem = _cache_problem(tokens, keys, values)
    if not problem and record.get("content") != content_signature(tokens, keys, values):
        problem = ("its tokens, keys and values are not the ones it was saved with (their "
                   "signature differs)")
    if problem:
        raise ValueError(f"{path}: a corrupted cache file: {problem}")
    wrong = _not_computed(params, tokens, keys, values)
    if wrong is not None:
        raise ValueError(f"{path}: the key or value of position {wrong} is not what these "
                         f"weights compute for its token there; the file was edited, and "
                         f"its signature with it")
    cache = KVCache(params)
    cache.extend(tokens, keys, values)
    return cache


def _not_computed(params, tokens, keys, values):
    """The first position whose key or value is not what params compute for its token
    there, or None. In the lesson's one-block model a key and a value depend on their
    own token and position alone: the first lines of a row, no attention, no MLP."""
    cols = model.columns(params)
    for position, (token_id, k, v) in enumerate(zip(tokens, keys, values)):
        x0 = model.add(params["tok_emb"][token_id], params["pos_emb"][position])
        h1 = model.layernorm(x0, params["ln1_g"], params["ln1_b"])
        if model.linear(h1, cols["Wk"]) != k or model.linear(h1, cols["Wv"]) != v:
            return position
    return None


def _cache_problem(tokens, keys, values):
    """What is wrong with a cache file's lists, or None."""
    if not all(isinstance(part, list) for part in (tokens, keys, values)):
        return "tokens, keys and values must be lists"
    if not len(tokens) == len(keys) == len(values) <= model.CONTEXT:
        return (f"{len(tokens)} tokens, {len(keys)} keys and {len(values)} values, where "
                f"each must have one per position, at most {model.CONTEXT}")
    for position, token_id in enumerate(tokens):
        if not model.is_int(token_id) or not 0 <= token_id < model.VOCAB_SIZE:
            return f"the token at position {position} is {token_id!r}, outside the vocabulary"
    for name, vectors in (("key", keys), ("value", values)):
        for position, vector in enumerate(vectors):
            if not isinstance(vector, list) or len(vector) != model.WIDTH or \
                    not all(type(x) is float and math.isfinite(x) for x in vector):
                return (f"the {name} of position {position} is not {model.WIDTH} finite "
                        f"floats")
    return None


# ---- the experiment (a stage of trace_kv.py) ---------------------------------------

# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "cache_files": {
        "positions": svg.COUNT, "bytes": svg.COUNT, "bytes_per_position": svg.COUNT},
}


def experiment(lab, runs):
    """Measure the bytes per position of save_cache's files for the greedy stories' caches.

    Every position fed; exact floats written as JSON text."""
    params, tok = lab.params, lab.tok
    positions = written = 0
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "cache.json")
        for prompt, result in zip(lab.prompts, runs.greedy):
            cache = KVCache(params)
            feed(params, cache, story_ids(tok, prompt, result)[:-1])
            save_cache(cache, path)
            positions += len(cache)
            written += os.path.getsize(path)
    return {"positions": positions, "bytes": written,
            "bytes_per_position": round(written / positions, 2)}


def main(argv=None):
    """Save a prompt's cache to a file, or continue a prompt from one (the command line)."""
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
        sys.exit(f"cache_files.py: error: {e}")
    generate.print_result(result)
    print(f"{done} ({os.path.getsize(args.save_cache or args.load_cache):,} bytes)")
    print(f"identical to the uncached generator: {'yes' if result == uncached else 'NO'}")
    if result != uncached:
        sys.exit(1)


if __name__ == "__main__":
    lab_files.run_command(main)
