"""The relay core's own vocabulary: the backend interface it runs segments through, and what a
finished generation reports (its trace and usage, which the API's ``usage.relay`` carries). The
messages a segment is made of are the wire protocol's (``relay_serve/protocol.py``). Knows nothing
of Ray or vLLM."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel, Field

from relay_serve.protocol import (
    EngineChunk,
    EngineTraits,
    FinishReason,
    ModelIdentity,
    ModelRole,
    SegmentRequest,
    Streaming,
)

if TYPE_CHECKING:
    from relay_serve.relay.detok import TokenStream


class Backend(ABC):
    """Runs segment requests on the large or the small model."""

    @abstractmethod
    async def identity(self, model: ModelRole, tokenizer: bool = True) -> ModelIdentity:
        """What ``model``'s deployment serves (``ModelIdentity``, with its tokenizer's files when
        ``tokenizer``); waits for a replica."""

    @abstractmethod
    def generate(
        self, request: SegmentRequest, stream: Streaming = True, timeout_s: float | None = None
    ) -> AsyncIterator[EngineChunk]:
        """The output of one request; closing the iterator early must abort the request. Without
        ``stream`` the backend may deliver it in one chunk (fewer messages; nobody is watching);
        with ``"first"``, the first token at once and the rest in one chunk. With ``timeout_s``
        (the small model's relay work) a request without a first token by then raises
        ``ModelUnavailable``."""

    def refusal(self, model: ModelRole) -> str | None:
        """Why a segment of ``model`` should not be sent now (its deployment is past this
        backend's bound on segments in flight, or did not answer lately), or None when it may.
        What to do then is the policy's rule (relay: the large model keeps the small one's work)."""
        return None

    def prepare(self, session_id: str, models: Sequence[ModelRole]) -> None:
        """A generation starts and will use ``models``: the backend may get ready for them (take
        a replica) before its first request to each. Nothing by default."""
        return None

    def release(self, session_id: str) -> None:
        """The generation ended: forget it (give back what ``prepare`` or its requests took).
        Nothing by default."""
        return None

    def has_replied(self, model: ModelRole) -> bool:
        """Whether a segment of ``model`` got an answer from this backend yet (so its deployment
        has a replica): what a deployment that may scale to zero is asked only after."""
        return True

    async def traits(self, model: ModelRole) -> EngineTraits:
        """What ``model``'s engine can run (its replicas say); no limits when unknown."""
        return EngineTraits()

    def stats(self) -> dict[str, int]:
        """Counts for ``/v1/relay/stats`` (generations pinned to replicas, leases, connections)."""
        return {}

    def segments_in_flight(self) -> dict[ModelRole, int] | None:
        """Segments this backend has in flight per model; None when it does not count them."""
        return None

    def lease_counts(self) -> tuple[dict[str, int] | None, dict[str, int] | None]:
        """Leases held and idle per model, for the metrics' gauges; None, None when the backend
        takes no leases."""
        return None, None

    def close(self) -> None:  # noqa: B027 - optional
        """The router is stopping: give back whatever is held (leases, connections)."""


class TextCodec(Protocol):
    """The tokenizer both models share (the relay hands token ids over)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def stream(self, context: Sequence[int] = ()) -> TokenStream:
        """Incremental ``decode`` of the tokens that follow ``context`` (``relay/detok.py``)."""
        ...


class TraceSegment(BaseModel):
    """A maximal run of output written by one model."""

    model: ModelRole
    start: int = Field(description="character offset in the completion text")
    end: int
    tokens: int
    cue: str | None = Field(default=None, description="the cue (or </think>) that opened this segment")
    forced: bool = Field(default=False, description="opened by a </think> the router inserted at the budget's end")


class EngineRequestRecord(BaseModel):
    """One engine request of a generation, for tracing and affinity measurements."""

    model: ModelRole
    replica_id: str | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    committed: bool = Field(description="false for a rejected draft")
    engine_s: float | None = Field(None, description="seconds inside the replica")
    ttft_s: float | None = Field(
        None, description="seconds from the engine's receipt to the first token (queue and prefill)"
    )
    decode_s: float | None = Field(None, description="seconds of decode steps inside the engine")
    decode_steps: int | None = Field(None, description="the decode steps decode_s covers")
    pauses: int = Field(0, description="pauses of a resumable request on a possible stop that was none")
    wall_s: float = Field(0.0, description="seconds from the router's call to the last chunk")


class RelayUsage(BaseModel):
    large_tokens: int = 0
    small_tokens: int = 0
    switches: int = 0
    segments: int = 0
    engine_requests: int = 0
    cached_prompt_tokens: int = 0
    discarded_tokens: int = Field(default=0, description="generated but not in the output (rejected drafts)")
    cue_set_version: str | None = Field(
        default=None, description="the active cue set's version, or 'request' for relay_cues"
    )
    cues: list[str] = Field(default_factory=list, description="the cues this relay generation handed off on")
    degraded: bool = Field(default=False, description="small-model segments were written by the large model")
    degraded_reason: str | None = Field(default=None, description="why (the first reason, if several)")
    kept_on_large: int = Field(
        default=0, description="handoffs the large model kept: small deployment overloaded, unavailable or failed"
    )
    retries: int = Field(default=0, description="engine requests sent again after a failure (a replica died)")
    explored: bool = Field(
        default=False,
        description="online cue calibration: the large model wrote all the reasoning (evidence on the selected cues)",
    )
    false_stops: int = Field(
        default=0,
        description="large-model segments that stopped on a cue's stop string where no cue was (a new engine request)",
    )
    policy: str | None = Field(default=None, description="auto: the policy it ran this generation as (relay or large)")
    wall_s: float = Field(0.0, description="seconds the router spent on the generation")
    engine_s: float = Field(0.0, description="of which inside engines (as the replicas measured it)")


class Handoff(BaseModel):
    """One switch of model as the router saw it: from the end of the last committed segment of
    the other model (a cue, a sentence end) to the first token of this model's segment."""

    to: ModelRole
    latency_s: float


class GenerationResult(BaseModel):
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: RelayUsage
    trace: list[TraceSegment]
    engine_requests: list[EngineRequestRecord] = Field(default_factory=list)
    handoffs: list[Handoff] = Field(default_factory=list)


class TextDelta(BaseModel):
    text: str
    model: ModelRole
