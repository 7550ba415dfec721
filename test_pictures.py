"""The documents' pictures: each file a document marks (<!--picture MODULE.NAME-->) is what
that function draws from the recorded kv-trace.json, valid SVG, shown once with a
caption, and drawn to scale; and whatever a hand-edited record holds, each draws a small,
valid SVG or refuses it naming the key."""
import ast
import contextlib
import copy
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import types
import unittest
import xml.etree.ElementTree as ET
from unittest import mock

import bandwidth
import documents
import eviction
import kernel_runs
import lossy
import support
import svg
from instruments import is_call_of, plant, replacing
from support import lab_file, paths

SVG = "{http://www.w3.org/2000/svg}"


def marks(svg):
    """(element, its title) for every drawn figure of an SVG text: the markers and bars."""
    root = ET.fromstring(svg)
    return [(element, element.find(f"{SVG}title").text) for element in root.iter()
            if element.tag in (f"{SVG}circle", f"{SVG}rect", f"{SVG}polygon", f"{SVG}path")
            and element.find(f"{SVG}title") is not None]


def look(element):
    """How a mark or a legend's sample is drawn: (its marker's name or None, its colour)."""
    fill = element.get("fill")
    return element.get("class"), element.get("stroke") if fill == "none" else fill


def legends(drawn):
    """The looks of each legend of an SVG text: a list of them for each legend group."""
    return [[look(element) for element in group if element.tag in (
                f"{SVG}circle", f"{SVG}rect", f"{SVG}polygon", f"{SVG}path")]
            for group in ET.fromstring(drawn).iter(f"{SVG}g") if group.get("class") == "legend"]


def legend_problems(drawn):
    """Each legend entry of an SVG text that no mark of the picture looks like: a swatch
    (no marker) stands for the marks of its colour, a marker for those of its colour and
    marker."""
    drawn_looks = {look(element) for element, _ in marks(drawn)}
    return [f"the legend shows {marker or 'a swatch'} in {color}, and nothing is drawn so"
            for entries in legends(drawn) for marker, color in entries
            if not any(color == c and marker in (None, m) for m, c in drawn_looks)]


def twins(items):
    """The items of a list that it holds more than once."""
    return sorted({item for item in items if items.count(item) > 1})


def series_problems(drawn):
    """The looks (marker and colour) of an SVG text's legends that more than one entry
    has: lines that could be taken for one another."""
    return [f"two series drawn as {look}" for look in twins(
        [entry for group in legends(drawn) for entry in group])]


BYTES = re.compile(r"^([\d,.]+) (B|KiB|MiB|GiB|TiB|PiB)$")
DECIMAL = re.compile(r"\d ?(kB|MB|GB|TB|PB)\b")


def unit_problems(pictures):
    """What in pictures ({file: SVG text}) counts memory otherwise than in binary units: a
    decimal unit (kB, MB, GB) in any text or title; an axis of bytes whose ticks are
    neither powers of 1,024 (a log axis) nor from 0 bytes a power of two apart."""
    problems = []
    for name, drawn in pictures.items():
        root = ET.fromstring(drawn)
        problems += [f"{name}: {element.text!r} counts in a decimal unit" for element in
                     root.iter() if element.text and DECIMAL.search(element.text)]
        axes = {}
        for tick in root.iter(f"{SVG}text"):
            found = BYTES.match(tick.text or "")
            if found and tick.get("class") in ("x tick", "y tick"):
                where = tick.get("y" if tick.get("class") == "x tick" else "x")
                size = float(found[1].replace(",", "")) * 1024 ** [
                    "B", "KiB", "MiB", "GiB", "TiB", "PiB"].index(found[2])
                axes.setdefault((tick.get("class"), where), []).append(size)
        for (axis, _), sizes in axes.items():
            steps = {b - a for a, b in zip(sizes, sizes[1:])}
            powers = all(1024 ** round(math.log(size, 1024)) == size for size in sizes if size)
            linear = sizes[0] == 0 and len(steps) == 1 and math.log2(min(steps)).is_integer()
            if not (powers and 0 not in sizes or linear):
                problems.append(f"{name}: an {axis} axis of bytes ticked at {sizes}")
    return problems


LATER_NAMES = re.compile(r"\d layers,|grouped|multi-query|multi-head|latent|DeepSeek|Llama-3|"
                         r"rotary|heads")


