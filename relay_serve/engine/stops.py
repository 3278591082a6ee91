"""Stop strings on a resumable engine request, which can only stop on token ids.

vLLM's resumable requests (streaming input) refuse stop strings: a request pauses only after a
stop token id, EOS or its ``max_tokens``. A stop string ``S`` first occurs in the generated text
when some token ``t`` is appended; then ``t``'s text holds all of ``S``, or the text before ``t``
ends with a non-empty proper prefix ``S[:j]`` and ``t``'s text starts with the rest ``S[j:]`` (the
*split* ``j``; only splits whose rest is no longer than the longest token text can happen). A
request that pauses on every token that can do either sees every stop exactly where vLLM's
stop-string check would: at the token that completes it. Each split is caught one of two ways:

- *completion*: pause on the tokens that start with the rest ``S[j:]``. For ``"word, "`` at
  ``j = 1`` that is the few tokens starting with ``"ord, "``; at ``j = 5`` it would be every token
  starting with a space, most of the vocabulary;
- *look-ahead*: pause on the tokens that can end the prefix ``S[:j]`` (their text ends with it, or
  is exactly ``S[i:j]`` for a prefix spread over several tokens), and whenever the text does end
  with it, generate one token more (``max_tokens`` 1) and look again. A *word stop* (a cue) counts
  only at a word start, so its prefix must start a word too: ``"so "`` looks ahead after
  ``" so"``, never after ``"also"``.

Every pause that stops nothing costs a round trip (a decode step for that request when the engine
is busy), so each split takes the way that pauses less. The vocabulary gives how many tokens each
way pauses on, not how often they occur in text; and a rest of one character is nearly always a
punctuation mark or white space, whose tokens are among the most frequent of all (every comma). So
the last split (a rest of one character) keeps the rule of its stop's kind: looked ahead for a
stop that ends in white space and for a word stop (``"Thus,"`` pauses after ``" Thus"``, not at
every comma), completed for the others (``"</answer>"`` pauses on the tokens that start with
``">"``). Every other split is looked ahead only where fewer than half as many tokens end its
prefix as start its rest (a look-ahead that fires costs two pauses).

The splits looked ahead are part of a stop list's pause ids (``PauseIds.ahead``): the check at a
pause (:func:`lookahead_stops`) looks ahead for those and no others.

With *spare* ids (tokens the model never writes), a stop's look-ahead moves into the engine where
its completing tokens fit: ``PauseIds.swaps`` maps each token that can end one of its looked-ahead
prefixes (a *trigger*, no longer a pause id) to the tokens that start a split's rest, each with a
spare id as its *stand-in* (a pause id); the engine draws the stand-in in the completing token's
place after a trigger and gives the real token back (``vllm_swaps.py``). Stops are taken in list
order, each wholly or not at all, while the stand-ins last; the others pause as above.

:class:`PauseTokens` finds the pause token ids in an index of the vocabulary's texts;
:func:`first_stop` and :func:`lookahead_stops` are the checks at a pause. Pure: no vLLM.
"""

from __future__ import annotations

import asyncio
import threading
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Collection, Iterator, Mapping, Sequence, Set
from itertools import groupby

import ahocorasick
import numpy as np

from relay_serve.relay.text import is_word_char


class PauseIds(Set[int]):
    """The pause token ids of one stop list: sorted once (``ordered``, what vLLM's
    ``stop_token_ids`` takes), looked up by bisection; a set, so it compares equal to any set of
    the same ids. ``ahead``: for each stop with splits caught by looking ahead, those splits (the
    lengths of the prefixes after which one more token is generated)."""

    __slots__ = ("ordered", "ahead", "swaps", "real", "wire")

    def __init__(
        self,
        ordered: list[int],
        ahead: Mapping[str, tuple[int, ...]] | None = None,
        swaps: Mapping[int, tuple[tuple[int, int], ...]] | None = None,
    ) -> None:
        self.ordered = ordered
        self.ahead: Mapping[str, tuple[int, ...]] = ahead or {}
        # looked ahead inside the engine: after a trigger token, each (completing token, stand-in) pair
        self.swaps: Mapping[int, tuple[tuple[int, int], ...]] = swaps or {}
        # a stand-in the request paused on -> the token it stood in for
        self.real: Mapping[int, int] = {standin: c for pairs in self.swaps.values() for c, standin in pairs}
        # the swaps as lists, made once: [[trigger, [completing...], [stand-in...]], ...]
        self.wire = [[t, [c for c, _ in pairs], [s for _, s in pairs]] for t, pairs in self.swaps.items()]

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
        return f"PauseIds({len(self.ordered)} ids, {len(self.swaps)} triggers)"


