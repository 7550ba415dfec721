"""Prefill and decode on two servers (Part 7, section 40): a prefill server computes a
request's prompt rows into its own pool and sends the request's keys and values to a
decode server, which keeps them in its own pool, perhaps in blocks of another size, and
only decodes.

serving.serve runs both kinds of rows on one server: a step that admits a request
computes its prompt beside the running requests' decodes. Disaggregated serving (vLLM's
disaggregated prefill, DistServe, Mooncake) gives each kind its own servers, so that a
long prompt never delays another request's next token and each side can be sized for its
work. What crosses between them is the cache: for each request, every layer's key and
value of every position, laid out as the two sides agree. Sent as the prefill server
computed them, they are the numbers the decode server would compute, so the stories are
one server's, bit for bit. Laid out one way and read another (heads and positions
transposed, as in TensorRT-LLM #6507), they are other numbers, and nothing fails to say
so: the stories just change. Here a message says its layout and the receiver reads it by
that layout.
"""
import deep_model
import svg
from batched import computed_by, exact, exact_attention, forward_rows
from documents import bold, shown, table
from instruments import recording
from model import CONTEXT
from paged import BlockPool, check_pool
from serving import Served, Steps, checked_settings, run_steps
import serving

LAYOUTS = ("positions, heads", "heads, positions")   # [2, page, heads, dim] or [2, heads, ...]
BYTES_PER_NUMBER = 8   # the lab's floats


