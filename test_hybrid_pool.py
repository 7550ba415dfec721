"""The hybrid pool (hybrid_pool.py): window layers and full layers in one pool of blocks,
a block table per group. After every step each window group holds the blocks vLLM's rule
keeps; keeping them all gives the same rows and the full bytes; a prefix hit is the
longest a brute-force search over every length finds; every row equals deep_model.forward
with each layer's mask, with ==; bad settings are refused by name."""
import ast
import copy
import math
import random
import unittest

import deep_model
import hybrid_pool
import support
import verdicts
from hybrid_pool import HybridPool, freeing_against_keeping, greedy_story, layer_groups
from instruments import replacing, spelt
from model import CONTEXT, VOCAB_SIZE, band, causal
from random_models import random_tokens
from support import assert_each_refused, check_random_cases, deep_snapshot
from verdicts import Layer, Wrong, deep_label, differ, step


LAYER = Layer("hybrid_pool", "the hybrid pool (hybrid_pool.py)", ("deep_model",))


def setUpModule():
    verdicts.set_up("hybrid_pool")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down
MODEL = (4, 4, 2, 16, 0)      # deep_model.init_params's: 4 layers of grouped-query attention
WINDOWS = [4, None, 4, None]  # gpt-oss's pattern: a window in the even layers
BLOCK_SIZE, POOL_BLOCKS = 2, 19
PROMPT, NEW = 8, 12           # the first story: 8 random tokens, then 12 chosen greedily
SHARED = (16, 12, 4)          # requests sharing the first story's first 16, 12, 4 tokens


def masks(params):
    """Each layer's mask, from the model's windows: the last window positions, or every one
    (a full layer)."""
    windows = params["shape"].get("windows") or [None] * params["shape"]["layers"]
    return [causal if window is None else band(window) for window in windows]


def group_name(g, group):
    """A group in words: "group 1 (window 4: layers 0, 2)"."""
    kind = "full" if group.window is None else f"window {group.window}"
    return f"group {g} ({kind}: layers {', '.join(map(str, group.layers))})"


def where_tables_stray(label, seq, seen):
    """None if each group's block table holds what vLLM's rule keeps, else a Wrong.

    A window group of a pool that frees holds no block whose last position is before the
    first one the next row reads, len(seq) - W + 1; every other block stays, as it was
    taken (seen[g]: the ids group g's table has held, noted here as they appear)."""
    pool, computed = seq.pool, len(seq)
    for g, (group, table) in enumerate(zip(pool.groups, seq.tables)):
        seen[g] += table[len(seen[g]):]
        first_read = computed - group.window + 1 if group.window and pool.frees else 0
        expected = [None if (index + 1) * pool.block_size <= first_read else block_id
                    for index, block_id in enumerate(seen[g])]
        why = differ(f"{label}, {computed} positions computed: {group_name(g, group)}'s "
                     f"block table", table, expected, "HybridSequence", names=("block",),
                     fed=f"token IDs {seq.tokens}, blocks of {pool.block_size}; expected: "
                         f"vLLM's remove_skipped_blocks")
        if why:
            return why
    return None


def where_counts_stray(label, pool, live):
    """None if each block's ref count is the number of live tables holding it, and the free
    blocks those no table holds; else a Wrong naming the block."""
    expected = [0] * len(pool.blocks)
    for seq in live:
        for table in seq.tables:
            for block_id in table:
                if block_id is not None:
                    expected[block_id] += 1
    return (differ(f"{label}: the pool's ref counts", pool.ref_counts, expected, "HybridPool",
                   names=("block",), fed=f"{len(live)} live sequences' tables")
            or differ(f"{label}: the pool's free blocks", [pool.free_blocks()],
                      [expected.count(0)], "HybridPool", names=("entry",)))