NO_PAUSES = PauseIds([])


class PauseTokens:
    """The pause token ids of sets of stop strings, for one vocabulary (``texts[i]`` is the
    decoded text of token ``i`` alone).

    Built once per vocabulary (about 3.5-4 s for 151,936 texts here; a replica builds it at
    start-up): the texts sorted, the texts reversed and sorted, every suffix of every text sorted,
    and an Aho-Corasick automaton of the texts that carries each text's first id (pyahocorasick;
    the other ids of a text several tokens decode to are kept beside it). The pause ids of a stop
    list then come from range lookups: tokens that start with a string (a range of the sorted
    texts), end with one (of the reversed), hold one (of the suffixes); and from one pass of the
    automaton over a stop for the tokens that are a piece of it (the automaton's trie also says
    whether any token starts with a rest whose prefix no token can end). The ids are joined by numpy. A
    query costs the log of the vocabulary's size per string looked up plus the ids it finds, never
    a pass over the vocabulary; no string longer than the longest text is looked up.
    :meth:`lookup` runs a stop list never seen in a worker thread, off the caller's event loop."""

    def __init__(self, texts: Sequence[str], cache_size: int = 256, spare_ids: Sequence[int] = ()) -> None:
        self.texts = list(texts)
        self.spare_ids = sorted(set(spare_ids))  # tokens the model never writes: stand-ins (see swaps)
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
        # every text, to find those a stop holds in one pass (pyahocorasick: a C automaton); a text's
        # value is its first id, the others of a text that several tokens decode to are in _same_text
        self._automaton = ahocorasick.Automaton()
        self._same_text: dict[int, list[int]] = {}
        for t, ids in exact.items():
            if t:
                self._automaton.add_word(t, ids[0])
                if len(ids) > 1:
                    self._same_text[ids[0]] = ids[1:]
        self._automaton.make_automaton()  # a vocabulary of empty texts only: no automaton (kind EMPTY)
        self._partial = np.array(
            [i for i, t in enumerate(self.texts) if "\ufffd" in t], dtype=np.int32
        )  # pieces of a multi-byte character
        # every id as a Python int, made once: a list of tens of thousands of pause ids is then references
        # to them (no int made, none freed with the list)
        self._id_objects = np.empty(len(self.texts), dtype=object)
        self._id_objects[:] = range(len(self.texts))
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
        ahead: dict[str, tuple[int, ...]] = {}
        swaps: dict[int, set[int]] = {}  # trigger -> the tokens that complete a stop after it (in the engine)
        swapped: set[int] = set()  # every completing token given a stand-in so far
        spare = np.array(self.spare_ids, dtype=np.int32)
        n = self._longest
        starting, ending = self._prefixes, self._reversed
        for s in stops:
            if len(s) <= n:
                parts.append(self._suffixes.starting_with(s))  # tokens that hold the whole stop
            at_word_start = s in word_stops and is_word_char(s[0])  # a word stop's prefix must start a word
            lead = _word_tail(s[::-1])  # how many word characters the stop starts with
            last_ahead = _looks_ahead(s, word_stops)
            splits: list[int] = []
            triggers: list[np.ndarray] = []  # tokens that can end a prefix looked ahead
            completing: list[np.ndarray] = []  # tokens that start the rest of a split looked ahead
            for j in range(max(1, len(s) - n), len(s)):  # the splits a token can complete
                if n < j < len(s) - 1:  # no token ends a prefix this long: looked ahead (on its pieces) if any
                    if self._automaton.match(s[j:]):  # token starts with the rest (a walk of the texts' trie, in C)
                        splits.append(j)
                        if len(spare):
                            lo, hi = starting.range_of(s[j:])
                            completing.append(starting.ids[lo:hi])
                    continue
                lo, hi = starting.range_of(s[j:])  # tokens that start with the rest
                end_lo, end_hi = ending.range_of(s[j - 1 :: -1]) if j <= n else (0, 0)  # that end the prefix
                if j == len(s) - 1:  # a rest of one character: the rule of the stop's kind
                    ahead_here = last_ahead
                else:  # a look-ahead that fires costs two pauses
                    ahead_here = 2 * (end_hi - end_lo) < hi - lo
                if not ahead_here:
                    if hi > lo:
                        parts.append(starting.ids[lo:hi])
                    continue
                splits.append(j)
                completing.append(starting.ids[lo:hi])
                if end_hi == end_lo:
                    continue
                ends = ending.ids[end_lo:end_hi]
                if not at_word_start:
                    triggers.append(ends)
                elif j <= lead:  # the prefix is all word characters: no word character before it
                    triggers.append(ends[self._tail_word[ends] == j])
                else:
                    prefix = s[:j]
                    triggers.append(
                        np.array([i for i in ends.tolist() if _ends_with(self.texts[i], prefix, True)], dtype=np.int32)
                    )
            if not splits:
                continue
            # tokens that are exactly a piece of a prefix spread over several, and the others of their texts
            pieces = self._pieces(s, frozenset(splits))
            triggers.append(np.array(pieces, dtype=np.int32))
            triggers.extend(np.array(self._same_text[i], dtype=np.int32) for i in self._same_text.keys() & pieces)
            needed = set(np.setdiff1d(np.concatenate(completing), spare).tolist()) if len(spare) else set()
            if needed and len(swapped | needed) <= len(spare):  # a stand-in for each: looked ahead inside the engine
                swapped |= needed
                for t in np.setdiff1d(np.concatenate(triggers), spare).tolist():
                    swaps.setdefault(t, set()).update(needed)
            else:  # paused on: the check at the pause looks ahead
                ahead[s] = tuple(splits)
                parts.extend(triggers)
        if any(not s.isascii() for s in stops):
            parts.append(self._partial)
        standin = dict(zip(sorted(swapped), self.spare_ids, strict=False))
        if standin:
            parts.append(np.array(list(standin.values()), dtype=np.int32))  # the request stops on a stand-in
        if not parts:
            return PauseIds([], ahead)
        marked = np.zeros(len(self.texts), dtype=bool)  # 152 kB for Qwen3: set in C, faster than a sort or a hash
        marked[np.concatenate(parts)] = True
        return PauseIds(
            self._id_objects[np.flatnonzero(marked)].tolist(),
            ahead,
            {t: tuple((c, standin[c]) for c in sorted(cs)) for t, cs in swaps.items() if cs},
        )

    def _pieces(self, stop: str, splits: Collection[int]) -> list[int]:
        """The first ids of the texts that are some ``stop[i:j]`` (1 <= i < j, ``j`` one of
        ``splits``): one pass of the texts' Aho-Corasick automaton (in C) over the part of the stop
        where such pieces can be (from the longest text's length before the first split to the
        last), every occurrence of every text in it kept where it ends a split's prefix."""
        if self._automaton.kind != ahocorasick.AHOCORASICK:
            return []  # no text to find
        start, end = max(1, min(splits) - self._longest), max(splits)
        return [first for last, first in self._automaton.iter(stop, start, end) if last + 1 in splits]


