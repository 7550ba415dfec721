"""Speculative decoding (speculative.py): every result is generate.generate's, whatever the
drafter proposes; verifier mistakes planted in the real function are caught."""
import ast
import random
import unittest

import kv_cache
import lossy
import model
import prefill
import speculative
import support
import verdicts
from instruments import is_call_of, recording, replacing
from kv_cache import generate_cached
from stories import split_stories, story_ids
from support import (OPENINGS, PARAMS, TOK, assert_equal, filled_cache, first_difference,
                     snapshot)
from verdicts import Layer, Wrong, differ, step, strayed


LAYER = Layer("speculative", "speculative decoding (speculative.py)", ("prefill", "lossy"))


def setUpModule():
    verdicts.set_up("speculative")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down
class OneWrongDrafter:
    """A drafter for the speculative check: the next tokens of a known story (truth),
    with the one at index calls % (lookahead + 1) changed to another token, so that its
    drafts are rejected at each place in turn (the first, the second, ...), and one in
    lookahead + 1 is accepted whole."""

    def __init__(self, truth):
        self.truth, self.calls = truth, 0

    def propose(self, ids, lookahead):
        draft = list(self.truth[len(ids):len(ids) + lookahead])
        wrong, self.calls = self.calls % (lookahead + 1), self.calls + 1
        if wrong < len(draft):
            draft[wrong] = (draft[wrong] + 1) % model.VOCAB_SIZE
        return draft


class _Strayed(Exception):
    """Raised from inside generate_speculative by the check's watch on prefill: the Wrong
    it found (args[0])."""


def _token(token_id):
    return f"{token_id} ({TOK.vocab[token_id]!r})"


def _accepted(draft, story):
    """How many of draft's tokens, from the first, are the story's."""
    return next((j for j, (a, b) in enumerate(zip(draft, story)) if a != b),
                min(len(draft), len(story)))


def _story_so_far(calls, story):
    """After the drafts checked so far (calls, each (start, the token IDs fed)): how many of
    the last one's drafted tokens generate's story accepts, and the positions its story so
    far then leaves."""
    last_start, last_ids = calls[-1]
    accepted = _accepted(last_ids[1:], story[last_start + 1:])
    return accepted, last_start + 1 + accepted


def _rejects_some(calls, story):
    """The last draft checked (calls[-1]) has positions generate's story rejects."""
    last_start, last_ids = calls[-1]
    return last_start + len(last_ids) > _story_so_far(calls, story)[1]


def _where_the_rollback_strays(where, calls, cache, start, story):
    """None if, after the drafts checked so far (calls), the cache holds as many positions
    as generate's story so far leaves, and the next draft is checked from there; else a
    Wrong naming where."""
    last_start, last_ids = calls[-1]
    accepted, wanted = _story_so_far(calls, story)
    if len(cache) != wanted:
        kept = len(cache) - wanted
        after = ("the prompt" if len(calls) == 1 else f"draft {len(calls) - 1}, "
                 f"{accepted} of its {len(last_ids) - 1} tokens accepted")
        return Wrong(
            f"{where}: the cache holds {len(cache)} positions, where generate's story so far "
            f"leaves {wanted} (after {after}): "
            + (f"{kept} rejected position(s) not rolled back" if kept > 0 else
               f"{-kept} position(s) of the story rolled back too"),
            f"  fed: {after.split(',')[0]} checked as {last_ids}, from position "
            f"{last_start}\n  generate's story: {story}\n  the cache holds: {cache.tokens}")
    if start != wanted:
        return Wrong(f"{where}: the draft is checked from position {start}, where "
                     f"generate's story so far leaves {wanted}")
    return None


