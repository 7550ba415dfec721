"""A byte-pair tokenizer: start from single characters, then repeatedly merge the most
frequent adjacent pair of tokens into a new token, until the vocabulary is full.

Merges happen only inside runs of letters, so a space, a period, a comma and the
newline that ends a story always stay tokens of their own. Encoding applies the learned
merges in the order they were learned (by rank), so it reproduces training exactly.

    python3 bpe.py            retrains tokenizer.json from corpus.txt
    python3 bpe.py --check    exits non-zero if retraining would change tokenizer.json
"""
import os
import sys
import lab_files
if __name__ == "__main__":   # first: Ctrl-C while the modules below load ends in one line
    lab_files.ctrl_c_in_one_line()

import argparse
import itertools
import json

from lab_files import add_folder_flag, lab_file, read_json, run_command, write_atomically
from model import VOCAB_SIZE, is_int

FORMAT = "kv-lab-bpe-1"


def _pieces(text):
    """Split text into runs of letters and single non-letter characters."""
    for is_letter, run in itertools.groupby(text, str.isalpha):
        if is_letter:
            yield "".join(run)
        else:
            yield from run


def _count_pairs(words):
    """How often each adjacent pair of tokens occurs, weighting each word by its count."""
    counts = {}
    for symbols, count in words.items():
        for pair in zip(symbols, symbols[1:]):
            counts[pair] = counts.get(pair, 0) + count
    return counts


def _merge(symbols, pair, new):
    """Replace every occurrence of pair in the tuple symbols, left to right, by new."""
    out, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(new)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


