"""Generation without a cache: for every new token, run the whole model on every token
so far and use only the last row's logits. Simple, and it redoes all the work for the
opening at every step. kv_cache.py keeps that work instead.

    python3 generate.py "zoe went to the park." [--temperature T] [--top-k K]
                        [--seed S] [--max-new-tokens N]

A prompt is lowercase letters, spaces, commas and periods: the stories' alphabet.
"""
import sys
import lab_files
if __name__ == "__main__":   # first: Ctrl-C while the modules below load ends in one line
    lab_files.ctrl_c_in_one_line()

import argparse
import math
import random

import checkpoint
import model
from bpe import Tokenizer
from checkpoint import CONFIG

PROMPT_HELP = ("the opening to continue, in lowercase letters, spaces, commas and periods "
               '(the stories\' alphabet), e.g. "zoe went to the park."')


def load_trained(folder=lab_files.LAB):
    """The shipped model from folder's tokenizer.json, corpus.txt and best.json.

    Gives (params, tokenizer), refusing a checkpoint of other data."""
    tokenizer, corpus, best = (lab_files.lab_file(folder, name)
                               for name in ("tokenizer.json", "corpus.txt", "best.json"))
    tok = Tokenizer.load(tokenizer)
    with open(corpus, encoding="utf-8") as f:
        signature = checkpoint.input_signature(tok, f.read())
    return checkpoint.load(best, CONFIG, signature)["params"], tok


def check_settings(temperature, top_k, vocab_size):
    """Raise ValueError unless temperature and top_k are settings generation can use.

    temperature must be a finite number >= 0, top_k None or an int from 1 to vocab_size."""
    if not (model.is_int(temperature) or isinstance(temperature, float)) \
            or abs(temperature) > sys.float_info.max or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got "
                         f"{model.excerpt(temperature)}")
    if top_k is not None:
        model.check_int("top_k", top_k, 1, vocab_size, " (or None)")


def next_token_probs(logits, temperature, top_k):
    """Probabilities for the next token, greedy or sampled, from its logits.

    Greedy (1.0 at the first highest score) at temperature 0, else the softmax of
    logits / temperature over the top_k highest."""
    check_settings(temperature, top_k, len(logits))
    if temperature == 0:
        best = logits.index(max(logits))
        return [1.0 if i == best else 0.0 for i in range(len(logits))]
    kept = range(len(logits)) if top_k is None else \
        sorted(range(len(logits)), key=lambda i: -logits[i])[:top_k]
    scaled = [logits[i] / temperature for i in kept]
    if not all(map(math.isfinite, scaled)):
        raise ValueError(f"temperature {temperature!r} is too small for these scores: divided "
                         f"by it, a score goes beyond a float's range (0 is greedy)")
    probs = [0.0] * len(logits)
    for i, p in zip(kept, model.softmax_row(scaled)):
        probs[i] = p
    return probs


def check_tokenizer(tok):
    """Refuse anything but a Tokenizer."""
    if not isinstance(tok, Tokenizer):
        raise ValueError(f"tok must be a bpe.Tokenizer (as generate.load_trained() gives), "
                         f"got {type(tok).__name__}")


def check_seeds(seeds):
    """Refuse seeds that are not a list, a tuple or a range of ints.

    An iterator is refused since one pass over it uses it up; the message names the first
    seed that is not an int."""
    if not isinstance(seeds, (list, tuple, range)):
        raise ValueError(f"seeds must be a list, a tuple or a range of ints, one a "
                         f"continuation, got {type(seeds).__name__}")
    for index, seed in enumerate(seeds):
        model.check_seed(seed, f"seeds[{index}]")


def check_request(tok, prompt, max_new_tokens, temperature, top_k, seed):
    """The prompt's token IDs, after refusing every bad argument of generate."""
    check_tokenizer(tok)
    check_settings(temperature, top_k, len(tok.vocab))
    model.check_seed(seed)
    model.check_int("max_new_tokens", max_new_tokens, 0)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt must be a non-empty string, got {prompt!r}")
    if not any(char.isalpha() for char in prompt):
        raise ValueError(f"prompt has no letters, got {prompt!r}: start the story with a "
                         f"few words, e.g. 'mia found a shell.'")
    ids = tok.encode(prompt)
    if len(ids) > model.CONTEXT:
        raise ValueError(f"prompt is {len(ids)} tokens, longer than the model's "
                         f"{model.CONTEXT} positions")
    return ids