def brute_hit(pool, ids):
    """The longest prefix of ids a new request may reuse, found by trying every length.

    Lengths of whole blocks up to len(ids) - 1; one is valid if every position each group
    needs there is in a findable block (indexed under its group and the tokens up to its
    end): all before it for a full group, the last W - 1 before it for a window group."""
    def held(g, position):
        end = (position // pool.block_size + 1) * pool.block_size
        return (g, tuple(ids[:end])) in pool.prefix_index

    def needed(group, length):
        return range(0 if group.window is None else max(0, length - group.window + 1), length)
    return max(length for length in range(0, len(ids), pool.block_size)
               if all(held(g, p) for g, group in enumerate(pool.groups)
                      for p in needed(group, length)))


def where_hit_strays(label, pool, ids):
    """None if pool.find(ids) gives brute_hit's length, else a Wrong naming both."""
    step(f"{label}: pool.find against every length tried")
    found, expected = pool.find(ids)[0], brute_hit(pool, ids)
    if found != expected:
        return Wrong(f"{label}: the prefix hit is {found} positions from HybridPool.find, "
                     f"{expected} expected (every length tried)",
                     f"  fed: token IDs {ids}, blocks of {pool.block_size}")
    return None


def where_story_strays(label, pool, prompt, new_tokens, live):
    """None if a sequence of pool for prompt, continued greedily by new_tokens, holds what it
    should; else a Wrong naming the quantity and where.

    Its hit is brute_hit's; after every step its tables follow vLLM's rule
    (where_tables_stray) and the ref counts the live tables (where_counts_stray); its rows
    are deep_model.forward's with each layer's mask. The sequence joins live."""
    why = where_hit_strays(label, pool, prompt)
    if why:
        return why
    params, seq = pool.params, pool.sequence(prompt)
    live.append(seq)
    hit, story, rows, seen = len(seq), list(prompt), [], [[] for _ in pool.groups]
    why = where_tables_stray(label, seq, seen) or where_counts_stray(label, pool, live)
    while not why and (len(story) < len(prompt) + new_tokens or len(seq) < len(story)):
        position = len(seq)
        if position == len(story):
            story.append(max(range(VOCAB_SIZE), key=rows[-1].__getitem__))
        step(f"{label}: forward_step of token {story[position]} at position {position}")
        rows.append(deep_model.forward_step(params, seq, story[position], position))
        why = where_tables_stray(label, seq, seen) or where_counts_stray(label, pool, live)
    if why:
        return why
    step(f"{label}: the full pass with each layer's mask (deep_model.forward)")
    expected = deep_model.forward(params, story, masks(params))
    return differ(f"{label}: the row", [None] * hit + rows, [None] * hit + expected[hit:],
                  "forward_step", fed=f"token IDs {story}, the first {hit} a prefix hit; "
                                      f"expected: the full pass with each layer's mask")


def quick_check():
    """The hybrid pool's tables, hits, ref counts and rows are what vLLM and the full pass say.

    On a 4-layer grouped-query model with a window of 4 in its even layers, in a pool of 19
    blocks of 2: a story of 8 random tokens and 12 greedy ones (where_story_strays); the
    hits of requests sharing its first 16, 12 and 4 tokens, against every length tried;
    the story of the first request, the first story still live; then the ref counts once
    the first story is freed."""
    params = deep_model.init_params(*MODEL, windows=WINDOWS)
    pool, live = HybridPool(params, POOL_BLOCKS, BLOCK_SIZE), []
    why = where_story_strays("the first story", pool, random_tokens(PROMPT), NEW, live)
    if why:
        return why
    requests = [live[0].tokens[:shared] + random_tokens(4, seed=shared) for shared in SHARED]
    for shared, request in zip(SHARED, requests):
        why = why or where_hit_strays(f"a request sharing the first story's first {shared} "
                                      f"tokens", pool, request)
    why = why or where_story_strays(f"the story of a request sharing the first story's "
                                    f"first {SHARED[0]}", pool, requests[0], 4, live)
    if why:
        return why
    live[0].free()
    return where_counts_stray("once the first story is freed", pool, live[1:])


QuickCheck = verdicts.quick_check_case("hybrid_pool", __name__)


def expression(source):
    return ast.parse(source, mode="eval").body


class Teeth(unittest.TestCase):
    """Each mistake planted in the real hybrid_pool.py makes the layer's quick check fail
    with a line naming the quantity and where: the group and block, the request, or the
    block whose count is wrong."""

    MISTAKES = [
        ("a window block freed one step early (last_useful_token one too far)",
         hybrid_pool.HybridSequence, "free_skipped",
         replacing(lambda node: isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
                   and spelt(node.left, "len(self.tokens) - group.window"),
                   lambda node: ast.BinOp(node.left, ast.Add(), ast.Constant(2))),
         r"the first story, \d+ positions computed: group 1 \(window 4: layers 0, 2\)'s block "
         r"table, at block \d+: None from HybridSequence, \d+ expected"),
        ("every group freed by the window, the full layers' too",
         hybrid_pool.HybridSequence, "free_skipped",
         replacing(lambda node: spelt(node, "group.window"),
                   lambda node: expression("pool.window")),
         r"the first story, \d+ positions computed: group 0 \(full: layers 1, 3\)'s block "
         r"table, at block 0: None from HybridSequence, \d+ expected"),
        ("a prefix hit that ignores the window group", HybridPool, "find",
         replacing(lambda node: isinstance(node, ast.If) and spelt(node.test, "windowed"),
                   lambda node: ast.Pass()),
         r"a request sharing the first story's first 4 tokens: the prefix hit is 4 positions "
         r"from HybridPool.find, 0 expected"),
        ("the window group's hit scanned left to right", HybridPool, "_window_hit",
         replacing(lambda node: spelt(node, "range(most - 1, -1, -1)"),
                   lambda node: expression("range(most)")),
         r"a request sharing the first story's first 16 tokens: the prefix hit is \d+ "
         r"positions from HybridPool.find, 16 expected"),
        ("a release that drops every table's hold on a block", HybridPool, "release",
         replacing(lambda node: isinstance(node, ast.AugAssign)
                   and spelt(node.target, "block.ref_count"),
                   lambda node: ast.Assign([node.target], ast.Constant(0))),
         r"once the first story is freed: the pool's ref counts, at block \d+: 0 from "
         r"HybridPool, 1 expected"),
    ]

    def test_the_quick_check_names_each_mistake_and_where(self):
        verdicts.assert_verdicts(self, "hybrid_pool", self.MISTAKES)


def random_story_case(n):
    """None if a random hybrid model's story holds what where_story_strays checks, else why.

    All from random.Random(n): 1 to 5 layers of width 8, a window of 1 to 8 in some of them,
    learned or rotary positions, sinks or none, some layers reading an earlier layer's
    cache, blocks of 1 to 4, a pool that frees or keeps, a prompt of 3 to 10 random tokens
    continued greedily to 10 to 30."""
    rng = random.Random(n)
    layers, (heads, kv_heads) = rng.randint(1, 5), rng.choice(((1, 1), (2, 1), (2, 2), (4, 2)))
    window = rng.randint(1, 8)
    windows = [rng.choice((None, window)) for _ in range(layers)]
    kv_from = list(range(layers))
    for layer in range(1, layers):
        kind = [e for e in range(layer) if kv_from[e] == e and windows[e] == windows[layer]]
        if kind and rng.random() < 0.3:
            kv_from[layer] = rng.choice(kind)
    params = deep_model.init_params(layers, heads, kv_heads, 8, n,
                                    rng.choice(("learned", "rotary")), windows=windows,
                                    sinks=rng.random() < 0.5, kv_from=kv_from)
    prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(3, 10))]
    pool = HybridPool(params, 64 * layers, rng.randint(1, 4), rng.random() < 0.7)
    label = (f"{deep_label(params)}, windows {windows}, kv_from {kv_from}, blocks of "
             f"{pool.block_size}" + ("" if pool.frees else ", every block kept"))
    return where_story_strays(label, pool, prompt, rng.randint(10, 30) - len(prompt), [])


