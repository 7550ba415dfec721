"""Shifting a rotary cache (Part 4, section 24), as a deliberate loss. When a full context
drops its oldest positions, an engine can keep the rest of the cache and turn each kept
key back by the positions dropped (llama.cpp's context shift), or compute the kept
tokens again. Turning a turned key is not turning it once: the cos and sin are rounded.
And from layer 2 on, a kept key also carries what the dropped tokens gave the layers
below it, which no turn removes. This module measures both, on random deep_model models
of every shape, and a block of keys reused at another offset, and what a learned
position table leaves (no turn can move its keys).
"""
import random

import deep_model
from deep_model import BASE, DEEP_SHAPES, DeepCache, forward, forward_step, init_params, rotate
from instruments import largest_gap, recording
from model import VOCAB_SIZE, WIDTH, causal

SEQUENCE, CONTINUED = 12, 6   # positions fed; rows continued after the shift
DROPPED = SEQUENCE // 2       # the oldest half, as llama.cpp's context shift drops


def _held(params, tokens, layers, mask=causal):
    """A DeepCache holding tokens and, per layer, these (keys, values) (placeholders
    where no row attends)."""
    cache = DeepCache(params, mask)
    cache.tokens = list(tokens)
    cache.layers = [{"keys": list(keys), "values": list(values)} for keys, values in layers]
    return cache


def _fed(params, cache, ids):
    """The rows of feeding ids to cache, from its next position on."""
    return [forward_step(params, cache, token_id, len(cache)) for token_id in ids]


def _key_gap(keys, other_keys):
    """The largest difference between two caches' keys (per layer, per position)."""
    return largest_gap(*([k for layer in layers for k in layer] for layers in (keys, other_keys)))


def _continued(params, reused, references, first):
    """The reused cache continued greedily for CONTINUED rows from token first, and each
    reference fed the same tokens: for each, the largest logit gap of those rows and
    whether its own greedy continuation changes (a row's first highest score differs)."""
    fed, rows = [first], []
    for _ in range(CONTINUED):
        rows.append(forward_step(params, reused, fed[-1], len(reused)))
        fed.append(max(range(VOCAB_SIZE), key=rows[-1].__getitem__))
    compared = []
    for reference in references:
        other = _fed(params, reference, fed[:-1])
        compared.append({"largest_logit_gap": largest_gap(rows, other),
                         "continuation_changed": fed[1:] != [
                             max(range(VOCAB_SIZE), key=row.__getitem__) for row in other]})
    return compared


def _shift(layers, kv_heads, seed, elsewhere):
    """A random rotary model of this shape (4 query heads, the lab's width) fed SEQUENCE
    random tokens: its cached rows against the full pass; its cache, the oldest DROPPED
    dropped and the kept keys rotated back, against those keys unrotated and rotated once
    (rounding alone), and against a recompute of the kept tokens. elsewhere: also the
    recompute's keys rotated on by DROPPED, with nothing before them or after the
    dropped tokens, and the model with a learned table instead, its old keys kept."""
    rng = random.Random(f"tokens {seed}")
    ids = [rng.randrange(VOCAB_SIZE) for _ in range(SEQUENCE + 1)]
    kept, first = ids[DROPPED:SEQUENCE], ids[SEQUENCE]
    params = init_params(layers, 4, kv_heads, WIDTH, seed, "rotary")
    original = DeepCache(params)
    with recording(deep_model, "rotate") as turns:
        rows = _fed(params, original, ids[:SEQUENCE])
    thetas = turns[0].args[2]

    def unturned(key):   # the vector forward_step turned into this cached key
        return next(call.args[0] for call in turns if call.result == key)
    once = [[rotate(unturned(k), p - DROPPED, thetas) for p, k in
             enumerate(layer["keys"][DROPPED:], DROPPED)] for layer in original.layers]
    back = [[rotate(k, -DROPPED, thetas) for k in layer["keys"][DROPPED:]]
            for layer in original.layers]
    values = [layer["values"][DROPPED:] for layer in original.layers]
    recomputed = DeepCache(params)
    _fed(params, recomputed, kept)
    fresh = [(list(layer["keys"]), list(layer["values"])) for layer in recomputed.layers]
    case = {"layers": layers, "kv_heads": kv_heads,
            "largest_logit_gap": largest_gap(rows, forward(params, ids[:SEQUENCE])),
            "floats_per_position": original.floats_per_position(),
            "key_gap_rotated_back_vs_rotated_once": _key_gap(back, once),
            "layer_1_keys_rotated_once_equal_recomputed": once[0] == fresh[0][0],
            "key_gap_rotated_once_vs_recomputed": _key_gap(once, [k for k, _ in fresh])}
    case["rounding"], case["against_recompute"] = _continued(
        params, _held(params, kept, zip(back, values)),
        [_held(params, kept, zip(once, values)), recomputed], first)
    if elsewhere:
        moved = [([rotate(k, DROPPED, thetas) for k in keys], vs) for keys, vs in fresh]
        blank, later = [None] * DROPPED, lambda i: range(DROPPED, i + 1)
        alone = _held(params, blank + kept, [(blank + k, blank + v) for k, v in moved], later)
        alone_recomputed = _held(params, blank, [(blank, blank)] * layers, later)
        _fed(params, alone_recomputed, kept)
        after = _held(params, ids[:SEQUENCE], [(layer["keys"][:DROPPED] + k,
                                                layer["values"][:DROPPED] + v)
                                               for layer, (k, v) in zip(original.layers, moved)])
        case["offset_with_nothing_before"], = _continued(params, alone, [alone_recomputed], first)
        case["offset_after_other_tokens"], = _continued(params, after, [original], first)
        learned = init_params(layers, 4, kv_heads, WIDTH, seed)
        table, table_recomputed = DeepCache(learned), DeepCache(learned)
        _fed(learned, table, ids[:SEQUENCE])
        _fed(learned, table_recomputed, kept)
        old = _held(learned, kept, [(layer["keys"][DROPPED:], layer["values"][DROPPED:])
                                    for layer in table.layers])
        case["learned_old_keys_against_recompute"], = _continued(learned, old,
                                                                 [table_recomputed], first)
    return case


def experiment(lab):
    """_shift for every shape of experiment() (one model and one sequence each; elsewhere
    for the grouped-query ones), and the largest gaps and changed continuations over
    them: rounding alone over all, against a recompute per number of layers."""
    cases = [_shift(layers, kv_heads, seed, kv_heads == 2)
             for seed, (layers, kv_heads) in enumerate(DEEP_SHAPES)]

    def over(name, chosen):
        return {"models": len(chosen),
                "largest_logit_gap": max(c[name]["largest_logit_gap"] for c in chosen),
                "continuations_changed": sum(c[name]["continuation_changed"] for c in chosen)}
    grouped = [c for c in cases if c["kv_heads"] == 2]
    return {"positions": SEQUENCE, "dropped": DROPPED, "continued": CONTINUED, "heads": 4,
            "width": WIDTH, "base": BASE, "shapes": cases,
            "key_gap_rotated_back_vs_rotated_once":
                max(c["key_gap_rotated_back_vs_rotated_once"] for c in cases),
            "rounding": over("rounding", cases),
            "against_recompute_by_layers": [
                {"layers": layers, **over("against_recompute",
                                          [c for c in cases if c["layers"] == layers])}
                for layers in (1, 2, 3, 4)],
            "offset_with_nothing_before": over("offset_with_nothing_before", grouped),
            "learned_old_keys_against_recompute":
                over("learned_old_keys_against_recompute", grouped)}
