"""Cache files (cache_files.py): a saved cache loads bit for bit, in this process or
another, and continues exactly; what is not a cache of these weights is refused, naming
the file."""
import ast
import copy
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import cache_files
import generate
import lossy
import model
import support
import verdicts
from instruments import replacing, where_raised
from kv_cache import KVCache, feed, generate_cached
from random_models import random_model
from support import OPENINGS, PARAMS, STORIES, TOK, assert_equal, filled_cache, snapshot
from verdicts import Layer, Wrong, step, where_cache_differs


LAYER = Layer("cache_files", "cache files (cache_files.py)", ("lesson", "paged", "lossy"))


def setUpModule():
    verdicts.set_up("cache_files")   # skips if a layer under it is wrong; runs from elsewhere


tearDownModule = support.tear_down
def refusal(error, path):
    """What a refusal of the file at path says, without the file's name it opens with."""
    return str(error).replace(f"{path}: ", "")


def saved_and_loaded(params, cache, path, label):
    """The cache load_cache gives for params from the file save_cache writes of cache at
    path, and None; or None and a Wrong: the cache loaded is not the one saved, or load_cache
    refused it (the file named "the file")."""
    step(f"{label}: saving it (save_cache; expected: it saves every cache that stores exactly)")
    cache_files.save_cache(cache, path)
    step(f"{label}: loading it (load_cache; expected: the very cache saved)")
    try:
        loaded = cache_files.load_cache(params, path)
    except ValueError as refused:
        return None, Wrong(f"{label}: load_cache refused the file save_cache wrote: "
                           f"{refusal(refused, path)}",
                           f"  fed: token IDs {list(cache.tokens)}")
    return loaded, where_cache_differs(f"{label}, saved and loaded", loaded, cache, "the file")


TAMPERED = 3   # the position whose value _cache_files changes in a file, signed again


def where_another_model_s_file_loads(path):
    """None if load_cache, given the trained weights, refuses the file at path (another
    model's cache of the first opening) as computed with other weights; else a Wrong."""
    step("loading another model's file with the trained weights (expected: refused, as "
         "computed with other weights)")
    try:
        cache_files.load_cache(PARAMS, path)
        return Wrong("another model's file (random weights) of the first opening loaded "
                     "with the trained weights, where load_cache must refuse it")
    except ValueError as refused:
        if "other weights" not in str(refused):
            return Wrong(f"another model's file (random weights) of the first opening was "
                         f"refused by the trained weights, but not as computed with other "
                         f"weights: {refusal(refused, path)}")
    return None


def where_a_tampered_file_loads(story_file, tampered_file):
    """None if load_cache refuses, naming position TAMPERED, the first test story's file
    (story_file) with the value of that position changed in its last bit and signed again
    (written to tampered_file); else a Wrong."""
    step(f"the first test story's file with the value of position {TAMPERED} changed and "
         f"signed again (expected: refused, naming position {TAMPERED})")
    with open(story_file, encoding="utf-8") as f:
        record = json.load(f)
    value = record["values"][TAMPERED]
    value[0] = math.nextafter(value[0], math.inf)
    record["content"] = cache_files.content_signature(record["tokens"], record["keys"],
                                                      record["values"])
    with open(tampered_file, "w", encoding="utf-8") as f:
        json.dump(record, f)
    try:
        cache_files.load_cache(PARAMS, tampered_file)
        return Wrong(f"the first test story's file with the value of position {TAMPERED} "
                     f"changed in its last bit and signed again loaded, where load_cache "
                     f"must refuse it (it computes every key and value again)")
    except ValueError as refused:
        if f"position {TAMPERED}" not in str(refused):
            return Wrong(f"the first test story's file with the value of position "
                         f"{TAMPERED} changed and signed again was refused without naming "
                         f"position {TAMPERED}: {refusal(refused, tampered_file)}")
    return None


