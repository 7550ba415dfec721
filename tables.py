"""The README's tables, text blocks and diagrams, each written by BLOCKS[NAME](record,
timing) from kv-trace.json's record and kv-time.json's timing (figures.py says how the
README marks them, and python3 trace_kv.py --write writes them); shown prints one figure
as the README does.
"""
import diagrams


def shown(figure, spec=""):
    """A figure as the README prints it: with spec, in that format spec; else an int with
    its thousands separated (20,509), a float to 4 significant digits (0.0 as 0.0), a
    bool as yes or no, None as a dash."""
    if spec:
        return format(figure, spec)
    if isinstance(figure, bool):
        return "yes" if figure else "no"
    if isinstance(figure, int):
        return f"{figure:,}"
    if isinstance(figure, float):
        return "0.0" if figure == 0 else f"{figure:.4g}"
    return "—" if figure is None else str(figure)


def _table(header, rows):
    """A Markdown table: its header cells, and each row's cells."""
    return ([f"| {' | '.join(header)} |".replace("|  |", "| |"), "|" + "---|" * len(header)]
            + [f"| {' | '.join(map(str, cells))} |" for cells in rows])


def _bold(text):
    return f"**{text}**"


def _work(r, t):
    w = r["work"]
    return _table(["", "without the cache", "with the cache", "ratio"], [
        ["rows (positions run through the model)", shown(w["uncached_rows"]),
         shown(w["cached_rows"]), f"{r['rows_ratio']}x"],
        ["attention scores", shown(w["uncached_scores"]), shown(w["cached_scores"]),
         f"{r['scores_ratio']}x"]])


def _cost_by_length(r, t):
    return _table(["positions", "rows without", "rows with", "scores without", "scores with",
                   "seconds without", "seconds with", "speed-up", "rows ratio"],
                  [[e["positions"], shown(e["uncached_rows"]), shown(e["cached_rows"]),
                    shown(e["uncached_scores"]), shown(e["cached_scores"]),
                    f"{s['uncached_seconds']:.4f}", f"{s['cached_seconds']:.4f}",
                    f"{s['speedup']}x", f"{e['positions'] // 2}x"]
                   for e, s in zip(r["cost_by_length"], t["cost_by_length"])])


def _cost_chart(r, t):
    lengths, width = r["cost_by_length"], 48   # the longest bar, in characters
    most = max(e["uncached_rows"] for e in lengths)
    lines = ["rows computed to reach each length (# without the cache, = with it)"]
    for e in lengths:
        for label, rows, mark in ((e["positions"], e["uncached_rows"], "#"),
                                  ("", e["cached_rows"], "=")):
            lines.append(f"{label:>3} {mark * max(1, round(rows / most * width))} {rows:,}")
    return ["```text", *lines, "```"]


def _slots(r, t):
    labels = {"static, 64 per story": "a whole 64-position context per story (a static cache)"}
    p = r["paged"]
    return _table(["how the cache reserves memory", "slots reserved", "wasted"],
                  [[labels.get(way, f"{way} positions"), shown(slots),
                    f"{p['wasted_share'][way]:.1%}"] for way, slots in p["slots_reserved"].items()])


def _parallel_sampling(r, t):
    p = r["parallel_sampling"]
    forks = p["continuations_each"]
    return _table(["opening", "prompt tokens", f"distinct continuations (of {forks})",
                   f"blocks held at the end: forks / {forks} caches of their own",
                   f"prompt rows: forks / {forks} caches of their own",
                   "identical to `generate`'s"],
                  [[f"`{o['prompt']}`", o["prompt_tokens"], o["distinct_continuations"],
                    f"{o['blocks_held_with_forks']} / {o['blocks_held_by_caches_of_their_own']}",
                    f"{o['prompt_rows_with_forks']} / "
                    f"{o['prompt_rows_with_caches_of_their_own']}",
                    _bold(f"{o['identical_to_generate']} of {forks}")] for o in p["openings"]])


def _ladder(r, t):
    rows = [["exact, in lists (the reference)",
             f"{t['cache_bytes_per_position']:,} as CPython objects", "all", "0.0", 0, 0]]
    rows += [[rung["cache"], shown(rung["bytes_per_position"], "g")
              if rung["bytes_per_position"] is not None else "—",
              "all" if rung["positions_kept"] is None else rung["positions_kept"],
              shown(rung["largest_logit_gap"]), rung["greedy_stories_changed"],
              rung["sampled_stories_changed"]] for rung in r["ladder"]["rungs"]]
    stories = r["ladder"]["stories"]
    return _table(["the cache", "bytes per position", "positions kept", "largest logit gap",
                   f"greedy stories changed (of {stories})",
                   f"sampled stories changed (of {stories})"], rows)


