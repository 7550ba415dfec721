"""The lab's experiment: run the uncached and the cached generator on the openings of
the 60 test stories, prove they agree bit for bit, and count the work each one does;
then every Part's experiments. Each experiment is a stage, declared once in STAGES (its
Part, its name in the record, its function, what it needs) and run by one small loop
that the machine's cores share.

    python3 trace_kv.py              runs it (its progress line says how long it took when
                                     it was last recorded): a summary
    python3 trace_kv.py --part 1     runs only the lesson's stages (Part 1)
    python3 trace_kv.py --json       prints the whole record instead, as JSON
    python3 trace_kv.py --check      also fails if the record differs from kv-trace.json
    python3 trace_kv.py --write      for changing the lab: rewrites kv-trace.json, the
                                     documents' figures and the pictures, keeping
                                     kv-time.json and the time figures as they are
    python3 trace_kv.py --write --times   also records this machine's times (timing more;
                                     on an idle machine): kv-time.json and the time figures
    python3 trace_kv.py --workers N  shares the stages among N processes (the same record)

kv-trace.json holds only what any machine reproduces exactly (results and counts);
kv-time.json holds wall-clock times, which vary, and is never compared; only
--write --times (or the first --write of a folder without it) records them. Progress
goes to stderr, so the output stays clean when redirected. Those two files are read,
compared and written by trace_records.py.
"""
import os
import sys
import lab_files
if __name__ == "__main__":   # first: Ctrl-C while the modules below load ends in one line
    lab_files.ctrl_c_in_one_line()

import argparse
import platform
import signal
import time
from collections import namedtuple
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from math import fsum

import bandwidth
import blockwise
import budget_runs
import cache_files
import context_shift
import deep_shapes
import eviction
import forks
import host_tier
import hybrid
import hybrid_pool
import kernel_runs
import latent_attention
import trace_lesson
import lossy
import model
import one_gpu
import paged
import paper_times
import prefill
import pyramid_kv
import quantization
import recurrent
import serving
import speculative
import svg
import two_servers
from documents import TIMES, TRACE
from generate import load_trained
from instruments import where_raised
from kv_cache import work   # trace_kv.work: the contract
from lab_files import LAB, add_folder_flag, finish_saving, positive_int, run_command
from stories import openings, split_stories
from trace_records import (TIMED, TIMING, differing_keys, dumps, kept_times, last_duration,
                           named, read_record, save_records, shown_path, unknown_names)
from workers import Here, Shipped, stop
from trace_lesson import FULL_RECORD, summary

MAX_WORKERS = 64   # the largest stage has 60 cases


# ---- the stages of every Part, and the loop that runs them ---------------------------

Stage = namedtuple("Stage", "part name function needs cases gather record",
                   defaults=((), None, None, "key"))
Stage.__doc__ = """One experiment: its Part; its name (its key in the record); its
function, called as function(lab, [case,] *needs) with the results of the stages it
needs; cases, if given, to run one call per case (for instance each opening), whose
results gather(lab, results) makes one (a list, without gather); and record: "key" (the
record holds the result under name), "top" (the result's keys join the record's top
level) or None (only later stages read it). A stage that records declares its record's
shape in its function's module (RECORDS, found by declared), checked after each run."""


def each_opening(lab):
    """The cases of a stage run once per test opening: each opening's index."""
    return range(len(lab.prompts))


