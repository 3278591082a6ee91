"""The segment channel's protocol: a direct TCP connection from a router replica to a model replica.

This module is what both ends share (frames, limits, errors); the router's end is
``relay_serve/router/channel.py``, the replica's ``relay_serve/replica/channel.py``.

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
replica's session does not hold: the router sends it whole). Requests are multiplexed on one connection by id; a closed connection fails
every request still open on it, and the replica aborts every engine request of a connection that
closed. A request whose chunks the router does not read fails after ``MAX_PENDING_CHUNKS``.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgspec

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
            for option, value in zip((socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT), KEEPALIVE_S):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)

