"""A layer whose cache is a state (recurrent.py): recurrent layers beside attention layers.
Fed token by token, every row equals the full pass, with ==; the states hold the same
numbers at every length, counted against the formula; the chunked form engines prefill
with stays within rounding of those rows; checkpoints are kept every C positions, and a
request resumes from the longest one an earlier request left within its prompt (every
checkpoint tried), its rows the full pass's; crop goes back to a checkpoint exactly and
refuses any other length; bad settings are refused by name; mistakes planted in
recurrent.py are named by the quick check."""
import ast
import copy
import math
import random
import unittest

import recurrent
import recurrent_params
import support
import verdicts
from instruments import replacing
from model import VOCAB_SIZE
from recurrent import Checkpoint, CheckpointStore, RecurrentCache, forward, forward_step
from recurrent_params import init_params, kv_numbers, state_numbers
from random_models import random_tokens
from support import STORIES, TOK, assert_each_refused, check_random_cases
from support import swapping
from verdicts import Layer, Wrong, differ, step, strayed

LAYER = Layer("recurrent", "a layer whose cache is a state (recurrent.py)", ("deep_model",))


def setUpModule():
    verdicts.set_up("recurrent")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down
QUICK_KINDS = ["recurrent", "attention", "recurrent"]
EVERY = 4


def label(params):
    """A hybrid in words: "the hybrid of layers recurrent, attention (2 heads, 1 kv head, ...)"."""
    shape = params["shape"]
    heads, kv_heads = shape["heads"], shape["kv_heads"]
    return (f"the hybrid of layers {', '.join(shape['kinds'])} ({heads} head{'s' * (heads > 1)}, "
            f"{kv_heads} kv head{'s' * (kv_heads > 1)}, width {shape['width']})")


def where_recurrence_wrong():
    """None if recurrent.updated and recurrent.read give, for one head of width 2 over three
    positions, the state and the output worked out plainly here (each new entry fsum of
    the gate times the old one and k[a] v[b], the gate first; q S by columns), bit for
    bit; else a Wrong naming the position, row and column."""
    q, state = [0.3, -1.1], [[0.0, 0.0], [0.0, 0.0]]
    for position, (g, k, v) in enumerate((
            (0.7, [0.9, -0.4], [1.3, 0.2]), (0.9, [0.1, 1.7], [-0.6, 0.8]),
            (0.35, [-1.2, 0.5], [0.4, -2.2]))):
        plain = [[math.fsum([g * state[a][b], k[a] * v[b]]) for b in range(2)] for a in range(2)]
        step(f"recurrent.updated at position {position}")
        why = differ(f"recurrent.updated's state after position {position}",
                     recurrent.updated(state, g, k, v), plain, "updated",
                     names=("row", "column"), fed=f"the state {state}, g {g}, k {k}, v {v}")
        if why:
            return why
        state = plain
    step("recurrent.read")
    return differ("recurrent.read's output after position 2", recurrent.read(q, state),
                  [math.fsum(q[a] * state[a][b] for a in range(2)) for b in range(2)], "read",
                  names=("value",), fed=f"q {q}, the state {state}")