STAGES = (
    Stage(1, "runs", trace_lesson.both_generators, cases=each_opening,
          gather=trace_lesson.gather_runs, record=None),
    Stage(1, "lesson", trace_lesson.lesson_figures, ("runs",), record="top"),
    Stage(1, "prefix_sharing", trace_lesson.share_prefixes, ("runs",)),
    Stage(1, "sums_in_another_order", trace_lesson.reordered_sums),
    Stage(2, "one_pass_prefill", prefill.experiment, ("runs",)),
    Stage(2, "paged", paged.experiment, ("runs",)),
    Stage(2, "parallel_sampling", forks.parallel_sampling),
    Stage(3, "ladder", lossy.ladder_rung, ("runs",), cases=range(len(lossy.RUNGS)),
          gather=lossy.ladder),
    Stage(3, "eviction", eviction.rung, ("runs",), cases=range(len(eviction.RUNGS)),
          gather=lossy.ladder),
    Stage(3, "quantization", quantization.rung, ("runs",), cases=quantization.CASES,
          gather=quantization.rungs),
    Stage(4, "prefix_cache", serving.prefix_cache, ("runs",)),
    Stage(4, "many_requests", serving.many_requests, ("runs",)),
    Stage(4, "speculative_decoding", speculative.experiment, ("runs",),
          cases=range(len(speculative.DRAFTS))),
    Stage(4, "batched_decode", kernel_runs.kernel_run, ("runs",),
          cases=range(len(kernel_runs.KERNEL_RUNS)), gather=kernel_runs.kernel_table),
    Stage(4, "blockwise", blockwise.story_kinds, ("runs",), cases=each_opening,
          gather=blockwise.kinds_table),
    Stage(4, "cache_files", cache_files.experiment, ("runs",)),
    Stage(5, "deep_models", deep_shapes.experiment),
    Stage(5, "pyramid", pyramid_kv.experiment),
    Stage(5, "rotary", context_shift.experiment),
    Stage(5, "latent_attention", latent_attention.experiment),
    Stage(5, "bytes_read", bandwidth.experiment),
    Stage(5, "one_gpu", one_gpu.experiment),
    Stage(6, "hybrid_models", hybrid.experiment),
    Stage(6, "hybrid_pool", hybrid_pool.experiment),
    Stage(6, "recurrent", recurrent.experiment),
    Stage(7, "host_tier", host_tier.experiment, ("runs", "many_requests")),
    Stage(7, "token_budget", budget_runs.experiment, ("runs",)),
    Stage(7, "two_servers", two_servers.experiment, ("runs",)),
    Stage(7, "paper_times", paper_times.experiment),
)
PARTS = max(stage.part for stage in STAGES)


def run(full_timing=False, folder=LAB, progress=None, workers=None, stories=None,
        parts=PARTS):
    """Every stage of Parts 1 to parts, on the 60 test openings: (record, timing).

    The openings are all 60, or the first stories of them for a quick run; workers
    processes (default: one per core) share the stages, each stage run as soon as the
    stages it needs are done, and the record is the same for any number of workers. The
    timing holds the seconds of both generators; with full_timing (what --write --times
    records) also what timings() measures afterwards, in this process alone.
    progress(stage, done, total), if given, is told each stage done."""
    progress = progress or (lambda stage, done, total: None)
    workers = (os.cpu_count() or 1) if workers is None else workers
    model.check_int("workers", workers, 1, MAX_WORKERS, " (each process loads the lab)")
    if stories is not None:   # a stage of no cases would never be done
        model.check_int("stories", stories, 1, None, " (the first test openings to run)")
    model.check_int("parts", parts, 1, PARTS, " (the stages of Parts 1 to parts run)")
    if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
        raise ValueError(f"folder must be the path of a folder of the lab's files, got "
                         f"{model.excerpt(folder)}")
    stages = [stage for stage in STAGES if stage.part <= parts]
    start = time.perf_counter()
    lab = _load(folder, stories)
    done = _run_stages(stages, lab, _workers(workers, folder, stories), workers, progress)
    record = _recorded(stages, done)
    timing = generators_timing(done["runs"], record["work"], workers)
    timing["run_seconds"] = round(time.perf_counter() - start, 1)   # every stage, all told
    if full_timing:
        timing.update(trace_lesson.timings(lab, done["runs"]))
    svg.checked(timing, {**TIMING, **(TIMED if full_timing else {})}, "time",
                strict=True)   # what the time marks are checked against
    return record, timing


