"""The stories: the corpus's split into training, validation and test stories, each
test story's opening (the prompt the generators continue), and how well a generated
story keeps the corpus's rules (story_quality), with how much the model looked at the
name where it chose a pronoun (attention_on_the_name). Training, the generators and
every Part's experiment read the stories from here.
"""
import random
import re
from itertools import accumulate
from math import fsum

import svg
from checkpoint import CONFIG
from documents import bold, indented, shown, table


def split_stories(text):
    """(train, val, test) lists of stories, each a line of text with its "\\n"."""
    stories = text.splitlines(keepends=True)
    if not text.endswith("\n") or "\n" in stories:
        raise ValueError("the corpus must be one story per line, each ending with a newline, "
                         "and no empty lines")
    need = CONFIG["test_stories"] + CONFIG["val_stories"] + 1
    if len(stories) < need:
        raise ValueError(f"the corpus has {len(stories)} stories; the split needs at least {need}")
    order = list(range(len(stories)))
    random.Random(CONFIG["split_seed"]).shuffle(order)
    test_end = CONFIG["test_stories"]
    val_end = test_end + CONFIG["val_stories"]
    parts = order[val_end:], order[test_end:val_end], order[:test_end]
    return tuple([stories[i] for i in sorted(part)] for part in parts)


PRONOUNS = {"he": "he", "him": "he", "his": "he", "she": "she", "her": "she"}


def openings(stories):
    """Each story's first sentence: the prompt the generators continue."""
    return [story.split(". ")[0] + "." for story in stories]


def _words(text):
    """The words and periods of text, each with where it starts: [(start, token)]."""
    return [(m.start(), m.group()) for m in re.finditer(r"[a-z]+|\.", text)]


def corpus_rules(text):
    """What story_agreement checks a story against, all read from the corpus text.

    - "names": each name and its gender ("he" or "she"): a name is a word that opens
      stories, and the first he/she/his/her/him after it has the same gender in every
      story it opens ("it" and "on" open stories whose pronouns go both ways);
    - "people": the other words a he/she can stand for, with their gender: w is one when
      the corpus says "his w. she" or "her w. he" (sister, brother, mom, dad, nan, friend);
    - "words": every word of the corpus.
    """
    stories = text.splitlines()
    seen = {"names": {}, "people": {}}
    for story in stories:
        words = [w for _, w in _words(story)]
        first = next((PRONOUNS[w] for w in words[1:] if w in PRONOUNS), None)
        if first:
            seen["names"].setdefault(words[0], set()).add(first)
        for owner, noun, stop, pronoun in zip(words, words[1:], words[2:], words[3:]):
            if (stop == "." and pronoun in ("he", "she") and owner in ("his", "her")
                    and PRONOUNS[owner] != pronoun):
                seen["people"].setdefault(noun, set()).add(pronoun)
    rules = {kind: {w: g.pop() for w, g in found.items() if len(g) == 1}
             for kind, found in seen.items()}
    rules["words"] = {w for _, w in _words(text) if w != "."}
    return rules


def story_agreement(story, rules):
    """Score a story's continuation against the corpus's rules (from corpus_rules).

    The continuation is the text after its opening (the first sentence). The rules:

    - a he, she, his, her or him in the continuation refers to the name when the story's
      first word is a name, except a he or she that opens a sentence right after one
      ending in a person word ("his sister. she"): that one refers to the person. So in
      "max made a picture for his sister. she said thank you." the she is not max's,
      and a story that does not open with a name ("it began to rain at the hill. mia
      ran home with her fish.") has no pronoun referring to it;
    - a pronoun agrees when it has the gender of the name, or of the person, it refers to;
    - every word of the continuation should be a word of the corpus.

    Returns {"name", "pronouns" (how many refer to the name), "agreeing",
    "unknown_words" (the continuation's words the corpus never uses, in order),
    "referring" (each pronoun that refers to the name: its index in story, and whether
    it agrees), "about_people" (the same for each pronoun that refers to a person),
    "clue_in_opening" (whether the opening holds a pronoun too, as in "mia lost her red
    ball.", or only the name tells the gender)}.
    """
    tokens = _words(story)
    opening_end = story.find(". ")
    start = len(story) if opening_end < 0 else opening_end + 1
    name = tokens[0][1] if tokens and tokens[0][1] in rules["names"] else None
    unknown, referring, about_people, clue = [], [], [], False
    for index, (position, word) in enumerate(tokens):
        if position < start:
            clue = clue or word in PRONOUNS
            continue
        if word == ".":
            continue
        if word not in rules["words"]:
            unknown.append(word)
        if word not in PRONOUNS:
            continue
        person = tokens[index - 2][1] if index >= 2 and tokens[index - 1][1] == "." else None
        if word in ("he", "she") and person in rules["people"]:
            about_people.append((position, word == rules["people"][person]))
        elif name is not None:
            referring.append((position, PRONOUNS[word] == rules["names"][name]))
    return {"name": name, "pronouns": len(referring),
            "agreeing": sum(agrees for _, agrees in referring), "unknown_words": unknown,
            "referring": referring, "about_people": about_people, "clue_in_opening": clue}


