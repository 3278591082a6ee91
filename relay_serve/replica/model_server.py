"""ModelServer: one engine behind a Ray Serve deployment. Deployed twice ("large", "small").

It knows nothing of relaying: it takes prompt token ids, sampling settings and stop strings and
streams what the engine generated (token ids, finish and stop reason, cached prompt tokens, the
engine's timings). Segments arrive as Ray Serve calls (``generate``, ``complete``) or over its
segment channel (``channel.py``), whose address and token a router gets by taking a ``lease``. A
segment marked ``resume`` (sent over the channel of a leased replica) continues its generation's
resumable engine request here (``engine/session.py``), which lives until the router ends the
generation, its connection closes, or it has been idle for ``SESSION_IDLE_S``. The class is
undecorated; ``app.build_app`` binds it with each model's own options. The engine class is
injected (tests pass a fake).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import logging
import time
import uuid
from collections.abc import AsyncIterator, Hashable
from typing import Any

from relay_serve.calibration.cues import model_fingerprint
from relay_serve.cluster import node_id, node_ip
from relay_serve.engine.base import Engine, EngineInfo
from relay_serve.engine.session import EngineSession
from relay_serve.engine.stops import PauseTokens
from relay_serve.protocol import ContextGap, EngineChunk, SegmentRequest, Streaming
from relay_serve.replica.channel import SegmentServer
from relay_serve.replica.load import ENGINE_LOAD

log = logging.getLogger(__name__)

SESSION_IDLE_S = 300.0  # a session no segment used for this long is closed (its router went quiet)


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (tests, scripts)
        return "local"


class ModelServer:
    def __init__(self, role: str, settings: dict[str, Any], engine_cls: type[Engine] | None = None) -> None:
        from relay_serve.config import ModelSettings

        cfg = ModelSettings.model_validate(settings)
        # served_model_name labels the engine's own metrics (model_name="large" or "small")
        args = (cfg.model_path, cfg.tokenizer_path, {"served_model_name": role, **cfg.resolved_engine_args})
        if engine_cls is None:
            from relay_serve.engine.vllm_engine import VLLMEngine

            self.engine: Engine = VLLMEngine(
                *args, ray_metrics=node_id() is not None, spare_ids=cfg.resolved_spare_token_ids
            )
        else:
            self.engine = engine_cls(*args)
        self.role = role
        self.settings = cfg
        self.replica_id = _replica_id()
        self.model_fingerprint = model_fingerprint(cfg)  # of the files it loaded: the router cannot read them
        self.requests_in_flight = 0
        self.leases_held = 0
        self.session_restarts = 0
        self.sessions: dict[str, EngineSession] = {}
        self._session_peers: dict[str, Hashable] = {}
        # what sampling the engine runs correctly: a segment outside it never reaches the engine
        self.traits = self.engine.info().traits
        self.resumable = self.engine.can_resume()
        self._pauses = (
            PauseTokens(self.engine.token_texts(), spare_ids=self.engine.spare_ids()) if self.resumable else None
        )
        if self._pauses is not None:
            # what start-up built (vLLM's and torch's modules, the engine, the pause index) lives as long
            # as the replica: out of the collector's sight, or every full collection walks its hundreds of
            # thousands of objects again on the event loop (vLLM's engine core freezes its own start-up too)
            gc.collect()
            gc.freeze()
            atexit.register(gc.unfreeze)  # at exit the collector sees it again and frees it
        self._channel: SegmentServer | None = None
        self._channel_lock = asyncio.Lock()
        self._reaper: asyncio.Task | None = None  # closes idle sessions while there are any
        log.info(
            "ModelServer %s ready on replica %s (resumable requests: %s): %s",
            role,
            self.replica_id,
            self.resumable,
            self.engine.info(),
        )

    # ---- segments ------------------------------------------------------------------------------

    async def _run(self, req: SegmentRequest, stream: bool, peer: Hashable | None) -> AsyncIterator[EngineChunk]:
        self.traits.check(self.role, req.sampling)  # InvalidRequest: the router refuses these before they come
        if req.resume and self.resumable:
            output = self._session(req.session_id, peer).segment(req, stream=stream)
        elif req.context_base:
            raise ContextGap("this replica runs a new engine request per segment: send the whole context")
        else:
            output = self.engine.generate(req, f"{req.session_id}-{uuid.uuid4().hex[:8]}", stream=stream)
        self.requests_in_flight += 1
        t0 = time.perf_counter()
        try:
            async for chunk in output:
                if chunk.finished:
                    chunk.replica_id = self.replica_id
                    chunk.engine_s = time.perf_counter() - t0
                yield chunk
        finally:
            self.requests_in_flight -= 1
            await output.aclose()

    async def segment(
        self, request: dict[str, Any], stream: Streaming, peer: Hashable | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """One segment request's output as EngineChunk dicts: as it comes (``stream`` true), all of
        it in one (false), or ``"first"``: the first token at once (a deadline bounds it), the rest
        in one."""
        req = SegmentRequest.model_validate(request)
        if stream is True:
            async for chunk in self._run(req, True, peer):
                yield chunk.model_dump()
            return
        ids: list[int] = []
        text: list[str] = []
        last = EngineChunk()
        waiting_for_first = stream == "first"
        async for chunk in self._run(req, waiting_for_first, peer):
            if waiting_for_first and chunk.token_ids and not chunk.finished:
                waiting_for_first = False
                yield chunk.model_dump()
                continue
            ids.extend(chunk.token_ids)
            text.append(chunk.text)
            last = chunk
        yield last.model_copy(update={"token_ids": ids, "text": "".join(text)}).model_dump()

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream the output of one segment request (a SegmentRequest as a dict) as EngineChunk dicts."""
        async for chunk in self.segment({**request, "resume": False}, stream=True):
            yield chunk

    async def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        """The whole output of one segment request at once: token ids, text, finish and stop
        reason, cached prompt tokens, replica."""
        chunks = self.segment({**request, "resume": False}, stream=False)
        try:
            return await chunks.__anext__()
        finally:
            await chunks.aclose()

    # ---- resumable requests, one per generation ------------------------------------------------

    def _session(self, session_id: str, peer: Hashable | None) -> EngineSession:
        session = self.sessions.get(session_id)
        if session is None:
            self._close_idle_sessions()
            session = self.sessions[session_id] = EngineSession(
                self.engine, session_id, self._pauses, on_restart=self._restarted
            )
            self._session_peers[session_id] = peer
            if self._reaper is None or self._reaper.done():
                self._reaper = asyncio.get_running_loop().create_task(self._reap_idle_sessions())
        return session

    async def _reap_idle_sessions(self) -> None:
        """While sessions are open: close those idle past ``SESSION_IDLE_S`` (each holds KV cache
        and one of the engine's ``max_num_seqs``), checked every quarter of it."""
        while self.sessions:
            await asyncio.sleep(SESSION_IDLE_S / 4)
            self._close_idle_sessions()

    def _restarted(self) -> None:
        self.session_restarts += 1

    async def end_session(self, session_id: str, peer: Hashable | None = None) -> None:
        """The generation ended: its resumable request goes (and its KV cache with it). Said over a
        connection (``peer``), it ends only a session that connection's segments opened."""
        if peer is not None and session_id in self._session_peers and self._session_peers[session_id] != peer:
            log.warning("a connection asked to end session %s, which another connection runs; ignored", session_id)
            return
        session = self.sessions.pop(session_id, None)
        self._session_peers.pop(session_id, None)
        if not self.sessions and self._reaper is not None:
            self._reaper.cancel()  # started again with the next session
            self._reaper = None
        if session is not None:
            await session.close()

    async def peer_closed(self, peer: Hashable) -> None:
        """A router's connection closed: the generations it ran here are gone."""
        for session_id in [s for s, p in self._session_peers.items() if p == peer]:
            await self.end_session(session_id)

    def _close_idle_sessions(self) -> None:
        now = time.monotonic()
        for session_id, session in list(self.sessions.items()):
            if not session.busy and now - session.last_used > SESSION_IDLE_S:
                log.warning("closing session %s: no segment for %.0f s", session_id, now - session.last_used)
                asyncio.get_running_loop().create_task(self.end_session(session_id))

    # ---- leases and the channel ----------------------------------------------------------------

    async def lease(self, lease_id: str, ttl_s: float) -> AsyncIterator[dict[str, Any]]:
        """Hold this replica for a router's generations, one at a time: first the segment
        channel's address and a token of this lease's own, then nothing until the router cancels
        the call, a channel connection the lease was used on closes (its router died: Serve does
        not cancel a dead caller's call), or ``ttl_s`` passes; the token dies with the lease. Ray
        Serve counts the open call as an ongoing request of this replica."""
        channel = await self._segment_channel()
        token = channel.issue_token()
        self.leases_held += 1
        try:
            yield {
                "address": channel.address,
                "token": token,
                "replica_id": self.replica_id,
                "resumable": self.resumable,
            }
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(channel.lease_ended(token), ttl_s)
        finally:
            self.leases_held -= 1
            channel.revoke_token(token)

    async def _segment_channel(self) -> SegmentServer:
        async with self._channel_lock:  # started on the loop the engine runs on, once
            if self._channel is None:
                channel = SegmentServer(self, host=node_ip())
                await channel.start()
                self._channel = channel
        return self._channel

    async def info(self) -> dict[str, Any]:
        info: EngineInfo = self.engine.info()
        return {
            **info.model_dump(),
            "role": self.role,
            "model_fingerprint": self.model_fingerprint,
            "replica_id": self.replica_id,
            "node_id": node_id(),
            "requests_in_flight": self.requests_in_flight,
            "leases_held": self.leases_held,
            "sessions": len(self.sessions),
            "session_restarts": self.session_restarts,
            "channel": self._channel.address if self._channel is not None else None,
        }

    async def tokenizer_files(self) -> dict[str, bytes]:
        """The model's tokenizer as files: the router builds its own from them (it reads no model
        files; ``router/startup.py``)."""
        from relay_serve.tokenizer import load_codec, tokenizer_files

        return await asyncio.to_thread(lambda: tokenizer_files(load_codec(self.settings.tokenizer_path).tokenizer))

    async def score(self, request: dict[str, Any]) -> list[list[float]]:
        """Teacher-forced scoring of a served generation (online cue calibration): the top-2
        log-probabilities at each position of ``token_ids`` from ``start``. Counted as engine load."""
        self.requests_in_flight += 1
        try:
            return await self.engine.score(
                list(request["token_ids"]), int(request["start"]), f"score-{uuid.uuid4().hex[:12]}"
            )
        finally:
            self.requests_in_flight -= 1

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics (sampled by the replica, averaged over the
        look-back window by the controller): this replica's engine load, the segments running
        or queued in its engine. ``app/autoscaling.py`` scales on it. Serve's own count of
        ongoing requests would count leases, which follow the number of generations, not the work
        a model does."""
        return {ENGINE_LOAD: float(self.requests_in_flight)}

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's request-router hook, polled by the controller: what this replica holds. The
        default router does not read it (a custom one may balance on it); an operator or a test can
        ask one replica for it through its actor (``ray.get(actor.record_routing_stats.remote())``),
        which a call through the deployment's handle cannot (the handle picks the replica)."""
        return {
            "leases_held": self.leases_held,
            "sessions": len(self.sessions),
            ENGINE_LOAD: float(self.requests_in_flight),
        }

    async def check_health(self) -> None:
        """Ray Serve's health check: a dead engine marks the replica unhealthy and replaces it."""
        await self.engine.check_health()

    def __del__(self) -> None:
        """Ray Serve calls it when the replica stops: the channel stops listening and drops its
        connections (the routers fail those segments over at once), then the engine goes."""
        channel = getattr(self, "_channel", None)
        if channel is not None:
            channel.shutdown()
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