def where_rows_stray(params, ids, every):
    """None if params' rows fed ids one token at a time equal its full pass's, with its
    states' numbers the formula's at every length; if the cache keeps a checkpoint after
    every multiple of every and each holds the states it held then; and if the chunked
    form's rows, chunks of 3 and of 5, are within rounding of those rows; else a Wrong
    naming the quantity and where."""
    name, shape = label(params), params["shape"]
    cache, rows, states = RecurrentCache(params, every), [], {}
    for position, token_id in enumerate(ids):
        step(f"{name}: forward_step of token {token_id} at position {position}")
        rows.append(forward_step(params, cache, token_id, position))
        states[len(cache)] = [layer.get("state") for layer in cache.layers]
        if cache.numbers("state") != state_numbers(shape):
            return Wrong(f"{name}: after {len(cache)} positions its states hold "
                         f"{cache.numbers('state')} numbers, {state_numbers(shape)} by formula")
    step(f"{name}: its full pass (recurrent.forward)")
    full = forward(params, ids)
    why = (differ(f"{name}: the row fed token by token", rows, full, "forward_step",
                  fed=f"token IDs {ids}; expected: recurrent.forward")
           or differ(f"{name}: the lengths of its checkpoints (every {every})",
                     sorted(cache.checkpoints), list(range(every, len(ids) + 1, every)), "keep",
                     names=("checkpoint",), fed=f"{len(ids)} tokens"))
    for length, checkpoint in sorted(cache.checkpoints.items()):
        why = why or differ(f"{name}: the states of its checkpoint after {length} positions",
                            [layer.get("state") for layer in checkpoint.layers], states[length],
                            "keep", names=("layer", "head", "row", "column"),
                            fed=f"token IDs {ids}; expected: the states after {length}")
    for size in (3, 5):
        step(f"{name}: the chunked form, chunks of {size} (recurrent.forward(..., {size}))")
        why = why or strayed(f"{name}: the chunked form's rows, chunks of {size}",
                             forward(params, ids, size), rows, "chunked",
                             fed=f"token IDs {ids}; expected: the rows fed token by token")
    return why


def brute_hit(stories, every, ids):
    """The longest prefix of ids a request may resume from, every earlier story tried.

    A length L, a multiple of every, at most len(ids) - 1 and at most a story's length, at
    which the story and ids agree on their first L tokens (it kept a checkpoint there)."""
    return max([length for story in stories for length in range(every, len(story) + 1, every)
                if length < len(ids) and story[:length] == ids[:length]], default=0)


def where_stories_stray(params, prompts, every, new_tokens):
    """None if each prompt, served in turn through one CheckpointStore and continued greedily
    by new_tokens, resumes from brute_hit's length and computes the full pass's rows of its
    story from there; else a Wrong naming the request."""
    store, stories = CheckpointStore(), []
    for number, prompt in enumerate(prompts):
        where = f"{label(params)}, a checkpoint every {every}: request {number}"
        step(f"{where}: the checkpoint it resumes from (CheckpointStore.find)")
        found, expected = store.find(prompt), brute_hit(stories, every, prompt)
        if (len(found.tokens) if found else 0) != expected:
            return Wrong(f"{where}: it resumes after {len(found.tokens) if found else 0} "
                         f"positions from CheckpointStore.find, {expected} expected (every "
                         f"checkpoint of the requests before tried)", f"  fed: prompts {prompts}")
        step(f"{where}: served through the store (recurrent.greedy_story)")
        story, rows, _ = recurrent.greedy_story(params, store, prompt, new_tokens, every)
        hit = len(story) - len(rows)
        step(f"{where}: the full pass of its story")
        why = differ(f"{where}: the row", [None] * hit + rows, [None] * hit + forward(
            params, story)[hit:], "forward_step", fed=f"token IDs {story}, the first {hit} "
                                                      f"from a checkpoint")
        if why:
            return why
        stories.append(story)
    return None


def quick_check():
    """A hybrid's recurrence, rows, states, checkpoints, chunked form and hits are right.

    recurrent.updated and read against the arithmetic worked out plainly
    (where_recurrence_wrong); then the first 13 tokens of the first test story through a
    hybrid of layers recurrent, attention, recurrent (2 heads, 1 kv head, width 8): rows,
    states, checkpoints every 4, chunks (where_rows_stray); and three requests, the second
    the first's prompt again, the third its first 7 tokens and 3 of its own, each continued
    by 2 (where_stories_stray)."""
    why = where_recurrence_wrong()
    if why:
        return why
    step("making the quick check's hybrid (recurrent_params.init_params)")
    params = init_params(QUICK_KINDS, 2, 1, 8, 0)
    ids = TOK.encode(STORIES[0])[:13]
    first = ids[:8]
    return (where_rows_stray(params, ids, EVERY)
            or where_stories_stray(params, [first, first, first[:7] + random_tokens(3)],
                                   EVERY, 2))


