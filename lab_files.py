"""The lab's files and command lines: what every command shares.

Each file the lab writes goes through write_atomically (a temporary file beside the
target, then a rename, so a crash leaves either the old file or the new one), and a set of
files that belong together through write_together (all old or all new); read_json reads
one back, refusing what is not the lab's; the lab's files are found in its own folder,
wherever the command runs from (lab_file, the --folder flag); and Ctrl-C or a closed pipe
end a command quietly (ctrl_c_in_one_line first, then run_command).
"""
import contextlib
import hashlib
import json
import os
import signal
import stat
import sys
import time

try:
    import fcntl   # POSIX
except ImportError:
    fcntl = None
    import msvcrt   # Windows

LAB = os.path.dirname(os.path.abspath(__file__))   # corpus.txt, tokenizer.json, best.json...
RESTORE = ("restore the shipped best.json (git checkout -- best.json, or download it again), "
           "or retrain with python3 train.py")


def lab_file(folder, name):
    """The path of the lab's file name in folder.

    A missing file raises a FileNotFoundError that says how to get it back (a lost
    best.json can be restored or retrained)."""
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


def ctrl_c_in_one_line():
    """Make a Ctrl-C that comes before run_command end in one line too.

    Such a Ctrl-C comes while the command's modules load: a command calls this first,
    before its other imports."""
    sys.excepthook = lambda kind, *rest: (
        print(f"{os.path.basename(sys.argv[0])}: interrupted", file=sys.stderr)
        if issubclass(kind, KeyboardInterrupt) else sys.__excepthook__(kind, *rest))


def run_command(main):
    """Run a command's main(), ending it in one line on Ctrl-C and silently on a closed pipe.

    A save of the lab's set of files (write_together) stopped midway is finished first.
    Ctrl-C gives exit code 130, a closed pipe (as in python3 trace_kv.py | head) 141: the
    codes a shell gives a program stopped by those signals."""
    name = os.path.basename(sys.argv[0])
    # A termination (kill, a closed terminal) unwinds like Ctrl-C, so that a file being
    # written removes its temporary file; exit code 143, as a shell gives.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        try:
            finish_saving(LAB)   # a save of the lab's set stopped midway: all new, first
        except (OSError, ValueError) as e:
            sys.exit(f"{name}: error: {e}")
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
NAME_MAX = 255                 # the longest file name most file systems take
LOCK = ".kv-save.lock"         # held (by the operating system) while a set of files is saved
JOURNAL = ".kv-save.journal"   # the renames of a set being saved, until the last is done
JOURNAL_FORMAT = "kv-lab-renames-1"
LOCK_SECONDS = 30              # how long a save of a set waits for another to end


