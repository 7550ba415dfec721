"""cache_protocol.py: the questions every kind of cache answers (Part 2 on), asked of a
cache of every kind."""
import inspect
import re
import unittest

import support
from cache_protocol import CacheProtocol
from kv_cache import KVCache, feed
from support import OPENINGS, PARAMS, TOK, filled_cache
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



if __name__ == "__main__":
    unittest.main()
