"""cache_protocol.py: the questions every kind of cache answers (Part 2 on), asked of a
cache of every kind."""
import inspect
import random
import re
import unittest

import model
import support
from cache_protocol import CacheProtocol
from kv_cache import KVCache, feed
from support import OPENINGS, PARAMS, STORIES, TOK, filled_cache
from verdicts import skip_unless_sound


def setUpModule():
    """Every test here runs from another folder than the lab's, as a learner might."""
    support.enter_another_folder()


tearDownModule = support.tear_down


class Protocol(unittest.TestCase):
    """The interface every cache offers, written down once in CacheProtocol's docstring,
    which KVCache inherits and its docstring points to."""

    PROTOCOL = ("params", "columns", "tokens", "keys", "values", "len", "append", "extend",
                "copy", "crop", "free", "room_for", "room_left", "room_owner", "attended", "stored",
                "keeps_every_position", "fixed_once_kept", "stores_exactly", "check_computed_by")

    def test_every_cache_offers_the_whole_documented_protocol(self):
        """CacheProtocol's list names PROTOCOL, and a cache of every kind offers each name;
        its room owner answers room_for and check_room for a list of demands; and
        stores_exactly says whether its keys and values are exactly a KVCache's."""
        for part in ("lossy", "paged"):   # their caches too, once their layers hold
            skip_unless_sound(part)
        import lossy   # here: a Part that fails to import must not stop the lesson's tests
        import paged
        listed = [re.match(r"\w+", name).group()
                  for line in inspect.getdoc(CacheProtocol).splitlines()
                  if re.match(r"  \w", line)
                  for name in re.split(r"  +", line.strip())[0].split(", ")]
        self.assertEqual(tuple(listed), self.PROTOCOL)
        self.assertIn("cache_protocol.py", " ".join(inspect.getdoc(KVCache).split()))
        self.assertTrue(issubclass(KVCache, CacheProtocol))
        ids = TOK.encode(OPENINGS[0])[:10]
        reference = filled_cache(ids)
        caches = [KVCache(PARAMS), paged.BlockPool(PARAMS, 4, 4).sequence(),
                  *(lossy.QuantizedCache(PARAMS, fmt) for fmt in lossy.FORMATS),
                  lossy.WindowCache(PARAMS, 8)]
        for cache in caches:
            with self.subTest(cache=type(cache).__name__, fmt=getattr(cache, "format", None)):
                feed(PARAMS, cache, ids)
                self.assertEqual(len(cache), len(ids))
                self.assertEqual([name for name in self.PROTOCOL
                                  if name != "len" and not hasattr(cache, name)], [])
                owner = cache.room_owner
                self.assertEqual(owner.room_for([(cache, 2)]), cache.room_for(2))
                self.assertIsNone(owner.check_room([(cache, 2)]))
                self.assertEqual(cache.stores_exactly,
                                 (cache.keys, cache.values) == (reference.keys, reference.values))
        self.assertEqual([c.stores_exactly for c in caches],
                         [True, True, True, False, False, False, False, False])


def every_kind(rng):
    """(name, a function giving a new cache) for every kind of cache the lab has (each a
    KVCache), their settings drawn from rng: small, so that a short sequence evicts, wraps,
    quantizes and fills blocks."""
    for part in ("lossy", "paged", "eviction", "quantization"):   # their layers must hold
        skip_unless_sound(part)
    import eviction
    import lossy
    import paged
    import quantization
    budget, group, sinks = rng.randint(2, 5), rng.randint(1, 3), rng.randint(1, 2)
    prompt, window = rng.randint(1, 8), rng.randint(1, budget - 1)
    return (("KVCache", lambda: KVCache(PARAMS)),
            ("PagedSequence", lambda: paged.BlockPool(PARAMS, 20, 3).sequence()),
            ("QuantizedCache", lambda: lossy.QuantizedCache(PARAMS, "int4")),
            ("WindowCache", lambda: lossy.WindowCache(PARAMS, 3)),
            ("WindowCache with sinks", lambda: lossy.WindowCache(PARAMS, 3, sinks)),
            ("HeavyHitterCache", lambda: eviction.HeavyHitterCache(PARAMS, budget)),
            ("KeyNormCache", lambda: eviction.KeyNormCache(PARAMS, budget)),
            ("SnapKVCache", lambda: eviction.SnapKVCache(PARAMS, budget, prompt, window)),
            ("GroupedCache", lambda: quantization.GroupedCache(PARAMS, 2, group, 2 * group)),
            ("GroupedCache re-quantizing", lambda: quantization.GroupedCache(
                PARAMS, 4, group + 1, group, rotate=True, flush="requantize")),
            ("RotatedCache", lambda: quantization.RotatedCache(PARAMS, "int8")))