def _run_stages(stages, lab, pool, workers, progress):
    """{stage's name: its result} for every stage, run in pool by workers processes."""
    needed = {need for stage in stages for need in stage.needs}
    done, results, left, waiting, running, shipped = {}, {}, {}, [], {}, {}
    try:
        while len(done) < len(stages):
            for stage in stages:   # queue each stage whose needs are done, in table order
                if stage.name not in left and all(need in done for need in stage.needs):
                    for need in stage.needs:   # to the workers, each pickled once
                        if workers > 1 and need not in shipped:
                            shipped[need] = Shipped(need, done[need])
                    needs = [shipped[need] if workers > 1 else done[need]
                             for need in stage.needs]
                    cases = stage.cases(lab) if callable(stage.cases) else stage.cases
                    cases = [None] if cases is None else list(cases)
                    results[stage.name], left[stage.name] = [None] * len(cases), len(cases)
                    waiting += [(stage, i, case, needs) for i, case in enumerate(cases)]
            # first the cases of a stage others need (they hold the rest up), then by their
            # stage's number of cases, fewest first: a run ends on many small cases shared
            # out among the workers, not on one long case with the others idle
            waiting.sort(key=lambda queued: (queued[0].name not in needed,
                                             len(results[queued[0].name])))
            while waiting and len(running) < workers:   # no more: a dead worker's is known
                stage, i, case, needs = waiting.pop(0)
                running[pool.submit(_stage, stage.name, case, needs)] = stage, i
            for future in wait(running, return_when=FIRST_COMPLETED).done:
                stage, i = running[future]
                results[stage.name][i] = future.result()
                del running[future]
                left[stage.name] -= 1
                if not left[stage.name]:
                    values = results[stage.name]
                    done[stage.name] = (values[0] if stage.cases is None else
                                        stage.gather(lab, values) if stage.gather else values)
                    progress(stage.name, len(done), len(stages))
    except BrokenProcessPool:   # a worker killed (by the out-of-memory killer, say)
        stop(pool)
        stopped = dict.fromkeys(f"{stage.name} (Part {stage.part})"
                                for stage, _ in running.values())
        raise StageFailed(f"a worker process died during stage {' or '.join(stopped)}, "
                          f"killed by a signal or out of memory; the run was stopped") from None
    except BaseException:   # a stage that failed, or Ctrl-C: start nothing more
        stop(pool)
        raise
    pool.shutdown()
    return done


def declared(stage):
    """The shape of the record stage writes, as its module declares it beside the stage.

    Its module's RECORDS[stage's name], in svg.checked's shapes (for a stage whose record is
    "top", the top-level keys it adds). A ValueError says what to add if there is none."""
    module = sys.modules[stage.function.__module__]
    shapes = getattr(module, "RECORDS", {})
    if not isinstance(shapes, dict) or stage.name not in shapes:
        raise ValueError(f"{module.__name__}.py declares no record for its stage {stage.name} "
                         f"(Part {stage.part}): add {stage.name!r}: its shape (svg.checked's) "
                         f"to the module's RECORDS dict, beside {stage.function.__name__}")
    return shapes[stage.name]


def record_shape(stages=None):
    """The shape of the record stages (default: every stage) write, as they declare it."""
    shape = {}
    for stage in STAGES if stages is None else stages:
        if stage.record == "top":
            shape.update(declared(stage))
        elif stage.record == "key":
            shape[stage.name] = declared(stage)
    return shape


def _recorded(stages, done):
    """The record of stages' results, each checked strictly against its declared shape.

    A stage that records a key its module does not declare, or misses one it does, fails
    the run, named with the key (declared keeps the declarations true)."""
    record = {}
    for stage in stages:
        if stage.record is None:
            continue
        try:
            svg.checked(done[stage.name], declared(stage),
                        stage.name if stage.record == "key" else "", strict=True)
        except ValueError as e:
            raise StageFailed(f"stage {stage.name} (Part {stage.part}) recorded what "
                              f"{stage.function.__module__}.RECORDS does not declare: {e}"
                              ) from None
        if stage.record == "top":
            record.update(done[stage.name])
        else:
            record[stage.name] = done[stage.name]
    return record


