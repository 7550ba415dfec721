"""Checkpoints as plain JSON: the parameters, the config they were trained with, and a
signature of the data (tokenizer and corpus), so weights are never paired with the
wrong tokenizer. Python writes floats with repr, so they read back exactly.

Also what every command of the lab shares about files: each file this lab writes goes
through write_atomically (a temporary file beside the target, then a rename, so a crash
leaves either the old file or the new one); the lab's files are found in its own folder,
wherever the command runs from; and Ctrl-C or a closed pipe end a command quietly.
"""
import hashlib
import json
import os
import sys
import tempfile

import model

FORMAT = "kv-lab-checkpoint-1"
LAB = os.path.dirname(os.path.abspath(__file__))   # corpus.txt, tokenizer.json, best.json...
RESTORE = ("restore the shipped best.json (git checkout -- best.json, or download it again), "
           "or retrain with python3 train.py")


def lab_file(folder, name):
    """The path of the lab's file name in folder, or a FileNotFoundError that says how to
    get it back (a lost best.json can be restored or retrained)."""
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        where = "" if folder == LAB else " (or leave out --folder to use the lab's own folder)"
        fix = RESTORE if name == "best.json" else f"restore it with git checkout -- {name}"
        raise FileNotFoundError(f"{path} is missing: {fix}{where}")
    return path


def add_folder_flag(parser):
    """The --folder flag every command has: where the lab's files are."""
    parser.add_argument("--folder", default=LAB,
                        help="the folder holding corpus.txt, tokenizer.json, best.json and "
                             "the records (default: the lab's own folder, wherever you run "
                             "the command from)")


def run_command(main):
    """Run a command's main(): Ctrl-C ends it with one line and exit code 130, and a
    closed pipe (as in python3 trace_kv.py | head) ends it silently with 141, the codes a
    shell gives a program stopped by those signals."""
    name = os.path.basename(sys.argv[0])
    try:
        try:
            main()
        finally:
            sys.stdout.flush()   # here, not at exit, so that a closed pipe shows up below
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        # Python flushes stdout again on the way out; send that to nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)


def write_atomically(path, text):
    """Write text to path through a temporary file and a rename; never a half-written file."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path}: the folder {folder} does not exist")
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
        raise ValueError(f"{path}: not valid JSON, or cut short ({e})") from None
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
