"""The record files of trace_kv.py: kv-trace.json and kv-time.json read, compared and written.

kv-trace.json holds what any machine reproduces exactly (results and counts), kv-time.json
the wall-clock times, which vary and are never compared. save_records writes the record with
every document's figures and pictures as one set; read_record, kept_times and last_duration
read them back; differing_keys is --check's comparison; unknown_names finds the marks of the
documents that name nothing, before --write's long run. TIMING and TIMED declare
kv-time.json's keys (in svg.checked's shapes), for the run that writes them and the tables
that read them.
"""
import json
import os

import documents
import svg
from documents import TIMES, TRACE
from lab_files import LAB, read_json, write_together

# kv-time.json's shape: what every run times (trace_kv.generators_timing and the run)
TIMING = {
    "uncached_seconds": svg.COUNT, "cached_seconds": svg.COUNT, "speedup": svg.COUNT,
    "uncached_microseconds_per_row": svg.COUNT, "cached_microseconds_per_row": svg.COUNT,
    "workers": svg.COUNT, "machine": str, "python": str, "run_seconds": svg.COUNT}
TIMED = {   # with --times, what trace_lesson.timings measures as well
    "forward_step_over_its_fsum_calls": svg.COUNT,
    "cost_by_length": [{"positions": svg.COUNT, "uncached_seconds": svg.COUNT,
                        "cached_seconds": svg.COUNT, "speedup": svg.COUNT}],
    "cache_bytes_full_context": svg.COUNT, "cache_bytes_per_position": svg.COUNT,
    "cache_bytes_as_8_byte_floats": svg.COUNT,
    "deep_model_cache_bytes_as_cpython_objects": [{
        "layers": svg.COUNT, "kv_heads": svg.COUNT, "bytes_per_position": svg.COUNT}]}


def dumps(data):
    """The text of a record file holding data: JSON, indented, with a final newline."""
    return json.dumps(data, indent=2) + "\n"


def save_records(record, timing, folder=LAB, times=True):
    """Write kv-trace.json and every document in folder as one set (lab_files.write_together).

    Every document's marked figures and blocks, and the pictures it marks, are drawn before any
    file is written; the time figures come from timing, written to kv-time.json too if times
    (else timing is what kv-time.json holds, kept). Returns the names of what it wrote that
    changed: the records, the documents whose figures changed, the pictures redrawn."""
    texts, drawn, changed = {}, {}, []
    for name in documents.documents(folder):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            text = f.read()
        try:
            texts[name] = documents.rendered(text, record, timing, folder)
            if texts[name] != text:
                changed.append(name)
            drawn.update(documents.pictures(text, record, timing, folder))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"{name}: a mark cannot be filled from this run "
                             f"({type(e).__name__}: {e}); nothing was written") from None
    records = {TRACE: dumps(record), **({TIMES: dumps(timing)} if times else {})}
    pictures = [name for name, svg_text in drawn.items() if _old(folder, name) != svg_text]
    write_together(folder, {**records, **drawn, **texts})
    return list(records) + ([f"the figures of {', '.join(changed)}"] if changed else []) + pictures


def _old(folder, name):
    """The text of folder's file name, or None if it cannot be read."""
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def unknown_names(shape, time_shape, folder=LAB):
    """A line for each mark of folder's documents that names nothing (documents.unknown_names).

    shape and time_shape: the record's and the timing's, as the stages declare them (in
    svg.checked's shapes), so that no record needs to be read. Checked in a moment, before
    --write's long run."""
    problems = []
    for name in documents.documents(folder):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            problems += [f"{name} {line}"
                         for line in documents.unknown_names(f.read(), shape, time_shape)]
    return problems


def read_record(path):
    """The recorded trace in path, or a ValueError that says how to make one."""
    folder = os.path.dirname(os.path.abspath(path))
    write = "python3 trace_kv.py --write" + ("" if folder == LAB else f" --folder {folder}")
    try:
        return read_json(path, None, "a record of trace_kv.py")
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} ({e}); run {write} to record it") from None


def differing_keys(record, recorded):
    """The keys whose values differ between two records, sorted."""
    return sorted(k for k in set(record) | set(recorded) if record.get(k) != recorded.get(k))


def named(keys, most=10):
    """Name keys (a tampered record's, perhaps) in one printable, bounded line.

    The first most, and how many more; each as repr gives it if a terminal would act on it,
    cut at 200 characters."""
    shown = [key if key.isprintable() else repr(key) for key in keys[:most]]
    return (", ".join(text if len(text) <= 200 else text[:197] + "..." for text in shown)
            + (f" and {len(keys) - most:,} more" if len(keys) > most else ""))


def shown_path(path):
    """path as a person would type it from here: relative, unless it is on another drive."""
    try:
        return os.path.relpath(path)
    except ValueError:
        return path


def last_duration(folder=LAB):
    """How long the whole run took when it was last recorded (kv-time.json), in words.

    For the progress line, as the README quotes it; nothing if there is no such record."""
    try:
        timing = read_json(os.path.join(folder, TIMES), None, "a timing of trace_kv.py")
        return (f" ({timing['run_seconds']:.0f} s in {timing['workers']} processes when it "
                f"was last recorded)")
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def kept_times(folder=LAB):
    """The timing folder's kv-time.json holds, which --write keeps; None if there is none.

    None for a new folder, whose first --write records this machine's times. A ValueError
    says how to record it again if it cannot be read."""
    path = os.path.join(folder, TIMES)
    if not os.path.lexists(path):
        return None
    try:
        return read_json(path, None, "a timing of trace_kv.py")
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {shown_path(path)} to keep it ({e}); run "
                         f"python3 trace_kv.py --write --times to record it again") from None