class Exactness(unittest.TestCase):

    def test_every_row_is_the_masked_pass_s_and_every_table_vllm_s_rule(self):
        """gpt-oss's pattern (windows alternating with full layers, sinks), Gemma 3's (five
        window layers to a full one), gpt-oss's with its last two layers reading earlier
        ones' caches, windows only and full layers only, freeing and keeping blocks; then
        random models, patterns, windows and blocks (2 cases, more with
        KV_LAB_RANDOM_CASES): what where_story_strays checks holds."""
        for name, windows, block_size, hybrid in (
                ("gpt-oss", [3, None] * 2, 2, {"sinks": True}),
                ("Gemma 3", [3] * 5 + [None], 3, {}),
                ("gpt-oss with a shared tail", [3, None] * 3, 2,
                 {"kv_from": [0, 1, 2, 3, 2, 3]}),
                ("windows only", [2, 2], 1, {}), ("full layers only", [None, None], 4, {})):
            params = deep_model.init_params(len(windows), 2, 1, 8, 1, windows=windows,
                                            **hybrid)
            for frees in (True, False):
                with self.subTest(pattern=name, frees=frees):
                    pool = HybridPool(params, 64, block_size, frees)
                    why = verdicts.checked(lambda: where_story_strays(
                        name, pool, random_tokens(6, seed=block_size), 14, []))
                    if why:
                        self.fail(why)
        check_random_cases(self, 2, random_story_case)