def _where_the_fed_tokens_stray(where, cache, token_ids, start, story, lookahead):
    """None if the cache holds generate's story's tokens, the tokens fed from start open
    with the story's token there, and (unless lookahead is None: the prompt) no more than
    lookahead drafted tokens follow it; else a Wrong naming where."""
    held = first_difference(cache.tokens, story[:len(cache)])
    if held:
        position = int(held[0][1:-1])
        return Wrong(f"{where}: the cache holds token {_token(cache.tokens[position])} at "
                     f"position {position}, where generate's story has "
                     f"{_token(story[position])}",
                     f"  generate's story: {story}\n  the cache holds: {cache.tokens}")
    if start < len(story) and token_ids[0] != story[start]:
        return Wrong(
            f"{where}: the tokens checked start with {_token(token_ids[0])} at "
            f"position {start} (the token chosen there), where generate's story has "
            f"{_token(story[start])}",
            f"  fed: {list(token_ids)} from position {start}\n  generate's story: {story}")
    if lookahead is not None and len(token_ids) - 1 > lookahead:
        return Wrong(
            f"{where}: {len(token_ids) - 1} drafted tokens are checked, more than the "
            f"lookahead of {lookahead}", f"  fed: {list(token_ids)} from position {start}")
    return None


def _where_the_result_differs(label, prompt, got, expected, story):
    """None if generate_speculative's result (got) is generate_cached's (expected, whose
    story is story); else a Wrong naming the run (label) and what differs first."""
    fed = f"the prompt {prompt!r}, token IDs {TOK.encode(prompt)}"
    return (differ(f"{label}: the story's token IDs", story_ids(TOK, prompt, got), story,
                   "generate_speculative", names=("position",), fed=fed)
            or differ(f"{label}: the chosen tokens and their probabilities",
                      [[s["token"], s["probability"]] for s in got["steps"]],
                      [[s["token"], s["probability"]] for s in expected["steps"]],
                      "generate_speculative", names=("generated token", "entry"), fed=fed)
            or (None if got == expected else Wrong(
                f"{label}: the generation stopped for {got['stopped']!r}, where generate's "
                f"stopped for {expected['stopped']!r}")))


def where_speculation_strays(label, prompt, settings, drafter_for, lookahead, max_new_tokens=16):
    """None if generate_speculative(prompt, with settings, the drafter drafter_for(the
    story generate_cached gives) and lookahead) gives
    generate_cached's result, and every prefill call it makes finds the cache holding
    exactly generate's story so far: the prompt, then each draft's accepted tokens and
    the token chosen after them, every rejected position rolled back, and no draft longer
    than the lookahead. Else a Wrong naming
    the run (label), the draft and the position, with both tokens or counts. Also the
    number of drafts whose rejected positions were rolled back."""
    from instruments import replaced
    from stories import story_ids
    step(f"{label}: generate_cached's result, for the story to expect")
    expected = kv_cache.generate_cached(PARAMS, TOK, prompt, max_new_tokens, **settings)
    story = story_ids(TOK, prompt, expected)
    drafter, calls, rolled_back = drafter_for(story), [], 0

    def watched(real):
        def checking_prefill(params, cache, token_ids, start):
            nonlocal rolled_back
            draft = f"draft {len(calls)}" if calls else "the prompt"
            where = f"{label}, before {draft} is checked (from position {start})"
            if calls and _rejects_some(calls, story):   # a rejected draft's positions
                rolled_back += 1
            why = _where_the_rollback_strays(where, calls, cache, start, story) if calls else None
            why = why or _where_the_fed_tokens_stray(where, cache, token_ids, start, story,
                                                     lookahead if calls else None)
            if why:
                raise _Strayed(why)
            calls.append((start, list(token_ids)))
            rows = real(params, cache, token_ids, start)
            step(f"{label}: choosing tokens from the rows of {draft} (positions {start} to "
                 f"{start + len(token_ids) - 1}) and rolling back the rejected ones, "
                 f"expecting generate's story")
            return rows
        return checking_prefill
    step(f"{label}: running generate_speculative, expecting generate's story, each draft "
         f"checked from a cache holding the story so far")
    try:
        with replaced(prefill, "prefill", watched):
            got = speculative.generate_speculative(PARAMS, TOK, prompt, max_new_tokens,
                                                   lookahead=lookahead, drafter=drafter,
                                                   **settings)
    except _Strayed as strayed:
        return strayed.args[0], rolled_back
    return _where_the_result_differs(label, prompt, got, expected, story), rolled_back


