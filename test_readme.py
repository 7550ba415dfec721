"""README.md against the code: every example, excerpt, diagram and figure it shows.

These are text checks, kept apart from the number checks of the other test modules. A
change you make on purpose (an edited function, new output, a retrained best.json)
fails them until README.md is brought up to date, and the message says what to copy
where. The exactness of the cache is tested in test_kv_cache.py, not here."""
import ast
import difflib
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import unittest

import kv_cache
import model
import paged
import serving
import trace_kv
from layers import skip_unless_sound
from generate import load_trained
from stories import openings, split_stories

HERE = os.path.dirname(os.path.abspath(__file__))
ON_PURPOSE = ("If you did not mean to change this, `git diff` shows what did (and `git "
              "checkout -- FILE` undoes an edit). If you changed the code or retrained on "
              "purpose, this is expected: bring README.md up to date")
TIMES = re.compile(r"\d[\d,]*\.\d+ (s|µs)\b")   # seconds vary from run to run
SPEED_UP = re.compile(r"\d[\d.]*x faster")      # and so does their ratio


def setUpModule():
    """The README shows what the code does: if a layer of the lab is wrong, its examples
    and figures wait (the layer's own tests say what is wrong)."""
    skip_unless_sound("every Part")


def shown(figure):
    """A float as the README prints it: 0.0 as 0.0, any other with 4 significant digits
    (the record keeps every digit)."""
    return "0.0" if figure == 0 else f"{figure:.4g}"


def readme():
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        return f.read()


def lab_json(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return json.load(f)


def fenced_blocks(text):
    """(line number, first line, lines) of every fenced block of text."""
    return [(text[:found.start()].count("\n") + 2, found.group(1), found.group(2).splitlines())
            for found in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)]


def mismatch(shown, printed, source="the command"):
    """None if the lines printed match the lines shown, else the first line that does not:
    times are not compared, and a line "..." in shown stands for any number of lines."""
    shown = [TIMES.sub("<seconds>", line) for line in shown]
    printed = [TIMES.sub("<seconds>", line) for line in printed]
    at, skipping = 0, False
    for line in shown:
        if line == "...":
            skipping = True
            continue
        if skipping:
            found = next((i for i in range(at, len(printed)) if printed[i] == line), None)
            if found is None:
                return f"the README shows {line!r}, which {source} does not give after line {at}"
            at, skipping = found + 1, False
        elif at >= len(printed) or printed[at] != line:
            got = printed[at] if at < len(printed) else "(nothing more)"
            return f"line {at + 1}: the README shows {line!r}, {source} gives {got!r}"
        else:
            at += 1
    if not skipping and at < len(printed):
        return f"{source} gives more than the README shows, from line {at + 1}: {printed[at]!r}"
    return None


def the_row_side_by_side():
    """model.forward's two loops over positions against kv_cache.forward_step after its
    checks, as a diff generated from their real source: the lines they share, and those
    that differ (what each keeps, where the keys and values come from)."""
    def body_lines(function, statements):
        lines = inspect.getsource(function).splitlines()
        return [lines[line - 1].strip() for s in statements
                for line in range(s.lineno, s.end_lineno + 1)]
    forward = ast.parse(inspect.getsource(model.forward)).body[0]
    loops = [s for s in forward.body if isinstance(s, ast.For)]
    step = ast.parse(inspect.getsource(kv_cache.forward_step)).body[0]
    after_checks = next(i for i, s in enumerate(step.body) if isinstance(s, ast.Assign))
    for_each_position = body_lines(model.forward, [s for loop in loops for s in loop.body])
    one_position = body_lines(kv_cache.forward_step, step.body[after_checks:])
    diff = list(difflib.unified_diff(for_each_position, one_position, lineterm="",
                                     n=len(one_position)))
    return ["--- model.forward: the body of its loops, for each position",
            "+++ kv_cache.forward_step: after its checks, for one position"] + diff[3:]


