"""Training: Adam on the mean next-token cross-entropy, one story per sequence, keeping
the parameters with the lowest validation loss and writing them to best.json at the end.

    python3 train.py                                  retrains from scratch (about 10 min)
    python3 train.py --epochs 2 --out quick.json      a short look at the loss falling

Everything random comes from two seeds: CONFIG["split_seed"] splits the stories, and
CONFIG["seed"] draws the first weights and the order of the batches. So a rerun
reproduces best.json byte for byte. Nothing is written before the last epoch, so an
interrupted run (Ctrl-C) leaves best.json as it was.
"""
import argparse
import copy
import math
import os
import random
import re
import sys
import time
from itertools import accumulate
from math import fsum

import checkpoint
import model
from bpe import Tokenizer

CONFIG = {
    "vocab_size": model.VOCAB_SIZE, "context": model.CONTEXT, "width": model.WIDTH,
    "hidden": model.HIDDEN, "split_seed": 0, "seed": 1, "test_stories": 60,
    "val_stories": 100, "epochs": 24, "batch_size": 4, "learning_rate": 0.02,
    "final_learning_rate": 0.001, "beta1": 0.9, "beta2": 0.99,
}


def split_stories(text):
    """(train, val, test) lists of stories, each a line of text with its "\\n"."""
    stories = text.splitlines(keepends=True)
    if not text.endswith("\n") or "\n" in stories:
        raise ValueError("the corpus must be one story per line, each ending with a newline, "
                         "and no empty lines")
    need = CONFIG["test_stories"] + CONFIG["val_stories"] + 1
    if len(stories) < need:
        raise ValueError(f"the corpus has {len(stories)} stories; the split needs at least {need}")
    order = list(range(len(stories)))
    random.Random(CONFIG["split_seed"]).shuffle(order)
    test_end = CONFIG["test_stories"]
    val_end = test_end + CONFIG["val_stories"]
    parts = order[val_end:], order[test_end:val_end], order[:test_end]
    return tuple([stories[i] for i in sorted(part)] for part in parts)


PRONOUNS = {"he": "he", "him": "he", "his": "he", "she": "she", "her": "she"}


def openings(stories):
    """Each story's first sentence: the prompt the generators continue."""
    return [story.split(". ")[0] + "." for story in stories]


def _words(text):
    """The words and periods of text, each with where it starts: [(start, token)]."""
    return [(m.start(), m.group()) for m in re.finditer(r"[a-z]+|\.", text)]


def corpus_rules(text):
    """What story_agreement checks a story against, all read from the corpus text:

    - "names": each name and its gender ("he" or "she"): a name is a word that opens
      stories, and the first he/she/his/her/him after it has the same gender in every
      story it opens ("it" and "on" open stories whose pronouns go both ways);
    - "people": the other words a he/she can stand for, with their gender: w is one when
      the corpus says "his w. she" or "her w. he" (sister, brother, mom, dad, nan, friend);
    - "words": every word of the corpus.
    """
    stories = text.splitlines()
    seen = {"names": {}, "people": {}}
    for story in stories:
        words = [w for _, w in _words(story)]
        first = next((PRONOUNS[w] for w in words[1:] if w in PRONOUNS), None)
        if first:
            seen["names"].setdefault(words[0], set()).add(first)
        for owner, noun, stop, pronoun in zip(words, words[1:], words[2:], words[3:]):
            if (stop == "." and pronoun in ("he", "she") and owner in ("his", "her")
                    and PRONOUNS[owner] != pronoun):
                seen["people"].setdefault(noun, set()).add(pronoun)
    rules = {kind: {w: g.pop() for w, g in found.items() if len(g) == 1}
             for kind, found in seen.items()}
    rules["words"] = {w for _, w in _words(text) if w != "."}
    return rules


