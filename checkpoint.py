"""Checkpoints as plain JSON: the parameters, the config they were trained with (CONFIG,
the model's shape and the training settings), and a signature of the data (tokenizer and
corpus), so weights are never paired with the wrong tokenizer. Python writes floats with
repr, so they read back exactly. The file is written and read through lab_files.py.
"""
import hashlib
import json

import model
from lab_files import RESTORE, read_json, write_atomically

FORMAT = "kv-lab-checkpoint-1"
# The model's shape and the training settings: a checkpoint records them, and loading
# refuses one trained with others.
CONFIG = {
    "vocab_size": model.VOCAB_SIZE, "context": model.CONTEXT, "width": model.WIDTH,
    "hidden": model.HIDDEN, "split_seed": 0, "seed": 1, "test_stories": 60,
    "val_stories": 100, "epochs": 24, "batch_size": 4, "learning_rate": 0.02,
    "final_learning_rate": 0.001, "beta1": 0.9, "beta2": 0.99,
}


def input_signature(tok, corpus_text):
    """A hash of the tokenizer's vocabulary and merges and of the corpus text."""
    data = json.dumps({"vocab": tok.vocab, "merges": tok.merges, "corpus": corpus_text})
    return hashlib.sha256(data.encode("utf-8")).hexdigest()[:16]


def save(path, params, config, signature, **meta):
    """Write params with their config, data signature and any extra facts (meta)."""
    model.check_params(params)
    record = {"format": FORMAT, "config": config, "signature": signature, "meta": meta,
              "params": params}
    write_atomically(path, json.dumps(record, separators=(",", ":")) + "\n")


def load(path, config, signature):
    """Read a checkpoint, refusing one made with another config, data or format."""
    record = read_json(path, FORMAT, "a checkpoint of this lab")
    saved = record.get("config")
    if saved != config:
        saved = saved if isinstance(saved, dict) else {}
        keys = sorted(k for k in set(saved) | set(config) if saved.get(k) != config.get(k))
        raise ValueError(f"{path}: trained with another config (differs in {', '.join(keys)}); "
                         f"{RESTORE}")
    if record.get("signature") != signature:
        raise ValueError(f"{path}: trained on other data or another tokenizer "
                         f"(signature {record.get('signature')!r}, expected {signature!r}); "
                         f"{RESTORE}")
    try:
        model.check_params(record.get("params"))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return record