def quick_check():
    """The first opening, greedy and sampled, with a drafter that drafts the story with
    one token wrong, at each place of a draft in turn (OneWrongDrafter, lookahead 3), and
    greedy with the default drafter: each run gives generate_cached's result, and checks
    every draft from a cache holding exactly the story so far (where_speculation_strays).
    Each run with the wrong tokens must reject and roll back some drafts (counted)."""
    prompt = OPENINGS[0]
    for settings, drafted in (({}, "drafted with one token wrong"),
                              ({"temperature": 1.0, "seed": 1}, "drafted with one token wrong"),
                              ({}, "drafted by prompt lookup")):
        how = "greedy" if not settings else "sampled ({})".format(
            ", ".join(f"{key} {value}" for key, value in settings.items()))
        label = f"generate_speculative on the first opening ({prompt!r}), {how}, {drafted}"
        one_wrong = drafted.endswith("wrong")
        why, rolled_back = where_speculation_strays(
            label + (", lookahead 3" if one_wrong else ""), prompt, settings,
            OneWrongDrafter if one_wrong else lambda story: None, 3 if one_wrong else 4)
        if why:
            return why
        if one_wrong and not rolled_back:
            return Wrong(f"{label}: no draft was rejected and rolled back, so the check did "
                         f"not test the rollback")
    return None


QuickCheck = verdicts.quick_check_case("speculative", __name__)


def is_rollback(node):
    """node is the call cache.crop(...) that rolls rejected positions back."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "crop")


KEEP_A_REJECTED_POSITION = replacing(   # crop(n) becomes crop(n + 1)
    is_rollback,
    lambda node: ast.Call(node.func, [ast.BinOp(node.args[0], ast.Add(), ast.Constant(1))], []))


def _at_the_rollback(tree, change):
    """change(body, index) at the statement cache.crop(...) of tree; 1 if there is one."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for index, statement in enumerate(body if isinstance(body, list) else []):
            if isinstance(statement, ast.Expr) and is_rollback(statement.value):
                change(body, index)
                return 1
    return 0


def draw_for_a_discarded_draft(tree):
    """Before the rollback, one more random number from the generation's own (whatever
    the object whose choose() is called is named), as if a discarded drafted token drew."""
    chooser = next((node.func.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute) and node.func.attr == "choose"),
                   None)
    draw = ast.Expr(ast.Call(ast.Attribute(ast.Attribute(chooser, "rng", ast.Load()), "random",
                                           ast.Load()), [], []))
    return chooser is not None and _at_the_rollback(tree, lambda body, i: body.insert(i, draw))


def no_rollback(tree):
    """The rollback left out: every drafted position stays in the cache."""
    return _at_the_rollback(tree, lambda body, i: body.__setitem__(i, ast.Pass()))


ROLL_BACK_TOO_FAR = replacing(   # crop(n) becomes crop(n - 1)
    is_rollback,
    lambda node: ast.Call(node.func, [ast.BinOp(node.args[0], ast.Sub(), ast.Constant(1))], []))


ACCEPT_BY_THE_NEXT_POSITION = replacing(   # cache.tokens[n - 1] becomes cache.tokens[n]
    lambda node: isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
    and node.value.attr == "tokens" and isinstance(node.slice, ast.BinOp)
    and isinstance(node.slice.op, ast.Sub),
    lambda node: ast.Subscript(node.value, node.slice.left, ast.Load()))


