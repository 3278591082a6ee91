"""The vocabulary the relay core speaks: segment requests, engine chunks, the backend interface,
and what a finished generation reports. Knows nothing of Ray or vLLM."""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from array import array
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidatorFunctionWrapHandler, WrapValidator

if TYPE_CHECKING:
    from relay_serve.relay.detok import TokenStream

ModelRole = Literal["large", "small"]
Streaming = bool | Literal["first"]  # "first": the first token at once, the rest in one piece
FinishReason = Literal["stop", "length", "abort"]


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as 4-byte little-endian unsigned integers: what a context crosses the segment
    channel as. A 32k-token context packs in about 0.2 ms and unpacks in 0.4 ms (one list of
    ints, no per-item checks), where a msgpack list and pydantic's check of it cost 1.2 ms."""
    packed = array("I", token_ids)
    if packed.itemsize != 4:  # never on the platforms vLLM runs on; exact anyway
        return np.asarray(token_ids, dtype="<u4").tobytes()
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _token_ids(value: Any, handler: ValidatorFunctionWrapHandler) -> list[int]:
    """A list of token ids, or the same packed (:func:`pack_token_ids`): every 4 bytes are one id."""
    if isinstance(value, bytes | bytearray | memoryview):
        if len(value) % 4:
            raise ValueError(f"packed token ids are 4 bytes each; got {len(value)} bytes")
        return np.frombuffer(value, dtype="<u4").tolist()
    return handler(value)


TokenIds = Annotated[list[int], WrapValidator(_token_ids)]


class SamplingSettings(BaseModel):
    """Sampling settings of one generation; every segment uses them (with a derived seed)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None

    def for_segment(self, index: int) -> SamplingSettings:
        """The settings of the ``index``-th engine request: the first samples with the request's own
        seed (a one-model request then writes what the engine alone writes for that seed); each later
        one with a seed derived from both."""
        if self.seed is None or index == 0:
            return self
        return self.model_copy(update={"seed": (self.seed * 1_000_003 + index) % (2**31 - 1)})


class InvalidRequest(ValueError):
    """A request that a model's engine refuses as invalid (the client's fault, HTTP 400 naming
    ``param``): never retried, never counted as an engine failure."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


class ContextGap(RuntimeError):
    """A segment that continues a context from ``context_base`` reached a replica whose session
    does not hold that much of it (the session ended, the replica restarted): the sender sends the
    whole context again."""


class EngineTraits(BaseModel):
    """What the router must know of a model's engine before it sends it a request, as the model's
    replicas report it."""

    model_config = ConfigDict(extra="ignore")

    speculative: str | None = Field(None, description="the engine's speculative decoding, e.g. 'draft_model k=8' (None: none)")
    greedy_only: str | None = Field(
        None, description="why the engine runs only greedy sampling (temperature 0) correctly; None: any sampling"
    )

    def check(self, model: ModelRole, sampling: SamplingSettings) -> None:
        """Raise :class:`InvalidRequest` (naming ``temperature``) for sampling this engine would run wrongly."""
        if self.greedy_only is not None and sampling.temperature > 0:
            raise InvalidRequest(
                f"temperature={sampling.temperature:g}: the {model} model's engine runs only greedy sampling correctly "
                f"({self.greedy_only}); send temperature 0",
                param="temperature",
            )


class SegmentRequest(BaseModel):
    """One engine request: continue ``prompt_token_ids`` until a stop string, EOS or ``max_tokens``."""

    model_config = ConfigDict(extra="forbid")

    model: ModelRole
    prompt_token_ids: TokenIds = Field(description="a list, or packed as bytes (4 little-endian bytes an id: the channel's form)")
    max_tokens: int = Field(ge=1)
    stop: list[str] = Field(default_factory=list)
    word_stops: list[str] = Field(
        default_factory=list,
        description="those of stop that count only at a word start (cues); an engine that cannot tell stops at any match",
    )
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    resume: bool = Field(
        False, description="continue the generation's resumable engine request on this replica (its KV kept between segments)"
    )
    session_id: str = Field(description="the generation's id: routes every segment to the replica holding its prefix")
    unchanged: int = Field(
        0,
        ge=0,
        description="the router's own: the first `unchanged` context tokens are those this model's previous request of the "
        "generation had, followed by the output it got back; a transport that reaches the same session leaves them out",
    )
    context_base: int = Field(
        0,
        ge=0,
        description="on the wire: the context is the first `context_base` tokens the replica's session holds for this "
        "generation, then prompt_token_ids (a resumable segment sends only what is new; ContextGap when it lacks them)",
    )