class Tokenizer:
    """A vocabulary (list of token strings by ID) and the merges that built it."""

    def __init__(self, vocab, merges):
        _check_tables(vocab, merges)
        self.vocab = list(vocab)
        self.merges = [tuple(pair) for pair in merges]
        self.ids = {token: i for i, token in enumerate(self.vocab)}
        self._rank = {pair: rank for rank, pair in enumerate(self.merges)}
        self._alphabet = set(self.vocab[:len(self.vocab) - len(self.merges)])
        self._word_ids = {}

    @classmethod
    def train(cls, text, vocab_size):
        """Learn merges from text until the vocabulary has vocab_size tokens."""
        if not isinstance(text, str) or not text:
            raise ValueError("text to train on must be a non-empty string")
        alphabet = sorted(set(text))
        if not is_int(vocab_size):
            raise ValueError(f"vocab_size must be an int, got {vocab_size!r}")
        if vocab_size < len(alphabet):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the text's "
                             f"alphabet of {len(alphabet)} characters")
        words = {}
        for piece in _pieces(text):
            if piece.isalpha() and len(piece) > 1:
                words[tuple(piece)] = words.get(tuple(piece), 0) + 1
        vocab, merges = list(alphabet), []
        while len(vocab) < vocab_size:
            counts = _count_pairs(words)
            if not counts:
                raise ValueError(f"vocab_size {vocab_size} is too large: only "
                                 f"{len(vocab)} tokens can be made from this text")
            # The most frequent pair; among equals, the alphabetically first.
            pair = min(counts, key=lambda p: (-counts[p], p))
            new = pair[0] + pair[1]
            merges.append(pair)
            vocab.append(new)
            words = {_merge(symbols, pair, new): count for symbols, count in words.items()}
        return cls(vocab, merges)

    def encode(self, text):
        """Token IDs of text; every character must be in the tokenizer's alphabet."""
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        unknown = set(text) - self._alphabet
        if unknown:
            index = next(i for i, ch in enumerate(text) if ch in unknown)
            char = text[index]
            hint = f"; use lowercase: {char.lower()!r}" if char.lower() in self._alphabet else ""
            raise ValueError(f"unknown character {char!r} at index {index}: "
                             f"the tokenizer's alphabet is {''.join(sorted(self._alphabet))!r}"
                             f"{hint}")
        ids = []
        for piece in _pieces(text):
            if piece not in self._word_ids:
                self._word_ids[piece] = [self.ids[t] for t in self._apply_merges(piece)]
            ids.extend(self._word_ids[piece])
        return ids

    def _apply_merges(self, word):
        """Merge the pair with the lowest rank, again and again, until none applies."""
        symbols = tuple(word)
        while len(symbols) > 1:
            pairs = [p for p in zip(symbols, symbols[1:]) if p in self._rank]
            if not pairs:
                break
            pair = min(pairs, key=self._rank.__getitem__)
            symbols = _merge(symbols, pair, pair[0] + pair[1])
        return symbols

    def decode(self, ids):
        """The text of a list of token IDs."""
        ids = list(ids)
        for index, token_id in enumerate(ids):
            if not is_int(token_id) or not 0 <= token_id < len(self.vocab):
                raise ValueError(f"token ID {token_id!r} at index {index} is outside the "
                                 f"vocabulary (ints 0 to {len(self.vocab) - 1})")
        return "".join(self.vocab[i] for i in ids)

    def to_json(self):
        """The saved form: readable JSON, one token or merge per line."""
        return json.dumps({"format": FORMAT, "vocab": self.vocab, "merges": self.merges},
                          indent=1) + "\n"

    def save(self, path):
        """Write the tokenizer to path as JSON, atomically."""
        write_atomically(path, self.to_json())

    @classmethod
    def load(cls, path):
        """Read a tokenizer written by save, refusing a malformed or inconsistent file."""
        data = read_json(path, FORMAT, "a tokenizer file")
        try:
            return cls(data.get("vocab"), data.get("merges"))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _check_tables(vocab, merges):
    """Refuse a vocabulary and merge list that training could not have produced."""
    if not isinstance(vocab, list) or not all(isinstance(t, str) and t for t in vocab):
        raise ValueError("vocab must be a list of non-empty strings")
    if len(set(vocab)) != len(vocab):
        raise ValueError("vocab has a token twice")
    if not isinstance(merges, list) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in merges):
        raise ValueError("merges must be a list of token pairs")
    base = len(vocab) - len(merges)
    if base < 1 or any(len(t) != 1 for t in vocab[:base]):
        raise ValueError("vocab must start with its single characters, one per merge after")
    for rank, (left, right) in enumerate(merges):
        known = vocab[:base + rank]
        if left not in known or right not in known or vocab[base + rank] != left + right:
            raise ValueError(f"merge {rank} {[left, right]} does not make token "
                             f"{vocab[base + rank]!r} from earlier tokens")
        if not (left + right).isalpha():
            raise ValueError(f"merge {rank} {[left, right]} crosses a non-letter")


def main(argv=None):
    """Retrain tokenizer.json from the command line, or check it (--check)."""
    parser = argparse.ArgumentParser(description="Retrain tokenizer.json from corpus.txt.")
    parser.add_argument("--check", action="store_true",
                        help="exit non-zero if retraining would change tokenizer.json")
    add_folder_flag(parser)
    args = parser.parse_args(argv)
    tokenizer = os.path.join(args.folder, "tokenizer.json")
    try:
        with open(lab_file(args.folder, "corpus.txt"), encoding="utf-8") as f:
            tok = Tokenizer.train(f.read(), VOCAB_SIZE)
    except (OSError, ValueError) as e:
        sys.exit(f"bpe.py: error: {e}")
    if args.check:
        try:
            with open(tokenizer, encoding="utf-8", newline="") as f:
                same = f.read() == tok.to_json()
        except OSError as e:
            sys.exit(f"bpe.py: error: tokenizer.json cannot be read: {e}")
        if not same:
            sys.exit("bpe.py: error: tokenizer.json differs from a tokenizer retrained on "
                     "corpus.txt; run python3 bpe.py to rewrite it")
        print(f"tokenizer.json matches corpus.txt ({len(tok.vocab)} tokens)")
        return
    tok.save(tokenizer)
    print(f"wrote {tokenizer}: {len(tok.vocab)} tokens, {len(tok.merges)} merges")


if __name__ == "__main__":
    run_command(main)