class Generation:
    """One generation in progress, from the prompt's token IDs (checked by check_request).

    It holds the token IDs so far (ids), the chosen steps, its own random numbers, and why
    it stopped (stopped: None while it goes on). Whoever computes the logits for the token
    after ids hands them to choose()."""

    def __init__(self, tok, ids, max_new_tokens, temperature, top_k, seed):
        self.tok, self.ids, self.steps = tok, ids, []
        self.max_new_tokens, self.temperature, self.top_k = max_new_tokens, temperature, top_k
        self.rng = random.Random(seed)
        self.stopped = self._stop_reason()

    def choose(self, logits):
        """Choose the next token from the logits for the token after ids, and append it."""
        probs = next_token_probs(logits, self.temperature, self.top_k)
        if self.temperature == 0:
            token_id = probs.index(1.0)
        else:
            token_id = self.rng.choices(range(len(probs)), weights=probs)[0]
        self.ids.append(token_id)
        self.steps.append({"token": self.tok.vocab[token_id],
                           "probability": round(probs[token_id], 4)})
        self.stopped = ("end of story" if token_id == self.tok.ids["\n"]
                        else self._stop_reason())

    def _stop_reason(self):
        if len(self.steps) == self.max_new_tokens:
            return "max_new_tokens"
        if len(self.ids) == model.CONTEXT:
            return "context full"
        return None

    def result(self):
        return {"text": self.tok.decode(self.ids), "steps": self.steps, "stopped": self.stopped}


def generate_with(next_logits, tok, ids, max_new_tokens, temperature, top_k, seed):
    """The generation loop, given next_logits(ids): the logits for the token after ids.

    generate and kv_cache.generate_cached differ only in the next_logits they pass."""
    generation = Generation(tok, ids, max_new_tokens, temperature, top_k, seed)
    while not generation.stopped:
        generation.choose(next_logits(generation.ids))
    return generation.result()


def generate(params, tok, prompt, max_new_tokens=60, temperature=0.0, top_k=None, seed=0):
    """Continue prompt token by token, running the full model on all tokens every step."""
    model.check_shapes(params)
    ids = check_request(tok, prompt, max_new_tokens, temperature, top_k, seed)

    def next_logits(ids):
        logits, _ = model.forward(params, ids)   # every row, again
        return logits[-1]                        # only the last one is used
    return generate_with(next_logits, tok, ids, max_new_tokens, temperature, top_k, seed)


def never_ending(params, tok):
    """A copy of params whose newline score is so low that no story ever ends."""
    changed = dict(params, b_out=list(params["b_out"]))
    changed["b_out"][tok.ids["\n"]] = -1e9
    return changed


def add_generation_flags(parser):
    """The prompt and sampling flags shared by generate.py and kv_cache.py."""
    parser.add_argument("prompt", help=PROMPT_HELP)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default) is greedy: the highest score wins, so each chosen "
                             "token shows probability 1.0000; higher samples more freely")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample only among the K highest-scoring tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling (default 0)")
    parser.add_argument("--max-new-tokens", type=int, default=60,
                        help="stop after this many new tokens (default 60)")
    lab_files.add_folder_flag(parser)


def main(argv=None):
    """Continue a story from the command line, without a cache."""
    parser = argparse.ArgumentParser(description="Continue a story with the trained model "
                                                 "(no cache: the full model every step).")
    add_generation_flags(parser)
    args = parser.parse_args(argv)
    try:
        params, tok = load_trained(args.folder)
        result = generate(params, tok, args.prompt, args.max_new_tokens, args.temperature,
                          args.top_k, args.seed)
    except (OSError, ValueError) as e:
        sys.exit(f"generate.py: error: {e}")
    print_result(result)


def print_result(result):
    """The story, each chosen token with its probability, and why generation stopped."""
    print(result["text"].rstrip("\n"))
    for step in result["steps"]:
        print(f"  {step['token']!r:12} {step['probability']:.4f}")
    print(f"stopped: {result['stopped']}")


if __name__ == "__main__":
    lab_files.run_command(main)
