"""Checkpoints as plain JSON: the parameters, the config they were trained with, and a
signature of the data (tokenizer and corpus), so weights are never paired with the
wrong tokenizer. Python writes floats with repr, so they read back exactly.

Every file this lab writes goes through write_atomically: a temporary file beside the
target, then a rename, so a crash leaves either the old file or the new one.
"""
import hashlib
import json
import os
import tempfile

import model

FORMAT = "kv-lab-checkpoint-1"


def write_atomically(path, text):
    """Write text to path through a temporary file and a rename; never a half-written file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".part")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)   # mkstemp makes it private; the lab's files are for reading
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_json(path, fmt, what):
    """The JSON object in path, refusing a file that is not UTF-8 JSON of format fmt."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise ValueError(f"{path}: not {what} (expected \"format\": \"{fmt}\")")
    return data


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
                         f"retrain with python3 train.py")
    if record.get("signature") != signature:
        raise ValueError(f"{path}: trained on other data or another tokenizer "
                         f"(signature {record.get('signature')!r}, expected {signature!r}); "
                         f"retrain with python3 train.py")
    try:
        model.check_params(record.get("params"))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return record