def _looks_ahead(stop: str, word_stops: Collection[str]) -> bool:
    """Whether a stop's last split (a rest of one character) is looked ahead: for a stop that ends
    in white space or a word stop (a cue)."""
    return stop[-1:].isspace() or stop in word_stops


def _word_tail(text: str) -> int:
    """How many word characters ``text`` ends with."""
    n = 0
    while n < len(text) and is_word_char(text[-n - 1]):
        n += 1
    return n


SHORT = 5  # the ranges of the keys that start with each string of up to this many characters are in a dict


class _Sorted:
    """The ids of tokens sorted by a string of each, for the ids whose string starts with a given
    one (a list of the strings in order). The range of the keys that start with each key's prefix
    of up to ``SHORT`` characters is in a dict (about 100,000 entries for 151,936 keys): a string
    of up to ``SHORT`` characters is one hash lookup, a longer one a C bisection within the range
    of its first ``SHORT`` characters, and a string no key starts with is mostly turned away by the
    hash lookup."""

    def __init__(self, keys: Sequence[str], ids: Sequence[int]) -> None:
        order = sorted(ids, key=keys.__getitem__)
        self.keys = [keys[i] for i in order]
        self.ids = np.asarray(order, dtype=np.int32)
        self.short: dict[str, tuple[int, int]] = {}
        for pos, k in enumerate(self.keys):  # the keys that share a prefix are adjacent
            for j in range(1, min(len(k), SHORT) + 1):
                lo, _ = self.short.get(k[:j], (pos, pos))
                self.short[k[:j]] = (lo, pos + 1)

    def range_of(self, prefix: str) -> tuple[int, int]:
        """The positions ``lo:hi`` of the keys that start with ``prefix`` (empty: none does)."""
        within = self.short.get(prefix[:SHORT])
        if within is None:
            return 0, 0
        if len(prefix) <= SHORT:
            return within
        start, end = within
        lo = bisect_left(self.keys, prefix, start, end)
        if lo == end or not self.keys[lo].startswith(prefix):
            return 0, 0
        after = _after_all_starting_with(prefix)
        return lo, bisect_left(self.keys, after, lo, end) if after is not None else end