def send(tokens, layers, heads, layout):
    """The message that carries positions' keys and values from one server to another.

    layers holds, for each layer, (keys, values): a vector a position, heads heads side by
    side. The numbers go layer by layer, keys then values, each as [positions, heads, dim]
    ("positions, heads") or [heads, positions, dim] ("heads, positions")."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    numbers = []
    for keys, values in layers:
        for part in (keys, values):
            dim = len(part[0]) // heads if part else 0
            order = ([(p, h) for p in range(len(part)) for h in range(heads)]
                     if layout == LAYOUTS[0] else
                     [(p, h) for h in range(heads) for p in range(len(part))])
            for p, h in order:
                numbers += part[p][h * dim:(h + 1) * dim]
    return {"tokens": list(tokens), "layers": len(layers), "heads": heads, "layout": layout,
            "numbers": numbers}


def receive(message, width):
    """The (tokens, layers) a message carries, width numbers a position in each part."""
    positions, heads = len(message["tokens"]), message["heads"]
    dim, numbers, layers = width // heads, message["numbers"], []
    size = positions * width
    for layer in range(message["layers"]):
        parts = []
        for part in range(2):
            flat = numbers[(2 * layer + part) * size:(2 * layer + part + 1) * size]
            vectors = [[0.0] * width for _ in range(positions)]
            for p in range(positions):
                for h in range(heads):
                    at = (p * heads + h if message["layout"] == LAYOUTS[0]
                          else h * positions + p) * dim
                    vectors[p][h * dim:(h + 1) * dim] = flat[at:at + dim]
            parts.append(vectors)
        layers.append(tuple(parts))
    return message["tokens"], layers


def serve(params, tok, requests, prefill_pool, decode_pool, max_batch, log=None,
          prefill_product=exact, decode_product=exact, layout=LAYOUTS[0]):
    """Run requests to completion on two servers: prefill_pool's computes, decode_pool's decodes.

    As serving.serve on decode_pool (its batches, preemption, log and decode_product), but
    an admitted request's rows are computed by the prefill server (prefill_product), after
    the full blocks its own pool caches; every position's key and value is then sent to
    the decode server (send, in layout), which keeps them in a new sequence of its pool,
    cut into its own blocks, and decodes from the logits sent with them. A preempted
    request is admitted again the same way. Returns (results, counts): the results exactly
    generate.generate's with the exact products; counts as serve's (its rows, the decode
    server's alone), and prefill_rows, positions_sent, bytes_sent and messages. Refused
    before anything runs: pools of other params, one pool for both, products that differ
    (the decode server would hold rows of another kernel than its own)."""
    log = checked_settings(params, tok, requests, decode_pool, max_batch, log,
                           decode_product, exact_attention)
    check_pool(prefill_pool, params)
    if prefill_pool is decode_pool:
        raise ValueError("prefill_pool and decode_pool are one pool: two servers have a pool "
                         "each; make a second BlockPool")
    if prefill_product is not decode_product:
        raise ValueError(f"the prefill server computes rows by "
                         f"{getattr(prefill_product, '__name__', prefill_product)} and the "
                         f"decode server by {getattr(decode_product, '__name__', decode_product)}"
                         f": the decode server would hold another kernel's keys and values "
                         f"than its own; give both servers one product")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    prefill = (prefill_pool, prefill_product, layout)
    served = [_Handed(params, tok, index, request, decode_pool, prefill)
              for index, request in enumerate(requests)]
    steps = Steps(params, decode_pool, max_batch, log, decode_product, exact_attention,
                  [request for request in served if not request.generation.stopped])
    steps.counts.update(prefill_rows=0, positions_sent=0, bytes_sent=0, messages=0)
    return run_steps(steps, served)


class _Handed(Served):
    """A request of the two servers: prefilled by one, handed to the other's pool."""

    def __init__(self, params, tok, index, request, pool, prefill):
        super().__init__(params, tok, index, request, pool)
        self.prefill_pool, self.prefill_product, self.layout = prefill
        fed = min(len(self.generation.ids) + request.get("max_new_tokens", 60), CONTEXT) - 1
        if not self.generation.stopped and not self.prefill_pool.could_hold(fed):
            raise ValueError(f"request {index} may need {fed} positions, more than the "
                             f"prefill server's pool holds; make a larger pool")

    def admit(self, counts, product, attention):
        """Prefill on the prefill server, send, keep on the decode server; False, with
        nothing changed, if the decode server's pool lacks room."""
        ids = self.generation.ids
        if not self.pool.room_for_sequence([], len(ids)):
            return False
        source = self.prefill_pool.sequence(ids[:-1], computed_by(self.prefill_product))
        try:
            start = len(source)
            items = [(source, token_id, at) for at, token_id in enumerate(ids[start:], start)]
            self.logits = forward_rows(self.params, items, self.prefill_product)[-1]
            message = send(source.tokens, [(source.keys, source.values)], 1, self.layout)
        finally:
            source.free()
        tokens, [(keys, values)] = receive(message, len(self.params["Wk"][0]))
        self.seq = self.pool.sequence((), computed_by(product))
        self.seq.extend(tokens, keys, values)
        counts["prefill_rows"] += len(items)
        counts["positions_sent"] += len(tokens)
        counts["bytes_sent"] += BYTES_PER_NUMBER * len(message["numbers"])
        counts["messages"] += 1
        if self.computed:
            counts["readmitted_positions"] += self.computed
        self.computed = max(self.computed, len(ids))
        return True


# ---- the experiment (a stage of trace_kv.py) ---------------------------------------

BATCH = 4
PREFILL_POOL, DECODE_POOL = (960, 4), (480, 8)   # blocks, positions a block: ample both
DEEP = (4, 4, 2, 16, 0)   # deep_model.init_params's: the deeper model whose cache is sent

# The records of this module's stages, in svg.checked's shapes (trace_kv.declared's)
RECORDS = {
    "two_servers": {
        "requests": svg.COUNT, "max_batch": svg.COUNT,
        "prefill_block_size": svg.COUNT, "decode_block_size": svg.COUNT,
        "one_server": {"steps": svg.COUNT, "rows": svg.COUNT,
                       "steps_prefilling_beside_decodes": svg.COUNT, "identical": svg.COUNT},
        "two_servers": {"steps": svg.COUNT, "prefill_rows": svg.COUNT,
                        "decode_server_rows": svg.COUNT, "tokens_fed_after_choice": svg.COUNT,
                        "steps_prefilling_beside_decodes": svg.COUNT,
                        "positions_sent": svg.COUNT, "bytes_sent": svg.COUNT,
                        "messages": svg.COUNT, "identical": svg.COUNT},
        "deep": {"layers": svg.COUNT, "kv_heads": svg.COUNT, "head_width": svg.COUNT,
                 "positions": svg.COUNT, "numbers_sent": svg.COUNT,
                 "received_equal": bool, "read_transposed_equal": bool}},
}


def experiment(lab, runs):
    """Serve the 60 greedy openings on one server and on two, and send a deeper cache.

    One server: serving.serve, an ample pool of blocks of 4, batches of up to BATCH; its
    steps that prefill beside decodes. Two servers: a prefill pool of PREFILL_POOL and a
    decode pool of DECODE_POOL (blocks re-cut from 4 positions to 8); the rows each
    computes (the decode server's counted in its forward_rows calls), what was sent, and
    the results identical to generate's. Then a deeper model's cache of 8 positions, sent
    in one layout and read in it, and read in the other."""
    requests = [{"prompt": prompt} for prompt in lab.prompts]
    events = {}
    alone, one = serving.serve(lab.params, lab.tok, requests, BlockPool(lab.params, 960, 4),
                               BATCH, lambda step, index, event: events.setdefault(
                                   step, set()).add(event))
    with recording(serving, "forward_rows") as calls:
        served, two = serve(lab.params, lab.tok, requests, BlockPool(lab.params, *PREFILL_POOL),
                            BlockPool(lab.params, *DECODE_POOL), BATCH)
    return {"requests": len(requests), "max_batch": BATCH,
            "prefill_block_size": PREFILL_POOL[1], "decode_block_size": DECODE_POOL[1],
            "one_server": {"steps": one["steps"], "rows": one["rows"],
                           "steps_prefilling_beside_decodes": sum(
                               {"prefill", "decode"} <= happened
                               for happened in events.values()),
                           "identical": sum(a == b for a, b in zip(alone, runs.greedy))},
            "two_servers": {"steps": two["steps"], "prefill_rows": two["prefill_rows"],
                            "decode_server_rows": sum(len(call.args[1]) for call in calls),
                            "tokens_fed_after_choice": sum(len(r["steps"]) - 1 for r in served),
                            "steps_prefilling_beside_decodes": sum(
                                len({id(item[0]) for item in call.args[1]}) < len(call.args[1])
                                for call in calls),
                            "positions_sent": two["positions_sent"],
                            "bytes_sent": two["bytes_sent"], "messages": two["messages"],
                            "identical": sum(a == b for a, b in zip(served, runs.greedy))},
            "deep": deep_transfer(lab.tok.encode(lab.test[0])[:8])}


def deep_transfer(ids):
    """Send a deeper model's cache of ids as positions then heads, and read it both ways."""
    params = deep_model.init_params(*DEEP)
    cache = deep_model.DeepCache(params)
    for position, token_id in enumerate(ids):
        deep_model.forward_step(params, cache, token_id, position)
    layers = [(layer["keys"], layer["values"]) for layer in cache.layers]
    heads, width = DEEP[2], len(layers[0][0][0])
    message = send(ids, layers, heads, LAYOUTS[0])
    _, received = receive(message, width)
    _, transposed = receive(dict(message, layout=LAYOUTS[1]), width)
    return {"layers": len(layers), "kv_heads": heads, "head_width": width // heads,
            "positions": len(ids), "numbers_sent": len(message["numbers"]),
            "received_equal": received == [tuple(layer) for layer in layers],
            "read_transposed_equal": transposed == [tuple(layer) for layer in layers]}


# ---- what Part 7 shows of it (documents.py fills its marks) --------------------------

def servers_table(record, timing):
    """Section 40's table: the greedy openings on one server and on two."""
    t = svg.checked(record, {"two_servers": RECORDS["two_servers"]})["two_servers"]
    one, two = t["one_server"], t["two_servers"]
    return table(["servers", "steps", "prompt rows", "decode rows", "steps computing prompt "
                  "rows beside decodes", "positions sent", "bytes sent",
                  "identical to `generate`"],
                 [["one (`serving.serve`)", shown(one["steps"]),
                   shown(one["rows"] - two["tokens_fed_after_choice"]),
                   shown(two["tokens_fed_after_choice"]),
                   shown(one["steps_prefilling_beside_decodes"]), "—", "—",
                   bold(f"{one['identical']} of {t['requests']}")],
                  ["two: prefill and decode", shown(two["steps"]), shown(two["prefill_rows"]),
                   shown(two["decode_server_rows"]),
                   shown(two["steps_prefilling_beside_decodes"]),
                   shown(two["positions_sent"]), shown(two["bytes_sent"]),
                   bold(f"{two['identical']} of {t['requests']}")]])