def later_names(pictures):
    """Each text or title of pictures ({file: SVG text}) that names what a later Part
    introduces: the deeper models, their heads and their designs."""
    return [f"{name}: {element.text!r}" for name, drawn in pictures.items()
            for element in ET.fromstring(drawn).iter()
            if element.text and LATER_NAMES.search(element.text)]


class Pictures(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.record = json.loads(lab_file(documents.TRACE))
        cls.timing = json.loads(lab_file(documents.TIMES))
        cls.texts = {name: lab_file(name) for name in documents.documents()}
        cls.drawn = {}
        for text in cls.texts.values():
            cls.drawn.update(documents.pictures(text, cls.record, cls.timing))
        cls.marked = {name: mark for text in cls.texts.values()
                      for mark, name in documents.PICTURE.findall(text)}

    def test_every_picture_is_what_the_record_draws(self):
        self.assertGreaterEqual(len(self.drawn), 4)
        for name, svg in self.drawn.items():
            with self.subTest(name):
                shown = lab_file(name).splitlines()
                wanted = svg.splitlines()
                first = next((i for i, (a, b) in enumerate(zip(shown, wanted)) if a != b),
                             min(len(shown), len(wanted)))
                self.assertEqual(shown, wanted, f"{name}, its line {first + 1}, is not what "
                                 f"its function draws from {documents.TRACE}: run python3 "
                                 f"trace_kv.py --write")

    def test_every_picture_is_an_svg_document_with_a_title_and_its_figures(self):
        for name, svg in self.drawn.items():
            with self.subTest(name):
                root = ET.fromstring(svg)   # raises on text that is not well-formed XML
                self.assertEqual(root.tag, f"{SVG}svg")
                self.assertEqual(root.get("viewBox"), f"0 0 {root.get('width')} "
                                                      f"{root.get('height')}")
                self.assertTrue(root.find(f"{SVG}title").text)
                self.assertGreater(len(marks(svg)), 3)

    def test_each_picture_is_marked_and_shown_once_with_a_caption(self):
        shown = [found for text in self.texts.values() for found in re.findall(
            r"^(<!--picture [\w.]+-->\n)?!\[[^\]]+\]\(([^)]+)\)\n\n(.+(?:\n.+)*)", text, re.M)]
        self.assertEqual(sorted(name for _, name, _ in shown), sorted(self.drawn),
                         "each picture once, on a line of its own after its mark, its caption "
                         "after a blank line")
        for mark, name, caption in shown:
            with self.subTest(name):
                self.assertTrue(mark, f"{name}: the line before it must be its "
                                      f"<!--picture MODULE.NAME--> mark")
                self.assertRegex(caption, r"^\*[^*]+\*$", "the caption: a paragraph in italics")
                self.assertIn(name, caption, "the caption names the file")
                self.assertEqual(sum(text.count(f"]({name})") for text in self.texts.values()), 1)

    def assert_to_scale(self, sizes, name):
        """Drawn sizes (pixels) against the figures they stand for: one scale for all,
        within what writing each to a tenth of a pixel can move them."""
        (low, low_size), (high, high_size) = min(sizes), max(sizes)
        scale = (high_size - low_size) / (high - low)
        for figure, size in sizes:
            self.assertLessEqual(abs(low_size + (figure - low) * scale - size), 0.16,
                                 f"{name}: {figure} drawn off the scale of the others")

    def test_rows_and_scores_are_drawn_to_scale_and_named_as_the_record_has_them(self):
        lengths = self.record["cost_by_length"]
        dots = marks(self.drawn["kv-rows.svg"])
        for kind in ("rows", "scores"):
            with self.subTest(kind):
                counts = [(int(re.search(r": ([\d,]+) ", title)[1].replace(",", "")),
                           -float(dot.get("cy"))) for dot, title in dots if f" {kind} " in title]
                self.assertEqual(sorted(count for count, _ in counts),
                                 sorted(e[f"{which}_{kind}"] for e in lengths
                                        for which in ("uncached", "cached")))
                self.assert_to_scale(counts, f"kv-rows.svg, {kind}")

    def test_the_readme_s_picture_names_only_the_lesson_s_and_the_7b_model_s_lines(self):
        """Section 9's picture stands with the lesson: its lines are the lesson's model and
        the 7B-class model of its text, that line ending where the text does (4 GiB at
        8,192 tokens), and nothing in it names a later Part's models; Part 4's picture of
        the designs, checked the same way, does."""
        readme = self.texts[documents.README]
        lesson = documents.pictures(readme, self.record, self.timing)
        self.assertEqual(later_names(lesson), [])
        titles = [title for _, title in marks(lesson["kv-cache-bytes.svg"])]
        self.assertEqual({title.split(":")[0] for title in titles},
                         {"the lesson's model", "a 7B-class model in fp16"})
        self.assertIn("a 7B-class model in fp16: 4 GiB at 8,192 positions", titles)
        self.assertRegex(readme, r"x 8,192 tokens +=\s+4 GiB for one sequence")
        self.assertTrue(later_names({"by design": self.drawn["kv-cache-bytes-by-design.svg"]}))

    def test_every_memory_axis_counts_in_binary_units(self):
        """Memory in KiB, MiB and GiB, as section 9 says every file counts it: no decimal
        unit in any picture, each axis of bytes ticked at powers of 1,024 or a power of two
        apart. Counted in thousands, ticked at powers of 1,000 or 2,000 bytes apart (each
        planted in the real code), they are found."""
        self.assertEqual(unit_problems(self.drawn), [])
        thousands = replacing(lambda node: isinstance(node, ast.Constant) and node.value == 1024,
                              lambda node: ast.Constant(1000))
        for what, owner, function, planting in (
                ("bytes counted in thousands", svg, "bytes_label", thousands),
                ("a log axis ticked at powers of 1,000", bandwidth, "_cache_lines", thousands),
                ("a linear axis ticked as a count", lossy, "ladder_picture", replacing(
                    lambda node: isinstance(node, ast.Attribute) and node.attr == "byte_ticks",
                    lambda node: ast.Attribute(node.value, "ticks", node.ctx)))):
            with self.subTest(mistake=what), mock.patch.object(
                    owner, function, plant(owner, function, planting)):
                redrawn = {name: documents.drawn(mark, self.record, self.timing)
                           for name, mark in self.marked.items()}
                self.assertTrue(unit_problems(redrawn))

    def test_each_series_of_the_side_by_side_picture_has_its_own_marker(self):
        """Lines that lie on each other are told apart: each series of a panel its own
        marker and its own colour. Every series a circle, or one colour a panel, planted in
        lossy.side_by_side_picture, is found."""
        def alike(drawn):   # a marker or a colour twice in a panel's legend
            return [twin for entries in legends(drawn) for column in zip(*entries)
                    for twin in twins(list(column))]
        self.assertEqual(len(legends(self.drawn["kv-ladder-side-by-side.svg"])), 2)
        self.assertEqual(alike(self.drawn["kv-ladder-side-by-side.svg"]), [])
        for what, replaced in (("every series a circle", "MARKERS"), ("one colour", "COLORS")):
            planting = replacing(lambda node: isinstance(node, ast.Subscript) and isinstance(
                node.value, ast.Attribute) and node.value.attr == replaced,
                lambda node: ast.Subscript(node.value, ast.Constant(0), node.ctx))
            with self.subTest(mistake=what), mock.patch.object(
                    lossy, "side_by_side_picture", plant(lossy, "side_by_side_picture", planting)):
                self.assertTrue(alike(lossy.side_by_side_picture(self.record, None)))

    def test_a_legend_shows_only_what_is_drawn(self):
        """No legend entry without a mark: kv-batches.svg names "not run" only when a run is
        missing, and then marks it; the entry shown always (planted) is found."""
        for name, drawn in self.drawn.items():
            with self.subTest(name):
                self.assertEqual(legend_problems(drawn), [])
        runs = self.record["batched_decode"]["runs"]
        missing = copy.deepcopy(self.record)
        del missing["batched_decode"]["runs"][next(
            i for i, run in enumerate(runs) if run["pool"] == "ample")]
        drawn = kernel_runs.stories_picture(missing, None)
        self.assertEqual(legend_problems(drawn), [])
        self.assertEqual([title for element, title in marks(drawn)
                          if element.get("class") == "cross"], [
            f"{runs[0]['kernel']}, batches of up to {runs[0]['max_batch']}: not run"] * 2)
        self.assertNotIn("not run", self.drawn["kv-batches.svg"])
        always = replacing(lambda node: isinstance(node, ast.Name) and node.id == "not_run"
                           and isinstance(node.ctx, ast.Load), lambda node: ast.Constant(True))
        with mock.patch.object(kernel_runs, "stories_picture",
                               plant(kernel_runs, "stories_picture", always)):
            self.assertTrue(legend_problems(kernel_runs.stories_picture(self.record, None)))

    def test_a_rung_without_its_axis_is_refused_naming_it(self):
        """A rung whose positions kept or bytes a position is null (which the ladder's
        declaration lets through, for the other panel) cannot be placed: refused, naming it;
        where its stage declares no null, refused by the declaration, naming the key."""
        window = len(lossy.RUNGS) - len(lossy.WINDOWS)   # the ladder's first window
        unplaced, declared = (r"the record's rung '{}' has no {} \(null\)",
                              r"the record's {2}.rungs\[0\]\.{1} is None")
        for stage, rung, key, refused in (
                ("ladder", window, "positions_kept", unplaced),
                ("ladder", 1, "bytes_per_position", unplaced),
                ("eviction", 0, "positions_kept", declared),
                ("quantization", 0, "bytes_per_position", declared)):
            record = copy.deepcopy(self.record)
            record[stage]["rungs"][rung][key] = None
            name = re.escape(record[stage]["rungs"][rung]["cache"])
            with self.subTest(stage=stage, key=key), self.assertRaisesRegex(
                    ValueError, "^" + refused.format(name, key, stage)):
                lossy.side_by_side_picture(record, None)

    def test_the_ladder_s_table_refuses_what_no_run_gives_naming_it(self):
        """A count of 10^400 (once an OverflowError) or a rung named by a number in the
        record, or a size that is not a number in the timing: refused, naming the key."""
        for where, key, value in (("ladder", "bytes_per_position", 10 ** 400),
                                  ("ladder", "cache", 5), (None, "cache_bytes_per_position", "x")):
            record, timing = copy.deepcopy(self.record), dict(self.timing)
            (record[where]["rungs"][0] if where else timing)[key] = value
            named = rf"ladder\.rungs\[0\]\.{key}" if where else rf"time\.{key}"
            with self.subTest(key), self.assertRaisesRegex(
                    ValueError, rf"^the record's {named} is"):
                lossy.ladder_table(record, timing)

    def test_more_kinds_than_colours_are_each_drawn_or_refused(self):
        """A kind a picture has no colour left for is drawn all the same, in a colour and
        marker no other has, and named in its legend (the evicting kinds, the 4-layer
        shapes); bars, which have their colour alone, refuse it, naming the record's key.
        Seven colours for the lines, planted in place of the cycle, are found."""
        record = copy.deepcopy(self.record)
        each_its_own_kind = tuple((f"kind {i}", budget)   # eviction.py's declarations
                                  for i, (_, budget) in enumerate(eviction.RUNGS))
        shape = next(s for s in record["deep_models"]["shapes"] if s["layers"] == 4)
        record["deep_models"]["shapes"] += [{**shape, "kv_heads": n} for n in range(5, 12)]
        cut = replacing(lambda node: is_call_of(node, "enumerate"), lambda node: ast.Call(
                ast.Name("zip", ast.Load()), [ast.Call(ast.Name("range", ast.Load()), [
                    ast.Constant(len(svg.COLORS))], []), node.args[0]], []))
        for owner, function, picture, kinds in (
                (lossy, "side_by_side_picture", "side_by_side_picture",   # every module's series
                 lambda: sum(len(module.side_by_side(record)) for module in lossy.keeping_less())),
                (bandwidth, "_cache_lines", "cache_bytes_by_design_picture",
                 lambda: 1 + 2 + 7 + 4)):
            with self.subTest(function), mock.patch.object(eviction, "RUNGS", each_its_own_kind):
                drawn, kinds = getattr(owner, picture)(record, None), kinds()
                self.assertGreater(kinds, len(svg.COLORS))
                self.assertEqual(sum(map(len, legends(drawn))), kinds)
                self.assertEqual(series_problems(drawn), [])
                self.assertEqual(legend_problems(drawn), [])
                with mock.patch.object(owner, function, plant(owner, function, cut)):
                    self.assertLess(sum(map(len, legends(getattr(owner, picture)(record, None)))),
                                    kinds)
        for run in record["batched_decode"]["runs"]:
            run["kernel"] += f" {run['max_batch']}"
        with self.assertRaisesRegex(ValueError, r"^the record's batched_decode\.runs has "
                                                r"\d+ kernels, more than the 7 colours"):
            kernel_runs.stories_picture(record, None)

    def test_every_stage_that_keeps_less_is_drawn_side_by_side(self):
        """A new module of the lab that declares side_by_side is drawn in section 19's
        picture with the others, in its own series; with the modules listed (planted in
        lossy.keeping_less) it is left out, and found."""
        new = types.ModuleType("largest_values")
        rung = {**self.record["eviction"]["rungs"][0], "cache": "largest values, 8 kept"}
        new.side_by_side = lambda record: [lossy.Series("positions_kept", "largest values",
                                                        [rung], False)]
        names = tuple(module.__name__ for module in lossy.keeping_less())   # as found today
        listed = replacing(lambda node: isinstance(node, ast.Return), lambda node: ast.parse(
            f"return [sys.modules[name] for name in {names!r}]").body[0])
        before = sum(map(len, legends(self.drawn["kv-ladder-side-by-side.svg"])))
        with tempfile.TemporaryDirectory() as folder:
            for name in os.listdir(support.HERE):   # the lab's modules, and the new one
                if name.endswith(".py"):
                    shutil.copy(os.path.join(support.HERE, name), folder)
            with open(os.path.join(folder, "largest_values.py"), "w", encoding="utf-8") as f:
                f.write('"""Keep the largest values."""\n\n\ndef side_by_side(record):\n'
                        '    return []\n')
            for found, keeping_less in ((True, lossy.keeping_less),
                                        (False, plant(lossy, "keeping_less", listed))):
                with self.subTest(found=found), \
                        mock.patch.dict(sys.modules, {new.__name__: new}), \
                        mock.patch.object(lossy, "keeping_less",
                                          lambda: keeping_less(folder)):
                    drawn = lossy.side_by_side_picture(self.record, None)
                    self.assertEqual(("largest values, 8 kept: " in drawn,
                                      sum(map(len, legends(drawn)))), (found, before + found))

    def test_the_batch_bars_are_as_high_as_their_counts(self):
        requests = self.record["batched_decode"]["requests"]
        runs = [run for run in self.record["batched_decode"]["runs"] if run["pool"] == "ample"]
        bars = marks(self.drawn["kv-batches.svg"])
        self.assertEqual(len(bars), 2 * len(runs))
        for panel in ("are generate's", "as with batches of 1"):
            self.assert_to_scale([(requests - int(re.search(r": (\d+) of", title)[1]),
                                   float(bar.get("height")))
                                  for bar, title in bars if panel in title
                                  and not title.endswith(f": {requests} of {requests} "
                                                         f"stories {panel}")],
                                 f"kv-batches.svg, stories {panel}")


class HostileRecords(unittest.TestCase):
    """Records edited by hand, or by someone hostile, given to every picture's function."""

    MOST_BYTES = 100_000   # the shipped pictures are about 10 kB

    @classmethod
    def setUpClass(cls):
        cls.record = json.loads(lab_file(documents.TRACE))
        cls.drawings = {name: documents.drawing(name) for text in map(
            lab_file, documents.documents()) for name, _ in documents.PICTURE.findall(text)}

    def drawn_or_refused(self, record):
        """None if every picture of record is a valid SVG of at most MOST_BYTES, or a
        ValueError that names the record's key in a printable line; else what is wrong."""
        for name, draw in self.drawings.items():
            try:
                drawn = draw(record, None)
            except ValueError as refused:
                why = str(refused)
                if not (why.startswith("the record") and why.isprintable() and len(why) < 400):
                    return f"{name} refused it with {why[:400]!r}"
                continue
            if len(drawn.encode("utf-8")) > self.MOST_BYTES:
                return f"{name} drew {len(drawn):,} characters"
            try:
                ET.fromstring(drawn)
            except ET.ParseError as e:
                return f"{name} drew an SVG that is not XML ({e})"
        return None

    def edited(self, **changes):
        """The shipped record with changes ({"batched_decode.requests": value}) made."""
        record = copy.deepcopy(self.record)
        for path, value in changes.items():
            *keys, last = path.split(".")
            inner = record
            for key in keys:
                inner = inner[int(key) if isinstance(inner, list) else key]
            inner[int(last) if isinstance(inner, list) else last] = value
        return record

    def test_a_count_of_a_trillion_draws_a_dozen_ticks_at_most(self):
        for requests in (10 ** 5, svg.LARGEST):
            with self.subTest(requests=requests), timed_out_after(2):
                drawn = documents.drawing("kernel_runs.stories_picture")(
                    self.edited(**{"batched_decode.requests": requests}), None)
                self.assertLessEqual(drawn.count('stroke="#ddd"'), 2 * 12)   # two panels
                self.assertIsNone(self.drawn_or_refused(
                    self.edited(**{"batched_decode.requests": requests})))
        with self.assertRaisesRegex(ValueError, r"^the record's batched_decode\.requests is "
                                                r"1000000000001, not a number from 0 to "):
            documents.drawing("kernel_runs.stories_picture")(
                self.edited(**{"batched_decode.requests": svg.LARGEST + 1}), None)

    def test_the_smallest_records_are_drawn_too(self):
        """A run of one story, one position, one batch: counts of 0 and 1 everywhere."""
        small = {"positions": 1, "uncached_rows": 1, "cached_rows": 1, "uncached_scores": 1,
                 "cached_scores": 1}
        record = self.edited(**{"cost_by_length": [small], "batched_decode.requests": 1,
                                "ladder.stories": 1, "deep_models.positions": 1,
                                "cache_floats_per_position": 1})
        for run in record["batched_decode"]["runs"]:
            run.update(stories_identical_to_generate=1, stories_identical_to_batches_of_1=0)
        for rung in record["ladder"]["rungs"]:
            rung.update(largest_logit_gap=0, greedy_stories_changed=0, positions_kept=1)
        self.assertIsNone(self.drawn_or_refused(record))
        for name, draw in self.drawings.items():
            with self.subTest(name):
                self.assertGreater(len(marks(draw(record, None))), 3)

    def test_a_shape_the_lab_did_not_ship_is_drawn_and_named(self):
        shape = next(i for i, shape in enumerate(self.record["deep_models"]["shapes"])
                     if shape["layers"] == 4 and shape["kv_heads"] == 2)
        drawn = documents.drawing("bandwidth.cache_bytes_by_design_picture")(
            self.edited(**{f"deep_models.shapes.{shape}.kv_heads": 3}), None)
        self.assertIn("4 layers, grouped-query 3: 512 B", drawn)

    def test_control_characters_and_markup_in_a_story_make_valid_xml(self):
        kernel = "a\x00\x1b[2J</text><script>\ud800\ufffe&amp;"
        drawn = documents.drawing("kernel_runs.stories_picture")(
            self.edited(**{"batched_decode.runs.0.kernel": kernel}), None)
        titles = [title for _, title in marks(drawn)]
        self.assertIn("a\\x00\\x1b[2J</text><script>\\ud800\\ufffe&amp;, batches of up to 1: "
                      "59 of 60 stories are generate's", titles)
        drawn = documents.drawing("lossy.ladder_picture")(
            self.edited(**{"ladder.rungs.0.cache": "x" * 10 ** 6}), None)
        self.assertIn(f"{'x' * 199}…", drawn)
        self.assertLess(len(drawn), self.MOST_BYTES)

    def test_random_hostile_edits_draw_a_small_valid_picture_or_are_refused(self):
        """Random edits of what the pictures read in kv-trace.json: numbers huge, negative,
        NaN or infinite; texts with control characters, markup or a million characters;
        keys missing; values of another type; lists emptied or long. Each case has 2 s."""
        read = ("batched_decode", "ladder", "deep_models", "cost_by_length",
                "cache_floats_per_position")
        wild = [10 ** 12, 10 ** 12 + 1, 10 ** 400, -1, -1e-300, 0, 0.5, math.nan, math.inf,
                -math.inf, True, None, "3", "\x1b[2J<b>&\x00", "é\ud800" * 10 ** 5, [], {},
                [0] * 10 ** 5]

        def reaches(inner, key):
            return (isinstance(inner, dict) and key in inner or isinstance(inner, list)
                    and isinstance(key, int) and key < len(inner))
        shipped = [path for key in read for path in paths(self.record[key], (key,))]

        def trial(number):
            rng = random.Random(number)
            record = {key: copy.deepcopy(self.record[key]) for key in read}
            for _ in range(rng.randint(1, 4)):
                *keys, last = rng.choice(shipped)
                inner = record
                for key in keys:
                    inner = inner[key] if reaches(inner, key) else None
                if not reaches(inner, last):   # an earlier edit took the path away
                    continue
                if rng.random() < 0.2 and isinstance(inner, dict):
                    del inner[last]
                elif rng.random() < 0.2 and isinstance(inner[last], list):
                    inner[last] = inner[last][:64] * rng.choice((0, 2, 7, 100))
                else:
                    inner[last] = rng.choice(wild)
            with timed_out_after(2):
                return self.drawn_or_refused(record)
        support.check_random_cases(self, 100, trial)


@contextlib.contextmanager
def timed_out_after(seconds):
    """Raise TimeoutError in a block still running after seconds (POSIX; elsewhere, no
    limit), so that a picture that would never end fails its case."""
    def stop(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    if not hasattr(signal, "setitimer"):
        yield
        return
    handler = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)


if __name__ == "__main__":
    unittest.main()