CHECK_THE_DRAFT_ALONE = replacing(   # prefill [chosen, *draft] becomes prefill [*draft]
    lambda node: isinstance(node, ast.List) and len(node.elts) == 2
    and isinstance(node.elts[1], ast.Starred),
    lambda node: ast.List([node.elts[1]], ast.Load()))


RUN = (r"generate_speculative on the first opening \('[^']+'\), (greedy|sampled \(temperature "
       r"1\.0, seed 1\)), drafted with one token wrong, lookahead 3")
BEFORE_A_DRAFT = RUN + r", before draft \d+ is checked \(from position \d+\): "
HELD = BEFORE_A_DRAFT + (r"the cache holds \d+ positions, where generate's story so far "
                         r"leaves \d+ \(after [^)]+\): ")


class Speculative(unittest.TestCase):
    """Speculative decoding gives generate.generate's result, whatever the drafter."""

    @classmethod
    def setUpClass(cls):
        train, _, _ = split_stories(support.lab_file("corpus.txt"))
        cls.drafters = {"prompt lookup": speculative.PromptLookup(),
                        "training stories": speculative.NgramDrafter([TOK.encode(story)
                                                                  for story in train])}

    SETTINGS = ({}, {"temperature": 1.0, "seed": 1}, {"temperature": 0.8, "top_k": 3, "seed": 2})

    def differences(self, prompts, lookaheads, settings_list=SETTINGS):
        """The runs whose result is not generate.generate's, in a few words (compared with
        generate_cached's, which is generate's, as test_kv_cache shows, and 4 times
        cheaper)."""
        found = []
        for prompt in prompts:
            for settings in settings_list:
                expected = generate_cached(PARAMS, TOK, prompt, **settings)
                for name, drafter in self.drafters.items():
                    for lookahead in lookaheads:
                        result = support.described(lambda: speculative.generate_speculative(
                            PARAMS, TOK, prompt, lookahead=lookahead, drafter=drafter,
                            **settings))
                        if result != expected:
                            found.append(f"{prompt!r} {settings}, {name}, lookahead "
                                         f"{lookahead}: " + (f"{result['text']!r}, not "
                                         f"{expected['text']!r}" if isinstance(result, dict)
                                         else result))
        return found

    def test_every_result_is_generate_s(self):
        """Top-k sampling, for both drafters (trace_kv's speculative stage compares greedy
        and sampled stories with generate's, on all 60 openings and four lookaheads)."""
        self.assertEqual(self.differences(OPENINGS[:2], (1, 4), self.SETTINGS[2:]), [])

    def test_a_drafter_proposes_what_followed(self):
        ids = [1, 2, 3, 9, 1, 2, 3]
        self.assertEqual(speculative.PromptLookup().propose(ids, 4), [9, 1, 2, 3])
        self.assertEqual(speculative.PromptLookup().propose([5, 6], 4), [])
        drafter = speculative.NgramDrafter([[1, 2, 3, 4], [1, 2, 3, 5], [7, 2, 3, 5]])
        self.assertEqual(drafter.propose([2, 3], 2), [5])     # 3 -> 5 twice, 4 once; 5: none
        self.assertEqual(drafter.propose([1, 2, 3], 1), [4])  # a tie: the smallest ID

    def test_a_cache_holding_the_start_of_the_prompt_is_copied_and_one_that_drops_is_refused(
            self):
        prompt = OPENINGS[0]
        ids = TOK.encode(prompt)
        fresh = generate_cached(PARAMS, TOK, prompt)   # generate's (test_kv_cache)
        for held in (0, 3, len(ids)):
            cache = filled_cache(ids[:held])
            before = snapshot(cache)
            self.assertEqual(speculative.generate_speculative(PARAMS, TOK, prompt, cache=cache),
                             fresh)
            assert_equal(self, snapshot(cache), before, f"the cache holding {held} tokens")
        window = lossy.WindowCache(PARAMS, 8)
        for bad, fragment in (({"cache": window}, "a WindowCache drops positions a crop may "
                                                  "need"),
                              ({"lookahead": 0}, "lookahead must be an int >= 1"),
                              ({"lookahead": 2.0}, "lookahead must be an int >= 1")):
            with self.subTest(**bad), self.assertRaisesRegex(ValueError, fragment):
                speculative.generate_speculative(PARAMS, TOK, prompt, **bad)