QuickCheck = verdicts.quick_check_case("recurrent", __name__)


def expression(source):
    return ast.parse(source, mode="eval").body


def one_position_late(tree):
    """The state after C k + 1 positions kept as the checkpoint after C k."""
    return all([swapping("held % self.every == 0", "held > 1 and held % self.every == 1")(tree),
                replacing(lambda node: isinstance(node, ast.Subscript)
                          and ast.unparse(node) == "self.checkpoints[held]",
                          lambda node: ast.Subscript(node.value, expression("held - 1"),
                                                     node.ctx))(tree)])


QUICK = (r"the hybrid of layers recurrent, attention, recurrent \(2 heads, 1 kv head, "
         r"width 8\)")


class Teeth(unittest.TestCase):
    """Each mistake planted in the real recurrent.py makes the layer's quick check fail with
    a line naming the quantity and where: the position, row and column of a state, the
    checkpoint and its layer, the chunk size and the row, the request."""

    MISTAKES = [
        ("the gate applied after the update, not before", recurrent, "updated",
         swapping("dot((g, k_a), (s, v_b))", "g * (s + k_a * v_b)"),
         r"^recurrent\.updated's state after position 0, at row 0, column 0: \S+ from "
         r"updated, \S+ expected$"),
        ("a checkpoint one position late", RecurrentCache, "keep", one_position_late,
         r"^" + QUICK + r": the states of its checkpoint after 4 positions, at layer 0, "
         r"head \d, row \d, column \d: \S+ from keep, \S+ expected$"),
        ("the state not carried between chunks", recurrent, "chunked",
         replacing(lambda node: isinstance(node, ast.Assign)
                   and ast.unparse(node.targets[0]) == "states[h]", lambda node: ast.Pass()),
         r"^" + QUICK + r": the chunked form's rows, chunks of 3, at position 3, logit \d+: "
         r"\S+ from chunked, \S+ expected \(\S+ apart, more than rounding, 1e-12\)$"),
        ("a request resumed from a checkpoint after its whole prompt", CheckpointStore,
         "find", swapping("range(len(ids) - 1, 0, -1)", "range(len(ids), 0, -1)"),
         r"^" + QUICK + r", a checkpoint every 4: request 1: it resumes after 8 positions "
                        r"from CheckpointStore\.find, 4 expected"),
    ]

    def test_the_quick_check_names_each_mistake_and_where(self):
        verdicts.assert_verdicts(self, "recurrent", self.MISTAKES)


