"""The stories (stories.py): the split into training, validation and test stories, and
the scoring of a story against the rules the corpus itself keeps."""
import os
import unittest
from unittest import mock

import stories
from bpe import Tokenizer
from checkpoint import CONFIG

HERE = os.path.dirname(os.path.abspath(__file__))


def read(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


class SplitTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.text = read("corpus.txt")
        cls.stories = cls.text.splitlines(keepends=True)
        cls.splits = stories.split_stories(cls.text)

    def test_exactly_60_test_stories(self):
        self.assertEqual(len(self.splits[2]), 60)

    def test_no_story_is_in_two_splits(self):
        train_set, val_set, test_set = (set(s) for s in self.splits)
        self.assertEqual(train_set & val_set, set())
        self.assertEqual(train_set & test_set, set())
        self.assertEqual(val_set & test_set, set())

    def test_the_splits_together_are_all_the_stories(self):
        together = self.splits[0] + self.splits[1] + self.splits[2]
        self.assertEqual(len(together), len(self.stories))
        self.assertTrue(sorted(together) == sorted(self.stories))

    def test_every_story_ends_with_a_newline(self):
        for split in self.splits:
            for story in split:
                self.assertTrue(story.endswith("\n"), repr(story))
                self.assertEqual(story.count("\n"), 1, repr(story))

    def test_split_is_deterministic(self):
        again = stories.split_stories(self.text)
        for name, first, second in zip(("train", "val", "test"), self.splits, again):
            self.assertTrue(first == second, f"the {name} split differs between two calls")

    def test_the_split_depends_on_split_seed_only(self):
        with mock.patch.dict(CONFIG, seed=CONFIG["seed"] + 1):
            self.assertEqual(stories.split_stories(self.text), self.splits)
        with mock.patch.dict(CONFIG, split_seed=CONFIG["split_seed"] + 1):
            self.assertNotEqual(stories.split_stories(self.text)[2], self.splits[2])

    def test_a_corpus_too_small_for_the_split_is_refused(self):
        need = CONFIG["test_stories"] + CONFIG["val_stories"] + 1
        enough = "".join(self.stories[:need])
        train_set, _, _ = stories.split_stories(enough)
        self.assertEqual(len(train_set), 1)
        with self.assertRaises(ValueError):
            stories.split_stories("".join(self.stories[:need - 1]))
        with self.assertRaises(ValueError):
            stories.split_stories("")

    def test_a_corpus_with_an_unfinished_or_empty_line_is_refused(self):
        text = "".join(self.stories)
        for bad in (text.rstrip("\n"), text + "\n", "\n" + text):
            with self.assertRaisesRegex(ValueError, "one story per line"):
                stories.split_stories(bad)


class StoryAgreementTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.text = read("corpus.txt")
        cls.rules = stories.corpus_rules(cls.text)
        cls.tok = Tokenizer.load(os.path.join(HERE, "tokenizer.json"))
        cls.tiny = stories.corpus_rules(
            "mia found a shell. she took it home.\n"
            "tom made a cake for his mom. she said thank you.\n"
            "ana made a cup for her dad. he said thank you.\n"
            "ana lost her hat. she found it.\n"
            "it began to rain. tom ran home with his dog.\n"
            "it began to rain. mia ran home with her cat.\n")

    def test_story_quality_counts_each_kind_of_pronoun(self):
        made_up = ["mia lost her red ball. she found it under the bed.\n",   # a clue; right
                   "emma went to the park. he saw a duck there.\n",          # only the name; wrong
                   "tom went to the zoo. he saw a lion there.\n",            # only the name; right
                   "zoe made a hat for her friend. she said thank you.\n"]   # the friend's; wrong
        even = [[[1 / (p + 1)] * (p + 1) for p in range(len(self.tok.encode(s)))]
                for s in made_up]
        openings = [story[:story.index(". ") + 1] for story in made_up]
        results = {kind: [{"text": story, "steps": [
            {"token": self.tok.vocab[t]} for t in self.tok.encode(story[len(opening):])]}
            for story, opening in zip(made_up, openings)] for kind in ("greedy", "sampled")}
        results["weights"] = {"greedy": even, "sampled": even}
        quality = stories.story_quality(self.tok, self.text, openings,
                                         results)["greedy"]
        self.assertEqual((quality["pronouns_referring_to_the_name"], quality["agreeing"]), (3, 2))
        self.assertEqual(quality["agreeing_by_opening"], {
            "with a pronoun": {"pronouns": 1, "agreeing": 1},
            "with only the name": {"pronouns": 2, "agreeing": 1}})
        self.assertEqual(quality["pronouns_referring_to_a_person"], {"pronouns": 1, "agreeing": 0})
        self.assertEqual(quality["stories_with_a_wrong_pronoun"], [made_up[1], made_up[3]])
        self.assertEqual(quality["first_three_right_where_only_the_name_tells"], [made_up[2]])

    def test_attention_on_the_name_is_read_where_each_pronoun_was_chosen(self):
        """Made-up rows of weights: position p puts p / 100 on position 0 (the name) and
        1.0 on every other, so each pronoun's figure shows which row and positions it read.
        Here the model wrote "and" letter by letter, where the text's own encoding has one
        token: the tokens it saw, not the text, decide which row chose "he"."""
        story = "mia was sad. tom gave her a hug, and he smiled.\n"
        seen = (self.tok.encode("mia was sad. tom gave her a hug, ")
                + [self.tok.ids[c] for c in "and"] + self.tok.encode(" he smiled.\n"))
        self.assertEqual(len(seen), len(self.tok.encode(story)) + 2)
        rows = [[p / 100] + [1.0] * p for p in range(len(seen))]
        her = len(self.tok.encode("mia was sad. tom gave "))       # the token index of "her"
        he = len(self.tok.encode("mia was sad. tom gave her a hug, ")) + 4
        score = stories.story_agreement(story, self.rules)
        self.assertEqual(stories.attention_on_the_name(self.tok, [seen], [score], [rows]), {
            "agreeing": {"pronouns": 1, "mean_weight_on_the_name": round((her - 1) / 100, 4),
                         "even_share": round(1 / her, 4)},
            "wrong": {"pronouns": 1, "mean_weight_on_the_name": round((he - 1) / 100, 4),
                      "even_share": round(1 / he, 4)}})

    def score(self, story):
        result = stories.story_agreement(story, self.rules)
        return result["pronouns"], result["agreeing"], result["unknown_words"]

    def test_rules_come_from_the_corpus_text(self):
        self.assertEqual(self.tiny["names"], {"mia": "she", "tom": "he", "ana": "she"})
        self.assertEqual(self.tiny["people"], {"mom": "she", "dad": "he"})
        self.assertIn("shell", self.tiny["words"])
        self.assertIn("rain", self.tiny["words"])
        self.assertNotIn("sister", self.tiny["words"])
        self.assertNotIn(".", self.tiny["words"])

    def test_the_corpus_genders_of_names_and_people(self):
        names, people = self.rules["names"], self.rules["people"]
        self.assertEqual((names["mia"], names["tom"], names["emma"], names["max"]),
                         ("she", "he", "she", "he"))
        self.assertNotIn("it", names)   # "it began to rain ...": pronouns go both ways
        self.assertNotIn("on", names)   # "on a windy day, ..."
        self.assertEqual((people["sister"], people["friend"]), ("she", "he"))

    def test_every_corpus_story_keeps_the_rules(self):
        corpus = self.text.splitlines(keepends=True)
        scores = [stories.story_agreement(story, self.rules) for story in corpus]
        self.assertGreater(sum(score["pronouns"] for score in scores), 500)
        for story, score in zip(corpus, scores):
            self.assertEqual((score["agreeing"], score["unknown_words"]),
                             (score["pronouns"], []), story)

    def test_right_stories_agree(self):
        self.assertEqual(self.score("mia was tired. she went to bed with her cat.\n"),
                         (2, 2, []))
        self.assertEqual(self.score("tom was sad. emma gave him a hug, and he smiled.\n"),
                         (2, 2, []))

    def test_wrong_pronouns_are_counted(self):
        self.assertEqual(self.score("ana went to the shop. he saw a cake there.\n"), (1, 0, []))
        self.assertEqual(self.score("emma was sad. zoe gave her a hug, and he smiled.\n"),
                         (2, 1, []))
        self.assertEqual(self.score("max was tired. she went to bed with his dog.\n"),
                         (2, 1, []))

    def test_a_pronoun_after_a_person_word_is_that_persons(self):
        self.assertEqual(self.score("max made a picture for his sister. she said thank "
                                    "you.\n"), (0, 0, []))
        self.assertEqual(self.score("zoe made a cake for her dad. he said thank you to "
                                    "her.\n"), (1, 1, []))
        for story, agrees in (("max made a picture for his sister. she said thank you.\n", True),
                              ("zoe made a hat for her friend. she said thank you.\n", False)):
            self.assertEqual(stories.story_agreement(story, self.rules)["about_people"],
                             [(story.index(". s") + 2, agrees)])

    def test_without_a_name_first_no_pronoun_refers_to_it(self):
        result = stories.story_agreement("it began to rain at the hill. mia ran home with his "
                                       "fish.\n", self.rules)
        self.assertEqual(result, {"name": None, "pronouns": 0, "agreeing": 0,
                                  "unknown_words": [], "referring": [], "about_people": [],
                                  "clue_in_opening": False})

    def test_each_referring_pronoun_is_located(self):
        story = "emma was sad. zoe gave her a hug, and he smiled.\n"
        referring = stories.story_agreement(story, self.rules)["referring"]
        self.assertEqual(referring, [(story.index("her"), True), (story.index(" he ") + 1, False)])

    def test_a_pronoun_in_the_opening_is_a_clue(self):
        clue = [stories.story_agreement(story, self.rules)["clue_in_opening"] for story in (
            "mia lost her red ball. she found it under the bed.\n",
            "mia went to the park. she saw a duck there.\n",
            "mia went to the park. she saw her duck there.\n")]
        self.assertEqual(clue, [True, False, False])

    def test_only_the_continuation_is_scored(self):
        self.assertEqual(self.score("ben lost her red ball. he found it under the bed.\n"),
                         (1, 1, []))
        self.assertEqual(self.score("mia zorp. she found it.\n"), (1, 1, []))

    def test_words_the_corpus_never_uses_are_listed(self):
        self.assertEqual(self.score("zoe lost her red drum. he found it the ble.\n"),
                         (1, 0, ["ble"]))
        self.assertEqual(self.score("tom was tired. he went to bed bed wi.\n"), (1, 1, ["wi"]))


if __name__ == "__main__":
    unittest.main()