def _prefix_cache(r, t):
    c = r["prefix_cache"]
    labels = {"small pool": f"small: far less than the 60 stories hold "
                            f"({shown(c['positions_held_in_all'])} positions)",
              "ample pool": "ample: nothing is evicted"}
    return _table(["pool of blocks of 4", "blocks", "prefix hits (blocks)", "rows saved",
                   "rows computed", "evictions", "stories identical",
                   "gap of the choosing rows"],
                  [[label, shown(c[run]["blocks"]), c[run]["prefix_hits"],
                    shown(c[run]["rows_saved"]), shown(c[run]["rows"]), c[run]["evictions"],
                    _bold(f"{c[run]['identical']} of 60"),
                    _bold(shown(c[run]["largest_logit_gap_of_choosing_rows"]))]
                   for run, label in labels.items()])


def _many_requests(r, t):
    m = r["many_requests"]
    return _table(["pool of blocks of 4", "steps", "requests choosing a token, mean a step",
                   "rows", "rows recomputed", "preemptions", "peak blocks", "evictions",
                   "prefix hits: at a first admission / at a readmission", "identical",
                   "gap of the choosing rows"],
                  [[f"{run.split()[0]} ({shown(c['blocks'])} blocks)", c["steps"],
                    shown(c["mean_requests_per_step"]), shown(c["rows"]),
                    c["recomputed_rows"], c["preemptions"], c["peak_blocks"],
                    c["evictions"],
                    f"{c['first_admission_prefix_hits']} / {c['readmitted_prefix_hits']}",
                    _bold(f"{c['identical']} of {m['requests']}"),
                    _bold(shown(c["largest_logit_gap_of_choosing_rows"]))]
                   for run, c in ((run, m[run]) for run in ("small pool", "ample pool"))])


def _kernels(r, t):
    k = r["batched_decode"]
    of = f" of {k['requests']}"
    return _table(["kernel", "batches of up to", "pool", "steps", "preemptions",
                   "stories as with batches of 1",
                   "first position (prompt included) where one parts",
                   "choosing rows unlike batches of 1 (same tokens)", "stories as `generate`'s",
                   "largest logit gap against the exact rows"],
                  [[run["kernel"], run["max_batch"], f"{run['pool']} ({shown(run['blocks'])} blocks)",
                    run["steps"], run["preemptions"],
                    f"{run['stories_identical_to_batches_of_1']}{of}",
                    shown(run["first_position_parting_from_batches_of_1"]),
                    f"{run['choosing_rows_unlike_batches_of_1']} of "
                    f"{shown(run['choosing_rows_compared_with_batches_of_1'])}",
                    f"{run['stories_identical_to_generate']}{of}",
                    shown(run["largest_logit_gap_against_exact"])] for run in k["runs"]])


def _speculative(r, t):
    return _table(["drafter", "lookahead", "model calls", "rows computed",
                   "drafted tokens accepted", "identical", "gap of the choosing rows"],
                  [[run["drafter"], run["lookahead"], shown(run["model_calls"]),
                    shown(run["rows"]),
                    f"{shown(run['accepted'])} of {shown(run['drafted'])} "
                    f"({run['accepted'] / run['drafted']:.0%})",
                    _bold(f"{run['identical']} of 120"),
                    _bold(shown(run["largest_logit_gap_of_choosing_rows"]))]
                   for run in r["speculative_decoding"]])


def _deep_shapes(r, t):
    objects = {(m["layers"], m["kv_heads"]): m["bytes_per_position"]
               for m in t["deep_model_cache_bytes_as_cpython_objects"]}
    rows = []
    for kv_heads, kind in ((4, "multi-head (4 key-value heads)"),
                           (2, "grouped-query (2 key-value heads)"),
                           (1, "multi-query (1 key-value head)")):
        shapes = [s for s in r["deep_models"]["shapes"] if s["kv_heads"] == kv_heads]
        rows.append([kind, _bold(" / ".join(shown(s["largest_logit_gap"]) for s in shapes)),
                     " / ".join(f"{s['floats_per_position']:g}" for s in shapes),
                     f"{shapes[0]['bytes_per_position_as_8_byte_floats']:g}",
                     f"{objects[1, kv_heads]:,}"])
    return _table(["attention", "largest gap, cached against full pass, 1 / 2 / 3 / 4 layers",
                   "numbers per position, 1 / 2 / 3 / 4 layers",
                   "bytes per position, one layer, as 8-byte floats",
                   "the same as CPython objects"], rows)


