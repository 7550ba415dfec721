"""Keep fewer positions, chosen by what attention reads (Part 3, section 18): caches that
evict. Each holds at most budget positions for a row to read, its own included, like a
WindowCache of budget positions, but chooses which by their content:

  HeavyHitterCache   H2O's heavy hitters: the positions that have received the most
                     attention so far, summed over every row, beside a recent window
  KeyNormCache       K-norm: the positions whose keys have the smallest norm, beside a
                     recent window
  SnapKVCache        SnapKV's choice, made once, at the end of the prompt: the prompt
                     positions its last window rows attended to most (pooled over
                     neighbours), beside a window over the latest positions

A cache learns what a row read through the cache protocol: forward_step calls
cache.attended(weights) after its softmax. After each row it evicts down to budget - 1
positions, so the next row, with its own, reads budget. It keeps every token ID, and for
every row the positions that row read (reads): model.forward with that mask gives the
same rows, bit for bit, which the experiment checks on every story. So what eviction
changes is what the dropped positions would have added, and nothing else.
"""
from math import fsum, isnan

import model
import svg
from documents import plain, shown, table
from cache_protocol import check_positions
from kv_cache import KVCache
import lossy
from lossy import Series, declared, measure


class EvictingCache(KVCache):
    """What the three kinds of evicting cache share, each kind scoring positions its own way.

    They share the positions kept (kept, in order), their keys, values and scores, and the
    rows' reads. After each row (for SnapKV, from the end of its prompt on), while it holds
    budget positions or more, it drops the one whose score is lowest (the earliest of
    equals) among all but the recent - 1 latest (recent: half the budget unless given);
    score(weights) is each kind's own."""

    keeps_every_position = stores_exactly = False

    def __init__(self, params, budget, recent=None):
        model.check_int("budget", budget, 2, model.CONTEXT, " (positions a row reads)")
        recent = budget // 2 if recent is None else recent
        model.check_int("recent", recent, 1, budget, " (the budget)")
        self._belong_to(params)
        self.budget, self.recent = budget, recent
        self.tokens = []                    # every token fed, one per position
        self.kept = []                      # the positions held, in order
        self._keys, self._values, self.scores = [], [], []   # theirs, in the same order
        self.reads = []                     # for each row fed: the positions it read

    def __len__(self):
        return len(self.tokens)

    @property
    def keys(self):   # a copy: attended evicts while the row still reads its values
        return self._keys[:]

    @property
    def values(self):
        return self._values[:]

    def extend(self, token_ids, keys, values):
        check_positions(token_ids, keys, values)
        for token_id, k, v in zip(token_ids, keys, values):
            self.kept.append(len(self.tokens))
            self.tokens.append(token_id)
            self._keys.append(k)
            self._values.append(v)
            self.scores.append(self.first_score(k))

    def first_score(self, k):
        return 0.0

    def attended(self, weights):
        """Take the weights the newest row read the kept positions with, and evict.

        It notes the row's reads, lets the kind score them, and evicts down to budget - 1
        positions."""
        if len(weights) != len(self.kept):
            raise ValueError(f"attended got {len(weights)} weights for the {len(self.kept)} "
                             f"positions held")
        # min and max skip a NaN, or stop at one (refused), so a NaN left shows in the fsum
        if weights and not (set(map(type, weights)) == {float} and min(weights) >= 0.0
                            and max(weights) <= 1.0 and not isnan(fsum(weights))):
            raise ValueError(f"weights must be floats from 0 to 1, one for each of the "
                             f"{len(self.kept)} positions held, got {model.excerpt(weights)}")
        self.reads.append(list(self.kept))
        self.score(weights)
        while len(self.kept) >= self.budget and self.evicts():
            self._evict(self.victim())

    def evicts(self):
        """Whether it evicts after this row: always, but for SnapKV."""
        return True

    def victim(self):
        """The index, in kept, of the position to drop next."""
        older = range(len(self.kept) - (self.recent - 1))
        return min(older, key=lambda i: (self.scores[i], i))

    def _evict(self, index):
        del self.kept[index], self._keys[index], self._values[index], self.scores[index]

    def crop(self, length):
        """Forget every position from length on: all of them (0), or none.

        Nothing between, since each choice it made depends on every row it has read."""
        if length not in (0, len(self)):
            raise ValueError(f"crop length must be 0 or {len(self)} (the positions fed), got "
                             f"{length!r}: an evicting cache's choices depend on every row "
                             f"it has read, so it cannot be rewound part of the way")
        super().crop(length)

    def _forget_from(self, length):
        if length == len(self):   # nothing to forget: what it keeps stays kept
            return
        del self.tokens[length:], self.reads[length:]
        del self.kept[:], self._keys[:], self._values[:], self.scores[:]


class HeavyHitterCache(EvictingCache):
    """H2O's cache: a position's score is the attention it has received so far.

    The attention is summed over every row so far; the recent - 1 latest positions are kept
    whatever their score (default: half the budget is a window, as H2O's paper splits
    it)."""

    def score(self, weights):
        self.scores = [held + w for held, w in zip(self.scores, weights)]