def block_table_diagram():
    """Section 16's Mermaid picture, from a real pool of blocks of 4: one prompt fed, then
    a second that begins like it."""
    params, tok = load_trained()
    pool = paged.BlockPool(params, 64, 4)
    prompts = ("mia was sad. tom gave her a hug.", "mia was tired.")
    sequences = []
    for prompt in prompts:
        ids = tok.encode(prompt)
        sequences.append(pool.sequence(ids))
        kv_cache.feed(params, sequences[-1], ids)
    shared = set(sequences[0].table) & set(sequences[1].table)

    def tokens(block):
        return ", ".join("space" if tok.vocab[t] == " " else tok.vocab[t]
                         for t in pool.blocks[block].tokens)
    lines = ["flowchart LR", '    subgraph tables["block tables"]']
    for name, prompt, seq in zip("AB", prompts, sequences):
        lines.append(f'        {name}["{prompt}<br/>blocks {", ".join(map(str, seq.table))}"]')
    lines += ["    end", '    subgraph pool["BlockPool: blocks of 4 positions"]']
    for block in sorted(set(sequences[0].table) | set(sequences[1].table)):
        lines.append(f'        P{block}["{block}: {tokens(block)}'
                     f'<br/>(refs {pool.ref_counts[block]})"]')
    lines.append("    end")
    for name, seq in zip("AB", sequences):
        lines += [f"    {name} --> P{block}" for block in seq.table]
    return lines, shared


def serving_timeline():
    """Section 19's picture, from a real run of serving.serve: four openings, batches of up
    to four, a pool of 16 blocks of 4. One line per request, one character per step: P
    admitted (its tokens prefilled), . a decode row, x preempted, - waiting, * finished."""
    params, tok = load_trained()
    with open(os.path.join(HERE, "corpus.txt"), encoding="utf-8") as f:
        prompts = openings(split_stories(f.read())[2])[:4]
    events = {}
    _, counts = serving.serve(params, tok, [{"prompt": p} for p in prompts],
                              paged.BlockPool(params, 16, 4), 4,
                              lambda step, index, event: events.setdefault(
                                  (index, step), set()).add(event))
    lines = []
    for index, prompt in enumerate(prompts):
        marks, finished = "", False
        for step in range(1, counts["steps"] + 1):
            happened = events.get((index, step), set())
            marks += ("*" if "finished" in happened else "x" if "preempted" in happened
                      else "P" if "prefill" in happened else "." if happened
                      else " " if finished else "-")
            finished = finished or "finished" in happened
        lines.append(f"{prompt:<{max(map(len, prompts))}}  {marks.rstrip()}")
    return lines, counts


PARTS = (("the lesson (Part 1)", "### 1. ", "## Part 2"), ("Part 2", "## Part 2", "## Part 3"),
         ("Part 3", "## Part 3", "## Part 4"), ("Part 4", "## Part 4", "## Reference"),
         ("the Reference", "## Reference", "### References"))


def prose_words(text, start="### 1. ", end="## Part 2"):
    """The words of the prose from the heading start to the heading end (by default the
    lesson, sections 1 to 14), without code blocks, tables, indented formula blocks,
    comments and link targets."""
    part = text[text.index(start):text.index(end)]
    part = re.sub(r"^```.*?^```$", "", part, flags=re.M | re.S)
    kept = [line for line in part.splitlines()
            if not line.startswith(("|", "    ", "<!--"))]
    prose = re.sub(r"\]\([^)]*\)", "]", "\n".join(kept))
    return [word for word in prose.split() if re.search(r"[A-Za-z0-9]", word)]