def _latent_shapes(r, t):
    rows = []
    for positions, latent, rotary_key in (("learned", 4, 0), ("learned", 8, 0), ("rotary", 4, 2),
                                          ("rotary", 8, 2), ("rotary", 8, 0)):
        shapes = [s for s in r["latent_attention"]["shapes"] if (s["positions"], s["latent"],
                                                                  s["rotary_key"]) == (
                                                                     positions, latent, rotary_key)]
        against = shapes[0]["against"]
        rows.append([f"{positions} positions, latent {latent}"
                     + (f", rotary key {rotary_key}" if rotary_key else
                        ", rebuilt keys turned (the control)" if positions == "rotary" else ""),
                     " / ".join(f"{s['floats_per_position']:g}" for s in shapes),
                     f"{against['multi-head']} / {against['grouped-query']} / "
                     f"{against['multi-query']}",
                     _bold(" / ".join(shown(s["largest_gap_rebuilt"]) for s in shapes)),
                     " / ".join(shown(s["largest_gap_absorbed"]) for s in shapes),
                     " / ".join("the same" if s["continuation_parts_at"] is None else
                                f"parts at token {s['continuation_parts_at'] + 1}"
                                for s in shapes)])
    return _table(["latent model (4 heads of 4)", "numbers cached per position, 1 / 2 layers",
                   "multi-head / grouped-query (2) / multi-query, 1 layer",
                   "rebuilt keys: largest gap, 1 / 2 layers",
                   "absorbed: largest gap, 1 / 2 layers",
                   f"absorbed greedy continuation ({r['latent_attention']['continued']} tokens)"],
                  rows)


def _latent_work(r, t):
    from latent_attention import cache_floats
    work = r["latent_attention"]["work_per_step"]
    shape, steps = work["shape"], work["steps"]
    latent = (f"latent {shape['latent']} + rotary key {shape['rotary_key']} "
              f"({cache_floats(1, 4, 4, shape['latent'], shape['rotary_key'])})")
    return _table(["one decode step, 1 layer, 4 heads", *(f"attending to {s['attended']}"
                                                           for s in steps)],
                  [[label, *(shown(s[path]) for s in steps)]
                   for path, label in (("multi-head", f"multi-head cache ({cache_floats(1, 4, 4)} "
                                                      f"numbers a position)"),
                                       ("multi-query",
                                        f"multi-query cache ({cache_floats(1, 1, 4)})"),
                                       ("rebuilt", f"{latent}, keys rebuilt"),
                                       ("absorbed", f"{latent}, absorbed"))])


def real_cache_bytes():
    """Each real model of latent_attention.REAL_MODELS: bytes a token, 2 a number, and
    for a latent model the bytes of its heads' own keys and values."""
    from latent_attention import REAL_MODELS, cache_floats
    return {m["model"]: (2 * cache_floats(m["layers"], m.get("kv_heads"), m["head_width"],
                                          m.get("latent"), m.get("rotary_key", 0)),
                         m.get("latent") and 2 * cache_floats(m["layers"], m["heads"],
                                                              m["head_width"], None,
                                                              m["rotary_key"]))
            for m in REAL_MODELS}


def _real_latent_models(r, t):
    from latent_attention import REAL_MODELS
    rows = []
    for m in REAL_MODELS:
        kept, plain = real_cache_bytes()[m["model"]]
        rows.append([m["model"], m["layers"], f"latent {m['latent']} + rotary key "
                     f"{m['rotary_key']}" if plain else f"{m['kv_heads']} key-value heads",
                     f"{kept:,}", f"{plain:,} ({plain / kept:.0f}x)" if plain else "—"])
    return _table(["model", "layers", "cache", "bytes a token (2-byte numbers)",
                   "its heads' keys and values cached instead"], rows)


def _bytes_read(r, t):
    shapes, lesson = r["bytes_read"]["shapes"], r["bytes_read"]["lesson"][-1]
    rows = [["the lesson's model (1 layer, 1 head)", shown(lesson["weights"]),
             shown(lesson["cache"]), r["bytes_read"]["lesson_cache_outweighs_weights_from_batch"]]]
    for s in shapes:
        kind = ({4: "multi-head", 2: "grouped-query (2)", 1: "multi-query"}[s["kv_heads"]]
                if s["path"] == "cached" else f"latent 8 + rotary key 2, {s['path']}")
        if (s["layers"] in (1, 4) and s["path"] == "cached"
                or (s["latent"], s["positions"], s["layers"]) == (8, "rotary", 1)):
            rows.append([f"{kind}, {s['layers']} layer{'s' * (s['layers'] > 1)}",
                         shown(s["weights"]), shown(s["cache_full_context"]),
                         s["cache_outweighs_weights_from_batch"]])
    return _table(["model (4 heads of 4, but the lesson's)", "weights read a step",
                   f"cache read, {lesson['held']} positions held",
                   "batch from which the cache outweighs each request's share of the weights"],
                  rows)


