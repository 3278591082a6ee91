"""Stop strings on a resumable engine request, which can only stop on token ids.

vLLM's resumable requests (streaming input) refuse stop strings: a request pauses only after a
stop token id, EOS or its ``max_tokens``. A stop string ``S`` first occurs in the generated text
when some token ``t`` is appended; then ``t``'s text holds all of ``S``, or the text before ``t``
ends with a non-empty proper prefix ``S[:j]`` and ``t``'s text starts with the rest ``S[j:]``.
A request that pauses on every token that can do either sees every stop exactly where vLLM's
stop-string check would: at the token that completes it. There are two ways to catch the second
case, and each stop string takes the one that pauses less:

- *completion*: pause on the tokens that start with a rest ``S[j:]`` (for ``"</answer>"``: those
  starting with ``">"``, ``"r>"``, ...). For a stop ending in white space (``". "``) that is most
  of the vocabulary, and for a cue (``"Thus,"``) every comma;
- *look-ahead*: pause on the tokens that can end a proper prefix (their text ends with ``S[:j]``,
  or is exactly ``S[i:j]`` for a prefix spread over several tokens), and whenever the text does end
  with one, generate one token more (``max_tokens`` 1) and look again. Stops ending in white space
  and *word stops* take this way. A word stop (a cue) counts only at a word start, so its prefix
  must start a word too: ``"so "`` pauses after ``" so"``, never after ``"also"``.

Every pause that stops nothing costs a round trip (a decode step for that request when the engine
is busy). :class:`PauseTokens` finds the pause token ids in an index of the vocabulary's texts;
:func:`first_stop` and :func:`lookahead_stops` are the checks at a pause. Pure: no vLLM.
"""

from __future__ import annotations

import asyncio
import threading
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence, Set

import ahocorasick
import numpy as np

from relay_serve.relay.text import is_word_char


def ends_with_space(stop: str) -> bool:
    return stop[-1:].isspace()


class PauseIds(Set[int]):
    """The pause token ids of one stop list: sorted once (``ordered``, what vLLM's
    ``stop_token_ids`` takes), looked up by bisection; a set, so it compares equal to any set of
    the same ids."""

    __slots__ = ("ordered",)

    def __init__(self, ordered: list[int]) -> None:
        self.ordered = ordered

    def __contains__(self, token_id: object) -> bool:
        if not isinstance(token_id, int):
            return False
        k = bisect_left(self.ordered, token_id)
        return k < len(self.ordered) and self.ordered[k] == token_id

    def __iter__(self) -> Iterator[int]:
        return iter(self.ordered)

    def __len__(self) -> int:
        return len(self.ordered)

    def __repr__(self) -> str:
        return f"PauseIds({len(self.ordered)} ids)"


NO_PAUSES = PauseIds([])