def random_hybrid(rng):
    """A random hybrid from rng: 1 to 4 layers of either kind, width 4 or 8, heads and kv
    heads that divide it."""
    width = rng.choice((4, 8))
    heads = rng.choice([h for h in (1, 2, 4) if width // h % 2 == 0])
    kv_heads = rng.choice([k for k in (1, 2, 4) if heads % k == 0])
    kinds = [rng.choice(recurrent_params.KINDS) for _ in range(rng.randint(1, 4))]
    return init_params(kinds, heads, kv_heads, width, rng.randrange(99))


class Exactness(unittest.TestCase):

    def test_random_hybrids_rows_states_checkpoints_and_chunks(self):
        """Case n draws from random.Random(n) a random_hybrid, 5 to 20 tokens and a
        checkpoint interval of 1 to 6: where_rows_stray finds nothing (2 cases, more with
        KV_LAB_RANDOM_CASES)."""
        def check(n):
            rng = random.Random(n)
            params = random_hybrid(rng)
            return where_rows_stray(params, random_tokens(rng.randint(5, 20), seed=n),
                                    rng.randint(1, 6))
        check_random_cases(self, 2, check)

    def test_a_state_holds_the_same_numbers_at_every_length(self):
        """Qwen3-Next's pattern on 4 layers: its states hold 3 x 4 heads x 4 x 4 = 192
        numbers after 0 to 20 positions, its attention layer's keys and values 2 x 1 kv
        head x 4 = 8 more a position."""
        params = recurrent.tried_model()
        cache = RecurrentCache(params)
        held = [(cache.numbers("state"), cache.numbers("keys") + cache.numbers("values"))]
        for position, token_id in enumerate(random_tokens(20)):
            forward_step(params, cache, token_id, position)
            held.append((cache.numbers("state"), cache.numbers("keys") + cache.numbers("values")))
        self.assertEqual(held, [(192, 8 * n) for n in range(21)])
        self.assertEqual([state_numbers(params["shape"]), kv_numbers(params["shape"], 20)],
                         [192, 160])


def random_requests_case(n):
    """None if random requests through a CheckpointStore hold what where_stories_stray
    checks, else why. From random.Random(n): a random_hybrid, a checkpoint every 1 to 5,
    5 requests, each the start of an earlier story (or none) and 1 to 6 tokens of its own,
    continued by 0 to 3."""
    rng = random.Random(n)
    params, every = random_hybrid(rng), rng.randint(1, 5)
    prompts = []
    for _ in range(5):
        base = rng.choice(prompts) if prompts else []
        prompts.append(base[:rng.randint(0, len(base))]
                       + [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 6))])
    return where_stories_stray(params, prompts, every, rng.randint(0, 3))


class Checkpoints(unittest.TestCase):

    def test_random_requests_resume_from_the_checkpoint_every_request_tried_finds(self):
        """2 cases of random_requests_case by default (KV_LAB_RANDOM_CASES for more)."""
        check_random_cases(self, 2, random_requests_case)

    def test_no_checkpoint_inside_the_prompt_reuses_nothing(self):
        """vLLM issue #40696's case: checkpoints every 16 positions, prompts of 12 tokens
        sharing 10: every request is computed from position 0; every 4, from 8."""
        params = init_params(QUICK_KINDS, 2, 1, 8, 0)
        shared = random_tokens(10)
        prompts = [shared + random_tokens(2, seed=seed) for seed in (1, 2, 3)]
        for every, hits in ((16, [0, 0, 0]), (4, [0, 8, 8])):
            store = CheckpointStore()
            found = [len(story) - len(rows) for story, rows, _ in
                     (recurrent.greedy_story(params, store, prompt, 1, every)
                      for prompt in prompts)]
            self.assertEqual(found, hits, f"a checkpoint every {every}")

    def test_crop_goes_back_to_a_checkpoint_exactly_and_refuses_any_other_length(self):
        """A speculative decoder's rollback: 11 tokens with a checkpoint every 4; cropped to
        10, 7 or 5 (no checkpoint there), refused naming the checkpoints, the cache
        unchanged; cropped to 8 or 0 and fed the rest again, the rows are the full pass's."""
        params, ids = recurrent.tried_model(), random_tokens(11)
        cache = RecurrentCache(params, 4)
        for position, token_id in enumerate(ids):
            forward_step(params, cache, token_id, position)
        state = lambda: copy.deepcopy((cache.tokens, cache.layers, cache.checkpoints))
        assert_each_refused(self, [
            (lambda length=length: cache.crop(length),
             rf"crop length {length}: a recurrent layer's state cannot go back to {length} "
             rf"positions; this cache holds the state after 11 and checkpoints after \[4, 8\]")
            for length in (10, 7, 5)]
            + [(lambda: cache.crop(12), r"crop length must be an int from 0 to 11"),
               (lambda: cache.crop(4.0), r"crop length must be an int")], state)
        full = forward(params, ids)
        for length in (8, 0):
            cache.crop(length)
            self.assertEqual((len(cache), sorted(cache.checkpoints)), (length, [4, 8][:length]))
            rows = [forward_step(params, cache, ids[p], p) for p in range(length, len(ids))]
            self.assertTrue(rows == full[length:], f"rows after a crop to {length}")
        cache.crop(len(cache))   # to its own length: nothing to undo
        self.assertEqual(len(cache), 11)