def quick_check():
    """Caches saved to a file and loaded: the first test story's KVCache, a paged sequence
    (blocks of 4) of a whole context (the test stories' first 64 tokens), another model's
    (random weights) KVCache of the first opening, each load as the very cache; the other
    model's file is refused by the trained weights as computed with other weights; a file
    with the value of position TAMPERED changed in its last bit, and signed again, is
    refused, naming that position."""
    import paged
    story = TOK.encode(STORIES[0])
    context = [t for text in STORIES for t in TOK.encode(text)][:model.CONTEXT]
    other = random_model(random.Random(0), 1.0, 1.0)
    pool = paged.BlockPool(PARAMS, model.CONTEXT // 4, 4)
    cases = ((f"the first test story's cache ({len(story)} positions)", PARAMS, KVCache(PARAMS),
              story),
             (f"a paged sequence (blocks of 4) of the test stories' first {len(context)} "
              f"tokens, a whole context", PARAMS, pool.sequence(), context),
             ("another model's cache (random weights) of the first opening", other,
              KVCache(other), TOK.encode(OPENINGS[0])))
    with tempfile.TemporaryDirectory() as folder:
        story_file, context_file, other_file, tampered_file = (
            os.path.join(folder, f"{name}.json") for name in ("story", "context", "other",
                                                              "tampered"))
        for (label, params, cache, ids), file in zip(cases, (story_file, context_file,
                                                             other_file)):
            step(f"{label}: feeding it")
            feed(params, cache, ids)
            _, why = saved_and_loaded(params, cache, file, label)
            if why:
                return why
        why = (where_another_model_s_file_loads(other_file)
               or where_a_tampered_file_loads(story_file, tampered_file))
    return why


QuickCheck = verdicts.quick_check_case("cache_files", __name__)


def attributes(node):
    """The names of the attributes a tuple of attributes reads (cache.tokens, ...), or []."""
    return ([getattr(e, "attr", None) for e in node.elts] if isinstance(node, ast.Tuple)
            else [])


SAVED_SWAPPED = replacing(   # cache.tokens, cache.keys, cache.values: keys and values swapped
    lambda node: attributes(node) == ["tokens", "keys", "values"],
    lambda node: ast.Tuple([node.elts[0], node.elts[2], node.elts[1]], ast.Load()))
LOADED_SWAPPED = replacing(   # cache.extend(tokens, keys, values): (tokens, values, keys)
    lambda node: (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "extend" and len(node.args) == 3),
    lambda node: ast.Call(node.func, [node.args[0], node.args[2], node.args[1]], []))
A_FULL_CONTEXT_TOO_LONG = replacing(   # len(tokens) == ... <= model.CONTEXT: < model.CONTEXT
    lambda node: isinstance(node, ast.Compare) and any(
        getattr(c, "attr", None) == "CONTEXT" for c in node.comparators),
    lambda node: ast.Compare(node.left, [ast.Lt() if isinstance(op, ast.LtE) else op
                                         for op in node.ops], node.comparators))
ONLY_THE_KEYS_COMPUTED_AGAIN = replacing(   # linear(...) != k or linear(...) != v: != k only
    lambda node: isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or),
    lambda node: node.values[0])
SIGNATURE_OF_THE_NAMES = replacing(   # [params[name] for name in sorted(params)]: sorted(params)
    lambda node: (isinstance(node, ast.ListComp) and isinstance(node.generators[0].iter, ast.Call)
                  and getattr(node.generators[0].iter.func, "id", None) == "sorted"),
    lambda node: node.generators[0].iter)
ONLY_A_KVCACHE_SAVED = replacing(   # isinstance(cache, KVCache): type(cache) is KVCache
    lambda node: (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
                  and getattr(node.args[1], "id", None) == "KVCache"),
    lambda node: ast.Compare(ast.Call(ast.Name("type", ast.Load()), node.args[:1], []),
                             [ast.Is()], node.args[1:]))