class Verdicts(unittest.TestCase):
    """Each mistake planted in the real generate_speculative (by its syntax tree) makes
    the layer's own check fail, naming the run (greedy or sampled), the draft and the
    position, and what the cache holds there or the token chosen, against generate's."""

    MISTAKES = [
        ("the room for a draft one token more than the lookahead", speculative,
         "generate_speculative",
         replacing(lambda node: is_call_of(node, "min")
                   and ast.unparse(node.args[0]) == "lookahead",
                   lambda node: ast.Call(node.func, [ast.BinOp(node.args[0], ast.Add(),
                                                               ast.Constant(1))]
                                         + node.args[1:], [])),
         BEFORE_A_DRAFT + r"\d+ drafted tokens are checked, more than the lookahead of 3"),
        ("the rollback left out: rejected drafted positions stay in the cache", speculative,
         "generate_speculative", no_rollback,
         HELD + r"\d+ rejected position\(s\) not rolled back"),
        ("the rollback one position too far (crop(n - 1))", speculative, "generate_speculative",
         ROLL_BACK_TOO_FAR, HELD + r"\d+ position\(s\) of the story rolled back too"),
        ("the rollback keeps one position too many (crop(n + 1))", speculative,
         "generate_speculative", KEEP_A_REJECTED_POSITION,
         RUN + r": choosing tokens from the rows of the prompt \(positions 0 to \d+\) .*"
               r"raised ValueError: crop length must be an int from 0 to \d+ .*got \d+"),
        ("one more random number drawn for a discarded draft", speculative,
         "generate_speculative", draw_for_a_discarded_draft,
         BEFORE_A_DRAFT.replace("(greedy|", "(")
         + r"the tokens checked start with \d+ \('[^']+'\) at position \d+ \(the token "
           r"chosen there\), where generate's story has \d+"),
        ("a drafted token accepted by the drafted token after it (cache.tokens[len(ids)])",
         speculative, "generate_speculative", ACCEPT_BY_THE_NEXT_POSITION,
         HELD + r"\d+ position\(s\) of the story rolled back too"),
        ("the draft checked without the token chosen before it", speculative,
         "generate_speculative", CHECK_THE_DRAFT_ALONE,
         BEFORE_A_DRAFT + r"the tokens checked start with \d+ \('[^']+'\) at position \d+ "
                          r"\(the token chosen there\), where generate's story has \d+"),
    ]

    def test_each_mistake_is_named_by_the_layer_s_check(self):
        verdicts.assert_verdicts(self, "speculative", self.MISTAKES)


