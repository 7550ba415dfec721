"""Speculative decoding, rolled back exactly (Part 4, section 24). After each chosen
token, a drafter proposes a few more; one call of prefill checks them all, and the model
chooses each next token from those rows in order, with its own random numbers, exactly
as it would one at a time. A drafted token counts only where it is the token chosen;
the positions after the first that is not are rolled back with crop. So the result is
generate.generate's, whatever the drafter proposes: a good drafter only saves calls.
"""
import functools
from collections import Counter

import generate
import model
import prefill
import svg
from documents import bold, plain, shown, table
from instruments import chosen_rows, largest_gap, recording
from kv_cache import KVCache, check_cache, fork_for_prompt
from stories import split_stories, story_ids

# the experiment: by drafter, tokens drafted at a time
DRAFTS = (("the story so far", 4),
          *(("training stories", lookahead) for lookahead in (1, 4)))


class PromptLookup:
    """The drafter of prompt lookup decoding.

    It drafts the tokens that followed the latest earlier occurrence of the story's last n
    tokens (n = longest down to 1) in the story itself."""

    def __init__(self, longest=3):
        model.check_int("longest", longest, 1)
        self.longest = longest

    def propose(self, ids, lookahead):
        """Up to lookahead tokens to check after ids; none if nothing matches."""
        for n in range(min(self.longest, len(ids) - 1), 0, -1):
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start:start + n] == ids[-n:]:
                    return ids[start + n:start + n + lookahead]
        return []


class NgramDrafter:
    """A drafter learned from stories (say, the training stories).

    After the story's last n tokens (n = longest down to 1, the longest seen), it drafts the
    token that most often followed them there (the smallest ID of a tie), one after
    another."""

    def __init__(self, stories, longest=3):
        model.check_int("longest", longest, 1)
        if not isinstance(stories, (list, tuple)):
            raise ValueError(f"stories must be a list of lists of token IDs, got {stories!r}")
        for index, ids in enumerate(stories):
            if not isinstance(ids, (list, tuple)):
                raise ValueError(f"stories[{index}] must be a list of token IDs, got {ids!r}")
            for position, token_id in enumerate(ids):
                model.check_token_id(token_id, f"stories[{index}][{position}] =")
        seen = {}
        for ids in stories:
            for n in range(1, longest + 1):
                for start in range(len(ids) - n):
                    followers = seen.setdefault(tuple(ids[start:start + n]), Counter())
                    followers[ids[start + n]] += 1
        self.longest = longest
        self.next = {gram: min(followers, key=lambda t: (-followers[t], t))
                     for gram, followers in seen.items()}

    def propose(self, ids, lookahead):
        """Up to lookahead tokens to check after ids."""
        story = list(ids)
        for _ in range(lookahead):
            grams = (tuple(story[-n:]) for n in range(min(self.longest, len(story)), 0, -1))
            token = next((self.next[gram] for gram in grams if gram in self.next), None)
            if token is None:
                break
            story.append(token)
        return story[len(ids):]


def generate_speculative(params, tok, prompt, max_new_tokens=60, temperature=0.0,
                         top_k=None, seed=0, lookahead=4, cache=None, drafter=None):
    """Generate as generate.generate does, with speculative decoding.

    Same arguments and result as generate.generate: after each chosen token, a draft of up
    to lookahead more (propose) is checked in one call of prefill; the model chooses each
    next token from the rows in order, with its own random numbers, exactly as it would one
    at a time, and a drafted token counts only where it is the token chosen. The positions
    after the first that is not are rolled back with crop. The drafter is prompt lookup in
    the story unless another is given (anything with propose(ids, lookahead), such as an
    NgramDrafter): it is given the story's token IDs as a tuple, and must return a list of
    at most lookahead token IDs, or the generation is refused, naming it. Given a cache that
    holds the start of the prompt, starts from a copy of it (one that cannot roll back is
    refused before anything is generated)."""
    if drafter is None:
        drafter = PromptLookup()
    elif not callable(getattr(drafter, "propose", None)):
        raise ValueError(f"drafter must have a method propose(ids, lookahead), got "
                         f"{drafter!r}")
    model.check_int("lookahead", lookahead, 1)
    if cache is None:
        cache = KVCache(params)
    check_cache(cache, params)
    if not cache.keeps_every_position:
        raise ValueError(f"speculative decoding rolls rejected positions back with crop, "
                         f"and a {type(cache).__name__} drops positions a crop may need; "
                         f"pass a cache that keeps every position")
    ids = generate.check_request(tok, prompt, max_new_tokens, temperature, top_k, seed)
    cache = fork_for_prompt(params, cache, ids, tok,
                            min(len(ids) + max_new_tokens, model.CONTEXT) - 1)
    try:
        generation = generate.Generation(tok, ids, max_new_tokens, temperature, top_k, seed)
        if generation.stopped:
            return generation.result()
        rows = prefill.prefill_in_chunks(params, cache, ids, model.CONTEXT)[-1:]
        while True:
            for row in rows:      # each row predicts the token after the one it read
                drafted = len(cache) - len(ids)   # ids: the story so far, chosen included
                generation.choose(row)
                if generation.stopped or drafted <= 0 \
                        or ids[-1] != cache.tokens[len(ids) - 1]:
                    break
            if generation.stopped:
                return generation.result()
            cache.crop(len(ids) - 1)              # roll back every position not chosen
            room = min(lookahead, model.CONTEXT - len(ids),
                       max_new_tokens - len(generation.steps) - 1)
            draft = _checked(drafter, drafter.propose(tuple(ids), room), room)
            rows = prefill.prefill(params, cache, [ids[-1], *draft], len(ids) - 1)
    finally:
        cache.free()   # the copy is this call's own