LEAD = 3  # the suffixes are grouped by their first characters, up to this many


class _SortedSuffixes:
    """The (token id, offset) pairs of every suffix ``keys[id][offset:]``, sorted by it (a key
    function: the suffixes are not stored as strings). The range of the suffixes that start with
    each string of ``LEAD`` characters (or are that string, if shorter) is in a dict (about 24,000
    entries for Qwen3's size): a lookup bisects within it."""

    def __init__(self, keys: Sequence[str], ids: np.ndarray, offsets: np.ndarray) -> None:
        self._keys = keys
        id_list, offset_list = ids.tolist(), offsets.tolist()
        order = sorted(range(len(ids)), key=lambda n: keys[id_list[n]][offset_list[n] :])
        self.ids, self.offsets = ids[order], offsets[order]
        self._ids_list, self._offsets_list = array("i", self.ids.tobytes()), array("i", self.offsets.tobytes())
        self._lead: dict[str, tuple[int, int]] = {}
        pos = 0
        leads = (keys[i][o : o + LEAD] for i, o in zip(self._ids_list, self._offsets_list, strict=True))
        for lead, group in groupby(leads):
            n = sum(1 for _ in group)
            self._lead[lead] = (pos, pos + n)
            pos += n

    def _key(self, n: int) -> str:
        return self._keys[self._ids_list[n]][self._offsets_list[n] :]

    def starting_with(self, prefix: str) -> np.ndarray:
        if len(prefix) >= LEAD:  # every suffix that starts with it starts with its first LEAD characters
            start, end = self._lead.get(prefix[:LEAD], (0, 0))
        else:
            start, end = 0, len(self._ids_list)
        positions = range(len(self._ids_list))
        lo = bisect_left(positions, prefix, start, end, key=self._key)
        after = _after_all_starting_with(prefix)
        hi = bisect_left(positions, after, lo, end, key=self._key) if after is not None else end
        return self.ids[lo:hi]


def _after_all_starting_with(prefix: str) -> str | None:
    """The least string greater than every string that starts with ``prefix`` (None: no string is)."""
    while prefix and prefix[-1] == "\U0010ffff":
        prefix = prefix[:-1]
    return prefix[:-1] + chr(ord(prefix[-1]) + 1) if prefix else None


def scan_pause_ids(
    texts: Sequence[str],
    stops: tuple[str, ...],
    word_stops: Collection[str] = frozenset(),
    ahead: Mapping[str, Collection[int]] | None = None,
) -> frozenset[int]:
    """The pause ids by a pass over every token text, the splits in ``ahead`` looked ahead and the
    others completed: what :class:`PauseTokens` replaced, kept as the reference its cost is
    measured against (``python -m relay_serve.bench.hotpath``)."""
    ahead = ahead or {}
    starts: set[str] = set()
    ends: dict[str, bool] = {}
    inner: set[str] = set()
    for s in stops:
        looked = set(ahead.get(s, ()))
        at_word_start = s in word_stops and is_word_char(s[0])
        for j in range(1, len(s)):
            if j in looked:
                ends[s[:j]] = ends.get(s[:j], True) and at_word_start
                inner.update(s[i:j] for i in range(1, j))
            else:
                starts.add(s[j:])
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


def lookahead_stops(text: str, ahead: Mapping[str, Collection[int]], word_stops: Collection[str] = ()) -> bool:
    """Whether ``text`` ends with the prefix of a split looked ahead (``ahead``: a stop's splits,
    as ``PauseIds.ahead``), at a word start for a word stop: the next token must be seen."""
    for s, splits in ahead.items():
        at_word_start = s in word_stops and is_word_char(s[0])
        for j in splits:
            if text.endswith(s[:j]) and (not at_word_start or not is_word_char(text[-j - 1 : -j] or " ")):
                return True
    return False