class KeyNormCache(EvictingCache):
    """K-norm's cache: a position's score is minus its key's squared norm.

    So the keys of largest norm go first; the recent - 1 latest positions are kept."""

    def first_score(self, k):
        return -fsum(x * x for x in k)

    def score(self, weights):
        """A key's norm does not change: nothing to add."""


class SnapKVCache(EvictingCache):
    """SnapKV's cache: at the end of the prompt it keeps, for good, what the window read most.

    The prompt's rows read every prompt position (prefill). At the end of the prompt (its
    prompt_tokens-th row), each earlier position is scored by the mean weight the window
    last rows gave it, averaged with its neighbours (kernel positions, the missing ones at
    the edges counted as 0, as avg_pool1d does), and the budget - window best are kept for
    good; the rest of the budget is a window over the latest positions."""

    def __init__(self, params, budget, prompt_tokens, window=4, kernel=3):
        super().__init__(params, budget, budget)
        model.check_int("window", window, 1, budget - 1, " (the budget - 1)")
        check_kernel(kernel)
        model.check_int("prompt_tokens", prompt_tokens, 1, model.CONTEXT)
        self.prompt_tokens, self.window, self.kernel = prompt_tokens, window, kernel
        self.last_rows = []   # the weights of the latest window rows of the prompt

    def score(self, weights):
        """Keep the weights of the prompt's latest window rows; at its last row, choose."""
        if len(self.reads) <= self.prompt_tokens:
            self.last_rows = (self.last_rows + [weights])[-self.window:]
        if len(self.reads) == self.prompt_tokens:
            chosen = snapkv_choice(self.last_rows, self.budget - self.window, self.kernel)
            self.scores = [1.0 if p in chosen else 0.0 for p in self.kept]
            self.recent = self.budget - len(chosen)

    def evicts(self):
        """Not before the end of the prompt: its rows read every prompt position."""
        return len(self.reads) >= self.prompt_tokens

    def _forget_from(self, length):
        """Forget them (all or none); all, with the window's rows and the choice made."""
        super()._forget_from(length)
        if not length:   # stale rows would be scored with the next prompt's
            self.last_rows, self.recent = [], self.budget


def check_kernel(kernel):
    """Refuse a pooling kernel that is not an odd int of at least 1.

    An odd kernel pools a position and as many neighbours on each side, as SnapKV's
    avg_pool1d (padding kernel // 2); an even one would pool kernel + 1 positions."""
    model.check_int("kernel", kernel, 1)
    if kernel % 2 == 0:
        raise ValueError(f"kernel must be odd (a position and as many neighbours on each "
                         f"side), got {kernel}: an even one would pool {kernel + 1} positions")


def snapkv_choice(rows, keep, kernel):
    """Give the keep positions before the window that the window attended to most, sorted.

    Positions before the window: those the rows (the window's weights) do not end on; their
    weights are pooled over kernel neighbours. Refuses no rows, rows that are not a window's
    (each one position longer than the one before), a keep below 0 and a kernel check_kernel
    refuses."""
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"rows must be a non-empty list of the window's rows of weights, got "
                         f"{model.excerpt(rows)}")
    lengths = [len(row) for row in rows]
    before = lengths[0] - 1   # the window's first row reads them and its own position
    if not lengths[0] or lengths != list(range(lengths[0], lengths[0] + len(rows))):
        raise ValueError(f"rows must be the window's rows of weights, the first of one or more, "
                         f"each one position longer than the one before: got rows of "
                         f"{', '.join(map(str, lengths))} weights")
    model.check_int("keep", keep, 0)
    check_kernel(kernel)
    mean = [fsum(row[p] for row in rows) / len(rows) for p in range(before)]
    half = kernel // 2
    pooled = [fsum(mean[max(0, p - half):p + half + 1]) / kernel for p in range(before)]
    return sorted(sorted(range(before), key=lambda p: (-pooled[p], p))[:keep])


# ---- the experiment (a stage of trace_kv.py, one rung a case) ----------------------

BUDGETS = (8, 12, 20)   # as many as the ladder's windows keep: each compared like for like
KINDS = (("heavy hitters", HeavyHitterCache), ("key norms", KeyNormCache),
         ("SnapKV", SnapKVCache))
# At 8 kept, heavy hitters and a window change nearly every story: the other kinds start at 12.
RUNGS = tuple((kind, budget) for kind, _ in KINDS
              for budget in (BUDGETS if kind == "heavy hitters" else BUDGETS[1:]))


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "eviction": {
        "stories": svg.COUNT,
        "rungs": [{
            "cache": str, "bytes_per_position": (*svg.COUNT, None),
            "positions_kept": svg.COUNT, "largest_logit_gap": svg.COUNT,
            "greedy_stories_changed": svg.COUNT, "sampled_stories_changed": svg.COUNT,
            "most_positions_a_row_read_after_the_prompt": svg.COUNT,
            "rows_compared_with_the_masked_pass": svg.COUNT,
            "rows_equal_to_the_masked_pass": svg.COUNT}]},
}