MISTAKES = [
    ("keys saved as values and values as keys", cache_files, "save_cache", SAVED_SWAPPED,
     r"the first test story's cache.*: load_cache refused the file save_cache wrote: .*"
     r"position 0"),
    ("keys loaded as values and values as keys", cache_files, "load_cache", LOADED_SWAPPED,
     r"the first test story's cache.*: its keys, at position 0, number 0: \S+ from the file, "
     r"\S+ expected"),
    ("a whole context refused as too long", cache_files, "_cache_problem",
     A_FULL_CONTEXT_TOO_LONG, r"64 tokens.*: load_cache refused the file save_cache wrote: "
                              r".*64 tokens, 64 keys and 64 values"),
    ("only the keys computed again", cache_files, "_not_computed", ONLY_THE_KEYS_COMPUTED_AGAIN,
     r"the value of position 3 changed.*loaded"),
    ("a paged sequence refused, as if only a KVCache could be saved", cache_files,
     "save_cache", ONLY_A_KVCACHE_SAVED,
     r"a paged sequence .*: saving it .*raised ValueError: save_cache saves .*PagedSequence"),
    ("the weights signed by their names only", cache_files, "weights_signature",
     SIGNATURE_OF_THE_NAMES, r"another model's file.*refused.*not as computed with other weights"),
]


class Teeth(unittest.TestCase):
    """Each mistake, planted in the real cache_files.py (by its syntax tree), makes the
    layer's quick check fail, naming the cache, the part and the position."""

    def test_each_mistake_is_named_by_the_quick_check(self):
        verdicts.assert_verdicts(self, "cache_files", MISTAKES)


def refused(test, load, what):
    """The message of the ValueError load() raises; else a failure saying it loaded what
    (or raised another exception, from where), where a refusal was expected."""
    try:
        load()
    except ValueError as refusal:
        return str(refusal)
    except Exception as error:   # a refusal that is not the one expected
        test.fail(f"loading {what} raised {support.raised(error)}{where_raised(error)}, where a "
                  f"ValueError naming the file was expected")
    test.fail(f"{what} loaded, where load_cache must refuse it, naming the file")


