"""Shifting a rotary cache (Part 5, section 27), as a deliberate loss. When a full context
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
import svg
from deep_model import BASE, DEEP_SHAPES, DeepCache, forward, forward_step, init_params, rotate
from documents import shown
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
    """One random rotary model of this shape (4 query heads, the lab's width), in steps:
    1. feed it SEQUENCE random tokens, and compare its cached rows with the full pass;
    2. shift its cache: drop the oldest DROPPED positions and turn each kept key back by
       DROPPED (_turned_back); beside it, the same keys turned once, from the vectors
       forward_step turned, to their new positions (_turned_once): rounding apart, the
       same keys;
    3. feed the kept tokens again into a new cache (the recompute);
    4. continue the shifted cache, against the turned-once one (what rounding changes)
       and the recompute (what the dropped tokens left in the kept keys);
    5. elsewhere: also a block of keys reused at another offset (_block_elsewhere), and
       the model with a learned table instead, its old keys kept (_learned_table)."""
    ids = _random_tokens(seed)
    kept, first = ids[DROPPED:SEQUENCE], ids[SEQUENCE]
    params = init_params(layers, 4, kv_heads, WIDTH, seed, "rotary")
    # 1. fed, each call of rotate recorded
    original = DeepCache(params)
    with recording(deep_model, "rotate") as turns:
        rows = _fed(params, original, ids[:SEQUENCE])
    thetas = turns[0].args[2]
    # 2. shifted, and turned once
    back, once = _turned_back(original, thetas), _turned_once(original, turns, thetas)
    values = [layer["values"][DROPPED:] for layer in original.layers]
    # 3. recomputed (its keys and values copied before step 4 feeds it more)
    recomputed = DeepCache(params)
    _fed(params, recomputed, kept)
    fresh = [(list(layer["keys"]), list(layer["values"])) for layer in recomputed.layers]
    case = {"layers": layers, "kv_heads": kv_heads,
            "largest_logit_gap": largest_gap(rows, forward(params, ids[:SEQUENCE])),
            "floats_per_position": original.floats_per_position(),
            "key_gap_rotated_back_vs_rotated_once": _key_gap(back, once),
            "layer_1_keys_rotated_once_equal_recomputed": once[0] == fresh[0][0],
            "key_gap_rotated_once_vs_recomputed": _key_gap(once, [k for k, _ in fresh])}
    # 4. continued
    shifted = _held(params, kept, zip(back, values))
    turned_once = _held(params, kept, zip(once, values))
    case["rounding"], case["against_recompute"] = _continued(
        params, shifted, [turned_once, recomputed], first)
    # 5. elsewhere
    if elsewhere:
        case.update(_block_elsewhere(params, original, fresh, thetas, first))
        case["learned_old_keys_against_recompute"] = _learned_table(layers, kv_heads, seed,
                                                                    ids)
    return case


def _random_tokens(seed):
    """SEQUENCE random tokens to feed, and one more to continue from."""
    rng = random.Random(f"tokens {seed}")
    return [rng.randrange(VOCAB_SIZE) for _ in range(SEQUENCE + 1)]


def _turned_back(cache, thetas):
    """The shift: each layer's keys from position DROPPED on, turned back by DROPPED."""
    return [[rotate(k, -DROPPED, thetas) for k in layer["keys"][DROPPED:]]
            for layer in cache.layers]


def _turned_once(cache, turns, thetas):
    """The same keys turned once to their new positions, from the vectors forward_step
    turned into them (found in turns, the recorded calls of rotate)."""
    def unturned(key):
        return next(call.args[0] for call in turns if call.result == key)
    return [[rotate(unturned(k), position - DROPPED, thetas)
             for position, k in enumerate(layer["keys"][DROPPED:], DROPPED)]
            for layer in cache.layers]


def _block_elsewhere(params, original, fresh, thetas, first):
    """A block reused at another offset, as a prefix cache would: the kept tokens' keys
    as the recompute made them (fresh: at positions 0 on), turned on by DROPPED. With
    nothing before them (the first DROPPED positions held as blanks nobody attends to),
    against the kept tokens fed there; and after the dropped tokens, against the
    original cache."""
    moved = [([rotate(k, DROPPED, thetas) for k in keys], values) for keys, values in fresh]
    kept = original.tokens[DROPPED:]
    blank, later = [None] * DROPPED, lambda i: range(DROPPED, i + 1)
    alone = _held(params, blank + kept, [(blank + k, blank + v) for k, v in moved], later)
    alone_recomputed = _held(params, blank, [(blank, blank)] * len(moved), later)
    _fed(params, alone_recomputed, kept)
    after = _held(params, original.tokens, [(layer["keys"][:DROPPED] + k,
                                             layer["values"][:DROPPED] + v)
                                            for layer, (k, v) in zip(original.layers, moved)])
    nothing_before, = _continued(params, alone, [alone_recomputed], first)
    after_other_tokens, = _continued(params, after, [original], first)
    return {"offset_with_nothing_before": nothing_before,
            "offset_after_other_tokens": after_other_tokens}


def _learned_table(layers, kv_heads, seed, ids):
    """The same shape with a learned position table, fed the same tokens: its old keys
    kept after the oldest DROPPED are dropped (no turn can move them), continued against
    a recompute of the kept tokens."""
    params = init_params(layers, 4, kv_heads, WIDTH, seed)
    kept = ids[DROPPED:SEQUENCE]
    original, recomputed = DeepCache(params), DeepCache(params)
    _fed(params, original, ids[:SEQUENCE])
    _fed(params, recomputed, kept)
    old = _held(params, kept, [(layer["keys"][DROPPED:], layer["values"][DROPPED:])
                               for layer in original.layers])
    against_recompute, = _continued(params, old, [recomputed], ids[SEQUENCE])
    return against_recompute


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
ONE_MODEL = {"largest_logit_gap": svg.COUNT, "continuation_changed": bool}   # one model's
OVER_MODELS = dict.fromkeys(("models", "largest_logit_gap", "continuations_changed"), svg.COUNT)
RECORDS = {
    "rotary": {
        **dict.fromkeys(("positions", "dropped", "continued", "heads", "width", "base"),
                        svg.COUNT),
        "shapes": [{
            **dict.fromkeys(("layers", "kv_heads", "largest_logit_gap", "floats_per_position",
                             "key_gap_rotated_back_vs_rotated_once"), svg.COUNT),
            "layer_1_keys_rotated_once_equal_recomputed": bool,
            "key_gap_rotated_once_vs_recomputed": svg.COUNT,
            "rounding": ONE_MODEL, "against_recompute": ONE_MODEL,
            **dict.fromkeys(("offset_with_nothing_before", "offset_after_other_tokens",
                             "learned_old_keys_against_recompute"), svg.optional(ONE_MODEL))}],
        "key_gap_rotated_back_vs_rotated_once": svg.COUNT,
        "rounding": OVER_MODELS,
        "against_recompute_by_layers": [{"layers": svg.COUNT, **OVER_MODELS}],
        **dict.fromkeys(("offset_with_nothing_before", "learned_old_keys_against_recompute"),
                        OVER_MODELS)},
}


def experiment(lab):
    """Shift the cache of a rotary model of each deep_model shape, and gather the gaps over them.

    _shift for every shape of deep_shapes.experiment() (one model and one sequence each;
    elsewhere for the grouped-query ones), and the largest gaps and changed continuations
    over them: rounding alone over all, against a recompute per number of layers."""
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


# ---- what Part 5 shows of it (documents.py fills its marks) --------------------------

def _deeper_grouped(record):
    """The recorded grouped-query shapes of two layers or more."""
    return [s for s in record["rotary"]["shapes"] if s["kv_heads"] == 2 and s["layers"] > 1]


def largest_shift_gap(record, timing):
    """The largest gap between the cached rows and the full pass, over every shape."""
    return max(s["largest_logit_gap"] for s in record["rotary"]["shapes"])


def later_layers_gaps(record, timing):
    """The shifted cache's largest gap to a recompute, for 2, 3 and 4 layers."""
    return ", ".join(shown(e["largest_logit_gap"])
                     for e in record["rotary"]["against_recompute_by_layers"][1:])


def later_layers_changed(record, timing):
    """How many continuations the shift changes against a recompute, for 2, 3 and 4 layers."""
    return ", ".join(str(e["continuations_changed"])
                     for e in record["rotary"]["against_recompute_by_layers"][1:])


def offset_gaps(record, timing):
    """Per deeper grouped-query model, the largest gap of a block reused after other tokens."""
    return ", ".join(shown(s["offset_after_other_tokens"]["largest_logit_gap"])
                     for s in _deeper_grouped(record))


def offset_changed(record, timing):
    """How many deeper grouped-query models' continuations that block changes, of how many."""
    deeper = _deeper_grouped(record)
    changed = sum(s["offset_after_other_tokens"]["continuation_changed"] for s in deeper)
    return f"{changed} of {len(deeper)}"


def last_dropped_position(record, timing):
    """The last position the shift drops."""
    return record["rotary"]["dropped"] - 1


def last_position(record, timing):
    """The last position fed before the shift."""
    return record["rotary"]["positions"] - 1