def story_agreement(story, rules):
    """Score a story's continuation (the text after its opening, the first sentence)
    against the corpus's rules (from corpus_rules):

    - a he, she, his, her or him in the continuation refers to the name when the story's
      first word is a name, except a he or she that opens a sentence right after one
      ending in a person word ("his sister. she"): that one refers to the person. So in
      "max made a picture for his sister. she said thank you." the she is not max's,
      and a story that does not open with a name ("it began to rain at the hill. mia
      ran home with her fish.") has no pronoun referring to it;
    - a pronoun agrees when it has the gender of the name, or of the person, it refers to;
    - every word of the continuation should be a word of the corpus.

    Returns {"name", "pronouns" (how many refer to the name), "agreeing",
    "unknown_words" (the continuation's words the corpus never uses, in order),
    "referring" (each pronoun that refers to the name: its index in story, and whether
    it agrees), "about_people" (the same for each pronoun that refers to a person),
    "clue_in_opening" (whether the opening holds a pronoun too, as in "mia lost her red
    ball.", or only the name tells the gender)}.
    """
    tokens = _words(story)
    opening_end = story.find(". ")
    start = len(story) if opening_end < 0 else opening_end + 1
    name = tokens[0][1] if tokens and tokens[0][1] in rules["names"] else None
    unknown, referring, about_people, clue = [], [], [], False
    for index, (position, word) in enumerate(tokens):
        if position < start:
            clue = clue or word in PRONOUNS
            continue
        if word == ".":
            continue
        if word not in rules["words"]:
            unknown.append(word)
        if word not in PRONOUNS:
            continue
        person = tokens[index - 2][1] if index >= 2 and tokens[index - 1][1] == "." else None
        if word in ("he", "she") and person in rules["people"]:
            about_people.append((position, word == rules["people"][person]))
        elif name is not None:
            referring.append((position, PRONOUNS[word] == rules["names"][name]))
    return {"name": name, "pronouns": len(referring),
            "agreeing": sum(agrees for _, agrees in referring), "unknown_words": unknown,
            "referring": referring, "about_people": about_people, "clue_in_opening": clue}


def story_ids(tok, prompt, result):
    """The token IDs of a generated story: the prompt's, then each chosen token's (the
    text itself may encode differently: BPE can merge across what was chosen)."""
    return tok.encode(prompt) + [tok.ids[step["token"]] for step in result["steps"]]


def story_quality(tok, corpus, prompts, results):
    """How well the greedy and the sampled stories keep the corpus's rules
    (story_agreement): pronouns that refer to the opening's name and agree with its
    gender, also split by whether the opening holds a pronoun too or only the name tells
    the gender; pronouns that refer to a person word (sister, dad) and agree with it;
    stories whose continuation uses only words of the corpus; the stories with a wrong
    pronoun, and the first three that keep every rule where only the name tells; and how
    much the model looked at the name where it chose its pronouns."""
    rules = corpus_rules(corpus)
    quality = {}
    for kind in ("greedy", "sampled"):
        stories = [r["text"] for r in results[kind]]
        scores = [story_agreement(story, rules) for story in stories]
        ids = [story_ids(tok, prompt, r) for prompt, r in zip(prompts, results[kind])]
        right = [all(agrees for _, agrees in sc["referring"] + sc["about_people"])
                 for sc in scores]
        overall = _count([pronoun for sc in scores for pronoun in sc["referring"]])
        quality[kind] = {
            "pronouns_referring_to_the_name": overall["pronouns"],
            "agreeing": overall["agreeing"],
            "agreeing_share": (round(overall["agreeing"] / overall["pronouns"], 4)
                               if overall["pronouns"] else None),   # None: no pronoun
            "agreeing_by_opening": {
                opening: _count([pronoun for sc in scores if sc["clue_in_opening"] == clue
                                 for pronoun in sc["referring"]])
                for opening, clue in (("with a pronoun", True), ("with only the name", False))},
            "pronouns_referring_to_a_person": _count(
                [pronoun for sc in scores for pronoun in sc["about_people"]]),
            "stories_of_corpus_words_only": sum(not sc["unknown_words"] for sc in scores),
            "stories_with_a_wrong_pronoun": [story for story, ok in zip(stories, right)
                                             if not ok],
            "first_three_right_where_only_the_name_tells": [
                story for story, sc, ok in zip(stories, scores, right)
                if ok and sc["referring"] and not sc["clue_in_opening"]
                and not sc["unknown_words"]][:3],
            "attention_on_the_name": attention_on_the_name(tok, ids, scores,
                                                           results["weights"][kind])}
    return quality


def _count(pronouns):
    """How many pronouns, and how many of them agree: pronouns as story_agreement lists
    them, (where, agrees)."""
    return {"pronouns": len(pronouns), "agreeing": sum(agrees for _, agrees in pronouns)}


