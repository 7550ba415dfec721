"""The README's pictures: each file is what pictures.py draws from the recorded
kv-trace.json, valid SVG, shown in the README with a caption, and drawn to scale."""
import json
import re
import unittest
import xml.etree.ElementTree as ET

import figures
import pictures
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
        cls.record = json.loads(lab_file(figures.TRACE))
        cls.drawn = {name: draw(cls.record) for name, draw in pictures.PICTURES.items()}

    def test_every_picture_is_what_the_record_draws(self):
        for name, svg in self.drawn.items():
            with self.subTest(name):
                shown = lab_file(name).splitlines()
                wanted = svg.splitlines()
                first = next((i for i, (a, b) in enumerate(zip(shown, wanted)) if a != b),
                             min(len(shown), len(wanted)))
                self.assertEqual(shown, wanted, f"{name}, its line {first + 1}, is not what "
                                 f"pictures.py draws from {figures.TRACE}: run python3 "
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

    def test_the_readme_shows_each_picture_once_with_a_caption(self):
        text = lab_file(figures.README)
        shown = re.findall(r"^!\[[^\]]+\]\(([^)]+)\)\n\n(.+(?:\n.+)*)", text, re.M)
        self.assertEqual(sorted(name for name, _ in shown), sorted(pictures.PICTURES),
                         "each picture once, on a line of its own, its caption after a blank "
                         "line")
        for name, caption in shown:
            with self.subTest(name):
                self.assertRegex(caption, r"^\*[^*]+\*$", "the caption: a paragraph in italics")
                self.assertIn(name, caption, "the caption names the file")
                self.assertEqual(text.count(f"]({name})"), 1)

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
