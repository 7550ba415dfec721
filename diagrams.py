"""The README's pictures that come from the code itself, not from the record: each is
drawn from the lab's real source or a real run, once per process (they are the same on
every run), and written into the README by python3 trace_kv.py --write like every block
of figures.py.
"""
import ast
import difflib
import functools
import inspect
import os

import checkpoint
import kv_cache
import model
import paged
import serving


@functools.lru_cache(maxsize=None)   # of the code alone: the same in a run
def the_row_side_by_side():
    """model.forward's two loops over positions against kv_cache.forward_step after its
    checks, as a diff generated from their real source: the lines they share, and those
    that differ (what each keeps, where the keys and values come from)."""
    def body_lines(function, statements):
        lines = inspect.getsource(function).splitlines()
        return [lines[line - 1].strip() for s in statements
                for line in range(s.lineno, s.end_lineno + 1)]
    forward = ast.parse(inspect.getsource(model.forward)).body[0]
    loops = [s for s in forward.body if isinstance(s, ast.For)]
    step = ast.parse(inspect.getsource(kv_cache.forward_step)).body[0]
    after_checks = next(i for i, s in enumerate(step.body) if isinstance(s, ast.Assign))
    for_each_position = body_lines(model.forward, [s for loop in loops for s in loop.body])
    one_position = body_lines(kv_cache.forward_step, step.body[after_checks:])
    diff = list(difflib.unified_diff(for_each_position, one_position, lineterm="",
                                     n=len(one_position)))
    return ("```diff", "--- model.forward: the body of its loops, for each position",
            "+++ kv_cache.forward_step: after its checks, for one position", *diff[3:], "```")


@functools.lru_cache(maxsize=None)
def block_table_diagram():
    """Section 16's picture, from a real pool of blocks of 4: one prompt fed, then a
    second that begins like it."""
    from generate import load_trained
    params, tok = load_trained()
    pool = paged.BlockPool(params, 64, 4)
    prompts = ("mia was sad. tom gave her a hug.", "mia was tired.")
    sequences = []
    for prompt in prompts:
        ids = tok.encode(prompt)
        sequences.append(pool.sequence(ids))
        kv_cache.feed(params, sequences[-1], ids)

    def tokens(block):
        return ", ".join("space" if tok.vocab[t] == " " else tok.vocab[t]
                         for t in pool.blocks[block].tokens)
    lines = ["block tables (sequences)", *(f"  {name}: {prompt!r}  ->  blocks "
                                          f"{', '.join(map(str, seq.table))}"
                                          for name, prompt, seq in zip("AB", prompts, sequences)),
             "BlockPool: blocks of 4 positions"]
    for block in sorted(set(sequences[0].table) | set(sequences[1].table)):
        held_by = " and ".join(name for name, seq in zip("AB", sequences) if block in seq.table)
        lines.append(f"  block {block}: {tokens(block):<24} refs {pool.ref_counts[block]}  "
                     f"(held by {held_by})")
    return ("```text", *lines, "```")


@functools.lru_cache(maxsize=None)
def serving_timeline():
    """Section 19's picture, from a real run of serving.serve: four openings, batches of
    up to four, a pool of 16 blocks of 4. One line per request, one character per step:
    P admitted (its tokens prefilled), . a decode row, x preempted, - waiting, * finished."""
    from generate import load_trained
    from stories import openings, split_stories
    params, tok = load_trained()
    with open(os.path.join(checkpoint.LAB, "corpus.txt"), encoding="utf-8") as f:
        prompts = openings(split_stories(f.read())[2])[:4]
    events = {}
    _, counts = serving.serve(params, tok, [{"prompt": p} for p in prompts],
                              paged.BlockPool(params, 16, 4), 4,
                              lambda step, index, event: events.setdefault(
                                  (index, step), set()).add(event))
    lines = []
    for index, prompt in enumerate(prompts):
        marks, finished = "", False
        for step in range(1, counts["steps"] + 1):
            happened = events.get((index, step), set())
            marks += ("*" if "finished" in happened else "x" if "preempted" in happened
                      else "P" if "prefill" in happened else "." if happened
                      else " " if finished else "-")
            finished = finished or "finished" in happened
        lines.append(f"{prompt:<{max(map(len, prompts))}}  {marks.rstrip()}")
    return ("```text", *lines, "```")