class Freeing(unittest.TestCase):

    def test_keeping_every_block_gives_the_same_rows_and_the_full_bytes(self):
        """A 24-token story on gpt-oss's pattern, blocks of 2, a window of 4: freeing, the
        window group holds after n positions the blocks whose last position is n - 3 or
        later; keeping, every block, as the full group does either way. Both give the
        masked pass's rows; bytes are the blocks held x the page (8 bytes x 2 positions x 2
        layers x a key and a value x 2 key-value heads x head width 4)."""
        params = deep_model.init_params(*MODEL, windows=WINDOWS)
        ids = random_tokens(24, seed=3)
        compared = freeing_against_keeping(params, ids, BLOCK_SIZE)
        every = [math.ceil(n / BLOCK_SIZE) for n in range(1, len(ids) + 1)]
        in_window = [sum((i + 1) * BLOCK_SIZE - 1 >= n - 3 for i in range(blocks))
                     for n, blocks in enumerate(every, 1)]
        for way, window_blocks in (("freeing", in_window), ("keeping", every)):
            with self.subTest(way=way):
                result = compared[way]
                self.assertTrue(result["rows_equal_to_the_masked_pass"])
                self.assertEqual(result["window_blocks_by_step"], window_blocks)
                self.assertEqual(result["full_blocks_by_step"], every)
                self.assertEqual(hybrid_pool.bytes_at_the_end(result),
                                 (window_blocks[-1] + every[-1]) * 8 * 2 * 2 * 2 * 2 * 4)
        self.assertEqual((compared["freeing"]["window_blocks_at_the_end"],
                          compared["keeping"]["window_blocks_at_the_end"]), (2, 12))
        self.assertEqual(hybrid_pool.bytes_at_the_end(compared["freeing"]), 7168)

    def test_layers_are_grouped_as_vllm_groups_them(self):
        """vLLM's design document's examples: 20 window and 10 full layers make three groups
        of 10; Gemma 3 27B's 52 window and 10 full layers, a full group of 10 and window
        groups of 10, the last of 2 (padded: a block is a page of 10 layers). A layer that
        reads another's cache is in no group."""
        groups = layer_groups({"layers": 30, "windows": [8, 8, None] * 10})
        self.assertEqual([(g.window, len(g.layers)) for g in groups],
                         [(None, 10), (8, 10), (8, 10)])
        gemma = [None if (layer + 1) % 6 == 0 else 8 for layer in range(62)]
        groups = layer_groups({"layers": 62, "windows": gemma})
        self.assertEqual([(g.window, len(g.layers)) for g in groups],
                         [(None, 10)] + [(8, 10)] * 5 + [(8, 2)])
        self.assertEqual(groups[0].layers, list(range(5, 62, 6)))
        self.assertEqual(sorted(layer for g in groups for layer in g.layers), list(range(62)))
        self.assertEqual(layer_groups({"layers": 4, "windows": [8, None, 8, None],
                                       "kv_from": [0, 1, 0, 1]}), [(None, [1]), (8, [0])])
        params = deep_model.init_params(5, 1, 1, 4, 0, windows=[3, 3, None, None, None])
        self.assertEqual(HybridPool(params, 3, 2).page_bytes(),
                         8 * 2 * 2 * 2 * 1 * 4)   # the window layers' group is a page of 2


def random_pool_case(n):
    """None if, in a random pool, every request's hit is brute_hit's and the ref counts
    follow the live tables; else a Wrong.

    All from random.Random(n): a tiny model of 1 to 4 layers, some of a window of 1 to 6,
    blocks of 1 to 3, a pool of few blocks; 8 requests, each the start of an earlier story
    and a few new tokens, fed until the pool is out of blocks (then the oldest other
    sequence is freed), and sometimes freed."""
    rng = random.Random(n)
    layers, window = rng.randint(1, 4), rng.randint(1, 6)
    windows = [rng.choice((None, window)) for _ in range(layers)]
    params = deep_model.init_params(layers, 1, 1, 4, n, windows=windows)
    groups = len(layer_groups(params["shape"]))
    pool, stories, live = HybridPool(params, rng.randint(2 * groups, 30), rng.randint(1, 3)), \
        [], []
    for request in range(8):
        base = rng.choice(stories) if stories else []
        ids = (base[:rng.randint(0, len(base))]
               + [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 6))])[:CONTEXT]
        label = f"windows {windows}, blocks of {pool.block_size}: request {request}"
        why = where_hit_strays(label, pool, ids)
        if why:
            return why
        seq = pool.sequence(ids)
        live.append(seq)
        while len(seq) < len(ids):
            try:
                deep_model.forward_step(params, seq, ids[len(seq)], len(seq))
            except ValueError:
                if len(live) == 1:
                    break
                live.pop(0).free()
        stories.append(list(seq.tokens))
        if rng.random() < 0.3:
            live.pop(rng.randrange(len(live))).free()
        why = where_counts_stray(label, pool, live)
        if why:
            return why
    return None


