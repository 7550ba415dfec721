"""The documents' pictures: each file a document marks (<!--picture MODULE.NAME-->) is what
that function draws from the recorded kv-trace.json, valid SVG, shown once with a
caption, and drawn to scale."""
import json
import re
import unittest
import xml.etree.ElementTree as ET

import documents
from support import lab_file

SVG = "{http://www.w3.org/2000/svg}"


def marks(svg):
    """(element, its title) for every drawn figure of an SVG text: the dots and bars."""
    root = ET.fromstring(svg)
    return [(element, element.find(f"{SVG}title").text) for element in root.iter()
            if element.tag in (f"{SVG}circle", f"{SVG}rect")
            and element.find(f"{SVG}title") is not None]


class Pictures(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.record = json.loads(lab_file(documents.TRACE))
        cls.timing = json.loads(lab_file(documents.TIMES))
        cls.texts = {name: lab_file(name) for name in documents.documents()}
        cls.drawn = {}
        for text in cls.texts.values():
            cls.drawn.update(documents.pictures(text, cls.record, cls.timing))

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


if __name__ == "__main__":
    unittest.main()