class PauseTokens:
    """The pause token ids of sets of stop strings, for one vocabulary (``texts[i]`` is the
    decoded text of token ``i`` alone).

    Built once per vocabulary (about 3 s for 151,936 texts here; a replica builds it at start-up):
    the texts sorted, the texts reversed and sorted, every suffix of every text sorted, and an
    Aho-Corasick automaton of the texts that carries each text's ids (pyahocorasick). The pause ids of a
    stop list then come from range lookups: tokens that start with a string (a range of the
    sorted texts), end with one (of the reversed), hold one (of the suffixes); and from one pass
    of the automaton over a stop for the tokens that are a piece of it. The ids are joined by
    numpy. A query costs the log of the vocabulary's size per string looked up plus the ids it
    finds, never a pass over the vocabulary; no string longer than the longest text is looked up.
    :meth:`lookup` runs a stop list never seen in a worker thread, off the caller's event loop."""

    def __init__(self, texts: Sequence[str], cache_size: int = 256) -> None:
        self.texts = list(texts)
        nonempty = [i for i, t in enumerate(self.texts) if t]
        self._prefixes = _Sorted(self.texts, nonempty)
        self._reversed = _Sorted([t[::-1] for t in self.texts], nonempty)
        # every suffix of every text, as (token id, offset): a token holds s where one starts with s
        lengths = [len(t) for t in self.texts]
        self._suffixes = _SortedSuffixes(
            self.texts,
            np.fromiter((i for i, n in enumerate(lengths) for _ in range(n)), dtype=np.int32),
            np.fromiter((k for n in lengths for k in range(n)), dtype=np.int32),
        )
        self._longest = max(lengths, default=0)
        # per token, how many word characters its text ends with (a word stop's prefix of j word
        # characters starts a word in a token that ends with it where this is exactly j)
        self._tail_word = np.fromiter((_word_tail(t) for t in self.texts), dtype=np.int32, count=len(self.texts))
        exact: dict[str, list[int]] = {}
        for i, t in enumerate(self.texts):
            exact.setdefault(t, []).append(i)
        # every text, to find those a stop holds in one pass (pyahocorasick: a C automaton)
        self._automaton = ahocorasick.Automaton()
        for t, ids in exact.items():
            if t:
                self._automaton.add_word(t, (len(t), tuple(ids)))
        self._automaton.make_automaton()  # a vocabulary of empty texts only: no automaton (kind EMPTY)
        self._partial = np.array(
            [i for i, t in enumerate(self.texts) if "\ufffd" in t], dtype=np.int32
        )  # pieces of a multi-byte character
        self._cache: OrderedDict[tuple[tuple[str, ...], frozenset[str]], PauseIds] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def ids(self, stops: tuple[str, ...], word_stops: frozenset[str] = frozenset()) -> PauseIds:
        """Token ids after which a request with these stop strings must pause (cached)."""
        found = self._cached((stops, word_stops))
        if found is not None:
            return found
        found = self._ids(stops, word_stops)
        with self._lock:
            self._cache[(stops, word_stops)] = found
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return found

    async def lookup(self, stops: tuple[str, ...], word_stops: frozenset[str] = frozenset()) -> PauseIds:
        """:meth:`ids` for code on an event loop: a cached list at once, a new one from a worker
        thread."""
        found = self._cached((stops, word_stops))
        return found if found is not None else await asyncio.to_thread(self.ids, stops, word_stops)

    def _cached(self, key: tuple[tuple[str, ...], frozenset[str]]) -> PauseIds | None:
        """A list found before, now the most recently used."""
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
            return found

    def _ids(self, stops: tuple[str, ...], word_stops: frozenset[str]) -> PauseIds:
        if not stops:
            return NO_PAUSES
        parts: list[np.ndarray] = []
        pieces: set[int] = set()  # ids of tokens that are a piece of a stop
        n = self._longest
        for s in stops:
            if len(s) <= n:
                parts.append(self._suffixes.starting_with(s))  # tokens that hold the whole stop
            if _looks_ahead(s, word_stops):
                at_word_start = s in word_stops and is_word_char(s[0])  # a word stop's prefix must start a word
                lead = _word_tail(s[::-1])  # how many word characters the stop starts with
                for j in range(1, min(len(s), n + 1)):
                    prefix = s[:j]
                    # tokens that end a proper prefix (where it starts a word, for a word stop's)
                    ending = self._reversed.starting_with(prefix[::-1])
                    if not at_word_start:
                        parts.append(ending)
                    elif j <= lead:  # the prefix is all word characters: no word character before it
                        parts.append(ending[self._tail_word[ending] == j])
                    else:
                        parts.append(
                            np.array(
                                [i for i in ending.tolist() if _ends_with(self.texts[i], prefix, True)], dtype=np.int32
                            )
                        )
                self._pieces(s, pieces)  # tokens that are exactly a piece of a prefix spread over several
            else:
                for j in range(max(1, len(s) - n), len(s)):  # tokens that start with the rest of a proper prefix
                    parts.append(self._prefixes.starting_with(s[j:]))
        if pieces:
            parts.append(np.fromiter(pieces, dtype=np.int32, count=len(pieces)))
        if any(not s.isascii() for s in stops):
            parts.append(self._partial)
        if not parts:
            return NO_PAUSES
        marked = np.zeros(len(self.texts), dtype=bool)  # 152 kB for Qwen3: set in C, faster than a sort or a hash
        marked[np.concatenate(parts)] = True
        return PauseIds(np.flatnonzero(marked).tolist())

    def _pieces(self, stop: str, found: set[int]) -> None:
        """Add to ``found`` the ids of the tokens whose whole text is some ``stop[i:j]`` (1 <= i <
        j < len(stop)): one pass of the texts' Aho-Corasick automaton over the stop (every
        occurrence of every text in it), in C."""
        if self._automaton.kind != ahocorasick.AHOCORASICK:
            return  # no text to find
        last = len(stop) - 2  # a piece ends before the stop's last character
        for end, (length, ids) in self._automaton.iter(stop):
            if length <= end <= last:  # starts at 1 or later
                found.update(ids)


def _word_tail(text: str) -> int:
    """How many word characters ``text`` ends with."""
    n = 0
    while n < len(text) and is_word_char(text[-n - 1]):
        n += 1
    return n


SHORT = 5  # the prefixes up to this long of every key are in a set: most lookups end there


class _Sorted:
    """The ids of tokens sorted by a string of each, for the ids whose string starts with a given
    one (a list of the strings in order, searched by C bisection). Every key's prefixes of up to
    ``SHORT`` characters are in a set (about 100,000 for 151,936 keys), so most strings no key
    starts with are turned away by a hash lookup, not a bisection."""

    def __init__(self, keys: Sequence[str], ids: Sequence[int]) -> None:
        order = sorted(ids, key=keys.__getitem__)
        self.keys = [keys[i] for i in order]
        self.ids = np.asarray(order, dtype=np.int32)
        self.short = frozenset(k[:j] for k in self.keys for j in range(1, min(len(k), SHORT) + 1))

    def range_of(self, prefix: str) -> tuple[int, int]:
        """The positions ``lo:hi`` of the keys that start with ``prefix`` (empty: none does)."""
        if prefix[:SHORT] not in self.short:
            return 0, 0
        lo = bisect_left(self.keys, prefix)
        if lo == len(self.keys) or not self.keys[lo].startswith(prefix):
            return 0, 0
        after = _after_all_starting_with(prefix)
        return lo, bisect_left(self.keys, after, lo) if after is not None else len(self.keys)

    def starting_with(self, prefix: str) -> np.ndarray:
        lo, hi = self.range_of(prefix)
        return self.ids[lo:hi]


