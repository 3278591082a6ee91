"""The replica's end of the segment channel (the wire format: ``relay_serve/protocol.py``): a TCP
server in the model replica's process that serves segment requests to routers holding a live lease."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Hashable
from typing import Any, Protocol

from relay_serve.protocol import (
    HELLO_TIMEOUT_S,
    MAX_HELLO_BYTES,
    ContextGap,
    InvalidRequest,
    no_delay,
    pack,
    read_message,
)

log = logging.getLogger(__name__)


class SegmentHandler(Protocol):
    """What a SegmentServer serves (the ModelServer); ``peer`` names the connection."""

    def segment(
        self, request: dict[str, Any], stream: bool, peer: Hashable | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """EngineChunk mappings of one segment request (one for a non-streamed request)."""

    async def end_session(self, session_id: str, peer: Hashable | None = None) -> None:
        """A generation ended (``peer``: the connection that says so; only its own sessions end)."""

    async def peer_closed(self, peer: Hashable) -> None:
        """A connection closed: what it started is over."""


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
        no_delay(writer, keepalive=True)
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
                        writer.write(
                            pack({"id": rid, "error": "LeaseExpired: the segment's lease is not live on this replica"})
                        )
                        continue
                    self._bind(message["token"], conn)
                    request, stream = message.get("request"), message.get("stream")
                    stream = stream if stream == "first" else bool(stream)
                    tasks[rid] = asyncio.create_task(self._generate(rid, request, stream, writer, tasks, conn))
                elif op == "generate":  # an id already running here: an error for that id, the connection lives on
                    log.warning(
                        "segment channel: request id %d is already running on the connection from %s", rid, peer
                    )
                    writer.write(
                        pack(
                            {
                                "id": rid,
                                "error": f"DuplicateRequest: request id {rid} is already running on this connection",
                            }
                        )
                    )
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

    async def _generate(
        self, rid: int, request: Any, stream: bool | str, writer: asyncio.StreamWriter, tasks: dict, conn: int
    ) -> None:
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
