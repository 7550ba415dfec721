"""Prefill and decode on two servers (two_servers.py): a cache sent and received is the
cache sent, bit for bit, in either layout, and read in the other layout it is not; the
stories are generate's with blocks re-cut and requests preempted; the decode server
computes only decode rows; the bytes sent are positions x 2 x key-value heads x width x
8; pools and products that do not match are refused."""
import ast
import copy
import random
import unittest

import batched
import deep_model
import kv_cache
import paged
import serving
import support
import two_servers
import verdicts
from instruments import recording, replacing, spelt
from random_models import random_tokens
from support import OPENINGS, PARAMS, TOK, check_random_cases, swapping
from two_servers import LAYOUTS
from verdicts import Layer, Wrong, differ, step


LAYER = Layer("two_servers", "prefill and decode on two servers (two_servers.py)",
              ("serving", "deep_model"))


def setUpModule():
    verdicts.set_up("two_servers")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down
BYTES_A_POSITION = 2 * 16 * 8   # the lab's model: a key and a value of 16 eight-byte floats


def where_transfer_strays(layout):
    """None if a deeper model's cache (4 layers, 2 key-value heads of 4), sent in layout and
    received, is the cache sent; else a Wrong naming the layer, part, position and number,
    and whether the numbers came back with heads and positions transposed."""
    params = deep_model.init_params(4, 4, 2, 16, 0)
    cache, ids = deep_model.DeepCache(params), random_tokens(6, seed=5)
    for position, token_id in enumerate(ids):
        deep_model.forward_step(params, cache, token_id, position)
    layers = [(layer["keys"], layer["values"]) for layer in cache.layers]
    step(f"sending a deeper model's cache ({layout})")
    message = two_servers.send(ids, layers, 2, layout)
    tokens, received = two_servers.receive(message, 8)
    other = LAYOUTS[1 - LAYOUTS.index(layout)]
    why = differ(f"the cache received ({layout})", received, [tuple(l) for l in layers],
                 "receive", names=("layer", "part", "position", "number"),
                 fed=f"token IDs {ids}, 2 key-value heads of 4")
    if why and two_servers.send(ids, received, 2, other)["numbers"] == message["numbers"]:
        why = Wrong(f"{why}: heads and positions transposed (read as {other})", why.detail)
    return why or (None if tokens == ids else Wrong(f"the tokens received ({layout}): "
                                                    f"{tokens}, {ids} expected"))


def where_servers_stray(label, requests, prefill_pool, decode_pool, max_batch):
    """None if the requests served on two servers are generate_cached's, the bytes sent are
    the positions sent x BYTES_A_POSITION, and every decode-server call computes one row a
    request; else a Wrong naming the quantity and where."""
    step(f"{label}: serving")
    with recording(serving, "forward_rows") as calls:
        served, counts = two_servers.serve(PARAMS, TOK, requests, prefill_pool, decode_pool,
                                           max_batch)
    for index, (request, result) in enumerate(zip(requests, served)):
        if result != kv_cache.generate_cached(PARAMS, TOK, **request):
            return Wrong(f"{label}: request {index}'s result is not generate_cached's",
                         f"  request: {request}\n  served: {result['text']!r}")
    if counts["bytes_sent"] != counts["positions_sent"] * BYTES_A_POSITION:
        return Wrong(f"{label}: {counts['bytes_sent']} bytes sent for "
                     f"{counts['positions_sent']} positions, "
                     f"{counts['positions_sent'] * BYTES_A_POSITION} expected")
    for number, call in enumerate(calls, 1):
        caches = [id(item[0]) for item in call.args[1]]
        if len(set(caches)) < len(caches):
            return Wrong(f"{label}: the decode server's call {number} computes "
                         f"{len(caches)} rows for {len(set(caches))} requests: a prefill")
    return None


def quick_check():
    """A deeper cache sent and received in each layout; then four requests (three greedy,
    one sampled) on two servers, the prefill pool's blocks of 4 re-cut into the decode
    pool's 7 blocks of 8, which preempts: what where_servers_stray checks holds."""
    for layout in LAYOUTS:
        why = where_transfer_strays(layout)
        if why:
            return why
    requests = [{"prompt": prompt, "max_new_tokens": 12} for prompt in OPENINGS[:3]] + [
        {"prompt": OPENINGS[3], "max_new_tokens": 12, "temperature": 1.0, "seed": 3}]
    return where_servers_stray("four requests on two servers", requests,
                               paged.BlockPool(PARAMS, 40, 4), paged.BlockPool(PARAMS, 7, 8), 4)


QuickCheck = verdicts.quick_check_case("two_servers", __name__)


class Teeth(unittest.TestCase):
    """Each mistake planted in the real two_servers.py makes the layer's quick check fail
    with a line naming the quantity and where."""

    MISTAKES = [
        ("the layout read transposed", two_servers, "receive",
         swapping("message['layout'] == LAYOUTS[0]", "message['layout'] != LAYOUTS[0]"),
         r"the cache received \(positions, heads\), at layer 0, part 0, position 0, number "
         r"\d+: .* from receive, .* expected: heads and positions transposed"),
        ("bytes counted as numbers", two_servers._Handed, "admit",
         swapping("BYTES_PER_NUMBER * len(message['numbers'])", "len(message['numbers'])"),
         r"four requests on two servers: \d+ bytes sent for \d+ positions, \d+ expected"),
        ("the first prompt row's logits sent, not the last's", two_servers._Handed, "admit",
         replacing(lambda node: isinstance(node, ast.Subscript)
                   and spelt(node.slice, "-1") and "forward_rows" in ast.unparse(node.value),
                   lambda node: ast.Subscript(node.value, ast.Constant(0), node.ctx)),
         r"four requests on two servers: request \d+'s result is not generate_cached's"),
    ]

    def test_the_quick_check_names_each_mistake_and_where(self):
        verdicts.assert_verdicts(self, "two_servers", self.MISTAKES)