def _decode_bound(r, t):
    import bandwidth
    rows = []
    for label, design in bandwidth.DESIGNS:
        model = {**bandwidth.LLAMA_2_7B, "kv_heads": None, **design}
        rows.append([label, f"{bandwidth.cache_bytes_per_token(model) // 1024:,} KiB",
                     f"{bandwidth.bound(model, 0):.0f} / {bandwidth.bound(model, 4096):.0f}",
                     f"{bandwidth.bound(model, 4096, 16):,.0f}",
                     f"{bandwidth.cache_outweighs_weights(model, 16):,} tokens"])
    return _table([f"Llama-2-7B's weights ({bandwidth.LLAMA_2_7B['weight_bytes'] / 1e9:.2f} GB) "
                   f"with this cache", "cache a token",
                   "tokens/s, batch 1: a short context / 4,096",
                   "tokens/s in all, batch 16 of 4,096", "cache outweighs the weights, batch 16"],
                  rows)


def _blockwise(r, t):
    b = r["blockwise"]
    return _table(["attention read", "parts", "largest logit gap", "greedy stories changed",
                   "sampled stories changed",
                   f"scores held at once, longest row ({b['longest_row']} positions)"],
                  [[k["kind"], k["parts"] or "—", _bold(shown(k["largest_logit_gap"]))
                    if k["kind"] == "exact" else shown(k["largest_logit_gap"]),
                    f"{k['greedy_stories_changed']} of {b['stories']}",
                    f"{k['sampled_stories_changed']} of {b['stories']}", k["scores_held"]]
                   for k in b["kinds"]])


def _story_quality(r, t):
    greedy, sampled = r["story_quality"]["greedy"], r["story_quality"]["sampled"]

    def both(pick):
        return [pick(greedy), pick(sampled)]

    def of(counts):
        return f"{counts['agreeing']} of {counts['pronouns']}"
    return _table(["the 60 test openings, continued", "greedy", "sampled at temperature 1.0"], [
        ["pronouns that refer to the name and agree with its gender", *both(
            lambda q: f"{q['agreeing']} of {q['pronouns_referring_to_the_name']} "
                      f"({q['agreeing_share']:.1%})")],
        ["of those, after an opening with a pronoun in it too (`mia lost her green shell.`)",
         *both(lambda q: of(q["agreeing_by_opening"]["with a pronoun"]))],
        ["after an opening where only the name tells the gender (`emma went to the park.`)",
         *both(lambda q: of(q["agreeing_by_opening"]["with only the name"]))],
        ["pronouns that refer to a person word (`her friend. he`) and agree with its gender",
         *both(lambda q: of(q["pronouns_referring_to_a_person"]))],
        ["stories whose continuation uses only words of the corpus",
         *both(lambda q: f"{q['stories_of_corpus_words_only']} of 60")]])


def _attention_on_the_name(r, t):
    rows = []
    for key, label, bold in (("agreeing", "pronouns that agree", True),
                             ("wrong", "pronouns with the wrong gender", False)):
        cells = [label]
        for kind in ("greedy", "sampled"):
            w = r["story_quality"][kind]["attention_on_the_name"][key]
            weight = shown(w["mean_weight_on_the_name"])
            cells += ([_bold(weight) if bold else weight, shown(w["even_share"])]
                      if w["pronouns"] else ["—", "—"]) + [w["pronouns"]]
        rows.append(cells)
    return _table(["where a pronoun was chosen", "greedy: weight on the name", "even share",
                   "pronouns", "sampled: weight on the name", "even share", "pronouns"], rows)


def _indented(stories):
    return [f"    {story.rstrip(chr(10))}" for story in stories]


BLOCKS = {
    "work": _work, "cost_by_length": _cost_by_length,
    "cost_chart": _cost_chart, "slots": _slots, "parallel_sampling": _parallel_sampling,
    "ladder": _ladder,
    "prefix_cache": _prefix_cache, "many_requests": _many_requests, "kernels": _kernels,
    "speculative": _speculative, "deep_shapes": _deep_shapes,
    "latent_shapes": _latent_shapes, "latent_work": _latent_work,
    "real_latent_models": _real_latent_models, "bytes_read": _bytes_read,
    "decode_bound": _decode_bound, "blockwise": _blockwise,
    "story_quality": _story_quality, "attention_on_the_name": _attention_on_the_name,
    "greedy_examples": lambda r, t: _indented(r["greedy_examples"]),
    "stories_with_a_wrong_pronoun": lambda r, t: _indented(
        r["story_quality"]["greedy"]["stories_with_a_wrong_pronoun"]),
    "right_where_only_the_name_tells": lambda r, t: _indented(
        r["story_quality"]["greedy"]["first_three_right_where_only_the_name_tells"]),
    "the_row_side_by_side": lambda r, t: list(diagrams.the_row_side_by_side()),
    "block_tables": lambda r, t: list(diagrams.block_table_diagram()),
    "serving_timeline": lambda r, t: list(diagrams.serving_timeline()),
}
