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

from array import array
from bisect import bisect_left
from collections.abc import Collection, Sequence
from functools import lru_cache


def _is_word_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def ends_with_space(stop: str) -> bool:
    return stop[-1:].isspace()


class PauseTokens:
    """The pause token ids of sets of stop strings, for one vocabulary (``texts[i]`` is the
    decoded text of token ``i`` alone).

    Built once per vocabulary (2.3 s for 151,936 texts here; a replica builds it at start-up):
    the texts sorted, the texts reversed and sorted, every suffix of every text sorted, and the
    texts' ids by text. The pause ids of a stop list then come from range lookups: tokens that
    start with a string (a range of the sorted texts), end with one (of the reversed), hold one
    (of the suffixes), or are one. A query costs the log of the vocabulary's size per string looked
    up plus the ids it finds, never a pass over the vocabulary."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts = list(texts)
        nonempty = array("i", (i for i, t in enumerate(self.texts) if t))
        self._prefixes = _Sorted(self.texts, nonempty)
        self._reversed = _Sorted([t[::-1] for t in self.texts], nonempty)
        # every suffix of every text, as (token id, offset): a token holds s where one starts with s
        lengths = [len(t) for t in self.texts]
        self._suffixes = _Sorted(
            self.texts,
            array("i", (i for i, n in enumerate(lengths) for _ in range(n))),
            array("i", (k for n in lengths for k in range(n))),
        )
        self._exact: dict[str, list[int]] = {}
        for i, t in enumerate(self.texts):
            self._exact.setdefault(t, []).append(i)
        self._partial = frozenset(i for i, t in enumerate(self.texts) if "\ufffd" in t)  # pieces of a multi-byte character
        self.ids = lru_cache(maxsize=256)(self._ids)

    def _ids(self, stops: tuple[str, ...], word_stops: frozenset[str] = frozenset()) -> frozenset[int]:
        """Token ids after which a request with these stop strings must pause."""
        out: set[int] = set()
        for s in stops:
            out.update(self._suffixes.starting_with(s))  # tokens that hold the whole stop
            if _looks_ahead(s, word_stops):
                at_word_start = s in word_stops and _is_word_char(s[0])
                for j in range(1, len(s)):
                    prefix = s[:j]
                    # tokens that end a proper prefix (where it starts a word, for a word stop's)
                    ends = self._reversed.starting_with(prefix[::-1])
                    out.update(ends if not at_word_start else (i for i in ends if _ends_with(self.texts[i], prefix, True)))
                    for i in range(1, j):  # tokens that are exactly a piece of a prefix spread over several
                        out.update(self._exact.get(s[i:j], ()))
            else:
                for j in range(1, len(s)):  # tokens that start with the rest of a proper prefix
                    out.update(self._prefixes.starting_with(s[j:]))
        if any(not s.isascii() for s in stops):
            out.update(self._partial)
        return frozenset(out)


class _Sorted:
    """The ids of tokens sorted by a string of each (``keys[id][offset:]``), for the ids whose
    string starts with a given one."""

    def __init__(self, keys: Sequence[str], ids: Sequence[int], offsets: Sequence[int] | None = None) -> None:
        self._keys, self.ids, self.offsets = keys, ids, offsets
        order = sorted(range(len(ids)), key=self._key)
        self.ids = array("i", (ids[n] for n in order))
        self.offsets = array("i", (offsets[n] for n in order)) if offsets is not None else None

    def _key(self, n: int) -> str:
        text = self._keys[self.ids[n]]
        return text[self.offsets[n] :] if self.offsets is not None else text

    def starting_with(self, prefix: str) -> Sequence[int]:
        positions = range(len(self.ids))
        lo = bisect_left(positions, prefix, key=self._key)
        after = _after_all_starting_with(prefix)
        hi = bisect_left(positions, after, lo, key=self._key) if after is not None else len(self.ids)
        return self.ids[lo:hi]


def _after_all_starting_with(prefix: str) -> str | None:
    """The least string greater than every string that starts with ``prefix`` (None: no string is)."""
    while prefix and prefix[-1] == "\U0010ffff":
        prefix = prefix[:-1]
    return prefix[:-1] + chr(ord(prefix[-1]) + 1) if prefix else None


def scan_pause_ids(texts: Sequence[str], stops: tuple[str, ...], word_stops: Collection[str] = frozenset()) -> frozenset[int]:
    """The pause ids by a pass over every token text: what :class:`PauseTokens` replaced, kept as
    the reference its cost is measured against (``python -m relay_serve.bench.hotpath``)."""
    starts: set[str] = set()
    ends: dict[str, bool] = {}
    inner: set[str] = set()
    for s in stops:
        if _looks_ahead(s, word_stops):
            at_word_start = s in word_stops and _is_word_char(s[0])
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
    return not word_start or len(text) == len(prefix) or not _is_word_char(text[-len(prefix) - 1])


def first_stop(text: str, stops: Sequence[str], word_stops: Sequence[str] = (), before: str = "") -> tuple[int, str] | None:
    """The first stop string (in list order, as vLLM's check) that occurs in ``text``, and where
    its match ends; None when none does. A word stop counts only where the character before it (in
    ``before`` + ``text``) is no letter, digit or underscore. At a pause every stop found completed
    with the last token (an earlier one would have stopped the request earlier)."""
    for s in stops:
        pos = text.find(s)
        while pos != -1 and s in word_stops and _is_word_char(s[0]) and _is_word_char((before + text[:pos])[-1:] or " "):
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
        at_word_start = s in word_stops and _is_word_char(s[0])
        for j in range(1, len(s)):
            if full.endswith(s[:j]) and (not at_word_start or not _is_word_char(full[-j - 1 : -j] or " ")):
                return True
    return False