class PrefixHits(unittest.TestCase):

    def test_hits_are_the_longest_every_length_tried_finds_on_random_pools(self):
        """Random tiny models (windows only, full layers only, windows of 1 among them) and
        pools, 3 cases by default (KV_LAB_RANDOM_CASES for more): what random_pool_case
        checks holds."""
        check_random_cases(self, 3, random_pool_case)

    def test_stories_with_prefix_reuse_are_the_stories_without_it(self):
        """Three greedy stories through one pool, each prompt the start of the one before and
        a few new tokens: each reuses a prefix (the longest every length tried finds), and
        its rows are deep_model.forward's on the whole story with each layer's mask, so
        each chosen token is the one the full pass chooses."""
        params = deep_model.init_params(*MODEL, windows=WINDOWS)
        pool, prompt = HybridPool(params, 64, BLOCK_SIZE), random_tokens(6, seed=7)
        for turn in range(3):
            with self.subTest(story=turn):
                hit = brute_hit(pool, prompt)
                story, rows, _ = greedy_story(pool, prompt, 8)
                self.assertEqual(hit > 0, turn > 0, "a prefix reused")
                expected = deep_model.forward(params, story, masks(params))
                self.assertEqual(len(rows), len(story) - hit)
                self.assertTrue(rows == expected[hit:], "rows equal to the masked full pass")
                self.assertEqual(story[len(prompt):],
                                 [max(range(VOCAB_SIZE), key=row.__getitem__)
                                  for row in expected[len(prompt) - 1:-1]])
            prompt = story[:len(story) - 3] + random_tokens(2, seed=turn)


class Sharing(unittest.TestCase):

    def test_a_block_another_sequence_holds_is_never_taken(self):
        """B shares the first 8 positions of A; A is freed, then C takes every free block
        (evicting A's findable ones) until the pool refuses it: B's blocks keep B's tokens,
        the ref counts follow the live tables, and once C is freed B goes on with the
        masked pass's rows."""
        params = deep_model.init_params(2, 2, 1, 8, 2, windows=[3, None])
        pool = HybridPool(params, 16, 2)
        a, _, seq_a = greedy_story(pool, random_tokens(6, seed=1), 6)
        b, rows, seq_b = greedy_story(pool, a[:9] + random_tokens(2, seed=2), 2)
        self.assertEqual(len(b) - len(rows), 8)
        seq_a.free()
        seq_c, c = pool.sequence(), random_tokens(30, seed=3)
        with self.assertRaisesRegex(ValueError, "the pool is out of blocks"):
            for position, token_id in enumerate(c):
                deep_model.forward_step(params, seq_c, token_id, position)
        self.assertIsNone(where_counts_stray("A freed, C fed", pool, [seq_b, seq_c]))
        size = pool.block_size
        for table in seq_b.tables:
            for index, block_id in enumerate(table):
                if block_id is not None:
                    self.assertEqual(pool.blocks[block_id].tokens,
                                     b[index * size:(index + 1) * size])
        seq_c.free()
        rows += [deep_model.forward_step(params, seq_b, token_id, len(b) + k)
                 for k, token_id in enumerate(random_tokens(4, seed=4))]
        story = b + random_tokens(4, seed=4)
        self.assertTrue(rows == deep_model.forward(params, story, masks(params))[8:])


