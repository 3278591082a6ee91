"""Token ids to text as they come, one token at a time (incremental detokenization).

A token's text depends on the tokens before it (byte-level merges, a multi-byte character split
over several tokens, a decoder that strips the space of the first token), so a token cannot be
decoded alone. A :class:`TokenStream` keeps what it needs of the left context and gives, for each
token, the text it adds, or ``None`` while the text so far ends inside a character. After
``MAX_PENDING`` tokens that still end inside one, their text is what decoding them gives (replacement
characters): a model that writes broken bytes still moves the text on, as a whole decode would.

Two kinds: a fast tokenizer's own incremental decoder (``tokenizer.FastStream``: tokenizers'
``DecodeStream``, what vLLM's detokenizer uses, O(1) a token), and :class:`WindowStream` for a codec
that only decodes whole lists (two decodes of a few tokens a token). Knows nothing of tokenizers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

WINDOW = 8  # tokens of left context that decide the next token's text
MAX_PENDING = 4  # a UTF-8 character has at most 4 bytes, so at most 4 tokens of a byte-level BPE

Decode = Callable[[Sequence[int]], str]


def window_text(decode: Decode, context: Sequence[int], new: Sequence[int]) -> str:
    """The text ``new`` adds after ``context``: decoded with the last ``WINDOW`` tokens of the
    context and without them, the difference (``new`` alone where the two disagree on the context)."""
    left = list(context[-WINDOW:])
    before, full = decode(left), decode(left + list(new))
    return full[len(before) :] if full.startswith(before) else decode(new)


class TokenStream(ABC):
    """The text of token ids as they come. ``step(id)`` is the text the token adds (with that of
    the tokens before it that had none yet), or ``None`` while the text ends inside a character."""

    def __init__(self, decode: Decode, context: Sequence[int] = ()) -> None:
        self.decode = decode
        self.ids = list(context[-WINDOW:])  # the left context, then the tokens without text yet
        self.pending = 0

    def step(self, token_id: int) -> str | None:
        self.ids.append(token_id)
        self.pending += 1
        text = self._step(token_id)
        if text is None and self.pending >= MAX_PENDING:  # broken bytes: their replacement characters
            n = len(self.ids)
            text = window_text(self.decode, self.ids[: n - self.pending], self.ids[n - self.pending :])
            self._resync()
        if text is not None:
            self.pending = 0
            del self.ids[:-WINDOW]
        return text

    @abstractmethod
    def _step(self, token_id: int) -> str | None:
        """The text so far's new end after ``token_id`` (already in ``ids``), or None mid-character."""

    def _resync(self) -> None:
        """The stream's own state restarts after ``ids`` (its text was given by a whole decode).
        A stream that keeps no state of its own does nothing."""
        return None


class WindowStream(TokenStream):
    """For a codec that decodes whole lists only: each token's text from two decodes of the window."""

    def _step(self, token_id: int) -> str | None:
        n = len(self.ids)
        text = window_text(self.decode, self.ids[: n - self.pending], self.ids[n - self.pending :])
        return None if text.endswith("\ufffd") else text
