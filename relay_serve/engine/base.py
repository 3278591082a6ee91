"""The engine interface a ModelServer wraps. Implemented by VLLMEngine (vllm_engine.py and its
logits processor vllm_swaps.py: the only modules that import vLLM) and by fakes in the tests.

Besides one request per segment (``generate``), an engine may offer *resumable* requests
(``resumable``): one engine request that pauses at the end of every chunk of input and resumes
with the next, keeping its KV cache in between. ``session.py`` drives a relay generation's segments
on one model through such a request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from relay_serve.protocol import (
    EngineChunk,
    EngineTraits,
    SamplingSettings,
    SegmentRequest,
)
from relay_serve.relay.detok import TokenStream, WindowStream


class SpecDecodeCounts(BaseModel):
    """A speculative engine's drafts since it started (vLLM's spec-decode statistics)."""

    drafts: int = Field(0, description="speculative steps (one draft of up to k tokens for one request)")
    draft_tokens: int = Field(0, description="tokens proposed by the draft")
    accepted_tokens: int = Field(0, description="proposed tokens the target model accepted")

    def acceptance_length(self) -> float | None:
        """Mean tokens a speculative step writes: the accepted ones plus the target's own (vLLM's definition)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None

    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def __sub__(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        return SpecDecodeCounts(
            drafts=self.drafts - other.drafts,
            draft_tokens=self.draft_tokens - other.draft_tokens,
            accepted_tokens=self.accepted_tokens - other.accepted_tokens,
        )


class EngineInfo(BaseModel):
    model: str
    max_model_len: int
    tokenizer_fingerprint: str = Field(description="sha256 of the tokenizer's vocabulary and added tokens")
    traits: EngineTraits = Field(
        default_factory=EngineTraits, description="what sampling it runs correctly, its speculation"
    )
    spec_decode: SpecDecodeCounts | None = Field(None, description="a speculative engine's drafts so far")


@dataclass
class ChunkOutput:
    """New output of a resumable request's current chunk; the last one has ``finish`` set."""

    token_ids: list[int]
    finish: Literal["stop", "length"] | None = None  # stop: after a pause token or EOS
    eos: bool = False
    cached_tokens: int = 0  # of the chunk's input, served from the prefix cache (a fresh request's first chunk)
    ttft_s: float | None = None  # the chunk's time from receipt to its first token
    decode_s: float | None = None  # from the chunk's first token to its last
    decode_steps: int = 0


class ResumableRequest(ABC):
    """One engine request fed in chunks: each chunk appends token ids to the request's context and
    generates until a pause token, EOS or the chunk's ``max_tokens``, then the request waits for
    the next chunk with its KV cache held. The last token a chunk sampled is not in that cache
    (a next chunk that keeps it feeds it again)."""

    @abstractmethod
    def chunk(
        self,
        token_ids: list[int],
        max_tokens: int,
        pause_ids: Collection[int],
        sampling: SamplingSettings,
        continued: bool = False,
    ) -> AsyncIterator[ChunkOutput]:
        """Feed ``token_ids`` and stream what the request writes until this chunk ends.
        ``continued``: the chunk goes on with the segment after a pause (its last fed token is the
        segment's own, so a stop can complete with its first token); a ``PauseIds`` with swaps is
        looked ahead inside an engine that has spare ids, which gives back the token a stand-in
        stood for."""

    @abstractmethod
    async def close(self) -> None:
        """End the request (aborted in the engine; its KV cache is freed)."""


class Engine(ABC):
    """One inference engine for one model."""

    @abstractmethod
    def generate(self, request: SegmentRequest, request_id: str, stream: bool = True) -> AsyncIterator[EngineChunk]:
        """Stream the output of one request; closing the iterator aborts it. Without ``stream``
        the engine may deliver the whole output as one final chunk."""

    def can_resume(self) -> bool:
        """Whether this engine offers resumable requests (else every segment is a request of its own)."""
        return False

    def resumable(self, request_id: str) -> ResumableRequest:
        """A new resumable request (engines whose ``can_resume`` is true)."""
        raise NotImplementedError

    def token_texts(self) -> list[str]:
        """The text of every token id alone (for the pause tokens of stop strings)."""
        raise NotImplementedError

    def spare_ids(self) -> list[int]:
        """Token ids the model never writes that its resumable requests take as stand-ins: the
        look-ahead of a stop inside the engine (``PauseIds.swaps``). None here: every look-ahead
        pauses."""
        return []

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, as the engine's own stop-string check would see it."""
        raise NotImplementedError

    def stream(self, context: Sequence[int] = ()) -> TokenStream:
        """Incremental ``decode`` of the tokens after ``context`` (a window unless an engine has better)."""
        return WindowStream(self.decode, context)

    async def score(self, token_ids: list[int], start: int, request_id: str, top_k: int = 2) -> list[list[float]]:
        """Teacher-forced: the ``top_k`` largest log-probabilities at every position of
        ``token_ids`` from ``start`` (online cue calibration scores served generations with it)."""
        raise NotImplementedError

    @abstractmethod
    def info(self) -> EngineInfo: ...

    @abstractmethod
    async def check_health(self) -> None:
        """Raise when the engine cannot serve."""

    def shutdown(self) -> None:  # noqa: B027 - optional
        pass
