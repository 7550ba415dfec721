"""Training: Adam on the mean next-token cross-entropy, one story per sequence, keeping
the checkpoint with the lowest validation loss in best.json.

    python3 train.py    retrains from scratch and rewrites best.json

Everything random comes from CONFIG["seed"], so a rerun on the same Python reproduces
best.json byte for byte.
"""
import argparse
import math
import random
import sys
import time

import checkpoint
import model
from bpe import Tokenizer

CONFIG = {
    "vocab_size": model.VOCAB_SIZE, "context": model.CONTEXT, "width": model.WIDTH,
    "hidden": model.HIDDEN, "seed": 0, "test_stories": 60, "val_stories": 100,
    "epochs": 24, "batch_size": 4, "learning_rate": 0.02, "final_learning_rate": 0.001,
    "beta1": 0.9, "beta2": 0.99,
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
    random.Random(CONFIG["seed"]).shuffle(order)
    test_end = CONFIG["test_stories"]
    val_end = test_end + CONFIG["val_stories"]
    parts = order[val_end:], order[test_end:val_end], order[:test_end]
    return tuple([stories[i] for i in sorted(part)] for part in parts)


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


def train(tok, text, out_path="best.json", log=print):
    """Train from scratch on text's training stories; write the best checkpoint to out_path."""
    train_set, val_set, _ = split_stories(text)
    train_ids = [tok.encode(s) for s in train_set]
    val_ids = [tok.encode(s) for s in val_set]
    baseline = unigram_entropy(train_ids)
    log(f"{len(train_ids)} training and {len(val_ids)} validation stories; "
        f"unigram baseline {baseline:.4f} nats per token")
    rng = random.Random(CONFIG["seed"])
    params = model.init_params(CONFIG["seed"])
    adam = Adam(params)
    epochs, size = CONFIG["epochs"], CONFIG["batch_size"]
    total_steps = epochs * math.ceil(len(train_ids) / size)
    signature = checkpoint.input_signature(tok, text)
    best, start = None, time.perf_counter()
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
        improved = best is None or val < best
        if improved:
            best = val
            checkpoint.save(out_path, params, CONFIG, signature, epoch=epoch,
                            val_loss=val, unigram_baseline=baseline)
        log(f"epoch {epoch:2d}/{epochs}  train {sum(losses) / len(losses):.4f}  "
            f"val {val:.4f}{' (best, saved)' if improved else ''}  "
            f"{seconds:5.0f} s, about {seconds / epoch * (epochs - epoch):.0f} s left")
    log(f"best validation loss {best:.4f} = {best / baseline:.1%} of the unigram baseline")
    return best, baseline


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Retrain the model from scratch on corpus.txt and write best.json.")
    parser.parse_args(argv)
    try:
        tok = Tokenizer.load("tokenizer.json")
        with open("corpus.txt", encoding="utf-8") as f:
            text = f.read()
        train(tok, text)
    except (OSError, ValueError) as e:
        sys.exit(f"train.py: error: {e}")


if __name__ == "__main__":
    main()