class Drafters(unittest.TestCase):
    """A drafter that misbehaves is refused, naming it; one that behaves is used as given."""

    class Proposing:
        """A drafter that proposes what it is told to, and keeps what it was given."""

        def __init__(self, draft):
            self.draft, self.given = draft, []

        def propose(self, ids, lookahead):
            self.given.append(ids)
            return self.draft

        def __len__(self):   # falsy, as an empty container is
            return 0

    def test_a_draft_that_is_not_a_short_list_of_token_ids_is_refused_naming_the_drafter(self):
        for draft in (None, 5, "ab", [96], [1.0], [True], [1] * 5):
            with self.subTest(draft=draft), self.assertRaisesRegex(
                    ValueError, r"the drafter Proposing proposed .*, where a draft must be a "
                                r"list of at most 4 token IDs"):
                speculative.generate_speculative(PARAMS, TOK, OPENINGS[0],
                                                 drafter=self.Proposing(draft))

    def test_a_drafter_without_propose_is_refused_before_anything_is_computed(self):
        for drafter in (5, "lookup", object()):
            with self.subTest(drafter=drafter), recording(prefill, "prefill") as calls, \
                    self.assertRaisesRegex(ValueError, "drafter must have a method propose"):
                speculative.generate_speculative(PARAMS, TOK, OPENINGS[0], drafter=drafter)
            self.assertEqual(calls, [])

    def test_a_falsy_drafter_is_used_and_given_the_story_as_a_tuple(self):
        drafter = self.Proposing([])
        result = speculative.generate_speculative(PARAMS, TOK, OPENINGS[0], max_new_tokens=5,
                                                  drafter=drafter)
        self.assertEqual(result, generate_cached(PARAMS, TOK, OPENINGS[0], max_new_tokens=5))
        self.assertEqual(len(drafter.given), 4)   # after each chosen token but the last
        self.assertTrue(all(isinstance(ids, tuple) for ids in drafter.given))

    def test_random_drafters_give_generate_s_result_or_a_refusal_naming_them(self):
        """Case n: a drafter that proposes, from random.Random(n), random tokens, the
        true continuation, nothing, or now and then something that is not a draft (too
        long, a token outside the vocabulary, None), with a random lookahead and setting,
        from a cache holding a random start of the prompt. Every run gives the cached
        generator's result (which is generate's) or a refusal naming the drafter, and
        leaves the given cache as it was."""
        class Random:
            def __init__(self, rng, truth):
                self.rng, self.truth = rng, truth

            def propose(self, ids, lookahead):
                pick = self.rng.random()
                if pick < 0.05:
                    return self.rng.choice((None, [96], [1] * (lookahead + 1)))
                if pick < 0.4:
                    return list(self.truth[len(ids):len(ids) + self.rng.randint(0, lookahead)])
                return [self.rng.randrange(model.VOCAB_SIZE)
                        for _ in range(self.rng.randint(0, lookahead))]
        refused = 0

        def check(index):
            nonlocal refused
            rng = random.Random(index)
            prompt = rng.choice(OPENINGS[:12])
            settings = rng.choice(({}, {"temperature": 1.0, "seed": index},
                                   {"temperature": 0.8, "top_k": 3, "seed": index}))
            expected = generate_cached(PARAMS, TOK, prompt, **settings)
            truth = story_ids(TOK, prompt, expected)
            cache = filled_cache(TOK.encode(prompt)[:rng.randint(0, 4)])
            before = snapshot(cache)
            try:
                result = speculative.generate_speculative(
                    PARAMS, TOK, prompt, lookahead=rng.randint(1, 6), cache=cache,
                    drafter=Random(rng, truth), **settings)
            except ValueError as e:
                refused += 1
                result = expected if "the drafter Random proposed" in str(e) else str(e)
            if snapshot(cache) != before:
                return "the given cache changed"
            return None if result == expected else f"{prompt!r} {settings}: {result}"
        if len(support.check_random_cases(self, 15, check)) >= 15:
            self.assertGreater(refused, 0)   # some drafts were refused

    def test_drafters_refuse_bad_settings(self):
        for make, fragment in ((lambda: speculative.PromptLookup("3"), "longest must be"),
                               (lambda: speculative.PromptLookup(0), "longest must be"),
                               (lambda: speculative.NgramDrafter(None), "stories must be"),
                               (lambda: speculative.NgramDrafter([[1, 96]]),
                                r"stories\[0\]\[1\] = 96 is outside the vocabulary"),
                               (lambda: speculative.NgramDrafter(["mia"]), "stories.0. must be")):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                make()


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of speculative decoding."""

    def test_every_drafter_gives_generate_s_stories(self):
        for run in support.recorded("speculative_decoding"):
            with self.subTest(drafter=run["drafter"], lookahead=run["lookahead"]):
                self.assertEqual((run["identical"], run["largest_logit_gap_of_choosing_rows"]),
                                 (120, 0.0))


if __name__ == "__main__":
    unittest.main()