def attention_on_the_name(tok, ids, scores, weights):
    """At each pronoun that refers to a story's name (scores: each story's
    story_agreement), the attention weight that the position choosing it (the one
    before it) put on the name's tokens, and the share an even spread over the positions
    it attends would give them; each averaged over the pronouns that agree with the name
    and over those that do not. ids: each story's token IDs as the model saw them;
    weights: each story's rows of attention weights, from a full pass over them."""
    found = {True: [], False: []}
    for story_tokens, score, rows in zip(ids, scores, weights):
        starts = list(accumulate((len(tok.vocab[t]) for t in story_tokens), initial=0))
        for offset, agrees in score["referring"]:
            row, name_tokens = rows[starts.index(offset) - 1], starts.index(len(score["name"]))
            found[agrees].append((fsum(row[:name_tokens]), name_tokens / len(row)))
    return {("agreeing" if agrees else "wrong"): {
                "pronouns": len(pairs),
                "mean_weight_on_the_name": rounded_mean([weight for weight, _ in pairs]),
                "even_share": rounded_mean([even for _, even in pairs])}
            for agrees, pairs in found.items()}


def rounded_mean(values):
    """The mean of values to 4 places; None for no values."""
    return round(fsum(values) / len(values), 4) if values else None


def mean_loss(params, sequences):
    """Mean cross-entropy per predicted token over token sequences (no gradients)."""
    total, count = 0.0, 0
    for ids in sequences:
        logits, _ = model.forward(params, ids[:-1])
        for scores, target in zip(logits, ids[1:]):
            total -= math.log(model.softmax_row(scores)[target])
            count += 1
    return total / count


def unigram_entropy(sequences):
    """Entropy (nats) of the token frequencies: the loss of a model that ignores context."""
    counts = {}
    for ids in sequences:
        for t in ids:
            counts[t] = counts.get(t, 0) + 1
    n = sum(counts.values())
    return -math.fsum(c / n * math.log(c / n) for c in counts.values())


class Adam:
    """Adam over a dict of vectors and matrices (lists of rows)."""

    def __init__(self, params):
        self.step = 0
        self.m = {k: _zeros_like(v) for k, v in params.items()}
        self.v = {k: _zeros_like(v) for k, v in params.items()}

    def update(self, params, grads, lr):
        self.step += 1
        b1, b2 = CONFIG["beta1"], CONFIG["beta2"]
        c1, c2 = 1 - b1 ** self.step, 1 - b2 ** self.step
        for name in params:
            is_vector = not isinstance(params[name][0], list)
            rows = zip(*(([x] if is_vector else x)
                         for x in (params[name], grads[name], self.m[name], self.v[name])))
            new = []
            for p_row, g_row, m_row, v_row in rows:
                m_row[:] = [b1 * m + (1 - b1) * g for m, g in zip(m_row, g_row)]
                v_row[:] = [b2 * v + (1 - b2) * g * g for v, g in zip(v_row, g_row)]
                new.append([p - lr * (m / c1) / (math.sqrt(v / c2) + 1e-8)
                            for p, m, v in zip(p_row, m_row, v_row)])
            params[name] = new[0] if is_vector else new


def _zeros_like(value):
    return [_zeros_like(x) for x in value] if isinstance(value[0], list) else [0.0] * len(value)


def average_grads(grads_list):
    """The element-wise mean of several gradient dicts."""
    n = len(grads_list)
    out = {}
    for name, first in grads_list[0].items():
        if isinstance(first[0], list):
            out[name] = [[math.fsum(cells) / n for cells in zip(*rows)]
                         for rows in zip(*(g[name] for g in grads_list))]
        else:
            out[name] = [math.fsum(cells) / n for cells in zip(*(g[name] for g in grads_list))]
    return out