def rung(lab, index, runs):
    """Measure one kind of evicting cache at one budget (RUNGS[index]) on every opening.

    Measured as the ladder's rungs are (lossy.measure), with the most positions a row read
    once its prompt was read. At the kind's smallest budget, where the reads are furthest
    from the causal mask, every row of every greedy story is also compared with
    model.forward's over the same tokens with that row's reads as its mask: how many rows,
    and how many are equal (==)."""
    name, budget = RUNGS[index]
    kind = dict(KINDS)[name]
    smallest = min(b for n, b in RUNGS if n == name)
    compared = equal = most_read = 0

    def make(prompt_tokens):
        if kind is SnapKVCache:
            return SnapKVCache(lab.params, budget, prompt_tokens)
        return kind(lab.params, budget)

    def check(cache, ids, rows, prompt_tokens):
        nonlocal compared, equal, most_read
        most_read = max([most_read, *map(len, cache.reads[prompt_tokens:])])   # a row, or none
        if budget == smallest:
            full, _ = model.forward(lab.params, ids, cache.reads.__getitem__)
            compared += len(rows)
            equal += sum(a == b for a, b in zip(rows, full))
    measured, _ = measure(lab, runs, make, check)
    return {"cache": f"{name}, {budget} kept", "bytes_per_position": None,
            "positions_kept": budget, **measured,
            "most_positions_a_row_read_after_the_prompt": most_read,
            "rows_compared_with_the_masked_pass": compared,
            "rows_equal_to_the_masked_pass": equal}


# ---- what Part 3 shows of it (documents.py fills its marks) --------------------------

def rows_equal_to_the_masked_pass(record, timing):
    """Say in words how many rows equal the masked full pass, of those compared.

    For each kind, or all kinds at once where they agree."""
    counts = [(name, rung["rows_equal_to_the_masked_pass"],
               rung["rows_compared_with_the_masked_pass"])
              for (name, _), rung in declared(record, RECORDS, "eviction", RUNGS)
              if rung["rows_compared_with_the_masked_pass"]]
    if len({(equal, compared) for _, equal, compared in counts}) == 1:
        return f"{counts[0][1]:,} of {counts[0][2]:,} rows for each kind"
    return "; ".join(f"{name}: {equal:,} of {compared:,} rows" for name, equal, compared in counts)


def rungs_table(record, timing):
    """Section 18's table of every rung, against the masked full pass.

    For each rung: the most positions a row read after its prompt, the largest logit gap,
    the stories changed, and the rows equal to the masked full pass (of those compared)."""
    stories = svg.checked(record, RECORDS)["eviction"]["stories"]
    rows = [[plain(rung["cache"]), rung["most_positions_a_row_read_after_the_prompt"],
             shown(rung["largest_logit_gap"]), rung["greedy_stories_changed"],
             rung["sampled_stories_changed"],
             f"{rung['rows_equal_to_the_masked_pass']:,} of "
             f"{rung['rows_compared_with_the_masked_pass']:,}"
             if rung["rows_compared_with_the_masked_pass"] else "—"]
            for rung in record["eviction"]["rungs"]]
    return table(["the cache", "most positions a row read", "largest logit gap",
                  f"greedy stories changed (of {stories})",
                  f"sampled stories changed (of {stories})",
                  "rows equal to the masked full pass"], rows)


def budgets_table(record, timing):
    """Section 18's table of the stories changed at each number of positions kept.

    Greedy (and sampled) stories changed, of the openings: by position (the ladder's windows
    and sinks) and by attention (each kind)."""
    svg.checked(record, {**lossy.RECORDS, **RECORDS})
    windows = [rung for rung in record["ladder"]["rungs"] if rung["positions_kept"]]
    by_kind = dict(declared(record, RECORDS, "eviction", RUNGS))

    def cell(rung):
        return f"{rung['greedy_stories_changed']} ({rung['sampled_stories_changed']})"
    rows = [[budget, "; ".join(f"{plain(r['cache'])}: {cell(r)}" for r in windows
                               if r["positions_kept"] == budget) or "—",
             *(cell(by_kind[name, budget]) if (name, budget) in by_kind else "—"
               for name, _ in KINDS)] for budget in BUDGETS]
    stories = record["eviction"]["stories"]
    return table(["positions kept", f"by position (window, sinks): greedy (sampled) stories "
                  f"changed, of {stories}", *(name for name, _ in KINDS)], rows)


def side_by_side(record):
    """Give each kind's series in section 19's picture (lossy.side_by_side_picture).

    Each its budgets, against the positions kept."""
    kinds = {}
    for (name, _), rung in declared(record, RECORDS, "eviction", RUNGS):
        kinds.setdefault(name, []).append(rung)
    return [Series("positions_kept", name, rungs, False) for name, rungs in kinds.items()]