class CacheFiles(unittest.TestCase):
    """A cache saved to a file and loaded again, here or in another process, continues
    exactly; every file that is not a cache of these weights is refused, naming it."""

    def setUp(self):
        self.folder = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.folder.name, "cache.json")

    def tearDown(self):
        self.folder.cleanup()

    def test_a_loaded_cache_continues_exactly_and_loads_for_a_copy_of_the_weights(self):
        """(That it loads bit for bit, a KVCache and a paged sequence: the quick check.)"""
        ids = TOK.encode(OPENINGS[0])
        cache_files.save_cache(filled_cache(ids), self.path)
        loaded = cache_files.load_cache(PARAMS, self.path)
        self.assertEqual(generate_cached(PARAMS, TOK, OPENINGS[0], cache=loaded),
                         generate.generate(PARAMS, TOK, OPENINGS[0]))
        twin = copy.deepcopy(PARAMS)   # the same weights: the same signature, the same keys
        self.assertEqual(len(cache_files.load_cache(twin, self.path)), len(ids))

    def test_a_cache_loaded_in_another_process_continues_every_opening(self):
        """Greedy for six openings, sampled too for the first (the trace saves every
        opening's cache; this is the one test that loads them in another process)."""
        for index, prompt in enumerate(OPENINGS[:6]):
            cache_files.save_cache(filled_cache(TOK.encode(prompt)),
                               os.path.join(self.folder.name, f"{index}.json"))
        script = (
            "import json, sys; sys.path.insert(0, sys.argv[1])\n"
            "import cache_files, generate, kv_cache, stories\n"
            "params, tok = generate.load_trained()\n"
            "prompts = stories.openings(stories.split_stories(open(sys.argv[1] + "
            "'/corpus.txt').read())[2])[:6]\n"
            "print(json.dumps([kv_cache.generate_cached(params, tok, prompt, temperature=t, "
            "seed=i, cache=cache_files.load_cache(params, f'{sys.argv[2]}/{i}.json')) "
            "for i, prompt in enumerate(prompts) for t in ((0.0, 1.0) if i == 0 else (0.0,))]))\n")
        done = subprocess.run([sys.executable, "-c", script, support.HERE,
                               self.folder.name], capture_output=True, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)
        never_saved = [generate_cached(PARAMS, TOK, prompt, temperature=t, seed=i,
                                       cache=filled_cache(TOK.encode(prompt)))
                       for i, prompt in enumerate(OPENINGS[:6])
                       for t in ((0.0, 1.0) if i == 0 else (0.0,))]
        results = json.loads(done.stdout)
        self.assertEqual(len(results), 7)   # six openings greedy, the first sampled too
        for result, expected in zip(results, never_saved):
            if result != expected:
                self.fail(f"a loaded cache continued as {result['text']!r}, the never-saved "
                          f"one as {expected['text']!r}")

    def test_what_is_not_a_cache_of_these_weights_is_refused_naming_the_file(self):
        cache_files.save_cache(filled_cache(TOK.encode(OPENINGS[0])), self.path)
        with open(self.path, encoding="utf-8") as f:
            good = json.load(f)
        other = copy.deepcopy(PARAMS)
        other["b_out"][0] = math.nextafter(other["b_out"][0], math.inf)   # one last bit
        bad_files = {
            "not valid JSON": json.dumps(good)[:-40],                        # truncated
            "not a KV cache file of this lab": json.dumps(dict(good, format="kv-lab-cache-1")),
            "not the ones it was saved with": json.dumps(dict(good, tokens=[80]
                                                              + good["tokens"][1:])),
            "not the ones it was saved with ": json.dumps(dict(good, keys=[
                [math.nextafter(good["keys"][0][0], 0.0)] + good["keys"][0][1:]]
                + good["keys"][1:])),
            "not a KV cache file of this lab (RecursionError": "[" * 100000 + "]" * 100000,
            "larger than 16,777,216 bytes": " " * (16 * 1024 * 1024 + 1),
            "a corrupted cache file: 15 tokens, 15 keys and 14 values":
                json.dumps(dict(good, values=good["values"][:-1])),
            "the key of position 3 is not 16 finite floats":
                json.dumps(dict(good, keys=good["keys"][:3] + [good["keys"][3][:15]]
                                + good["keys"][4:])),
            "the token at position 0 is 96, outside the vocabulary":
                json.dumps(dict(good, tokens=[96] + good["tokens"][1:])),
        }
        self.assertEqual(len(good["tokens"]), 15)
        for fragment, text in bad_files.items():
            with self.subTest(fragment=fragment):
                with open(self.path, "w", encoding="utf-8") as f:
                    f.write(text)
                refusal = refused(self, lambda: cache_files.load_cache(PARAMS, self.path),
                                  f"a file {fragment.strip()}")
                self.assertIn(self.path, refusal)
                self.assertIn(fragment.strip(), refusal)
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(good, f)
        with self.assertRaisesRegex(ValueError, "computed with other weights .* stale logits"):
            cache_files.load_cache(other, self.path)
        with self.assertRaisesRegex(ValueError, "not a KV cache file of this lab"):
            cache_files.load_cache(PARAMS, os.path.join(support.HERE, "best.json"))
        with self.assertRaises(FileNotFoundError):
            cache_files.load_cache(PARAMS, os.path.join(self.folder.name, "missing.json"))
        with self.assertRaisesRegex(ValueError, "params must be a dict"):
            cache_files.weights_signature(None)
        with self.assertRaisesRegex(ValueError, "exact and complete .stores_exactly., and a "
                                                "WindowCache's are not"):
            cache_files.save_cache(lossy.WindowCache(PARAMS, 8), self.path)
        for path, fragment in ((None, "a file name is needed"), (5, "a file name is needed"),
                               (self.folder.name + os.sep, "it names a folder")):
            with self.subTest(path=path), self.assertRaisesRegex(ValueError, fragment):
                cache_files.load_cache(PARAMS, path)
            with self.subTest(path=path), self.assertRaisesRegex(ValueError, fragment):
                cache_files.save_cache(filled_cache([5]), path)
        nowhere = os.path.join(self.folder.name, "no such folder", "cache.json")
        with self.assertRaisesRegex(FileNotFoundError, "cannot write .*the folder .* does "
                                                       "not exist"):
            cache_files.save_cache(filled_cache([5]), nowhere)

    def test_a_file_edited_with_its_signature_computed_again_is_refused(self):
        """The content signature is no secret: a token changed, and the signature computed
        again, would load a cache that continues otherwise than generate. Every key and
        value is computed again from its token and position, and compared."""
        cache_files.save_cache(filled_cache(TOK.encode(OPENINGS[1])), self.path)
        with open(self.path, encoding="utf-8") as f:
            record = json.load(f)
        record["tokens"][3] = (record["tokens"][3] + 1) % 96
        record["content"] = cache_files.content_signature(record["tokens"], record["keys"],
                                                          record["values"])
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(record, f)
        with self.assertRaisesRegex(ValueError, "the key or value of position 3 is not what "
                                                "these weights compute for its token there"):
            cache_files.load_cache(PARAMS, self.path)

    def test_a_file_of_positions_out_of_order_is_refused(self):
        """A file holds no positions, only rows in order. What refuses rows out of order
        is load_cache computing each key and value again from its token and its place in
        the file: a reversed cache saves, and its file is refused; a good file's rows
        reordered are refused by the content signature and, signed again, by that same
        recomputation."""
        ids = TOK.encode(OPENINGS[1])
        refused = "the key or value of position 0 is not what these weights compute"
        cache_files.save_cache(support.stored_in_reverse(ids), self.path)
        with self.assertRaisesRegex(ValueError, refused):
            cache_files.load_cache(PARAMS, self.path)
        cache_files.save_cache(filled_cache(ids), self.path)
        with open(self.path, encoding="utf-8") as f:
            record = json.load(f)
        rows = record["tokens"], record["keys"], record["values"]
        for part in rows:
            part.insert(0, part.pop())          # the last position first
        for fragment, content in (("not the ones it was saved with", record["content"]),
                                  (refused, cache_files.content_signature(*rows))):
            with open(self.path, "w", encoding="utf-8") as f:
                json.dump(dict(record, content=content), f)
            with self.subTest(fragment=fragment), self.assertRaisesRegex(ValueError, fragment):
                cache_files.load_cache(PARAMS, self.path)

    def test_an_edit_of_any_one_part_not_signed_again_is_refused_by_the_signature(self):
        """One token, one key's number or one value's number changed in a saved file,
        its signature left as it was: refused as corrupted (the signature covers the
        tokens, the keys and the values), before any key or value is computed again."""
        cache_files.save_cache(filled_cache(TOK.encode(OPENINGS[0])), self.path)
        with open(self.path, encoding="utf-8") as f:
            record = json.load(f)
        for part in ("tokens", "keys", "values"):
            edited = json.loads(json.dumps(record))
            if part == "tokens":
                edited["tokens"][1] = (edited["tokens"][1] + 1) % model.VOCAB_SIZE
            else:
                edited[part][2][3] *= 2   # position 2, number 3
            with open(self.path, "w", encoding="utf-8") as f:
                json.dump(edited, f)
            with self.subTest(part=part), self.assertRaisesRegex(
                    ValueError, "corrupted cache file: its tokens, keys and values are not the "
                                "ones it was saved with"):
                cache_files.load_cache(PARAMS, self.path)

    def test_a_randomly_corrupted_file_loads_exactly_or_is_refused_naming_it(self):
        """Case n changes the saved file with random.Random(n): one character replaced,
        a piece cut out, or a piece copied elsewhere. Every load gives exactly the saved
        cache or a ValueError naming the file."""
        cache = filled_cache(TOK.encode(OPENINGS[1]))
        cache_files.save_cache(cache, self.path)
        with open(self.path, encoding="utf-8") as f:
            saved = f.read()
        loaded_exactly = refused = 0

        def check(index):
            nonlocal loaded_exactly, refused
            rng = random.Random(index)
            at, end = sorted(rng.randrange(len(saved)) for _ in range(2))
            how = rng.choice(("replace", "cut", "copy", "re-signed"))
            if how == "re-signed":   # a token, key or value changed, and the signature too
                record = json.loads(saved)
                part = rng.choice(("tokens", "keys", "values"))
                position = rng.randrange(len(record[part]))
                if part == "tokens":
                    record[part][position] = (record[part][position] + 1) % 96
                else:
                    record[part][position][rng.randrange(16)] += rng.choice((1e-16, 0.5))
                record["content"] = cache_files.content_signature(
                    record["tokens"], record["keys"], record["values"])
                text = json.dumps(record)
            elif how == "replace":
                text = saved[:at] + rng.choice('0123456789.,-e[]{}":ab ') + saved[at + 1:]
            elif how == "cut":
                text = saved[:at] + saved[end:]
            else:
                where = rng.randrange(len(saved))
                text = saved[:where] + saved[at:end] + saved[where:]
            with open(self.path, "w", encoding="utf-8") as f:
                f.write(text)
            try:
                loaded = cache_files.load_cache(PARAMS, self.path)
            except ValueError as e:
                refused += 1
                return None if self.path in str(e) else f"a refusal without the file: {e}"
            loaded_exactly += 1
            if snapshot(loaded) != snapshot(cache):
                return f"{how} at {at}: it loaded, but not as the saved cache"
            return None
        if len(support.check_random_cases(self, 50, check)) >= 50:
            self.assertGreater(refused, 0)   # some corruptions were refused

    def test_a_failed_write_keeps_the_previous_file(self):
        cache_files.save_cache(filled_cache(TOK.encode(OPENINGS[0])), self.path)
        with open(self.path, encoding="utf-8") as f:
            previous = f.read()
        with mock.patch("lab_files.os.replace", side_effect=OSError("disk full")), \
                self.assertRaises(OSError, msg="save_cache with os.replace failing: it writes "
                                               "through lab_files.write_atomically"):
            cache_files.save_cache(filled_cache(TOK.encode(OPENINGS[1])), self.path)
        with open(self.path, encoding="utf-8") as f:
            if f.read() != previous:   # not assertEqual: it would print both files
                self.fail("a failed save_cache changed the file it was to replace")
        self.assertEqual(os.listdir(self.folder.name), ["cache.json"],
                         "the folder's files after a failed save_cache (no temporary file left)")

    def test_the_command_line_saves_and_continues_and_refuses_in_one_line(self):
        def run(*args):
            return subprocess.run([sys.executable, os.path.join(support.HERE, "cache_files.py"),
                                   *args], capture_output=True, text=True, timeout=120)
        saved = run("zoe went to the park.", "--save-cache", self.path)
        loaded = run("zoe went to the park.", "--load-cache", self.path)
        for done in (saved, loaded):
            self.assertEqual(done.returncode, 0, done.stderr)
            self.assertEqual(done.stdout.splitlines()[-1:],
                             ["identical to the uncached generator: yes"],
                             f"the command's last line; it wrote:\n{done.stdout}{done.stderr}")
        self.assertIn("continued from 14 positions of", loaded.stdout)
        refused = run("tom was sad.", "--load-cache", self.path)
        self.assertEqual((refused.returncode, len(refused.stderr.splitlines())), (1, 1))
        self.assertIn("the cache is not a prefix of the prompt", refused.stderr)
        self.assertEqual(run("zoe went to the park.").returncode, 2)   # one flag is required


class AsksTheProtocol(unittest.TestCase):

    def test_save_cache_saves_what_stores_exactly_and_refuses_the_rest(self):
        """A float64 QuantizedCache stores exactly, so its file loads as the same cache;
        the other formats and a window do not, and nothing is written for them."""
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "cache.json")
            ids = TOK.encode(OPENINGS[0])
            for cache in (*(lossy.QuantizedCache(PARAMS, fmt) for fmt in lossy.FORMATS),
                          lossy.WindowCache(PARAMS, 8)):
                feed(PARAMS, cache, ids)
                with self.subTest(cache=type(cache).__name__, fmt=getattr(cache, "format", None)):
                    if cache.stores_exactly:
                        cache_files.save_cache(cache, path)
                        assert_equal(self, snapshot(cache_files.load_cache(PARAMS, path)),
                                     snapshot(filled_cache(ids)), "the loaded cache")
                        os.remove(path)
                    else:
                        with self.assertRaisesRegex(ValueError, "exact and complete"):
                            cache_files.save_cache(cache, path)
                        self.assertEqual(os.listdir(folder), [], "the files written")


if __name__ == "__main__":
    unittest.main()