def train(tok, text, out_path, log=print, epochs=None):
    """Train from scratch on text's training stories for epochs (CONFIG["epochs"] unless
    given); write the checkpoint with the lowest validation loss to out_path once the last
    epoch is done. Interrupted (KeyboardInterrupt), it writes nothing and says so."""
    config = CONFIG if epochs is None else dict(CONFIG, epochs=epochs)
    train_set, val_set, _ = split_stories(text)
    train_ids = [tok.encode(s) for s in train_set]
    val_ids = [tok.encode(s) for s in val_set]
    baseline = unigram_entropy(train_ids)
    epochs, size = config["epochs"], config["batch_size"]
    total_steps = epochs * math.ceil(len(train_ids) / size)
    best, start, epoch = None, time.perf_counter(), 1
    try:
        log(f"{len(train_ids)} training and {len(val_ids)} validation stories; "
            f"unigram baseline {baseline:.4f} nats per token")
        rng = random.Random(CONFIG["seed"])
        params = model.init_params(CONFIG["seed"])
        adam = Adam(params)
        for epoch in range(1, epochs + 1):
            order = list(range(len(train_ids)))
            rng.shuffle(order)
            losses = []
            for first in range(0, len(order), size):
                batch = [train_ids[i] for i in order[first:first + size]]
                results = [model.loss_and_grads(params, ids[:-1], ids[1:]) for ids in batch]
                losses.extend(loss for loss, _ in results)
                # The learning rate falls geometrically from its first to its final value.
                fraction = adam.step / max(1, total_steps - 1)
                lr = CONFIG["learning_rate"] * (
                    CONFIG["final_learning_rate"] / CONFIG["learning_rate"]) ** fraction
                adam.update(params, average_grads([g for _, g in results]), lr)
            val = mean_loss(params, val_ids)
            seconds = time.perf_counter() - start
            improved = best is None or val < best["val_loss"]
            if improved:
                best = {"params": copy.deepcopy(params), "epoch": epoch, "val_loss": val}
            log(f"epoch {epoch:2d}/{epochs}  train {sum(losses) / len(losses):.4f}  "
                f"val {val:.4f}{' (best so far)' if improved else ''}  "
                f"{seconds:5.0f} s, about {seconds / epoch * (epochs - epoch):.0f} s left")
    except KeyboardInterrupt:
        kept = "" if best is None else (f"; this run's best (epoch {best['epoch']}, validation "
                                        f"loss {best['val_loss']:.4f}) was not saved")
        raise KeyboardInterrupt(f"during epoch {epoch}/{epochs}: {_untouched(out_path)}"
                                f"{kept}") from None
    checkpoint.save(out_path, best["params"], config, checkpoint.input_signature(tok, text),
                    epoch=best["epoch"], val_loss=best["val_loss"], unigram_baseline=baseline)
    log(f"best validation loss {best['val_loss']:.4f} = {best['val_loss'] / baseline:.1%} "
        f"of the unigram baseline (epoch {best['epoch']}); wrote {out_path}")
    return best["val_loss"], baseline


def _untouched(path):
    """What an interrupted run says of the checkpoint it did not write."""
    return f"{path} is unchanged" if os.path.exists(path) else f"nothing written to {path}"


def positive_int(text):
    """argparse type: an int of at least 1."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Retrain the model from scratch on corpus.txt and write best.json (about "
                    "10 minutes on 2 cores). Nothing is written until the last epoch, so "
                    "Ctrl-C leaves best.json as it was.")
    parser.add_argument("--epochs", type=positive_int, default=CONFIG["epochs"],
                        help=f"passes over the training stories (default {CONFIG['epochs']}; "
                             f"each takes about 30 s)")
    parser.add_argument("--out", help="where to write the checkpoint (default: best.json in "
                                      "the lab's folder); a run with other --epochs needs "
                                      "a file of its own")
    checkpoint.add_folder_flag(parser)
    args = parser.parse_args(argv)
    if args.epochs != CONFIG["epochs"] and args.out is None:
        parser.error(f"--epochs {args.epochs} needs --out: a run of other epochs must not "
                     f"replace best.json, the model the lab runs on")
    out = args.out or os.path.join(args.folder, "best.json")
    try:
        tok = Tokenizer.load(checkpoint.lab_file(args.folder, "tokenizer.json"))
        with open(checkpoint.lab_file(args.folder, "corpus.txt"), encoding="utf-8") as f:
            text = f.read()
        train(tok, text, out, epochs=args.epochs)
    except (OSError, ValueError) as e:
        sys.exit(f"train.py: error: {e}")
    except KeyboardInterrupt as e:   # train() says where; before it starts, nothing to say
        print(f"train.py: interrupted {e or f'before training: {_untouched(out)}'}",
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    checkpoint.run_command(main)
