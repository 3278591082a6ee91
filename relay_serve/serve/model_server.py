"""ModelServer: one engine behind a Ray Serve deployment. Deployed twice ("large", "small").

It knows nothing of relaying: it takes prompt token ids, sampling settings and stop strings and
streams what the engine generated (token ids, finish and stop reason, cached prompt tokens). It
also scores a given token sequence for calibration. Segments arrive as Ray Serve calls
(``generate``, ``complete``) or over its segment channel (``channel.py``), whose address and token
a router gets by taking a ``lease``. The class is undecorated; ``app.build_app`` binds it with each
model's own options. The engine class is injected (tests pass a fake).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from relay_serve.engine.base import Engine, EngineInfo
from relay_serve.relay.types import EngineChunk, SegmentRequest
from relay_serve.serve.channel import SegmentServer

log = logging.getLogger(__name__)


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (tests, scripts)
        return "local"


def _node_ip() -> str:
    """The address other nodes reach this one by (inside Ray), else the loopback address."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (tests, scripts)
        pass
    return "127.0.0.1"


class ModelServer:
    def __init__(self, role: str, settings: dict[str, Any], engine_cls: type[Engine] | None = None) -> None:
        from relay_serve.config import ModelSettings

        cfg = ModelSettings.model_validate(settings)
        if engine_cls is None:
            from relay_serve.engine.vllm_engine import VLLMEngine

            engine_cls = VLLMEngine
        self.role = role
        self.engine = engine_cls(cfg.model_path, cfg.tokenizer_path, cfg.engine_args)
        self.replica_id = _replica_id()
        self.requests_in_flight = 0
        self.leases_held = 0
        self._channel: SegmentServer | None = None
        self._channel_lock = asyncio.Lock()
        log.info("ModelServer %s ready on replica %s: %s", role, self.replica_id, self.engine.info())

    async def _run(self, request: dict[str, Any], stream: bool) -> AsyncIterator[EngineChunk]:
        req = SegmentRequest.model_validate(request)
        request_id = f"{req.session_id}-{uuid.uuid4().hex[:8]}"
        self.requests_in_flight += 1
        t0 = time.perf_counter()
        try:
            async for chunk in self.engine.generate(req, request_id, stream=stream):
                if chunk.finished:
                    chunk.replica_id = self.replica_id
                    chunk.engine_s = time.perf_counter() - t0
                yield chunk
        finally:
            self.requests_in_flight -= 1

    async def segment(self, request: dict[str, Any], stream: bool) -> AsyncIterator[dict[str, Any]]:
        """One segment request's output as EngineChunk dicts: as it comes, or (not ``stream``)
        all of it in one."""
        if stream:
            async for chunk in self._run(request, stream=True):
                yield chunk.model_dump()
            return
        ids: list[int] = []
        text: list[str] = []
        last = EngineChunk()
        async for chunk in self._run(request, stream=False):
            ids.extend(chunk.token_ids)
            text.append(chunk.text)
            last = chunk
        yield last.model_copy(update={"token_ids": ids, "text": "".join(text)}).model_dump()

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream the output of one segment request (a SegmentRequest as a dict) as EngineChunk dicts."""
        async for chunk in self.segment(request, stream=True):
            yield chunk

    async def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        """The whole output of one segment request at once: token ids, text, finish and stop
        reason, cached prompt tokens, replica."""
        chunks = self.segment(request, stream=False)
        try:
            return await chunks.__anext__()
        finally:
            await chunks.aclose()

    async def lease(self, lease_id: str, ttl_s: float) -> AsyncIterator[dict[str, Any]]:
        """Hold this replica for a router's generations, one at a time: first the segment
        channel's address and token, then nothing until the router cancels the call or ``ttl_s``
        passes. Ray Serve counts the open call as an ongoing request of this replica."""
        channel = await self._segment_channel()
        self.leases_held += 1
        try:
            yield {"address": channel.address, "token": channel.token, "replica_id": self.replica_id}
            await asyncio.sleep(ttl_s)
        finally:
            self.leases_held -= 1

    async def _segment_channel(self) -> SegmentServer:
        async with self._channel_lock:  # started on the loop the engine runs on, once
            if self._channel is None:
                channel = SegmentServer(self.segment, host=_node_ip())
                await channel.start()
                self._channel = channel
        return self._channel

    async def score(self, token_ids: list[int], start: int, top_k: int = 2) -> list[list[float]]:
        return await self.engine.score(token_ids, start, top_k)

    async def info(self) -> dict[str, Any]:
        info: EngineInfo = self.engine.info()
        return {
            **info.model_dump(),
            "role": self.role,
            "replica_id": self.replica_id,
            "requests_in_flight": self.requests_in_flight,
            "leases_held": self.leases_held,
            "channel": self._channel.address if self._channel is not None else None,
        }

    async def check_health(self) -> None:
        """Ray Serve's health check: a dead engine marks the replica unhealthy and replaces it."""
        await self.engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