class EngineChunk(BaseModel):
    """A streamed piece of an engine request's output. The last chunk has ``finished`` set."""

    token_ids: list[int] = Field(default_factory=list, description="tokens new in this chunk")
    text: str = Field(default="", description="the engine's own text for them (stop-truncated; the relay decodes ids itself)")
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = Field(default=None, description="the stop string that matched, if any")
    cached_tokens: int = Field(default=0, description="prompt tokens served from the prefix cache")
    replica_id: str | None = None
    engine_s: float | None = Field(default=None, description="seconds the request spent inside the replica")
    ttft_s: float | None = Field(default=None, description="seconds from the engine's receipt of the request to its first token")
    decode_s: float | None = Field(default=None, description="seconds of decode steps inside the engine (after a first token)")
    decode_steps: int | None = Field(default=None, description="the decode steps decode_s covers (output tokens - 1 for a plain request)")
    pauses: int = Field(default=0, description="times a resumable request paused on a possible stop that was none")


class ModelIdentity(BaseModel):
    """What a model deployment says of itself, so that the router reads no model files: its
    fingerprint (of its weights and config, not of the path or hub id they came from), its
    tokenizer (as files) and its engine's context length."""

    model_fingerprint: str
    tokenizer_fingerprint: str
    max_model_len: int = Field(gt=0)
    tokenizer_files: dict[str, bytes] = Field(default_factory=dict, repr=False, description="empty unless asked for")


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
        ``SmallModelUnavailable``."""

    def small_refusal(self) -> str | None:
        """Why a small-model segment should not be sent now (its deployment is past its queue
        bound, or did not answer lately), or None when it may."""
        return None

    def prepare(self, session_id: str, models: Sequence[ModelRole]) -> None:
        """A generation starts and will use ``models``: the backend may get ready for them (take
        a replica) before its first request to each."""

    def release(self, session_id: str) -> None:
        """The generation ended: forget it (give back what ``prepare`` or its requests took)."""

    def has_replied(self, model: ModelRole) -> bool:
        """Whether a segment of ``model`` got an answer from this backend yet (so its deployment
        has a replica): what a deployment that may scale to zero is asked only after."""
        return True

    async def traits(self, model: ModelRole) -> EngineTraits:
        """What ``model``'s engine can run (its replicas say); no limits when unknown."""
        return EngineTraits()

    def stats(self) -> dict[str, int]:
        """Counts for ``/v1/relay/stats`` (sessions pinned to replicas, leases, connections)."""
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
    ttft_s: float | None = Field(None, description="seconds from the engine's receipt to the first token (queue and prefill)")
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
    cue_set_version: str | None = Field(default=None, description="the active cue set's version, or 'request' for relay_cues")
    cues: list[str] = Field(default_factory=list, description="the cues this relay generation handed off on")
    degraded: bool = Field(default=False, description="small-model segments were written by the large model")
    degraded_reason: str | None = Field(default=None, description="why (the first reason, if several)")
    kept_on_large: int = Field(
        default=0, description="handoffs the large model kept: small deployment overloaded, unavailable or failed"
    )
    retries: int = Field(default=0, description="engine requests sent again after a failure (a replica died)")
    explored: bool = Field(
        default=False, description="online cue calibration: the large model wrote all the reasoning (evidence on the selected cues)"
    )
    false_stops: int = Field(
        default=0, description="large-model segments that stopped on a cue's stop string where no cue was (a new engine request)"
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