def random_servers_case(n):
    """None if random requests on two random servers hold what where_servers_stray checks.

    All from random.Random(n): 3 to 5 openings, greedy or sampled, 4 to 16 new tokens;
    blocks of 1 to 8 positions on each side, the decode pool fitting each request with up
    to 4 blocks more; batches of 1 to 4."""
    rng = random.Random(n)
    requests = [{"prompt": rng.choice(OPENINGS), "max_new_tokens": rng.randint(4, 16),
                 **({"temperature": 1.0, "seed": rng.randrange(100)} if rng.random() < 0.5
                    else {})} for _ in range(rng.randint(3, 5))]
    sizes = rng.randint(1, 8), rng.randint(1, 8)
    longest = max(min(len(TOK.encode(r["prompt"])) + r["max_new_tokens"], 64) for r in requests)
    decode_blocks = -(-longest // sizes[1]) + rng.randint(0, 4)
    return where_servers_stray(f"blocks of {sizes[0]} then {sizes[1]}, {decode_blocks} decode "
                               f"blocks", requests, paged.BlockPool(PARAMS, 400, sizes[0]),
                               paged.BlockPool(PARAMS, decode_blocks, sizes[1]),
                               rng.randint(1, 4))


class TwoServers(unittest.TestCase):

    def test_random_requests_block_sizes_and_pools(self):
        """Random requests, block sizes on each side and pools (3 cases, more with
        KV_LAB_RANDOM_CASES): what random_servers_case checks holds."""
        check_random_cases(self, 3, random_servers_case)

    def test_a_message_is_laid_out_as_it_says(self):
        """Two positions of 2 heads of 2: positions then heads, or heads then positions."""
        keys, values = [[1, 2, 3, 4], [5, 6, 7, 8]], [[9, 10, 11, 12], [13, 14, 15, 16]]
        self.assertEqual(two_servers.send([0, 1], [(keys, values)], 2, LAYOUTS[0])["numbers"],
                         list(range(1, 17)))
        self.assertEqual(two_servers.send([0, 1], [(keys, values)], 2, LAYOUTS[1])["numbers"],
                         [1, 2, 5, 6, 3, 4, 7, 8, 9, 10, 13, 14, 11, 12, 15, 16])

    def test_mismatched_servers_are_refused_before_anything_runs(self):
        """Pools of other params, one pool for both servers, products that differ, a layout
        neither side knows, a prefill pool too small for a request: each refused, naming
        it, with every block free."""
        others = copy.deepcopy(PARAMS)
        pool, decode = paged.BlockPool(PARAMS, 40, 4), paged.BlockPool(PARAMS, 40, 8)
        requests = [{"prompt": OPENINGS[0], "max_new_tokens": 4}]
        for call, fragment in (
                (lambda: two_servers.serve(PARAMS, TOK, requests, paged.BlockPool(others, 40, 4),
                                           decode, 2),
                 "pool must be a BlockPool made for these params, got one made for others"),
                (lambda: two_servers.serve(PARAMS, TOK, requests, pool, pool, 2),
                 "prefill_pool and decode_pool are one pool"),
                (lambda: two_servers.serve(PARAMS, TOK, requests, pool, decode, 2,
                                           prefill_product=batched.by_batch),
                 "the prefill server computes rows by by_batch and the decode server by exact"),
                (lambda: two_servers.serve(PARAMS, TOK, requests, pool, decode, 2,
                                           layout="by head"), "layout must be one of"),
                (lambda: two_servers.serve(PARAMS, TOK, requests, paged.BlockPool(PARAMS, 2, 4),
                                           decode, 2),
                 "request 0 may need \\d+ positions, more than the prefill server's pool")):
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                call()
        self.assertEqual((pool.free_blocks(), decode.free_blocks()), (40, 40))


class TheRecord(unittest.TestCase):
    """What the recorded run (support.recorded) says of the two servers."""

    def test_two_servers_split_the_rows_and_send_the_cache_s_bytes(self):
        """Every story generate's, on one server and on two; the decode server's rows are the tokens fed after their
        choice, none a prompt's, where one server computed prompt rows beside decodes; the
        two servers' rows are one server's; the bytes are the positions sent x 2 x 16 x 8;
        a deeper cache read in its own layout is the cache, in the other it is not."""
        record = support.recorded("two_servers")
        one, two, deep = record["one_server"], record["two_servers"], record["deep"]
        self.assertEqual((one["identical"], two["identical"]), (record["requests"],) * 2)
        self.assertEqual(two["decode_server_rows"], two["tokens_fed_after_choice"])
        self.assertEqual(two["steps_prefilling_beside_decodes"], 0)
        self.assertGreater(one["steps_prefilling_beside_decodes"], 0)
        self.assertEqual(two["prefill_rows"] + two["decode_server_rows"], one["rows"])
        self.assertEqual(two["bytes_sent"], two["positions_sent"] * BYTES_A_POSITION)
        self.assertEqual(deep["numbers_sent"], deep["layers"] * deep["positions"] * 2
                         * deep["kv_heads"] * deep["head_width"])
        self.assertEqual((deep["received_equal"], deep["read_transposed_equal"]),
                         (True, False))


if __name__ == "__main__":
    unittest.main()
