"""Checkpoints as plain JSON: the parameters, the config they were trained with (CONFIG,
the model's shape and the training settings), and a signature of the data (tokenizer and
corpus), so weights are never paired with the wrong tokenizer. Python writes floats with
repr, so they read back exactly.

Also what every command of the lab shares about files: each file this lab writes goes
through write_atomically (a temporary file beside the target, then a rename, so a crash
leaves either the old file or the new one); the lab's files are found in its own folder,
wherever the command runs from; and Ctrl-C or a closed pipe end a command quietly.
"""
import contextlib
import hashlib
import json
import os
import signal
import stat
import sys
import tempfile
import time

import model

FORMAT = "kv-lab-checkpoint-1"
# The model's shape and the training settings: a checkpoint records them, and loading
# refuses one trained with others.
CONFIG = {
    "vocab_size": model.VOCAB_SIZE, "context": model.CONTEXT, "width": model.WIDTH,
    "hidden": model.HIDDEN, "split_seed": 0, "seed": 1, "test_stories": 60,
    "val_stories": 100, "epochs": 24, "batch_size": 4, "learning_rate": 0.02,
    "final_learning_rate": 0.001, "beta1": 0.9, "beta2": 0.99,
}
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


def positive_int(text):
    """argparse type: an int of at least 1."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def run_command(main):
    """Run a command's main(): Ctrl-C ends it with one line and exit code 130, and a
    closed pipe (as in python3 trace_kv.py | head) ends it silently with 141, the codes a
    shell gives a program stopped by those signals."""
    name = os.path.basename(sys.argv[0])
    # A termination (kill, a closed terminal) unwinds like Ctrl-C, so that a file being
    # written removes its temporary file; exit code 143, as a shell gives.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
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


MAX_BYTES = 16 * 1024 * 1024   # far more than any file of the lab (best.json: 150 kB)
STALE_SECONDS = 10             # a temporary file left this long is a killed save's
NAME_MAX = 255                 # the longest file name most file systems take


def file_path(path):
    """path as a str, refusing what cannot name a file: not a str (a number would be
    read as a file descriptor), empty, or ending with a folder separator."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"a file name is needed (a str), got {path!r}")
    path = os.fspath(path)
    if not path or path.endswith(("/", os.sep)):
        raise ValueError(f"{path!r} is not a file name: it names a folder")
    return path


def write_atomically(path, text):
    """Write text to path through a temporary file beside it and a rename; never a
    half-written file. The temporary file is named after the target
    (.NAME.tmp-XXXX.part, NAME a hash of a name too long to lengthen): a save interrupted
    by Ctrl-C or a termination removes its own, and one killed outright leaves it for the
    next save of the same file to remove."""
    path = file_path(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path}: the folder {folder} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"cannot write {path}: it is a folder")
    name = os.path.basename(path)
    if len(name.encode("utf-8")) > NAME_MAX - 20:   # the temporary name adds 20 at most
        name = hashlib.sha256(name.encode("utf-8")).hexdigest()[:16]
    prefix = f".{name}.tmp-"
    for entry in os.listdir(folder):
        stale = os.path.join(folder, entry)
        if entry.startswith(prefix) and entry.endswith(".part") \
                and time.time() - os.path.getmtime(stale) > STALE_SECONDS:
            os.unlink(stale)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=".part")
    except OSError as e:
        raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)   # mkstemp makes it private; the lab's files are for reading
        os.replace(tmp, path)
    except BaseException as failed:
        with contextlib.suppress(FileNotFoundError):   # an interrupt just after the rename
            os.unlink(tmp)
        if isinstance(failed, OSError) and failed.strerror:
            raise OSError(failed.errno, f"cannot write {path}: {failed.strerror}") from None
        raise


def read_json(path, fmt, what):
    """The JSON object in path, refusing, with the file's name, what is not a regular
    file (a folder; a named pipe, which would block) or not UTF-8 JSON of format fmt (any
    object, for fmt None): too large, too deeply nested, or a number beyond Python's
    limit. A missing file raises FileNotFoundError."""
    path = file_path(path)
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file (a pipe or a device)"
        raise ValueError(f"{path}: {kind}, so not {what}")
    with open(path, "rb") as f:
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise ValueError(f"{path}: larger than {MAX_BYTES:,} bytes, so not {what}")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON, or cut short ({e})") from None
    except (ValueError, RecursionError) as e:   # a 5,000-digit number; [[[[...]]]]
        raise ValueError(f"{path}: not {what} ({type(e).__name__}: "
                         f"{str(e)[:120] or 'nested too deeply'})") from None
    if not isinstance(data, dict) or (fmt is not None and data.get("format") != fmt):
        wanted = "a JSON object" if fmt is None else f"expected \"format\": \"{fmt}\""
        raise ValueError(f"{path}: not {what} ({wanted})")
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