def _checked(drafter, draft, room):
    """The draft, if it is a list of at most room token IDs; else a refusal naming the
    drafter."""
    what = (f"the drafter {type(drafter).__name__} proposed {draft!r}, where a draft must "
            f"be a list of at most {room} token IDs")
    if not isinstance(draft, (list, tuple)) or len(draft) > room:
        raise ValueError(what)
    for token_id in draft:
        if not model.is_int(token_id) or not 0 <= token_id < model.VOCAB_SIZE:
            raise ValueError(f"{what} (ints 0 to {model.VOCAB_SIZE - 1})")
    return draft


# ---- the experiment (a stage of trace_kv.py, one drafter and lookahead a case) -----

@functools.lru_cache(maxsize=1)
def _training_drafter(tok, corpus):
    """An NgramDrafter of corpus's training stories, made once in each process."""
    train, _, _ = split_stories(corpus)
    return NgramDrafter([tok.encode(story) for story in train])


_PREFILLED = {}   # the lab whose openings this process has prefilled, and their caches


def _openings(lab):
    """Each opening of lab prefilled into a cache of its own (one call of prefill), once
    in each process for every drafter and lookahead: generate_speculative continues from
    a copy of the cache it is given, so these stay as they are."""
    if _PREFILLED.get("lab") is not lab:
        caches = [KVCache(lab.params) for _ in lab.prompts]
        for cache, prompt in zip(caches, lab.prompts):
            prefill.prefill(lab.params, cache, lab.tok.encode(prompt), 0)
        _PREFILLED.update(lab=lab, caches=caches)
    return _PREFILLED["caches"]


# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "speculative_decoding": [{
        "drafter": str, "lookahead": svg.COUNT, "identical": svg.COUNT,
        "model_calls": svg.COUNT, "model_calls_one_per_token": svg.COUNT,
        "rows": svg.COUNT, "rows_one_per_token": svg.COUNT, "drafted": svg.COUNT,
        "accepted": svg.COUNT, "largest_logit_gap_of_choosing_rows": svg.COUNT}],
}


def experiment(lab, draft, runs):
    """Run generate_speculative with DRAFTS[draft] on every opening, greedy and sampled.

    Each from a cache holding the opening (fed once for both, and for every case:
    _openings): the stories identical to the uncached ones, the largest gap between the
    logits each token was chosen with and the uncached full pass's row for the same
    position, the prefill calls and the rows they computed after the opening (rejected ones
    included) against one call and one row per generated token, and how many drafted tokens
    were accepted."""
    params, tok, prompts = lab.params, lab.tok, lab.prompts
    drafter, lookahead = DRAFTS[draft]
    chosen_drafter = (_training_drafter(tok, lab.corpus) if drafter == "training stories"
                      else PromptLookup())
    counts = {"drafter": drafter, "lookahead": lookahead, "identical": 0, "model_calls": 0,
              "model_calls_one_per_token": 0, "rows": 0, "rows_one_per_token": 0,
              "drafted": 0, "accepted": 0}
    gap = 0.0
    for index, (prompt, opening) in enumerate(zip(prompts, _openings(lab))):
        for settings, result, rows in (({}, runs.greedy[index], runs.greedy_rows[index]),
                                       ({"temperature": 1.0, "seed": index},
                                        runs.sampled[index], runs.sampled_rows[index])):
            with recording(generate.Generation, "choose") as choices, \
                    recording(prefill, "prefill") as calls:
                again = generate_speculative(params, tok, prompt, lookahead=lookahead,
                                             drafter=chosen_drafter, cache=opening, **settings)
            story = story_ids(tok, prompt, result)
            counts["identical"] += again == result
            if again == result:
                gap = max([gap] + [largest_gap([logits], [rows[position]])
                                   for _, position, logits in chosen_rows(choices)])
            for call in calls[1:]:    # the first is the prompt's last token, fed again
                _, _, token_ids, start = call.args
                counts["drafted"] += len(token_ids) - 1
                counts["accepted"] += next((j for j, token in enumerate(token_ids[1:])
                                            if story[start + 1 + j:start + 2 + j] != [token]),
                                           len(token_ids) - 1)
            counts["model_calls"] += len(calls)
            counts["model_calls_one_per_token"] += len(result["steps"])
            counts["rows"] += sum(len(call.args[2]) for call in calls)
            counts["rows_one_per_token"] += len(result["steps"])
    counts["largest_logit_gap_of_choosing_rows"] = gap
    return counts


# ---- what Part 4 shows of it (documents.py fills its marks) --------------------------

def runs_table(record, timing):
    """Section 24's table: each drafter's model calls, rows, drafts accepted and stories."""
    svg.checked(record, RECORDS)
    return table(["drafter", "lookahead", "model calls", "rows computed",
                  "drafted tokens accepted", "identical", "gap of the choosing rows"],
                 [[plain(run["drafter"]), run["lookahead"], shown(run["model_calls"]),
                   shown(run["rows"]),
                   f"{shown(run['accepted'])} of {shown(run['drafted'])} "
                   f"({shown((run['drafted'] or None) and run['accepted'] / run['drafted'], '.0%')})",
                   bold(f"{run['identical']} of 120"),
                   bold(shown(run["largest_logit_gap_of_choosing_rows"]))]
                  for run in record["speculative_decoding"]])