class RealModels(unittest.TestCase):

    def test_a_state_against_an_attention_layer_by_the_configs(self):
        """Qwen3-Next-80B-A3B: a Gated DeltaNet layer's state is 32 x 128 x 128 numbers and
        3 x 8,192 of its convolution, 1,097,728 bytes in 16 bits; an attention layer holds
        2 x 2 x 256 x 2 = 2,048 bytes a token (8 MiB at 4,096, as large as a state from 536
        tokens); the model at 131,072 tokens, 12 attention layers of 256 MiB and 36 states.
        Jamba-v0.1: 8,192 x 16 + 3 x 8,192 numbers, 4,096 bytes a token."""
        qwen, jamba = recurrent_params.real_caches()
        self.assertEqual((qwen["model"], qwen["recurrent_layers"], qwen["attention_layers"]),
                         ("Qwen3-Next-80B-A3B", 36, 12))
        self.assertEqual(qwen["state_bytes"], (32 * 128 * 128 + 3 * 8192) * 2)
        self.assertEqual(qwen["attention_layer_bytes"], [8 * 2 ** 20, 256 * 2 ** 20])
        self.assertEqual(qwen["model_bytes"][1], 12 * 256 * 2 ** 20 + 36 * 1097728)
        self.assertEqual(qwen["every_layer_attention_bytes"][1], 12 * 2 ** 30)
        self.assertEqual(qwen["tokens_as_large"], 536)
        self.assertEqual((jamba["recurrent_layers"], jamba["attention_layers"]), (28, 4))
        self.assertEqual(jamba["state_bytes"], (8192 * 16 + 3 * 8192) * 2)
        self.assertEqual(jamba["attention_layer_bytes"][0], 4096 * 4096)