class _SortedSuffixes:
    """The (token id, offset) pairs of every suffix ``keys[id][offset:]``, sorted by it (a key
    function: the suffixes are not stored as strings)."""

    def __init__(self, keys: Sequence[str], ids: np.ndarray, offsets: np.ndarray) -> None:
        self._keys = keys
        id_list, offset_list = ids.tolist(), offsets.tolist()
        order = sorted(range(len(ids)), key=lambda n: keys[id_list[n]][offset_list[n] :])
        self.ids, self.offsets = ids[order], offsets[order]
        self._ids_list, self._offsets_list = array("i", self.ids.tobytes()), array("i", self.offsets.tobytes())

    def _key(self, n: int) -> str:
        return self._keys[self._ids_list[n]][self._offsets_list[n] :]

    def starting_with(self, prefix: str) -> np.ndarray:
        positions = range(len(self._ids_list))
        lo = bisect_left(positions, prefix, key=self._key)
        after = _after_all_starting_with(prefix)
        hi = bisect_left(positions, after, lo, key=self._key) if after is not None else len(positions)
        return self.ids[lo:hi]


def _after_all_starting_with(prefix: str) -> str | None:
    """The least string greater than every string that starts with ``prefix`` (None: no string is)."""
    while prefix and prefix[-1] == "\U0010ffff":
        prefix = prefix[:-1]
    return prefix[:-1] + chr(ord(prefix[-1]) + 1) if prefix else None


def scan_pause_ids(
    texts: Sequence[str], stops: tuple[str, ...], word_stops: Collection[str] = frozenset()
) -> frozenset[int]:
    """The pause ids by a pass over every token text: what :class:`PauseTokens` replaced, kept as
    the reference its cost is measured against (``python -m relay_serve.bench.hotpath``)."""
    starts: set[str] = set()
    ends: dict[str, bool] = {}
    inner: set[str] = set()
    for s in stops:
        if _looks_ahead(s, word_stops):
            at_word_start = s in word_stops and is_word_char(s[0])
            for j in range(1, len(s)):
                ends[s[:j]] = ends.get(s[:j], True) and at_word_start
                inner.update(s[i:j] for i in range(1, j))
        else:
            starts.update(s[j:] for j in range(1, len(s)))
    non_ascii = any(not s.isascii() for s in stops)
    return frozenset(
        tid
        for tid, text in enumerate(texts)
        if text
        and (
            any(s in text for s in stops)
            or text in inner
            or any(text.startswith(x) for x in starts)
            or any(_ends_with(text, e, word) for e, word in ends.items())
            or (non_ascii and "\ufffd" in text)
        )
    )


def _looks_ahead(stop: str, word_stops: Collection[str]) -> bool:
    return ends_with_space(stop) or stop in word_stops


def _ends_with(text: str, prefix: str, word_start: bool) -> bool:
    if not text.endswith(prefix):
        return False
    return not word_start or len(text) == len(prefix) or not is_word_char(text[-len(prefix) - 1])


def first_stop(
    text: str, stops: Sequence[str], word_stops: Sequence[str] = (), before: str = ""
) -> tuple[int, str] | None:
    """The first stop string (in list order, as vLLM's check) that occurs in ``text``, and where
    its match ends; None when none does. A word stop counts only where the character before it (in
    ``before`` + ``text``) is no letter, digit or underscore. At a pause every stop found completed
    with the last token (an earlier one would have stopped the request earlier)."""
    for s in stops:
        pos = text.find(s)
        while pos != -1 and s in word_stops and is_word_char(s[0]) and is_word_char((before + text[:pos])[-1:] or " "):
            pos = text.find(s, pos + 1)
        if pos != -1:
            return pos + len(s), s
    return None


def lookahead_stops(text: str, stops: Sequence[str], word_stops: Collection[str] = (), before: str = "") -> bool:
    """Whether ``text`` ends with a non-empty proper prefix of a stop string caught by looking
    ahead (one ending in white space, or a word stop whose prefix starts a word): the next token
    must be seen."""
    full = before + text
    for s in stops:
        if not _looks_ahead(s, word_stops):
            continue
        at_word_start = s in word_stops and is_word_char(s[0])
        for j in range(1, len(s)):
            if full.endswith(s[:j]) and (not at_word_start or not is_word_char(full[-j - 1 : -j] or " ")):
                return True
    return False
