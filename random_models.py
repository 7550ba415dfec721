"""Random models of the lab's shapes, random prompts and tokens: what the tests' seeded random
cases draw (support.check_random_cases runs them, naming a failing case's seed).

random_case(n) draws all from random.Random(n): a model's params of the lab's shapes at a
scale, a prompt, and the settings generate takes; every LONG_EVERY-th case a model that
never ends its story, run until the context is full.
"""
import math
import random

import model
from generate import never_ending
from support import TOK

SCALES = (0.1, 0.3, 1.0, 2.0, 5.0)          # weight matrices and biases
EMBEDDING_SCALES = (0.1, 1.0, 5.0)
TEMPERATURES = (0.0, 0.3, 1.0, 2.5)         # 0.0 is greedy
TOP_KS = (1, 2, 3, 10, model.VOCAB_SIZE, None)
LONG_EVERY = 20         # cases 0, 20, 40, ...: a long prompt, run until the context is full


def random_model(rng, scale, embedding_scale):
    """Uniform random params of the lab's shapes from rng: matrices with std scale / sqrt(inputs).

    Embeddings with std embedding_scale, layer-norm gains in [-3, 3], biases in [-scale, scale]."""
    def matrix(rows, cols, std):
        half_width = std * math.sqrt(3)   # a uniform on [-w, w] has std w / sqrt(3)
        return [[rng.uniform(-half_width, half_width) for _ in range(cols)]
                for _ in range(rows)]
    params = {}
    for name, shape in model.SHAPES.items():
        if name.endswith("_emb"):
            params[name] = matrix(*shape, embedding_scale)
        elif len(shape) == 2:
            params[name] = matrix(*shape, scale / math.sqrt(shape[0]))
        elif name.endswith("_g"):
            params[name] = [rng.uniform(-3.0, 3.0) for _ in range(shape[0])]
        else:
            params[name] = [rng.uniform(-scale, scale) for _ in range(shape[0])]
    return params


def random_tokens(count, seed=0):
    """count token IDs drawn from random.Random(seed), for the random models of Part 5."""
    rng = random.Random(seed)
    return [rng.randrange(model.VOCAB_SIZE) for _ in range(count)]


def random_prompt(rng, fewest, most):
    """The text of random token IDs, re-drawn until it encodes to fewest..most tokens.

    Its text alone counts (encoding may merge otherwise); it holds a letter, as generate needs."""
    while True:
        ids = [rng.randrange(model.VOCAB_SIZE) for _ in range(rng.randint(fewest, most))]
        prompt = TOK.decode(ids)
        if fewest <= len(TOK.encode(prompt)) <= most and any(map(str.isalpha, prompt)):
            return prompt


def random_case(index):
    """Random case index, all from random.Random(index): (params, prompt, settings, a label)."""
    rng = random.Random(index)
    scale, embedding_scale = rng.choice(SCALES), rng.choice(EMBEDDING_SCALES)
    params = random_model(rng, scale, embedding_scale)
    long = index % LONG_EVERY == 0
    if long:
        params = never_ending(params, TOK)
        prompt = random_prompt(rng, 50, 60)
    else:
        prompt = random_prompt(rng, 1, 12)
    settings = {"max_new_tokens": model.CONTEXT if long else rng.randint(0, 8),
                "temperature": rng.choice(TEMPERATURES),
                "top_k": rng.choice(TOP_KS), "seed": rng.randrange(2 ** 32)}
    label = {"case": index, "scale": scale, "embedding_scale": embedding_scale,
             "never_ends": long, "prompt_tokens": len(TOK.encode(prompt)), **settings}
    return params, prompt, settings, label
