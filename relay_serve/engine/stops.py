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
is busy). :class:`PauseTokens` computes the pause token ids from the vocabulary's texts;
:func:`first_stop` and :func:`lookahead_stops` are the checks at a pause. Pure: no vLLM.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from functools import lru_cache


def _is_word_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def ends_with_space(stop: str) -> bool:
    return stop[-1:].isspace()


class PauseTokens:
    """The pause token ids of sets of stop strings, for one vocabulary (``texts[i]`` is the
    decoded text of token ``i`` alone)."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts = list(texts)
        self.ids = lru_cache(maxsize=256)(self._ids)

    def _ids(self, stops: tuple[str, ...], word_stops: frozenset[str] = frozenset()) -> frozenset[int]:
        """Token ids after which a request with these stop strings must pause."""
        starts: set[str] = set()  # a token starting with one of these may complete a stop
        ends: dict[str, bool] = {}  # one ending with one of these may end a proper prefix (look ahead);
        # True: only where that prefix starts a word (a word stop's)
        inner: set[str] = set()  # one that is exactly one of these may continue such a prefix
        for s in stops:
            if _looks_ahead(s, word_stops):
                at_word_start = s in word_stops and _is_word_char(s[0])
                for j in range(1, len(s)):
                    ends[s[:j]] = ends.get(s[:j], True) and at_word_start
                    inner.update(s[i:j] for i in range(1, j))
            else:
                starts.update(s[j:] for j in range(1, len(s)))
        non_ascii = any(not s.isascii() for s in stops)
        out = set()
        for tid, text in enumerate(self.texts):
            if not text:
                continue
            if (
                any(s in text for s in stops)
                or text in inner
                or any(text.startswith(x) for x in starts)
                or any(_ends_with(text, e, word) for e, word in ends.items())
                or (non_ascii and "\ufffd" in text)  # a piece of a multi-byte character
            ):
                out.add(tid)
        return frozenset(out)


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