def story_ids(tok, prompt, result):
    """The token IDs of a generated story: the prompt's, then each chosen token's.

    The text itself may encode differently: BPE can merge across what was chosen."""
    return tok.encode(prompt) + [tok.ids[step["token"]] for step in result["steps"]]


def common_start(ids, other_ids):
    """How many positions two lists of token IDs share from the start.

    The last token chosen is never fed, so at most one less than the shorter."""
    fed = min(len(ids), len(other_ids)) - 1
    return next((i for i in range(fed) if ids[i] != other_ids[i]), fed)


# The shape of each path's story_quality in the lesson's record (below)
AGREEING = {"pronouns": svg.COUNT, "agreeing": svg.COUNT}
ON_THE_NAME = {"pronouns": svg.COUNT, **dict.fromkeys(("mean_weight_on_the_name", "even_share"),
                                                      (*svg.COUNT, None))}
STORY_QUALITY = {
    "pronouns_referring_to_the_name": svg.COUNT, "agreeing": svg.COUNT,
    "agreeing_share": (*svg.COUNT, None),
    "agreeing_by_opening": dict.fromkeys(("with a pronoun", "with only the name"), AGREEING),
    "pronouns_referring_to_a_person": AGREEING,
    "stories_of_corpus_words_only": svg.COUNT,
    "stories_with_a_wrong_pronoun": [str, (0, 64)],
    "first_three_right_where_only_the_name_tells": [str, (0, 64)],
    "attention_on_the_name": dict.fromkeys(("agreeing", "wrong"), ON_THE_NAME)}


def story_quality(tok, corpus, prompts, results):
    """How well the greedy and the sampled stories keep the corpus's rules (story_agreement).

    Counted: pronouns that refer to the opening's name and agree with its
    gender, also split by whether the opening holds a pronoun too or only the name tells
    the gender; pronouns that refer to a person word (sister, dad) and agree with it;
    stories whose continuation uses only words of the corpus; the stories with a wrong
    pronoun, and the first three that keep every rule where only the name tells; and how
    much the model looked at the name where it chose its pronouns."""
    rules = corpus_rules(corpus)
    quality = {}
    for kind in ("greedy", "sampled"):
        stories = [r["text"] for r in results[kind]]
        scores = [story_agreement(story, rules) for story in stories]
        ids = [story_ids(tok, prompt, r) for prompt, r in zip(prompts, results[kind])]
        right = [all(agrees for _, agrees in sc["referring"] + sc["about_people"])
                 for sc in scores]
        overall = _count([pronoun for sc in scores for pronoun in sc["referring"]])
        quality[kind] = {
            "pronouns_referring_to_the_name": overall["pronouns"],
            "agreeing": overall["agreeing"],
            "agreeing_share": (round(overall["agreeing"] / overall["pronouns"], 4)
                               if overall["pronouns"] else None),   # None: no pronoun
            "agreeing_by_opening": {
                opening: _count([pronoun for sc in scores if sc["clue_in_opening"] == clue
                                 for pronoun in sc["referring"]])
                for opening, clue in (("with a pronoun", True), ("with only the name", False))},
            "pronouns_referring_to_a_person": _count(
                [pronoun for sc in scores for pronoun in sc["about_people"]]),
            "stories_of_corpus_words_only": sum(not sc["unknown_words"] for sc in scores),
            "stories_with_a_wrong_pronoun": [story for story, ok in zip(stories, right)
                                             if not ok],
            "first_three_right_where_only_the_name_tells": [
                story for story, sc, ok in zip(stories, scores, right)
                if ok and sc["referring"] and not sc["clue_in_opening"]
                and not sc["unknown_words"]][:3],
            "attention_on_the_name": attention_on_the_name(tok, ids, scores,
                                                           results["weights"][kind])}
    return quality