class Examples(unittest.TestCase):

    def test_every_example_prints_what_the_readme_shows(self):
        """Each fenced block whose first line is "$ python3 ..." is run from the lab's
        folder; training logs (python3 train.py) are one real run's and are tied to
        best.json by test_the_readme_quotes_the_checkpoint_figures instead."""
        examples = [(line, block[0], block[1:]) for line, _, block in fenced_blocks(readme())
                    if block and block[0].startswith("$ python3 ")
                    and not block[0].startswith("$ python3 train.py")]
        self.assertGreaterEqual(len(examples), 2)
        for line, command, shown in examples:
            with self.subTest(command=command):
                done = subprocess.run([sys.executable, *shlex.split(command[len("$ python3 "):])],
                                      cwd=HERE, capture_output=True, text=True, timeout=120)
                found = mismatch(shown, (done.stdout + done.stderr).splitlines())
                if found:
                    self.fail(f"README.md line {line}, `{command}`: {found}.\n{ON_PURPOSE}: "
                              f"run the command and copy what it prints.")

    def test_the_summary_shown_is_what_trace_kv_prints_for_the_recorded_run(self):
        text = readme()
        block = next(lines for _, _, lines in fenced_blocks(text) if lines[0] == "Exactness")
        printed = trace_kv.summary(lab_json(trace_kv.TRACE), lab_json(trace_kv.TIMES))
        printed += f"The full record: {trace_kv.TRACE} (or python3 trace_kv.py --json)"
        found = mismatch([SPEED_UP.sub("<ratio>x faster", line) for line in block],
                         [SPEED_UP.sub("<ratio>x faster", line) for line in printed.splitlines()],
                         "trace_kv.py")
        self.assertIsNone(found, f"the summary in README.md is not what trace_kv.py prints "
                                 f"for kv-trace.json (the times and their ratio are one "
                                 f"run's, and not compared): {found}. {ON_PURPOSE}.")
        section_7 = re.search(r"\| 60 greedy stories \| ([\d.]+ s) \| ([\d.]+ s) \|", text)
        self.assertIn(f"{section_7[1]:>16}{section_7[2]:>10}", "\n".join(block),
                      "the summary's times are not the run of section 7")

    def test_section_5_shows_the_row_side_by_side_from_the_real_source(self):
        wanted = the_row_side_by_side()
        blocks = [lines for _, kind, lines in fenced_blocks(readme()) if kind == "diff"]
        if wanted not in blocks:
            self.fail(f"section 5's diff is generated from model.forward and "
                      f"kv_cache.forward_step, which changed: "
                      f"{mismatch(blocks[0], wanted, 'the source')}. "
                      f"{ON_PURPOSE}: the_row_side_by_side() in test_readme.py gives the "
                      f"new diff")
        changed = [line for line in wanted[2:] if line[:1] in "+-"]
        keys = [line for line in changed if line[1:].startswith("keys, values =")]
        self.assertEqual(len(keys), 2)   # where the keys and values come from: the one line

    def test_the_block_table_diagram_is_a_real_pool(self):
        wanted, shared = block_table_diagram()
        self.assertTrue(shared)          # the second prompt reuses the first's full blocks
        blocks = [lines for _, kind, lines in fenced_blocks(readme()) if kind == "mermaid"]
        if wanted not in blocks:
            self.fail(f"section 16's block tables are not what a real pool holds: "
                      f"{mismatch(blocks[-1], wanted, 'a real pool')}. {ON_PURPOSE}: "
                      f"block_table_diagram() "
                      f"in test_readme.py gives the new diagram")

    def test_the_serving_timeline_is_a_real_run(self):
        wanted, counts = serving_timeline()
        self.assertGreater(counts["preemptions"], 0)   # the picture shows one
        blocks = [lines for _, kind, lines in fenced_blocks(readme()) if kind == "text"]
        if wanted not in blocks:
            self.fail(f"section 19's timeline is not what serving.serve does: "
                      f"{mismatch(blocks[0] if blocks else [], wanted, 'a real run')}. "
                      f"{ON_PURPOSE}: serving_timeline() in test_readme.py gives the new one")

    def test_the_readme_shows_the_real_code(self):
        excerpts = re.findall(r"<!-- excerpt: (\w+)\.(\w+) -->\n```python\n(.*?)```", readme(),
                              re.DOTALL)
        self.assertGreaterEqual(len(excerpts), 2)
        for module, function, code in excerpts:
            with self.subTest(excerpt=f"{module}.{function}"):
                self.assertTrue(code in inspect.getsource(getattr(sys.modules[module], function)),
                                f"README.md's excerpt of {module}.{function} is not in its "
                                f"source any more. {ON_PURPOSE}: copy the lines again.")

    def test_the_lesson_is_at_most_2500_words(self):
        words = len(prose_words(readme()))
        self.assertLessEqual(words, 2500, "the lesson (sections 1 to 14, without code, "
                                          "tables and formulas) has grown past 2,500 words")
        self.assertIn(f"{words:,} words", readme())   # the README says its own length

    def test_each_part_gives_its_own_length(self):
        """The table of what each Part takes quotes its words of prose, and the minutes
        they take at 200 words a minute."""
        text = readme()
        for part, start, end in PARTS:
            words = len(prose_words(text, start, end))
            with self.subTest(part=part):
                self.assertRegex(text, rf"\n\| {re.escape(part)}[^|\n]* \| [^|\n]* \| "
                                       rf"{words:,} words, about {round(words / 200)} minutes \|",
                                 f"README.md's table of times must give {part} {words:,} "
                                 f"words of prose")
                with_code = re.search(rf"\n\| {re.escape(part)}[^\n]* \| (\d+ to \d+) minutes",
                                      text).group(1)
                if part != "the Reference":   # optional: it has no opening to say so
                    opening = text[text.index(start.replace("### 1. ", "## The lesson")):
                                   text.index(end)]
                    self.assertIn(f"With its code, {with_code} minutes.",
                                  " ".join(opening.split()))

    def test_the_lesson_counts_its_words_without_code_tables_and_formulas(self):
        text = ("### 1. One\n\nTwo words, [a link](https://x.y/z).\n\n```python\nx = 1\n```\n"
                "| a | table |\n    a formula\n<!-- a comment -->\n- a list `item`\n## Part 2\n")
        self.assertEqual(prose_words(text),
                         ["1.", "One", "Two", "words,", "[a", "link].", "a", "list", "`item`"])

    def test_no_figure_in_the_text_has_more_than_6_significant_digits(self):
        """In the prose and tables before the Reference (not in what a command prints),
        a decimal figure is rounded for a reader; the record keeps every digit."""
        text = readme()
        text = re.sub(r"^```.*?^```$", "", text[:text.index("## Reference")],
                      flags=re.M | re.S)
        prose = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
        for figure in re.findall(r"\d[\d,]*\.\d+(?:e[-+]?\d+)?", prose):
            digits = re.sub(r"e.*|\D", "", figure).lstrip("0")
            with self.subTest(figure=figure):
                self.assertLessEqual(len(digits), 6, f"README.md prints {figure}: round it "
                                                     f"(test_readme.shown does)")

    def test_a_line_shown_must_match_except_times_and_elided_lines(self):
        printed = ["uncached: 198 rows, 0.067 s", "a", "b", "c", "identical: yes"]
        self.assertIsNone(mismatch(["uncached: 198 rows, 1.234 s", "...", "identical: yes"],
                                   printed))
        self.assertIn("line 1", mismatch(["uncached: 225 rows, 0.067 s", "..."], printed))
        self.assertIn("gives more", mismatch(printed[:3], printed))
        self.assertIn("does not give", mismatch(["...", "identical: NO"], printed))