class StageFailed(Exception):
    """A stage that raised, named: its name, its Part, the error and where it came from."""


def _stage(name, case, needs):
    """Run one stage (one case of it) in this process, on this process's lab."""
    stage = next(stage for stage in STAGES if stage.name == name)
    cases = () if stage.cases is None else (case,)
    needs = [need.value() if isinstance(need, Shipped) else need for need in needs]
    try:
        return stage.function(_LAB, *cases, *needs)
    except Exception as e:   # a mistake in a Part may raise anything: name its stage
        raise StageFailed(f"stage {name} (Part {stage.part}"
                          f"{'' if case is None else f', case {case}'}) failed: "
                          f"{type(e).__name__}: {e}{where_raised(e)}") from None


_LAB = None   # what every stage reads, loaded once in each process by _load

Lab = namedtuple("Lab", "params tok corpus test prompts")


def _load(folder, stories=None):
    """Load folder's model, tokenizer and test openings (the first stories, if given) into _LAB."""
    global _LAB
    params, tok = load_trained(folder)
    with open(os.path.join(folder, "corpus.txt"), encoding="utf-8") as f:
        corpus = f.read()
    _, _, test = split_stories(corpus)
    _LAB = Lab(params, tok, corpus, test, openings(test)[:stories])
    return _LAB


def _workers(count, folder, stories):
    """Where the stages run: count processes (each loads the lab once), or this one."""
    if count == 1:
        return Here()
    return ProcessPoolExecutor(count, initializer=_start_worker, initargs=(folder, stories))


def _start_worker(folder, stories):
    """A worker's start: the default signal handlers, not the command's (a fork inherits
    them; a worker that turned SIGTERM into SystemExit would take it for a stage's failure
    and block, its result unread, when the pool ends it), then the lab."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _load(folder, stories)


# ---- timing (kv-time.json: it varies, and is never compared) ------------------------

def generators_timing(runs, total, workers):
    """The greedy seconds of both generators over the openings, per story and per row."""
    seconds = {path: fsum(one[path] for one in runs.seconds) for path in ("uncached", "cached")}
    return {
        "uncached_seconds": round(seconds["uncached"], 3),
        "cached_seconds": round(seconds["cached"], 3),
        "speedup": round(seconds["uncached"] / seconds["cached"], 2),
        "uncached_microseconds_per_row":
            round(seconds["uncached"] / total["uncached_rows"] * 1e6, 1),
        "cached_microseconds_per_row": round(seconds["cached"] / total["cached_rows"] * 1e6, 1),
        "workers": workers,
        "machine": f"{platform.platform()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
    }


# ---- what the command prints and writes ----------------------------------------------

def show_progress(stage, done, total):
    """Progress on stderr: on a terminal, one line rewritten per stage; in a log, one a stage."""
    line = f"  {done} of {total} stages done (the last: {stage})"
    if sys.stderr.isatty():
        print(f"\r{line:<72}", end="\n" if done == total else "", file=sys.stderr, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)


def _parser():
    """The command's flags, with their help."""
    parser = argparse.ArgumentParser(
        description="Run the uncached and the cached generator on the openings of the 60 "
                    "test stories: prove they agree bit for bit, count the work each does, "
                    "run every Part's experiments, and print a summary.")
    parser.add_argument("--json", action="store_true",
                        help="print the whole record as JSON instead of the summary")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help=f"exit non-zero if the record differs from {TRACE}")
    mode.add_argument("--write", action="store_true",
                      help=f"for changing the lab: rewrite {TRACE}, every document's figures "
                           f"and the pictures, keeping {TIMES} and the time figures as they "
                           f"are (a folder without {TIMES} gets this machine's)")
    parser.add_argument("--times", action="store_true",
                        help=f"with --write: also record this machine's times in {TIMES} and "
                             "the documents (run it on an idle machine)")
    parser.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1,
                        help="processes to share the experiments (default: one per core, "
                             f"{os.cpu_count() or 1} here; at most {MAX_WORKERS}, since each "
                             "loads the lab and the stages keep no more busy); the record "
                             "is the same for any")
    parser.add_argument("--part", type=int, choices=range(1, PARTS + 1), default=PARTS,
                        help="run only the stages of Parts 1 to PART (1: the lesson's alone); "
                             "--check then compares only the keys those stages record")
    add_folder_flag(parser)
    return parser


