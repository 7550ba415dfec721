"""What every kind of cache answers (Part 2, section 16, on): CacheProtocol.

The lesson asks of a cache only what kv_cache.KVCache offers. From Part 2 on, keys and
values also live in caches of other kinds (a paged sequence, a QuantizedCache, a
WindowCache, an evicting cache: each a KVCache that keeps them its own way), and code that
uses a cache works with every kind by asking it what CacheProtocol lists, never its type.
KVCache inherits these answers; a kind of cache that keeps its positions another way
overrides them.
"""


class ListRoom:
    """The room of caches that keep their positions in lists of their own.

    It is always there (forward_step refuses positions past the model's 64)."""

    def room_for(self, demands):
        return True

    def check_room(self, demands):
        """Nothing to refuse."""


def check_positions(token_ids, keys, values):
    """Refuse new positions given as lists of different lengths.

    Each position needs its token ID, its key and its value (zip would keep the fewest;
    list += would keep them all)."""
    if not len(token_ids) == len(keys) == len(values):
        raise ValueError(f"extend got {len(token_ids)} token IDs, {len(keys)} keys and "
                         f"{len(values)} values: one of each a position")


class CacheProtocol:
    """What every cache of the lesson's model offers, and all that code using a cache relies on.

    A KVCache, a paged sequence, a QuantizedCache and a WindowCache each offer:
      params, columns       the model it was made for; its matrices, ready for linear()
      tokens                the token ID of every position held, in order
      keys, values          what attention reads: a key and a value per position kept
      len()                 how many positions it holds
      append, extend        keep one more position, or several (refused, keeping none;
                            check_positions refuses lists of different lengths)
      copy, crop, free      fork it; forget the positions from a length on; end it
      room_for(positions)   whether it can keep that many more positions
      room_left()           what limits the positions it can keep, in words
      room_owner            what holds its room (ListRoom, a paged sequence's pool): its
                            room_for(demands) answers for several caches at once, its
                            check_room(demands) refuses, naming what is short (demands:
                            a list of (cache, more positions))
      attended(weights)     told, by forward_step, what the newest row read: its
                            attention weights over keys, in their order (a cache that
                            evicts by attention keeps its scores; the others ignore it)
      stored(vector)        a key or value as the cache gives it back once kept (itself,
                            or rounded to the cache's format), refusing one it cannot keep
      keeps_every_position  whether keys and values hold every position (a window's don't)
      fixed_once_kept       whether each key and value, once kept, is given back the same
                            for good, as rows computed together need (a GroupedCache's
                            change when it quantizes their group)
      stores_exactly        whether they are forward_step's, exactly and every one, so
                            that a file of them loads as the same cache
      check_computed_by(kernel)  refuse rows computed by kernel (None: forward_step's
                            arithmetic; else batched.py's product) if it keeps only another's
                            (a paged sequence: its pool shares its blocks with sequences
                            computed alike); one of its own takes any

    KVCache offers those down to free as the lesson needs them; the rest it inherits from
    here, as written below (a kind of cache that keeps its positions another way overrides
    them)."""

    keeps_every_position = True   # what prefill.prefill's mask needs (a window drops some)
    fixed_once_kept = True
    stores_exactly = True
    room_owner = ListRoom()

    def stored(self, vector):
        """vector as the cache gives it back once kept: a list keeps it as it is."""
        return vector

    def attended(self, weights):
        """Nothing to keep: a list evicts nothing, whatever the rows read."""

    def check_computed_by(self, kernel):
        """Nothing to refuse: no other sequence reads a list's keys and values."""

    def room_for(self, positions):
        """Whether the cache can keep that many more positions: its room's owner says."""
        return self.room_owner.room_for([(self, positions)])

    def room_left(self):
        """What limits the positions the cache can keep, in words."""
        return "nothing but the model's 64 positions"
