"""Stop strings on a resumable engine request, which can only stop on token ids.

vLLM's resumable requests (streaming input) refuse stop strings: a request pauses only after a
stop token id, EOS or its ``max_tokens``. A stop string ``S`` first occurs in the generated text
when some token ``t`` is appended; then ``t``'s text holds all of ``S``, or the text before ``t``
ends with a non-empty proper prefix ``S[:j]`` and ``t``'s text starts with the rest ``S[j:]``.
A request that pauses after every token that can do either sees every stop exactly where vLLM's
stop-string check would: at the token that completes it. For most stop strings those tokens are
few (for ``"Thus,"``: the tokens that start with ``","``, ``"s,"``, ``"us,"`` or ``"hus,"``, or
hold ``"Thus,"``). For one that ends in white space (``". "``, ``"So "``) they are most of the
vocabulary, so the request pauses instead after a token that can *end a proper prefix* (its text
ends with ``S[:j]``, or is exactly ``S[i:j]`` for a prefix spread over several tokens) and looks
one token ahead (``max_tokens`` 1) whenever the text does end with one.

:class:`PauseTokens` computes the pause token ids from the vocabulary's texts; :func:`first_stop`
and :func:`lookahead_stops` are the checks at a pause. A stop string listed as a *word stop*
counts only at a word start (a cue: ``"so "`` never stops inside ``"also "``). Pure: no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
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
        # True: only where the prefix starts a word (a word stop's)
        inner: set[str] = set()  # one that is exactly one of these may continue such a prefix
        for s in stops:
            at_word_start = s in word_stops and _is_word_char(s[0])
            for j in range(1, len(s)):
                if ends_with_space(s):
                    ends[s[:j]] = ends.get(s[:j], True) and at_word_start
                    inner.update(s[i:j] for i in range(1, j))
                else:
                    starts.add(s[j:])
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


def lookahead_stops(text: str, stops: Sequence[str]) -> bool:
    """Whether ``text`` ends with a non-empty proper prefix of a stop string ending in white space
    (whose completion the pause tokens do not catch: the next token must be seen)."""
    return any(text.endswith(s[:j]) for s in stops if ends_with_space(s) for j in range(1, len(s)))
