"""The router's end of the segment channel (the wire format: ``relay_serve/protocol.py``): one
connection per model replica, shared by every segment the router replica sends there."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

from relay_serve.protocol import (
    MAX_PENDING_CHUNKS,
    ChannelError,
    ContextGap,
    InvalidRequest,
    RemoteError,
    no_delay,
    pack,
    read_message,
)

log = logging.getLogger(__name__)


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
        no_delay(writer)
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
