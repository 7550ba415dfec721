"""Parallel sampling by copy on write (Part 2, section 16): several continuations of one
prompt from forks of one paged sequence. The prompt is computed once and its full blocks
are held once for every continuation; each fork copies only the partly filled last block
it writes to (paged.PagedSequence.copy), and each continuation is exactly generate's for
its seed.
"""
import generate
import kv_cache
import model
import svg
from documents import bold, code, table
from instruments import passes_by_input, recording, reusing
from kv_cache import feed
from paged import BlockPool, check_pool
from stories import story_ids

FORKED_OPENINGS, FORKS = 3, 4   # the experiment: the first openings, continuations each


def sample_from_forks(params, tok, prompt, seeds, pool):
    """Sample in parallel by copy on write: one prefill, a fork per seed.

    The prompt is prefilled once into a sequence of pool, forked once per seed of the list
    seeds, each continued at temperature 1.0 with its seed from the prompt's last row
    (computed once). Gives the results, and the blocks the pool had taken when the last
    ended. On the way out, normally or not, all go back. A pool whose free blocks could not
    hold every continuation at its longest (a context, or 60 new tokens) is refused first."""
    ids = generate.check_request(tok, prompt, 60, 1.0, None, 0)
    check_pool(pool, params)
    if isinstance(seeds, (list, tuple, range)) and len(seeds) > len(pool.blocks):
        raise ValueError(f"seeds: {len(seeds):,} continuations need a block of their own each, "
                         f"more than the pool's {len(pool.blocks)} blocks")
    generate.check_seeds(seeds)
    most = max(len(ids), min(len(ids) + 60, model.CONTEXT) - 1)   # positions a fork may hold
    full = len(ids) // pool.block_size   # the prompt's full blocks, held once for every fork
    needed = max(pool.blocks_to_hold(len(ids)), full + len(seeds) * (pool.blocks_to_hold(most)
                                                                     - full))
    if needed > pool.free_blocks():
        raise ValueError(f"pool: {len(seeds)} continuations of a prompt of {len(ids)} tokens may "
                         f"need {needed} blocks of {pool.block_size} positions (its {full} full "
                         f"blocks held once, and up to {most} positions each), and the pool has "
                         f"{pool.free_blocks()} free; make a larger pool")
    seq, forks, results = pool.sequence(), [], []
    try:
        last = feed(params, seq, ids)[-1]
        forks = [seq.copy() for _ in seeds]   # no block taken: every one is shared
        seq.free()   # the forks hold its blocks; the last to write needs no copy
        for seed, fork in zip(seeds, forks):
            # The first call feeds nothing (the fork holds the prompt): the prompt's last row.
            def next_logits(ids, fork=fork):
                return (feed(params, fork, ids) or [last])[-1]
            results.append(generate.generate_with(next_logits, tok, list(ids), 60, 1.0, None,
                                                  seed))
        return results, len(pool.blocks) - pool.free_blocks()
    finally:
        for sequence in (seq, *forks):
            sequence.free()


# ---- the experiment (a stage of trace_kv.py) --------------------------------------

# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "parallel_sampling": {
        "continuations_each": svg.COUNT,
        "openings": [{
            "prompt": str, "prompt_tokens": svg.COUNT, "distinct_continuations": svg.COUNT,
            "blocks_held_with_forks": svg.COUNT,
            "blocks_held_by_caches_of_their_own": svg.COUNT,
            "prompt_rows_with_forks": svg.COUNT,
            "prompt_rows_with_caches_of_their_own": svg.COUNT,
            "identical_to_generate": svg.COUNT}]},
}


def parallel_sampling(lab):
    """Sample FORKS continuations of each of the first FORKED_OPENINGS openings from forks.

    Seeds 0 to FORKS - 1, from forks of one prefill in a pool of blocks of 4, against FORKS
    caches of their own: the blocks held when all have ended, the prompt rows, and how many
    continuations are generate.generate's for their seed (instruments.reusing)."""
    params, tok = lab.params, lab.tok
    openings = []
    for prompt in lab.prompts[:FORKED_OPENINGS]:
        pool = BlockPool(params, FORKS * model.CONTEXT // 4, 4)   # a context for each fork
        with recording(kv_cache, "forward_step") as rows:
            results, held = sample_from_forks(params, tok, prompt, range(FORKS), pool)
        prompt_tokens = len(tok.encode(prompt))
        positions = [len(story_ids(tok, prompt, result)) - 1 for result in results]
        passes, identical = {}, 0
        for seed, result in enumerate(results):
            with reusing(params, passes), recording(model, "forward") as full_passes:
                expected = generate.generate(params, tok, prompt, temperature=1.0, seed=seed)
            passes.update(passes_by_input(story_ids(tok, prompt, expected), full_passes))
            identical += result == expected
        openings.append({
            "prompt": prompt, "prompt_tokens": prompt_tokens,
            "distinct_continuations": len({result["text"] for result in results}),
            "blocks_held_with_forks": held,
            "blocks_held_by_caches_of_their_own": sum(map(pool.blocks_to_hold, positions)),
            "prompt_rows_with_forks": len(rows) - sum(n - prompt_tokens for n in positions),
            "prompt_rows_with_caches_of_their_own": FORKS * prompt_tokens,
            "identical_to_generate": identical})
    return {"continuations_each": FORKS, "openings": openings}


# ---- what Part 2 shows of it (documents.py fills its marks) --------------------------

def forks_table(record, timing):
    """Section 16's table: forks of one prefill against caches of their own, by opening."""
    p = svg.checked(record, RECORDS)["parallel_sampling"]
    forks = p["continuations_each"]
    return table(["opening", "prompt tokens", f"distinct continuations (of {forks})",
                  f"blocks held at the end: forks / {forks} caches of their own",
                  f"prompt rows: forks / {forks} caches of their own",
                  "identical to `generate`'s"],
                 [[code(o["prompt"]), o["prompt_tokens"], o["distinct_continuations"],
                   f"{o['blocks_held_with_forks']} / {o['blocks_held_by_caches_of_their_own']}",
                   f"{o['prompt_rows_with_forks']} / "
                   f"{o['prompt_rows_with_caches_of_their_own']}",
                   bold(f"{o['identical_to_generate']} of {forks}")] for o in p["openings"]])
