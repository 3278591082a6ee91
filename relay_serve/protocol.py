"""The wire protocol between a router replica and the model replicas: the messages (a segment
request, the engine chunks it streams back, a replica's traits and identity, the errors that cross
the wire typed) and the segment channel that carries them, a direct TCP connection from a router
replica to a model replica. The relay core builds the messages, the router sends them, a replica
serves them with its engine. The channel's router end is ``relay_serve/router/channel.py``, the
replica's ``relay_serve/replica/channel.py``.

A Ray Serve handle call costs 3-5 ms on a 2-core machine (its router, the rejection protocol, the
replica's request wrapper, metrics); a relay generation makes one engine request per segment, and
that cost was most of a handoff. Serve still places, admits, autoscales and watches the replicas,
at the granularity of a generation (a *lease*, see ``transport.py``); the segments of a leased
generation travel over this channel instead.

Wire format: frames of a 4-byte big-endian length and a msgpack body (msgspec), at most
``MAX_FRAME_BYTES`` (``MAX_HELLO_BYTES`` before the hello is checked). Every lease gets a token of
its own, through Ray Serve, valid while the lease lives: the client's first frame is ``{"op":
"hello", "token": ...}`` with a live lease's token (else the connection is closed), and every
``{"op": "generate", "id", "stream", "token", "request"}`` carries the token of the lease it runs
under (a segment under an ended lease is refused: Serve's admission and the API keys cannot be
gone around with a token seen once). Also ``{"op": "cancel", "id"}``, ``{"op": "end",
"session"}`` (a generation ended: its resumable engine request goes) and ``{"op": "attach",
"token"}`` (a lease the router just took will be used on this connection). A lease is bound to
every connection that attached it or sent a segment under it, and ends when one of them closes:
a router that dies (its process gone, its sockets closed by the OS; TCP keepalive where its node
went silent) frees its replica slots at once, not at the lease's TTL. Replica to client: ``{"id",
"chunk"}`` (an EngineChunk as a mapping; a non-streamed request gets one, the whole output) or
``{"id", "error"}`` (with ``"invalid": param`` when the engine refuses the request as invalid:
the client's fault, never retried; with ``"gap": true`` when the segment continues a context the
replica's session does not hold: the router sends it whole). Requests are multiplexed on one connection by id; a
closed connection fails
every request still open on it, and the replica aborts every engine request of a connection that
closed. A request whose chunks the router does not read fails after ``MAX_PENDING_CHUNKS``.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)

# ---- messages -----------------------------------------------------------------------------------

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

    speculative: str | None = Field(
        None, description="the engine's speculative decoding, e.g. 'draft_model k=8' (None: none)"
    )
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
    prompt_token_ids: TokenIds = Field(
        description="a list, or packed as bytes (4 little-endian bytes an id: the channel's form)"
    )
    max_tokens: int = Field(ge=1)
    stop: list[str] = Field(default_factory=list)
    word_stops: list[str] = Field(
        default_factory=list,
        description="those of stop that count only at a word start (cues); an engine that cannot tell stops at any "
        "match",
    )
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    resume: bool = Field(
        False,
        description="continue the generation's resumable engine request on this replica (its KV kept between segments)",
    )
    session_id: str = Field(description="the generation's id: routes every segment to the replica holding its prefix")
    unchanged: int = Field(
        0,
        ge=0,
        description="the router's own: the first `unchanged` context tokens are those this model's previous request of "
        "the "
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
    text: str = Field(
        default="", description="the engine's own text for them (stop-truncated; the relay decodes ids itself)"
    )
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = Field(default=None, description="the stop string that matched, if any")
    cached_tokens: int = Field(default=0, description="prompt tokens served from the prefix cache")
    replica_id: str | None = None
    engine_s: float | None = Field(default=None, description="seconds the request spent inside the replica")
    ttft_s: float | None = Field(
        default=None, description="seconds from the engine's receipt of the request to its first token"
    )
    decode_s: float | None = Field(
        default=None, description="seconds of decode steps inside the engine (after a first token)"
    )
    decode_steps: int | None = Field(
        default=None, description="the decode steps decode_s covers (output tokens - 1 for a plain request)"
    )
    pauses: int = Field(default=0, description="times a resumable request paused on a possible stop that was none")


class ModelIdentity(BaseModel):
    """What a model deployment says of itself, so that the router reads no model files: its
    fingerprint (of its weights and config, not of the path or hub id they came from), its
    tokenizer (as files) and its engine's context length."""

    model_fingerprint: str
    tokenizer_fingerprint: str
    max_model_len: int = Field(gt=0)
    tokenizer_files: dict[str, bytes] = Field(default_factory=dict, repr=False, description="empty unless asked for")


# ---- the channel's frames -----------------------------------------------------------------------

FRAME = struct.Struct("!I")
MAX_FRAME_BYTES = 64 << 20
MAX_HELLO_BYTES = 4096  # what an unauthenticated connection may send
MAX_PENDING_CHUNKS = 4096  # chunks of one request the router has not read yet
HELLO_TIMEOUT_S = 10.0

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class ChannelError(ConnectionError):
    """The connection to a replica could not be made, or closed (the replica died or refused it)."""


class RemoteError(RuntimeError):
    """The replica could not serve one request (its message says why)."""


def pack(message: dict[str, Any]) -> bytes:
    body = _encoder.encode(message)
    return FRAME.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader, limit: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    """The next frame; IncompleteReadError at the end of the stream, ChannelError when malformed
    or over ``limit`` bytes."""
    (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    if size > limit:
        raise ChannelError(f"a frame of {size} bytes exceeds the limit of {limit}")
    try:
        message = _decoder.decode(await reader.readexactly(size))
    except msgspec.DecodeError as e:
        raise ChannelError(f"a malformed frame: {e}") from e
    if not isinstance(message, dict):
        raise ChannelError("a frame that is not a mapping")
    return message


KEEPALIVE_S = (10, 5, 3)  # idle seconds before the first probe, between probes, probes: a silent peer is gone in 25 s


def no_delay(writer: asyncio.StreamWriter, keepalive: bool = False) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if keepalive and hasattr(socket, "TCP_KEEPIDLE"):  # Linux: a router whose node went silent
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in zip(
                (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT), KEEPALIVE_S, strict=True
            ):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