class Refusals(unittest.TestCase):

    def test_bad_settings_are_refused_naming_them(self):
        """A block size, a block count or frees out of range, a model of two window sizes
        or a latent one, what is not params or ids, a block no table holds. (A pattern of
        the wrong length, or a window of 0, is the model's shape's to refuse:
        deep_params.check_hybrid.)"""
        params = deep_model.init_params(2, 1, 1, 4, 0, windows=[2, None])
        two_windows = deep_model.init_params(2, 1, 1, 4, 0, windows=[2, 3])
        pool = HybridPool(params, 8, 2)
        for call, fragment in (
                (lambda: HybridPool(params, 8, 0),
                 r"block_size must be an int from 1 to 64 \(the model's positions\), got 0"),
                (lambda: HybridPool(two_windows, 8, 2),
                 r"params: the model's windows are of \[2, 3\] positions, and this pool takes "
                 r"one window size"),
                (lambda: HybridPool(params, 1, 2),
                 r"blocks must be an int from 2 to 100000 \(a position takes a block in each "
                 r"of the 2 groups"),
                (lambda: HybridPool(params, 8.0, 2), "blocks must be an int"),
                (lambda: HybridPool(params, 8, 2, "yes"),
                 "frees must be True or False, got 'yes'"),
                (lambda: HybridPool(deep_model.init_params(1, 2, 2, 8, 0, latent=4), 8, 2),
                 "a latent model keeps latents, not keys and values"),
                (lambda: HybridPool(None, 8, 2), "params must be deep_model"),
                (lambda: pool.sequence("ab"), "ids must be a list of token IDs, got str"),
                (lambda: pool.sequence([96]), r"ids\[0\] = 96 is outside the vocabulary"),
                (lambda: greedy_story(pool, [], 3), "ids is empty"),
                (lambda: greedy_story(pool, [1], -1), "new_tokens must be an int >= 0"),
                (lambda: pool.release(0), "block 0 is held by no table"),
                (lambda: pool.release(8), "block id must be an int from 0 to 7"),
                (lambda: pool.share(0), "block 0 is free and holds nothing to share")):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                call()
        self.assertEqual(pool.free_blocks(), 8)

    def test_a_step_the_pool_has_no_blocks_for_is_refused_and_changes_nothing(self):
        """Blocks of 1, a window of 2: a position takes a block in each group and the window
        frees one; the fourth position finds 1 block free of 5, where 2 are needed."""
        params = deep_model.init_params(2, 1, 1, 4, 0, windows=[2, None])
        pool = HybridPool(params, 5, 1)
        seq = pool.sequence()
        for position, token_id in enumerate(random_tokens(3)):
            deep_model.forward_step(params, seq, token_id, position)
        state = lambda: copy.deepcopy((deep_snapshot(seq), seq.tables, pool.ref_counts,
                                       list(pool.free_list), pool.prefix_index))
        assert_each_refused(self, [(lambda: deep_model.forward_step(params, seq, 5, 3),
                                    r"the pool is out of blocks: it has 5 blocks of 1 "
                                    r"positions, 1 free, and 2 more are needed")], state)

    def test_a_freed_sequence_is_refused_and_freeing_it_again_does_nothing(self):
        params = deep_model.init_params(2, 1, 1, 4, 0, windows=[2, None])
        pool = HybridPool(params, 8, 2)
        _, _, seq = greedy_story(pool, random_tokens(3), 2)
        seq.free()
        seq.free()
        self.assertEqual(pool.ref_counts, [0] * 8)
        for call in (lambda: deep_model.forward_step(params, seq, 1, 5), lambda: len(seq),
                     seq.blocks_held, lambda: seq.layers):
            with self.assertRaisesRegex(ValueError, "this sequence was freed and its blocks "
                                                    "returned to the pool"):
                call()



class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of the hybrid pool."""

    def test_freeing_holds_the_window_s_blocks_and_keeping_every_block_same_rows(self):
        """For each model: the rows equal the masked pass both ways; the full groups hold
        every block both ways; freeing, the window groups hold at most the blocks a window
        spans (ceil((W - 1) / block size) + 1 a group), keeping, as many as the full ones a
        group; so keeping holds more bytes."""
        record = support.recorded("hybrid_pool")
        every = math.ceil(record["positions"] / record["block_size"])
        spans = math.ceil((record["window"] - 1) / record["block_size"]) + 1
        for name, ways in record["models"].items():
            freeing, keeping = ways["freeing"], ways["keeping"]
            groups = keeping["window_blocks_at_the_end"] // every
            with self.subTest(model=name):
                self.assertTrue(freeing["rows_equal_to_the_masked_pass"])
                self.assertTrue(keeping["rows_equal_to_the_masked_pass"])
                self.assertEqual(keeping["window_blocks_at_the_end"], groups * every)
                self.assertEqual(freeing["full_blocks_at_the_end"],
                                 keeping["full_blocks_at_the_end"])
                self.assertLessEqual(max(freeing["window_blocks_by_step"]), groups * spans)
                self.assertLess(hybrid_pool.bytes_at_the_end(freeing),
                                hybrid_pool.bytes_at_the_end(keeping))


if __name__ == "__main__":
    unittest.main()