def file_path(path):
    """path as a str, refusing what cannot name a file.

    Refused: not a str (a number would be read as a file descriptor), empty, or ending
    with a folder separator."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"a file name is needed (a str), got {path!r}")
    path = os.fspath(path)
    if not path or path.endswith(("/", os.sep)):
        raise ValueError(f"{path!r} is not a file name: it names a folder")
    return path


def _target(path):
    """path checked as a file to write: (path, its folder), or an error naming it."""
    path = file_path(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path}: the folder {folder} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"cannot write {path}: it is a folder")
    return path, folder


def write_atomically(path, text):
    """Write text to path through a temporary file beside it and a rename.

    path is never left half written, and no temporary file is left, whatever interrupts it:
    the temporary file is named first and made inside the try that removes it."""
    path, _ = _target(path)
    tmp = _temporary(path)
    try:
        _write_temporary(tmp, text)
        os.replace(tmp, path)
    except BaseException as failed:
        _remove(tmp)   # gone already if the interrupt came just after the rename
        raise _named(failed, path) from None


def write_together(folder, texts):
    """Write the files texts names ({file name: text}) in folder as one set.

    Whatever interrupts it, and whatever other save runs at once, they are then all old or all
    new. Under folder's lock (LOCK), every temporary file is written first, then a journal of
    the renames (JOURNAL), then the renames, with Ctrl-C and SIGTERM held from the journal to
    the last rename (a signal then is taken once the set is all new); a save stopped between
    the journal and its last rename (killed outright) is finished by the next one, or by
    finish_saving, before anything else."""
    for name in texts:   # all checked before any is written
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise ValueError(f"{name!r}: a file name in {folder} is needed, not a path")
    paths = {name: _target(os.path.join(folder, name))[0] for name in texts}
    journal = os.path.join(folder, JOURNAL)
    with _lock(folder):
        _finish_renames(folder)
        temporary = {name: _temporary(path) for name, path in paths.items()}
        try:
            for name, text in texts.items():
                try:
                    _write_temporary(temporary[name], text)
                except OSError as failed:
                    raise _named(failed, paths[name]) from None
            renames = [[os.path.basename(temporary[name]), name] for name in texts]
            with _signals_held():
                write_atomically(journal, json.dumps({"format": JOURNAL_FORMAT,
                                                      "renames": renames}))
                _finish_renames(folder)
        finally:
            if os.path.exists(journal):   # every file written: the set is new
                _finish_renames(folder)
            else:                         # renamed, or not all written: the set stays old
                for tmp in temporary.values():
                    _remove(tmp)


def finish_saving(folder):
    """Finish the save of a set in folder stopped midway through its renames, if any.

    The set is write_together's; its files are then all new. Every command does this first
    (run_command, for the lab's folder), and so do the tests, as they read the lab's files."""
    if os.path.exists(os.path.join(folder, JOURNAL)):
        with _lock(folder):
            _finish_renames(folder)


def _finish_renames(folder):
    """Do what is left of the journal's renames (a temporary file already gone is already
    renamed), then remove the journal; Ctrl-C and SIGTERM held. Called with the lock held."""
    journal = os.path.join(folder, JOURNAL)
    if not os.path.exists(journal):
        return
    renames = read_json(journal, JOURNAL_FORMAT, "a journal of a save").get("renames")
    if not isinstance(renames, list) or not all(
            isinstance(pair, list) and len(pair) == 2
            and all(isinstance(name, str) and name and os.path.basename(name) == name
                    for name in pair) for pair in renames):
        raise ValueError(f"{journal}: not a journal of a save (expected \"renames\": pairs "
                         "of file names); remove it, then save again")
    with _signals_held():
        for tmp, name in renames:
            if os.path.exists(os.path.join(folder, tmp)):
                try:
                    os.replace(os.path.join(folder, tmp), os.path.join(folder, name))
                except OSError as e:
                    raise _named(e, os.path.join(folder, name)) from None
        os.unlink(journal)


@contextlib.contextmanager
def _lock(folder):
    """Hold folder's save lock: the file LOCK, locked by the operating system (so a killed
    holder frees it), and removed by its last holder. Waits up to LOCK_SECONDS for another
    save, then refuses. Its descriptor is opened and closed with Ctrl-C and SIGTERM held,
    so that no interrupt finds it open and unnamed, or named and closed."""
    path = os.path.join(folder, LOCK)
    deadline = time.monotonic() + LOCK_SECONDS
    fd = None
    try:
        while True:
            with _signals_held():
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            while not _locked(fd):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cannot write in {folder}: another save has held "
                                       f"{LOCK} there for {LOCK_SECONDS} s; let it end, "
                                       "then run this again")
                time.sleep(0.05)
            if _same_file(fd, path):   # not a file its last holder has since removed
                break
            with _signals_held():
                os.close(fd)
                fd = None
        yield
        with _signals_held():   # in the try: an interrupt before it finds fd still named
            _unlock(fd, path)
            fd = None
    finally:
        if fd is not None:
            _unlock(fd, path)


def _unlock(fd, path):
    """Give up the lock on path, open as fd: remove the file, and close fd."""
    if os.name == "nt":   # Windows removes no open file: close first
        os.close(fd)
        _remove(path, OSError)
    else:                 # POSIX: remove it while holding it, so no one takes it over
        _remove(path, OSError)
        os.close(fd)


def _locked(fd):
    """Try to lock the open file fd, not waiting: whether it is now locked."""
    try:
        if fcntl:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except (BlockingIOError, PermissionError):
        return False
    return True


def _same_file(fd, path):
    """Whether path still names the open file fd."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _signals_held():
    """Hold Ctrl-C and SIGTERM until the block ends (POSIX; elsewhere a no-op).

    A signal that comes meanwhile is taken as the block ends: a file opened inside has its
    descriptor stored first, and renames inside are all done first."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _temporary(path):
    """Name a new temporary file beside path, for _write_temporary; nothing is made yet.

    It is named after the target and this process (.NAME.tmp-PID-RANDOM.part, NAME a hash of
    a name too long to lengthen); any of the target's that a process no longer running left (a
    save killed outright) is removed first, and no one else's."""
    path, folder = _target(path)
    name = os.path.basename(path)
    if len(name.encode("utf-8")) > NAME_MAX - 32:   # the temporary name adds 32 at most
        name = hashlib.sha256(name.encode("utf-8")).hexdigest()[:16]
    prefix = f".{name}.tmp-"
    for entry in os.listdir(folder):
        pid = entry[len(prefix):].partition("-")[0]
        if entry.startswith(prefix) and entry.endswith(".part") and pid.isdigit() \
                and not _running(int(pid)):
            _remove(os.path.join(folder, entry))
    return os.path.join(folder, f"{prefix}{os.getpid()}-{os.urandom(4).hex()}.part")


def _write_temporary(tmp, text):
    """Make the file tmp (_temporary's name) holding text, on disk; the caller removes it.

    Made with O_EXCL, not by the tempfile module, whose lock an interrupt can leave held; its
    descriptor is closed whatever interrupts."""
    fd = None
    try:
        with _signals_held():
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                         | getattr(os, "O_BINARY", 0), 0o644)
        with open(fd, "w", encoding="utf-8", newline="\n", closefd=False) as f:
            f.write(text)
        os.fsync(fd)
    finally:
        if fd is not None:
            os.close(fd)


def _remove(path, missing=FileNotFoundError):
    """Remove the file path, if there is one (an error of the kind missing is let pass)."""
    with contextlib.suppress(missing):
        os.unlink(path)


def _running(pid):
    """Whether a process pid runs on this machine (on Windows, where os.kill would end
    it, always taken to: a temporary file left there stays)."""
    if sys.platform == "win32":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's
        return True
    return True


def _named(failed, path):
    """An OSError of the system's (errno and strerror) reworded to name path; any other
    exception as it is."""
    if isinstance(failed, OSError) and failed.strerror and failed.errno:
        return OSError(failed.errno, f"cannot write {path}: {failed.strerror}")
    return failed


def read_json(path, fmt, what):
    """The JSON object in path, refusing with the file's name what is not a lab file.

    Refused: what is not a regular file (a folder; a named pipe, which would block) or not
    UTF-8 JSON of format fmt (any object, for fmt None): too large, too deeply nested, or a
    number beyond Python's limit. A missing file raises FileNotFoundError."""
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