class Refusals(unittest.TestCase):

    def test_bad_settings_are_refused_naming_them(self):
        """A checkpoint interval of 0 or not an int, a chunk of 0, kinds or a pattern not
        the module's, params not init_params', a step of another cache or out of order."""
        params = init_params(QUICK_KINDS, 2, 1, 8, 0)
        cache = RecurrentCache(params)
        for call, fragment in (
                (lambda: RecurrentCache(params, 0), r"checkpoint_every must be an int from 1 "
                                                    r"to 64 \(the positions between saved "
                                                    r"states; None saves none\), got 0"),
                (lambda: RecurrentCache(params, 2.0), r"checkpoint_every must be an int .*2\.0"),
                (lambda: RecurrentCache(params, True), r"checkpoint_every must be an int .*True"),
                (lambda: forward(params, [1, 2], 0), r"chunk must be an int >= 1"),
                (lambda: init_params(["recurrent", "mamba"], 2, 1, 8, 0),
                 r"kinds must be a list of \"recurrent\" or \"attention\", one a layer"),
                (lambda: init_params([], 2, 1, 8, 0), r"kinds must be a list"),
                (lambda: init_params(["recurrent"], 3, 1, 8, 0), r"width 8 must be a multiple"),
                (lambda: recurrent_params.pattern_kinds("mamba", 4), r"pattern must be"),
                (lambda: RecurrentCache({"shape": {}}), r"params must be recurrent_params"),
                (lambda: RecurrentCache(dict(params, blocks=params["blocks"][:2])),
                 r"params must hold .* 3 blocks"),
                (lambda: forward_step(init_params(QUICK_KINDS, 2, 1, 8, 0), cache, 1, 0),
                 r"this cache was made for different parameters"),
                (lambda: forward_step(params, cache, 1, 1), r"expected position 0, got 1"),
                (lambda: forward_step(params, cache, 96, 0), r"outside the vocabulary")):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                call()
        self.assertEqual(len(cache), 0)

    def test_a_checkpoint_of_the_wrong_shape_is_refused_naming_the_layer(self):
        """A state of another number of heads, a row too short or a NaN; an attention
        layer without a key a token; not a Checkpoint; refused before a cache is made."""
        params = init_params(QUICK_KINDS, 2, 1, 8, 0)
        cache = RecurrentCache(params)
        for position, token_id in enumerate(random_tokens(3)):
            forward_step(params, cache, token_id, position)
        good = cache.checkpoint()

        def edited(layer, held):
            return Checkpoint(good.tokens, good.layers[:layer] + [held] + good.layers[layer + 1:])
        state = good.layers[0]["state"]
        for checkpoint, fragment in (
                (edited(0, {"state": state[:1]}), r"checkpoint: layer 0 is recurrent, and must "
                                                  r"hold a state of 2 heads of 4 x 4 finite "
                                                  r"floats, got"),
                (edited(2, {"state": [state[0], [row[:3] for row in state[1]]]}),
                 r"checkpoint: layer 2 is recurrent"),
                (edited(0, {"state": [state[0], [[math.nan] * 4] * 4]}),
                 r"checkpoint: layer 0 is recurrent"),
                (edited(1, dict(good.layers[1], keys=good.layers[1]["keys"][:2])),
                 r"checkpoint: layer 1 is attention, and must hold 3 keys and 3 values \(one a "
                 r"token\) of 4 finite floats"),
                (Checkpoint(good.tokens, good.layers[:2]), r"checkpoint: its layers must be 3"),
                ({"tokens": ()}, r"checkpoint must be a recurrent_params\.Checkpoint")):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                RecurrentCache.resumed(params, checkpoint)
        resumed = RecurrentCache.resumed(params, good)
        self.assertEqual((resumed.tokens, resumed.layers), (cache.tokens, cache.layers))


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of the hybrid with states."""

    def test_rows_are_exact_states_constant_and_chunks_within_rounding(self):
        """Every row fed token by token equals the full pass (gap 0.0) on the test stories;
        the states hold the formula's numbers at every length, the keys and values grow with
        it; the chunked form differs, by less than 1e-12, but not by nothing."""
        record = support.recorded("recurrent")
        self.assertEqual((record["rows_compared"], record["rows_equal"],
                          record["largest_logit_gap"]), (record["positions"], True, 0.0))
        for held in record["lengths"]:
            self.assertEqual([held["state_numbers"], held["kv_numbers"]], held["formula"])
        self.assertEqual(len({held["state_numbers"] for held in record["lengths"]}), 1)
        self.assertLess(record["lengths"][0]["kv_numbers"], record["lengths"][-1]["kv_numbers"])
        for run in record["chunked"]:
            self.assertTrue(0.0 < run["largest_logit_gap"] < 1e-12, run)

    def test_requests_resume_from_the_last_checkpoint_in_their_shared_prefix(self):
        """Each request after the first shares the prefix an attention layer could reuse
        whole; a checkpoint every C positions reuses its largest multiple of C, nothing when
        C is beyond it (no checkpoint there: vLLM #40696), and every row is the full pass's."""
        prefix = support.recorded("recurrent")["prefix"]
        for run in prefix["checkpoints"]:
            with self.subTest(every=run["every"]):
                self.assertEqual(run["positions_reused"],
                                 [shared // run["every"] * run["every"]
                                  for shared in prefix["attention_reuse"]])
                self.assertTrue(run["rows_equal_to_the_full_pass"])
        self.assertEqual([run["positions_reused"][1] for run in prefix["checkpoints"]
                          if run["every"] > prefix["prompt"]], [0])

    def test_real_models_are_their_configs_figures(self):
        self.assertEqual(support.recorded("recurrent")["real_models"],
                         recurrent_params.real_caches())


if __name__ == "__main__":
    unittest.main()