def state(cache):
    """What a cache holds (support.snapshot), with what it keeps for its choices to come: an
    evicting cache's positions kept, scores, reads, and SnapKV's window rows and recent; a
    GroupedCache's stored groups and values and its exact positions."""
    return support.snapshot(cache), [getattr(cache, name, None) for name in (
        "kept", "scores", "reads", "last_rows", "recent", "key_groups", "stored_values",
        "exact_keys", "exact_values")]


class Positions(unittest.TestCase):
    """What every kind of cache does with positions given or taken away."""

    def test_every_kind_refuses_to_extend_by_lists_of_different_lengths(self):
        """3 token IDs, 1 key and 1 value (a KVCache kept 3 tokens and 1 key; the others
        kept 1, through zip): refused naming the lengths, the cache as it was."""
        ids = TOK.encode(OPENINGS[0])[:4]
        held = filled_cache(ids)
        for name, make in every_kind(random.Random(0)):
            cache = make()
            feed(PARAMS, cache, ids[:3])
            before = state(cache)
            with self.subTest(cache=name), self.assertRaisesRegex(
                    ValueError, r"extend got 3 token IDs, 1 keys and 1 values: one of each a "
                                r"position"):
                cache.extend(ids[:3], held.keys[3:], held.values[3:])
            self.assertEqual(state(cache), before, name)

    def test_a_crop_to_every_length_leaves_a_fresh_cache_of_that_many_tokens(self):
        """Case n draws, from random.Random(n), 5 to 9 token IDs, as many others, and the small
        settings of a cache of every kind (every_kind). Each, holding the first, is cropped,
        in a copy, to every length from all of them down to 0: either it holds just what a
        new cache fed that many holds (state: keys and values the same floats, by ==), and so
        it does once both are fed the others from there (an evicting cache, whose choices
        follow its rows, gives the same rows too), or it refuses the crop naming the crop
        length, and holds what it held. A paged one's pool has every block back at the end.
        One case by default (KV_LAB_RANDOM_CASES=n for more)."""
        def check(index):
            rng = random.Random(index)
            first, others = ([rng.randrange(model.VOCAB_SIZE) for _ in range(9)] for _ in "ab")
            count = rng.randint(5, 9)
            exact = [filled_cache(first[:count]), filled_cache(others[:count])]

            def fed(cache, ids, source):   # ids fed from the cache's length; the rows computed
                if hasattr(cache, "kept"):   # an evicting cache chooses by what rows read
                    return feed(PARAMS, cache, cache.tokens + ids[len(cache):])
                held = len(cache)
                cache.extend(ids[held:], source.keys[held:len(ids)], source.values[held:len(ids)])
                return []
            for name, make in every_kind(rng):
                full = make()
                fed(full, first[:count], exact[0])
                for length in range(count, -1, -1):
                    cropped = full.copy()
                    try:
                        cropped.crop(length)
                    except ValueError as refused:
                        if not str(refused).startswith("crop length must be") \
                                or state(cropped) != state(full):
                            return f"{name}: crop({length}) refused so: {refused}"
                        cropped.free()
                        continue
                    fresh = make()
                    fed(fresh, first[:length], exact[0])
                    if state(cropped) != state(fresh):
                        return f"{name}: crop({length}) holds other than a new cache of as many"
                    then = first[:length] + others[length:count]
                    if fed(cropped, then, exact[1]) != fed(fresh, then, exact[1]) \
                            or state(cropped) != state(fresh):
                        return f"{name}: after crop({length}), fed others, it differs"
                    cropped.free()
                full.free()
                pool = getattr(full, "pool", None)
                if pool and (pool.free_blocks(), any(pool.ref_counts)) != (len(pool.blocks), 0):
                    return f"{name}: {len(pool.blocks) - pool.free_blocks()} blocks held after all"
            return None
        support.check_random_cases(self, 1, check)

if __name__ == "__main__":
    unittest.main()
