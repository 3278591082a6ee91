"""The segment channel: a direct TCP connection from a router replica to a model replica.

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
import contextlib
import hmac
import itertools
import logging
import secrets
import socket
import struct
from collections.abc import AsyncIterator, Hashable
from typing import Any, Protocol

import msgspec

from relay_serve.relay.types import ContextGap, InvalidRequest

log = logging.getLogger(__name__)

FRAME = struct.Struct("!I")
MAX_FRAME_BYTES = 64 << 20
MAX_HELLO_BYTES = 4096  # what an unauthenticated connection may send
MAX_PENDING_CHUNKS = 4096  # chunks of one request the router has not read yet
HELLO_TIMEOUT_S = 10.0

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()



class SegmentHandler(Protocol):
    """What a SegmentServer serves (the ModelServer); ``peer`` names the connection."""

    def segment(self, request: dict[str, Any], stream: bool, peer: Hashable | None = None) -> AsyncIterator[dict[str, Any]]:
        """EngineChunk mappings of one segment request (one for a non-streamed request)."""

    async def end_session(self, session_id: str, peer: Hashable | None = None) -> None:
        """A generation ended (``peer``: the connection that says so; only its own sessions end)."""

    async def peer_closed(self, peer: Hashable) -> None:
        """A connection closed: what it started is over."""


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


def _no_delay(writer: asyncio.StreamWriter, keepalive: bool = False) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if keepalive and hasattr(socket, "TCP_KEEPIDLE"):  # Linux: a router whose node went silent
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in zip((socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT), KEEPALIVE_S):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


# ---- the replica's end ---------------------------------------------------------------------------


class SegmentServer:
    """Serves segment requests on ``host`` (port 0: any free port) with ``handler``, to holders of
    a live lease token (:meth:`issue_token`, :meth:`revoke_token`)."""

    def __init__(self, handler: SegmentHandler, host: str, port: int = 0) -> None:
        self.handler = handler
        self.host = host
        self.port = port
        self._tokens: set[bytes] = set()
        self._ended: dict[str, asyncio.Event] = {}  # per live lease token: set when a connection it was used on closes
        self._bound: dict[int, set[str]] = {}  # per connection: the lease tokens used on it
        self.connections = 0
        self.refused = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._peers = itertools.count(1)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def issue_token(self) -> str:
        """A token for a new lease: it opens connections and admits segments until revoked."""
        token = secrets.token_urlsafe(24)
        self._tokens.add(token.encode())
        return token

    def revoke_token(self, token: str) -> None:
        self._tokens.discard(token.encode())
        self._ended.pop(token, None)

    async def lease_ended(self, token: str) -> None:
        """Returns when a connection that used ``token`` closes (its router is gone or gave up)."""
        await self._ended.setdefault(token, asyncio.Event()).wait()

    def _bind(self, token: str, conn: int) -> None:
        self._bound.setdefault(conn, set()).add(token)

    def _valid(self, token: Any) -> bool:
        if not isinstance(token, str):
            return False
        given, found = token.encode(), False
        for live in list(self._tokens):
            found |= hmac.compare_digest(given, live)  # every live token, in constant time each
        return found

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connection, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("segment channel listening on %s", self.address)

    def shutdown(self) -> None:
        """Stop listening and drop every connection (their open requests are aborted here and
        fail at once on the routers, which retry elsewhere). The replica's shutdown calls it."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        self._tokens.clear()

    async def close(self) -> None:
        self.shutdown()
        if self._server is not None:
            await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _no_delay(writer, keepalive=True)
        peer = writer.get_extra_info("peername")
        conn = next(self._peers)
        tasks: dict[int, asyncio.Task] = {}
        self._writers.add(writer)
        try:
            try:
                hello = await asyncio.wait_for(read_message(reader, MAX_HELLO_BYTES), HELLO_TIMEOUT_S)
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                self.refused += 1
                return
            if hello.get("op") != "hello" or not self._valid(hello.get("token")):
                self.refused += 1
                log.warning("segment channel: refused a connection from %s (no valid token)", peer)
                return
            self.connections += 1
            self._bind(hello["token"], conn)
            while True:
                try:
                    message = await read_message(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the router closed the connection (or died): its requests go with it
                op, rid = message.get("op"), message.get("id")
                if op == "attach":
                    if self._valid(message.get("token")):
                        self._bind(message["token"], conn)
                    continue
                if op == "end" and isinstance(message.get("session"), str):
                    await self.handler.end_session(message["session"], conn)  # only a session of this connection
                    continue
                if not isinstance(rid, int):
                    log.warning("segment channel: a message without an id from %s; closing", peer)
                    return
                if op == "generate" and rid not in tasks:
                    if not self._valid(message.get("token")):
                        writer.write(pack({"id": rid, "error": "LeaseExpired: the segment's lease is not live on this replica"}))
                        continue
                    self._bind(message["token"], conn)
                    request, stream = message.get("request"), message.get("stream")
                    stream = stream if stream == "first" else bool(stream)
                    tasks[rid] = asyncio.create_task(self._generate(rid, request, stream, writer, tasks, conn))
                elif op == "generate":  # an id already running here: an error for that id, the connection lives on
                    log.warning("segment channel: request id %d is already running on the connection from %s", rid, peer)
                    writer.write(pack({"id": rid, "error": f"DuplicateRequest: request id {rid} is already running on this connection"}))
                elif op == "cancel":
                    task = tasks.pop(rid, None)
                    if task is not None:
                        task.cancel()
                else:
                    log.warning("segment channel: unexpected message %r from %s; closing", op, peer)
                    return
        finally:
            for task in tasks.values():
                task.cancel()
            self._writers.discard(writer)
            writer.close()
            for token in self._bound.pop(conn, ()):  # the leases used here end (those still live)
                if token.encode() in self._tokens:
                    self._ended.setdefault(token, asyncio.Event()).set()
            if tasks:
                await asyncio.gather(*tasks.values(), return_exceptions=True)
            await self.handler.peer_closed(conn)

    async def _generate(self, rid: int, request: Any, stream: bool | str, writer: asyncio.StreamWriter, tasks: dict, conn: int) -> None:
        try:
            if not isinstance(request, dict):
                raise ValueError("the request is not a mapping")
            # aclosing: a cancelled segment closes its engine generator (vLLM aborts) at once, not at GC
            async with contextlib.aclosing(self.handler.segment(request, stream, conn)) as chunks:
                async for chunk in chunks:
                    if writer.is_closing():
                        return
                    writer.write(pack({"id": rid, "chunk": chunk}))
                    await writer.drain()
        except asyncio.CancelledError:
            raise  # cancelled by the router, or its connection closed: nobody waits for a reply
        except InvalidRequest as e:  # the request's fault: the router answers 400, no retry
            if not writer.is_closing():
                writer.write(pack({"id": rid, "error": e.message, "invalid": e.param or ""}))
        except ContextGap as e:  # the router sends the whole context again
            if not writer.is_closing():
                writer.write(pack({"id": rid, "error": str(e), "gap": True}))
        except Exception as e:  # noqa: BLE001 - reported to the router, which retries or fails the segment
            log.warning("segment %d failed: %s: %s", rid, type(e).__name__, e)
            if not writer.is_closing():
                writer.write(pack({"id": rid, "error": f"{type(e).__name__}: {e}"}))
        finally:
            tasks.pop(rid, None)


# ---- the router's end ----------------------------------------------------------------------------


class Channel:
    """One connection to a replica's SegmentServer, shared by every segment sent there."""

    def __init__(self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.address = address
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Queue] = {}
        self.closed: ChannelError | None = None
        self._read_task = asyncio.create_task(self._read_loop())

    @classmethod
    async def connect(cls, address: str, token: str, timeout_s: float = 10.0) -> Channel:
        """Open a connection with a live lease's ``token``."""
        host, _, port = address.rpartition(":")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout_s)
        except (OSError, TimeoutError) as e:
            raise ChannelError(f"cannot connect to the replica at {address}: {e or type(e).__name__}") from e
        _no_delay(writer)
        writer.write(pack({"op": "hello", "token": token}))
        return cls(address, reader, writer)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def attach(self, token: str) -> None:
        """The lease of ``token`` will be used on this connection: it ends if the connection closes."""
        if self.closed is None and not self._writer.is_closing():
            self._writer.write(pack({"op": "attach", "token": token}))

    def end_session(self, session_id: str) -> None:
        """Tell the replica that a generation ended (its resumable engine requests go)."""
        if self.closed is None:
            self._writer.write(pack({"op": "end", "session": session_id}))

    async def request(self, request: dict[str, Any], stream: bool | str, token: str) -> AsyncIterator[dict[str, Any]]:
        """The replica's EngineChunk mappings for one request under the lease of ``token``;
        closing early cancels it there."""
        if self.closed is not None:
            raise self.closed
        rid = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue(MAX_PENDING_CHUNKS)
        self._pending[rid] = queue
        self._writer.write(pack({"op": "generate", "id": rid, "stream": stream, "token": token, "request": request}))
        done = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if "error" in item:
                    done = True
                    if "invalid" in item:
                        raise InvalidRequest(str(item["error"]), param=str(item["invalid"]) or None)
                    if item.get("gap"):
                        raise ContextGap(str(item["error"]))
                    raise RemoteError(str(item["error"]))
                chunk = item.get("chunk")
                if not isinstance(chunk, dict):
                    raise ChannelError(f"the replica at {self.address} sent a malformed reply")
                done = bool(chunk.get("finished"))
                yield chunk
                if done:
                    return
        finally:
            self._pending.pop(rid, None)
            if not done and self.closed is None:
                self._writer.write(pack({"op": "cancel", "id": rid}))

    async def _read_loop(self) -> None:
        reason = "closed by the router"
        try:
            while True:
                message = await read_message(self._reader)
                rid = message.get("id")
                queue = self._pending.get(rid)
                if queue is None:
                    continue  # a request given up on (cancelled) still answered
                if queue.full():  # nobody reads this request: fail it rather than grow without end
                    self._pending.pop(rid)
                    self._writer.write(pack({"op": "cancel", "id": rid}))
                    queue.get_nowait()
                    queue.put_nowait(ChannelError(f"request {rid}: over {MAX_PENDING_CHUNKS} chunks were not read"))
                    continue
                queue.put_nowait(message)
        except asyncio.IncompleteReadError:
            reason = "closed by the replica"
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - any read failure ends the connection
            reason = f"{type(e).__name__}: {e}"
        finally:
            self._fail(ChannelError(f"the connection to the replica at {self.address} ended ({reason})"))

    def _fail(self, error: ChannelError) -> None:
        if self.closed is not None:
            return
        self.closed = error
        for queue in self._pending.values():
            if queue.full():
                queue.get_nowait()  # the error goes in even where the reader fell behind
            queue.put_nowait(error)
        self._writer.close()

    def close(self, reason: str = "closed by the router") -> None:
        self._fail(ChannelError(f"the connection to the replica at {self.address} ended ({reason})"))
        self._read_task.cancel()