def main(argv=None):
    """The command: run the stages, then print, check or write what the flags ask."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.workers > MAX_WORKERS:
        parser.error(f"--workers {args.workers}: at most {MAX_WORKERS} (each process loads "
                     f"the lab, and the stages keep no more than that busy)")
    if args.write and args.part != PARTS:
        parser.error(f"--write records every Part: leave out --part {args.part}")
    if args.times and not args.write:
        parser.error("--times records the times with --write: add --write")
    try:
        finish_saving(args.folder)   # a --write stopped midway: its files all new, first
        unknown = (unknown_names(record_shape(), {**TIMING, **TIMED},
                                 args.folder) if args.write else [])   # in a moment
        if unknown:
            sys.exit("trace_kv.py: error: marks that name nothing, so nothing was run or "
                     "written:\n  " + "\n  ".join(unknown))
        # Read the files first, so that a missing or unreadable one fails before the run.
        recorded = read_record(os.path.join(args.folder, TRACE)) if args.check else None
        kept = kept_times(args.folder) if args.write and not args.times else None
        print("Running both generators on the openings of the 60 test stories, greedy and "
              "sampled, and comparing every row's logits, then "
              + (f"every Part's experiments{last_duration(args.folder)}:"
                 if args.part == PARTS else f"the experiments of Parts 1 to {args.part}:"),
              file=sys.stderr)
        record, timing = run(args.write and kept is None, args.folder, show_progress,
                             args.workers, parts=args.part)
    except (OSError, ValueError, StageFailed) as e:
        sys.exit(f"trace_kv.py: error: {e}")
    print(dumps(record) if args.json else summary(record, timing), end="")
    if args.write:
        _write(record, timing if kept is None else kept, kept is None, args.folder)
    elif args.check:
        _check(record, recorded, args.part, args.folder)
    elif not args.json:
        print(FULL_RECORD.format(shown_path(os.path.join(args.folder, TRACE))))


def _write(record, timing, times, folder):
    """--write's end: save the records (the times too, if times) and say what was written."""
    try:
        written = save_records(record, timing, folder, times)
    except (OSError, ValueError) as e:
        sys.exit(f"trace_kv.py: error: {e}")
    where = "" if folder == LAB else f" in {shown_path(folder)}"
    unchanged = len(written) == (2 if times else 1)
    print(f"wrote {', '.join(written[:-1])}{' and ' * (len(written) > 1)}{written[-1]}{where}; "
          + ("no document's figure or picture changed; " if unchanged else "")
          + ("the times are this machine's now: keep them only from an idle machine "
             "(CONTRIBUTING.md)" if times else
             f"{TIMES} and the time figures kept as they were (--write --times records "
             f"this machine's, on an idle machine)"))


def _check(record, recorded, part, folder):
    """--check's end: exit non-zero naming the keys where the run and the record differ."""
    trace = shown_path(os.path.join(folder, TRACE))
    differ = differing_keys(record, {key: recorded.get(key) for key in record}
                            if part != PARTS else recorded)
    if differ:
        sys.exit(f"trace_kv.py: {trace} differs from this run in: {named(differ)}")
    print(f"{trace} matches this run")


if __name__ == "__main__":
    run_command(main)