def _count(pronouns):
    """How many pronouns, and how many of them agree: pronouns as story_agreement lists
    them, (where, agrees)."""
    return {"pronouns": len(pronouns), "agreeing": sum(agrees for _, agrees in pronouns)}


def attention_on_the_name(tok, ids, scores, weights):
    """How much attention the model put on a story's name where it chose its pronouns.

    At each pronoun that refers to a story's name (scores: each story's story_agreement),
    the attention weight that the position choosing it (the one before it) put on the
    name's tokens, and the share an even spread over the positions it attends would give
    them; each averaged over the pronouns that agree with the name and over those that do
    not. ids: each story's token IDs as the model saw them;
    weights: each story's rows of attention weights, from a full pass over them."""
    found = {True: [], False: []}
    for story_tokens, score, rows in zip(ids, scores, weights):
        starts = list(accumulate((len(tok.vocab[t]) for t in story_tokens), initial=0))
        for offset, agrees in score["referring"]:
            row, name_tokens = rows[starts.index(offset) - 1], starts.index(len(score["name"]))
            found[agrees].append((fsum(row[:name_tokens]), name_tokens / len(row)))
    return {("agreeing" if agrees else "wrong"): {
                "pronouns": len(pairs),
                "mean_weight_on_the_name": rounded_mean([weight for weight, _ in pairs]),
                "even_share": rounded_mean([even for _, even in pairs])}
            for agrees, pairs in found.items()}


def rounded_mean(values):
    """The mean of values to 4 places; None for no values."""
    return round(fsum(values) / len(values), 4) if values else None


# ---- what the Reference shows of it (documents.py fills its marks) -------------------

def _quality(record):
    """The record's story_quality, checked as the lesson's stage declares it (STORY_QUALITY)."""
    return svg.checked(record, {"story_quality": dict.fromkeys(("greedy", "sampled"),
                                                               STORY_QUALITY)})["story_quality"]


def quality_table(record, timing):
    """The table of how well the greedy and the sampled stories keep the corpus's rules."""
    greedy, sampled = (_quality(record)[kind] for kind in ("greedy", "sampled"))

    def both(pick):
        return [pick(greedy), pick(sampled)]

    def of(counts):
        return f"{counts['agreeing']} of {counts['pronouns']}"
    return table(["the 60 test openings, continued", "greedy", "sampled at temperature 1.0"], [
        ["pronouns that refer to the name and agree with its gender", *both(
            lambda q: f"{q['agreeing']} of {q['pronouns_referring_to_the_name']} "
                      f"({shown(q['agreeing_share'], '.1%')})")],
        ["of those, after an opening with a pronoun in it too (`mia lost her green shell.`)",
         *both(lambda q: of(q["agreeing_by_opening"]["with a pronoun"]))],
        ["after an opening where only the name tells the gender (`emma went to the park.`)",
         *both(lambda q: of(q["agreeing_by_opening"]["with only the name"]))],
        ["pronouns that refer to a person word (`her friend. he`) and agree with its gender",
         *both(lambda q: of(q["pronouns_referring_to_a_person"]))],
        ["stories whose continuation uses only words of the corpus",
         *both(lambda q: f"{q['stories_of_corpus_words_only']} of 60")]])


def attention_table(record, timing):
    """The table of the attention put on the name where the pronouns were chosen."""
    rows = []
    for key, label, strong in (("agreeing", "pronouns that agree", True),
                               ("wrong", "pronouns with the wrong gender", False)):
        cells = [label]
        for kind in ("greedy", "sampled"):
            w = _quality(record)[kind]["attention_on_the_name"][key]
            weight = shown(w["mean_weight_on_the_name"])
            cells += ([bold(weight) if strong else weight, shown(w["even_share"])]
                      if w["pronouns"] else ["—", "—"]) + [w["pronouns"]]
        rows.append(cells)
    return table(["where a pronoun was chosen", "greedy: weight on the name", "even share",
                  "pronouns", "sampled: weight on the name", "even share", "pronouns"], rows)


def stories_with_a_wrong_pronoun(record, timing):
    """The greedy stories with a pronoun of the wrong gender, indented."""
    return indented(_quality(record)["greedy"]["stories_with_a_wrong_pronoun"])


def right_where_only_the_name_tells(record, timing):
    """The first three greedy stories that keep every rule where only the name tells."""
    return indented(_quality(record)["greedy"]["first_three_right_where_only_the_name_tells"])