class ChannelPool:
    """The router replica's connections, one per model replica, opened on first use."""

    def __init__(self, connect_timeout_s: float = 10.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._channels: dict[str, Channel] = {}
        self._connecting: dict[str, asyncio.Task] = {}

    def __len__(self) -> int:
        return sum(1 for c in self._channels.values() if c.closed is None)

    async def get(self, address: str, token: str) -> Channel:
        """The connection to ``address``, opened with ``token`` (a live lease's) if there is none.
        One connect runs at a time per address, in a task of its own: a caller that is cancelled
        while it waits does not cancel the connect the others wait on."""
        channel = self._channels.get(address)
        if channel is not None and channel.closed is None:
            return channel
        connect = self._connecting.get(address)
        if connect is None:
            connect = self._connecting[address] = asyncio.ensure_future(self._connect(address, token))
            connect.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, whoever waits
        return await asyncio.shield(connect)

    async def _connect(self, address: str, token: str) -> Channel:
        try:
            channel = await Channel.connect(address, token, self.connect_timeout_s)
            self._channels[address] = channel
            return channel
        finally:
            self._connecting.pop(address, None)

    def existing(self, address: str) -> Channel | None:
        """The open connection to ``address``, if any."""
        channel = self._channels.get(address)
        return channel if channel is not None and channel.closed is None else None

    def drop(self, address: str, reason: str) -> None:
        """Close the connection to ``address`` (its replica is gone): its open requests fail now."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            channel.close(reason)

    def close(self) -> None:
        for address in list(self._channels):
            self.drop(address, "the router is shutting down")
