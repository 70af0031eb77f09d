"""Candidate node names to fleet rows, straight from the JSON text kube-scheduler sent.

kube-scheduler sends every filter call the names of all nodes that passed its own filters: at 5,000
nodes about 60 KB of JSON, in another order each time (it starts each cycle at another node, and its
16 filter goroutines append names as they finish), so neither the text nor the order repeats.
Decoding it into 5,000 Python strings and recognising the set (or looking each name up in a dict)
cost about 0.7 ms here; a few numpy passes over the bytes cost about half, and stay exact:

- the text must be a JSON array of strings without escapes or commas (what Go's encoder writes
  for DNS names: `plain_names`); anything else returns None, and the caller decodes it;
- each name's bytes are read as little-endian 64-bit words (zero past its end) and hashed; the hash
  picks an entry from two slot tables, and the entry counts only when its length and every word
  equal the name's, so a hash collision can never map a name to the wrong row. A name that matches
  no entry (never seen, or one of the few entries the tables could not hold) is decoded alone and
  looked up in a dict.

The index holds every node the cache knows, nodes without GPUs too (with no row): they are in
kube-scheduler's lists as well, since sharegpu's resources are ignored by its own resource filter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np

_QUOTE: Final = ord('"')
_COMMA: Final = ord(",")
_WORD: Final = 8
_MULTIPLIERS: Final = np.array(
    [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93], dtype=np.uint64
)
_LENGTH_MULTIPLIER: Final = np.uint64(0xFF51AFD7ED558CCD)
_MASKS: Final = np.array([(1 << (8 * k)) - 1 for k in range(_WORD + 1)], dtype=np.uint64)
"""Per count of valid bytes in a word (0..8), the mask that keeps them (little-endian)."""


def plain_names(text: bytes) -> bool:
    """Whether a JSON array (already validated as JSON) holds only strings without escapes, commas
    or brackets: then every quote in it is a string's delimiter. With no nested array or object,
    it holds twice as many quotes as commas plus one exactly then: every element a string (each has
    two quotes, each but the last a comma after it), and no comma inside one."""
    if len(text) < 4 or text[:2] != b'["' or text[-2:] != b'"]' or b"\\" in text or b"{" in text:
        return False
    if text.find(b"[", 1) >= 0 or text.find(b"]", 0, len(text) - 1) >= 0:
        return False
    raw = np.frombuffer(text, dtype=np.uint8)
    return int(np.count_nonzero(raw == _QUOTE)) == 2 * (int(np.count_nonzero(raw == _COMMA)) + 1)


def mentions(text: bytes, name: str) -> bool:
    """Whether a `plain_names` text holds `name`, by one search of the text. There a quoted match
    starts at a string's opening quote, unless the name is what lies between two strings (a comma,
    perhaps with spaces); a name with a comma, a quote or a backslash (never a node's) gets False,
    and the caller maps the text instead."""
    if "," in name or '"' in name or "\\" in name:
        return False
    return b'"' + name.encode() + b'"' in text


class NameIndex:
    """Node names and their fleet rows (-1 for nodes the fleet does not place on), searchable by
    their bytes. Built once per fleet state."""

    def __init__(self, names: Sequence[str], rows: Sequence[int]) -> None:
        self._row_of = dict(zip(names, rows, strict=True))
        encoded = [n.encode() for n in names]
        lengths = np.array([*(len(b) for b in encoded), -1], dtype=np.int64)  # a last row matching nothing
        width = max(1, -(-int(lengths.max(initial=0)) // _WORD))
        table = np.zeros((len(encoded) + 1, width * _WORD), dtype=np.uint8)
        for at, raw in enumerate(encoded):
            table[at, : len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        self._words = np.ascontiguousarray(table.view("<u8").T)
        """Per word position, every entry's word there (little-endian, zero past the name's end)."""
        self._lengths = lengths
        self._rows = np.array([*rows, -1], dtype=np.int64)
        self._hashes = _hash(self._words, lengths)
        self._bits = max(4, (8 * len(encoded)).bit_length())
        """Two slot tables of 2**bits entries (at most an eighth full): an entry goes into the
        first table at its slot there, or into the second one if that is taken; an entry that finds
        both taken is found by the dictionary (a few in ten thousand)."""
        nothing = len(encoded)
        self._first = np.full(1 << self._bits, nothing, dtype=np.int64)
        self._second = np.full(1 << self._bits, nothing, dtype=np.int64)
        first, second = self._slots(self._hashes[:-1])
        for at, (a, b) in enumerate(zip(first.tolist(), second.tolist(), strict=True)):
            if self._first[a] == nothing:
                self._first[a] = at
            elif self._second[b] == nothing:
                self._second[b] = at

    def _slots(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each hash's slot in the first table (its top bits) and in the second (its low bits)."""
        top = (hashes >> np.uint64(64 - self._bits)).astype(np.int64)
        low = (hashes & np.uint64((1 << self._bits) - 1)).astype(np.int64)
        return top, low

    def rows(self, text: bytes) -> np.ndarray | None:
        """Per name in `text` (a JSON array of names) its row, -1 where the fleet has none; None
        when the text is not `plain_names` (the caller decodes it then)."""
        if text == b"[]":
            return np.empty(0, dtype=np.int64)
        if not plain_names(text):
            return None
        raw = np.frombuffer(text, dtype=np.uint8)
        quotes = np.flatnonzero(raw == _QUOTE)
        starts, ends = quotes[0::2] + 1, quotes[1::2]
        lengths = ends - starts
        words = _words_at(text, starts, lengths, len(self._words))
        hashes = _hash(words, lengths)
        first, second = self._slots(hashes)
        a = self._first[first]
        entries = np.where(self._hashes[a] == hashes, a, self._second[second])
        exact = self._lengths[entries] == lengths  # the hash found an entry: its bytes decide
        for w in range(len(words)):
            exact &= self._words[w][entries] == words[w]
        looked = np.where(exact, self._rows[entries], -1)
        for i in np.flatnonzero(~exact).tolist():  # a name never seen, or one the tables could not hold
            looked[i] = self._row_of.get(text[starts[i] : ends[i]].decode(), -1)
        return looked


def _words_at(text: bytes, starts: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """Each name as `width` little-endian words (one row per word position), zero past its end; a
    name longer than the longest indexed one is cut (it cannot match: its length differs)."""
    count = (len(text) + _WORD * width) // _WORD + 1
    padded = text + bytes(_WORD * (width + 2))
    # shifted[s, i] is the word at byte offset 8 * i + s: eight aligned copies, so any offset p
    # is one flat index (p % 8) * count + p // 8
    shifted = np.empty((_WORD, count), dtype=np.uint64)
    for s in range(_WORD):
        shifted[s] = np.frombuffer(padded, dtype="<u8", offset=s, count=count)
    flat = shifted.reshape(-1)
    out = np.empty((width, len(starts)), dtype=np.uint64)
    at = (starts & (_WORD - 1)) * count + (starts >> 3)
    for w in range(width):
        out[w] = flat[at + w] & _MASKS[np.clip(lengths - _WORD * w, 0, _WORD)]
    return out


def _hash(words: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """64-bit hashes of names given as word rows (`_words_at`) and lengths."""
    with np.errstate(over="ignore"):
        total = lengths.astype(np.uint64) * _LENGTH_MULTIPLIER
        for w in range(len(words)):
            mixed = words[w] * _MULTIPLIERS[w % len(_MULTIPLIERS)]
            total = (total ^ mixed ^ (mixed >> np.uint64(29))) * _MULTIPLIERS[(w + 1) % len(_MULTIPLIERS)]
        return total ^ (total >> np.uint64(31))
