"""Training: Adam on the mean next-token cross-entropy, one story per sequence, keeping
the parameters with the lowest validation loss and writing them to best.json at the end.

    python3 train.py                                  retrains from scratch (about 10 min)
    python3 train.py --epochs 2 --out quick.json      a short look at the loss falling

Everything random comes from two seeds: CONFIG["split_seed"] splits the stories, and
CONFIG["seed"] draws the first weights and the order of the batches. So a rerun
reproduces best.json byte for byte. Nothing is written before the last epoch, so an
interrupted run (Ctrl-C) leaves best.json as it was.
"""
import os
import sys
import lab_files
if __name__ == "__main__":   # first: Ctrl-C while the modules below load ends in one line
    lab_files.ctrl_c_in_one_line()

import argparse
import copy
import math
import random
import time

import checkpoint
import model
from bpe import Tokenizer
from checkpoint import CONFIG
from lab_files import positive_int
from stories import split_stories   # train.CONFIG and train.split_stories: the contract


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
    """Train from scratch on text's training stories, writing the best checkpoint to out_path.

    It runs for epochs (CONFIG["epochs"] unless given) and writes the checkpoint with the
    lowest validation loss once the last epoch is done. Interrupted (KeyboardInterrupt),
    it writes nothing and says so."""
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


def main(argv=None):
    """Retrain the model from the command line and write its checkpoint."""
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
    lab_files.add_folder_flag(parser)
    args = parser.parse_args(argv)
    if args.epochs != CONFIG["epochs"] and args.out is None:
        parser.error(f"--epochs {args.epochs} needs --out: a run of other epochs must not "
                     f"replace best.json, the model the lab runs on")
    out = args.out or os.path.join(args.folder, "best.json")
    try:
        tok = Tokenizer.load(lab_files.lab_file(args.folder, "tokenizer.json"))
        with open(lab_files.lab_file(args.folder, "corpus.txt"), encoding="utf-8") as f:
            text = f.read()
        train(tok, text, out, epochs=args.epochs)
    except (OSError, ValueError) as e:
        sys.exit(f"train.py: error: {e}")
    except KeyboardInterrupt as e:   # train() says where; before it starts, nothing to say
        print(f"train.py: interrupted {e or f'before training: {_untouched(out)}'}",
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    lab_files.run_command(main)