class RecordedFigures(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.record = lab_json(trace_kv.TRACE)

    def test_the_readme_s_times_are_one_run_s_and_agree_with_each_other(self):
        """The seconds of sections 7 and 8 are one run's (kv-time.json when the README was
        written), so a --write, which times a new run, leaves this test green: it checks
        that the quoted figures agree with each other and with the counts of kv-trace.json
        (each ratio is the ratio of the quoted seconds, as rounded), not that they are
        the latest run's."""
        text, work_done = readme(), self.record["work"]

        def agrees(ratio, top, bottom, places):   # top and bottom were rounded to places
            half = 0.5 * 10 ** -places
            return (top - half) / (bottom + half) - 0.05 <= ratio \
                <= (top + half) / (bottom - half) + 0.05
        found = re.search(r"\| 60 greedy stories \| ([\d.]+) s \| ([\d.]+) s \|\n"
                          r"\| per row \| ([\d.]+) µs \| ([\d.]+) µs \|\n"
                          r"\| speed-up \| \| \*\*([\d.]+)x\*\* \|", text)
        self.assertIsNotNone(found, "section 7's table of times is not in README.md")
        uncached, cached, per_row, cached_per_row, speedup = map(float, found.groups())
        self.assertTrue(agrees(speedup, uncached, cached, 3), found.group())
        self.assertTrue(agrees(per_row, uncached * 1e6, work_done["uncached_rows"], 3 - 6))
        self.assertTrue(agrees(cached_per_row, cached * 1e6, work_done["cached_rows"], 3 - 6))
        self.assertIn(f"The speed-up ({speedup}x)", text)
        rows = re.findall(r"^\| (\d+) \| [\d,]+ \| [\d,]+ \| [\d,]+ \| [\d,]+ \| ([\d.]+) \| "
                          r"([\d.]+) \| ([\d.]+)x \| (\d+)x \|$", text, re.M)
        self.assertEqual([int(r[0]) for r in rows], [e["positions"]
                                                       for e in self.record["cost_by_length"]])
        for positions, without, with_, ratio, rows_ratio in rows:
            with self.subTest(positions=positions):
                self.assertTrue(agrees(float(ratio), float(without), float(with_), 4))
                self.assertEqual(int(rows_ratio), int(positions) // 2)
        if "in the recorded run each lands a little below its rows ratio" in text:
            self.assertTrue(all(float(r[3]) < int(r[4]) for r in rows),
                            "section 8 says each speed-up is below its rows ratio; in its "
                            "table one is not: say what the table shows")
        params, tok = load_trained()
        with open(os.path.join(HERE, "corpus.txt"), encoding="utf-8") as f:
            full_context = [t for story in split_stories(f.read())[2]
                            for t in tok.encode(story)][:model.CONTEXT]
        memory = trace_kv.cache_bytes(params, full_context)   # CPython's, the same each run
        self.assertIn(f"**{memory:,} bytes** ({memory / model.CONTEXT:,} bytes per position",
                      text, f"section 9's bytes are not what this Python measures. {ON_PURPOSE}.")
        share = re.search(r"the steps took ([\d.]+) times as long as the same `math.fsum`", text)
        self.assertGreater(float(share.group(1)), 1.0)   # the steps make those calls and more

    def test_the_readme_quotes_the_recorded_figures(self):
        text = readme()
        chunks = self.record["one_pass_prefill"]["positions_compared_by_chunk"]
        self.assertEqual(len(set(chunks.values()) - {chunks["whole prompt"]}), 1)
        for figure in readme_figures(self.record):
            with self.subTest(figure=figure):
                self.assertTrue(figure in text, "not in README.md")   # not the whole text

    def test_the_readme_quotes_the_checkpoint_figures(self):
        meta = lab_json("best.json")["meta"]
        val, baseline = meta["val_loss"], meta["unigram_baseline"]
        text = readme()
        for figure in (f"| {baseline:.4f} nats per token |",
                       f"| {val:.4f} nats per token, {val / baseline:.1%} of the baseline |",
                       f"best validation loss {val:.4f} = {val / baseline:.1%} of the unigram "
                       f"baseline (epoch {meta['epoch']})"):
            with self.subTest(figure=figure):
                self.assertTrue(figure in text, f"not in README.md. {ON_PURPOSE}.")


def readme_figures(r):
    """Every figure of the record r that README.md quotes, as it is written there."""
    sharing, reordered = r["prefix_sharing"], r["sums_in_another_order"]
    by_name = {rung["cache"]: rung for rung in r["ladder"]["rungs"]}
    every_row = r["every_row_of_every_story"]
    quoted = [f"{count:,}" for count in r["work"].values()] + [
        f"every position of the {every_row['stories']} stories (60 greedy, 60 sampled): "
        f"{every_row['positions']:,} rows of 96 logits | **{every_row['largest_logit_gap']}**",
        f"bit for bit ({every_row['positions']:,} positions)",
        f"which generated {r['generated_tokens']:,} tokens ({r['greedy_ended_with_newline']} of "
        f"60 ended with a newline)",
        f"over all {r['positions_checked']} positions of the first test story",
        f"| rows (positions run through the model) | {r['work']['uncached_rows']:,} | "
        f"{r['work']['cached_rows']:,} | {r['rows_ratio']}x |",
        f"| attention scores | {r['work']['uncached_scores']:,} | {r['work']['cached_scores']:,} "
        f"| {r['scores_ratio']}x |",
        f"close to the rows ratio ({r['rows_ratio']}x)",
        f"**{r['largest_logit_gap_first_story']}**",
        f"**{r['greedy_identical']} of {r['stories']}**",
        f"**{r['sampled_identical']} of {r['stories']}**",
        f"All {sharing['identical']} of {sharing['runs']} results are identical",
        f"{sharing['prompt_rows_with_sharing']:,} rows instead of "
        f"{sharing['prompt_rows_without_sharing']:,} ("
        f"{sharing['prompt_rows_without_sharing'] - sharing['prompt_rows_with_sharing']:,} "
        f"rows saved)",
        f"gap between them stays **{shown(reordered['largest_logit_gap_first_story_in_both_paths'])}**",
        f"it becomes\n**{shown(reordered['largest_logit_gap_first_story'])}**, and of all 60 "
        f"greedy stories (section 17) **{by_name['exact lists, sums in another order']['greedy_stories_changed']}** change",
    ] + [text.rstrip("\n") for text in r["greedy_examples"]] + [
        f"| {e['positions']} | {e['uncached_rows']:,} | {e['cached_rows']:,} | "
        f"{e['uncached_scores']:,} | {e['cached_scores']:,} |" for e in r["cost_by_length"]]
    quoted += [f"    {kind} [{', '.join(str(e[key]) for e in r['cost_by_length'])}]"
               for kind, key in (("bar", "uncached_rows"), ("line", "cached_rows"))]
    quoted += trace_kv.summary(r, None).splitlines()   # all but the times of one run
    one_pass, paged = r["one_pass_prefill"], r["paged"]
    chunks = one_pass["positions_compared_by_chunk"]
    sharing = paged["prefix_sharing_blocks_of_4"]
    quoted += [
        f"**{one_pass['largest_logit_gap']}** largest gap, {chunks['1']:,} positions for "
        f"each chunk size",
        f"{chunks['whole prompt']:,} positions; **{one_pass['greedy_identical']} of 60** "
        f"stories identical",
        f"{one_pass['prompt_calls_one_token_at_a_time']:,} one token at a time; "
        f"{one_pass['prompt_calls_one_pass']} in one pass",
        f"which hold {paged['positions_held']:,}\npositions at their end",
        f"share {sharing['blocks_shared']} blocks, so their prompts cost "
        f"{sharing['prompt_rows_with_sharing']:,} rows instead of "
        f"{sharing['prompt_rows_without_sharing']:,}",
        f"**{sharing['greedy_identical']} of 60** greedy stories continued from the pool"]
    quoted += [f" | {slots:,} | {paged['wasted_share'][way]:.1%} |"
               for way, slots in paged["slots_reserved"].items()]
    for rung in r["ladder"]["rungs"]:
        size, kept = rung["bytes_per_position"], rung["positions_kept"]
        quoted.append(f"| {rung['cache']} | {'—' if size is None else f'{size:g}'} | "
                      f"{'all' if kept is None else kept} | {shown(rung['largest_logit_gap'])} | "
                      f"{rung['greedy_stories_changed']} | {rung['sampled_stories_changed']} |")
    for kind in ("greedy", "sampled"):
        q = r["story_quality"][kind]
        quoted.append(f"{q['agreeing']} of {q['pronouns_referring_to_the_name']} "
                      f"({q['agreeing_share']:.1%})")
    greedy, sampled = r["story_quality"]["greedy"], r["story_quality"]["sampled"]
    quoted.append(f"| {greedy['stories_of_corpus_words_only']} of 60 | "
                  f"{sampled['stories_of_corpus_words_only']} of 60 |")
    for opening, counts in greedy["agreeing_by_opening"].items():
        other = sampled["agreeing_by_opening"][opening]
        quoted.append(f"| {counts['agreeing']} of {counts['pronouns']} | {other['agreeing']} "
                      f"of {other['pronouns']} |")
    for key, label, bold in (("agreeing", "pronouns that agree", "**"),
                             ("wrong", "pronouns with the wrong gender", "")):
        cells = [(f"{bold}{w['mean_weight_on_the_name']}{bold} | {w['even_share']}"
                  if w["pronouns"] else "— | —") + f" | {w['pronouns']}"
                 for w in (greedy["attention_on_the_name"][key],
                           sampled["attention_on_the_name"][key])]
        quoted.append(f"| {label} | {' | '.join(cells)} |")
    people = [q["pronouns_referring_to_a_person"] for q in (greedy, sampled)]
    quoted.append(" | ".join(f"{p['agreeing']} of {p['pronouns']}" for p in people))
    quoted += [story.rstrip("\n") for story in greedy["stories_with_a_wrong_pronoun"]
               + greedy["first_three_right_where_only_the_name_tells"]]

    def changed(name):
        return by_name[name]["greedy_stories_changed"]
    quoted += [f"changed {changed('int4')} greedy stories and "
               f"{by_name['int4']['sampled_stories_changed']} sampled ones",
               f"with 8 positions kept, {changed('window 8, sinks 0')} of the 60 greedy stories",
               f"16 changed {changed('window 16, sinks 4')} greedy stories where a window of 20 "
               f"changed {changed('window 20, sinks 0')}",
               f"window of 8 changed {changed('window 8, sinks 4')} where a window of 12 changed "
               f"{changed('window 12, sinks 0')}"]
    held = r["prefix_cache"]["positions_held_in_all"]
    for run, label in (("small pool", f"small: far less than the 60 stories hold ({held:,} "
                                      f"positions)"), ("ample pool", "ample: nothing is evicted")):
        c = r["prefix_cache"][run]
        quoted.append(f"| {label} | {c['blocks']} | {c['prefix_hits']} | {c['rows_saved']} | "
                      f"{c['rows']:,} | {c['evictions']} | **{c['identical']} of 60** | "
                      f"**{c['largest_logit_gap_of_choosing_rows']}** |")
    many = r["many_requests"]
    for run in ("small pool", "ample pool"):
        c = many[run]
        quoted.append(f"({c['blocks']:,} blocks) | {c['steps']} | {c['rows']:,} | "
                      f"{c['recomputed_rows']} | {c['preemptions']} | {c['peak_blocks']} | "
                      f"{c['prefix_hits']} | **{c['identical']} of 120** | "
                      f"**{c['largest_logit_gap_of_choosing_rows']}** |")
    quoted += [f"batches of up to {many['max_batch']}, every",
               f"a batch of {many['max_batch']} starts",
               f"takes {many['static_batching_steps']} steps for the same requests; continuous "
               f"batching, {many['ample pool']['steps']}",
               f"recomputes {many['small pool']['recomputed_rows']} rows"]
    kernels = r["batched_decode"]
    for run in kernels["runs"]:
        parts = run["first_position_parting_from_batches_of_1"]
        quoted.append(f"| {run['kernel']} | {run['max_batch']} | {run['pool']} ({run['blocks']:,} "
                      f"blocks) | {run['steps']} | {run['preemptions']} | "
                      f"{run['stories_identical_to_batches_of_1']} of {kernels['requests']} | "
                      f"{'—' if parts is None else parts} | "
                      f"{'yes' if run['logits_as_with_batches_of_1'] else 'no'} | "
                      f"{run['stories_identical_to_generate']} of {kernels['requests']} | "
                      f"{shown(run['largest_logit_gap_against_exact'])} |")
    for run in r["speculative_decoding"]:
        quoted.append(f"| {run['drafter']} | {run['lookahead']} | {run['model_calls']:,} | "
                      f"{run['rows']:,} | {run['accepted']:,} of {run['drafted']:,} "
                      f"({run['accepted'] / run['drafted']:.0%}) | **{run['identical']} of 120** "
                      f"| **{run['largest_logit_gap_of_choosing_rows']}** |")
    first, files = r["speculative_decoding"][0], r["cache_files"]
    quoted += [f"({first['model_calls_one_per_token']:,} calls, the prompt in one and then one "
               f"per token; {first['rows_one_at_a_time']:,} rows)",
               f"take {files['bytes']:,} bytes in files for {files['positions']:,} positions,",
               f"**{files['bytes_per_position']} bytes per position**"]
    deep = r["deep_models"]
    for kv_heads, kind in ((4, "multi-head (4 key-value heads)"),
                           (2, "grouped-query (2 key-value heads)"),
                           (1, "multi-query (1 key-value head)")):
        shapes = [shape for shape in deep["shapes"] if shape["kv_heads"] == kv_heads]
        assert [shape["floats_per_position"] for shape in shapes] \
            == [shape["formula"] for shape in shapes], "the cache keeps what the formula says"
        gaps = " / ".join(shown(shape["largest_logit_gap"]) for shape in shapes)
        counts = " / ".join(f"{shape['floats_per_position']:g}" for shape in shapes)
        quoted.append(f"| {kind} | **{gaps}** | {counts} | "
                      f"{shapes[0]['bytes_per_position_as_8_byte_floats']:g} | ")
    one, two, three = deep["window_through_layers"]
    quoted += [f"changes the rows up to position {one['last_position_token_0_reaches']} with one "
               f"layer, {two['last_position_token_0_reaches']} with two and "
               f"{three['last_position_token_0_reaches']}",
               f"largest logit change is **{shown(one['largest_logit_change_at_position_14'])}** "
               f"with one layer, **{shown(two['largest_logit_change_at_position_14'])}** with "
               f"two and\n**{shown(three['largest_logit_change_at_position_14'])}**"]
    rotary = r["rotary"]
    by_layers, grouped = rotary["against_recompute_by_layers"], [
        shape for shape in rotary["shapes"] if shape["kv_heads"] == 2]
    quoted += [
        f"gap **{shown(max(shape['largest_logit_gap'] for shape in rotary['shapes']))}**). "
        f"Three mistakes",
        f"each shape, fed {rotary['positions']} random tokens; the oldest {rotary['dropped']} "
        f"dropped; {rotary['continued']} tokens continued greedily.",
        f"position by at most {shown(rotary['key_gap_rotated_back_vs_rotated_once'])}, the rows "
        f"by {shown(rotary['rounding']['largest_logit_gap'])}; "
        f"{rotary['rounding']['continuations_changed']} of {rotary['rounding']['models']} "
        f"continuations change.",
        f"alone ({shown(by_layers[0]['largest_logit_gap'])}, "
        f"{by_layers[0]['continuations_changed']} of {by_layers[0]['models']} change)",
        f"gaps of {', '.join(shown(e['largest_logit_gap']) for e in by_layers[1:])} for 2, 3 "
        f"and 4 layers,\n  and {', '.join(str(e['continuations_changed']) for e in by_layers[1:])}"
        f" of {by_layers[1]['models']} continuations change.",
        f"positions 0 to {rotary['dropped'] - 1} and turned on by {rotary['dropped']}",
        f"computed at {rotary['dropped']} to {rotary['positions'] - 1} by {shown(rotary['offset_with_nothing_before']['largest_logit_gap'])}"
        f"\n({rotary['offset_with_nothing_before']['models']} grouped-query models, "
        f"{rotary['offset_with_nothing_before']['continuations_changed']} change)",
        f"original cache, they differ by "
        f"{', '.join(shown(s['offset_after_other_tokens']['largest_logit_gap']) for s in grouped[1:])}"
        f" for\n2, 3 and 4 layers, and "
        f"{'every' if all(s['offset_after_other_tokens']['continuation_changed'] for s in grouped[1:]) else 'not every'}"
        f" continuation changes",
        f"gives gaps up to\n{shown(rotary['learned_old_keys_against_recompute']['largest_logit_gap'])}, "
        f"and {rotary['learned_old_keys_against_recompute']['continuations_changed']} of "
        f"{rotary['learned_old_keys_against_recompute']['models']} continuations change."]
    attention = r["attention_to_position_0"]
    quoted += [f"(of {r['ladder']['stories']})", f"on all {r['ladder']['stories']} openings",
               f"**{attention['mean_weight']}**",
               f"even share ({attention['even_share']})"]
    return quoted


if __name__ == "__main__":
    unittest.main()
