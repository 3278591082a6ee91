"""RelayRouter: the OpenAI-compatible ingress deployment. It wires three parts that each read
alone: the HTTP surface (``http.py``: routes, API keys, bodies, errors), the mapping of a request
to a generation (``generations.py``: prompt, limits, session, policy, response) and streaming
(``streaming.py``: server-sent events). Never imports vLLM, so it runs on CPU-only nodes; the
class is undecorated (``app.build_app`` binds it) and tests drive its FastAPI app directly with a
fake backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from relay_serve.cluster import node_id
from relay_serve.config import AppConfig
from relay_serve.relay.policy import MODEL_IDS
from relay_serve.relay.types import Backend
from relay_serve.router.calls import own_request
from relay_serve.router.cue_provider import CueProvider
from relay_serve.router.generations import Generations
from relay_serve.router.http import RequestModel, build_api, read_request, validate
from relay_serve.router.metrics import RouterMetrics
from relay_serve.router.openai_api import (
    ChatCompletionRequest,
    ClientError,
    CompletionRequest,
    ModelCard,
    ServerError,
    now,
)
from relay_serve.router.shadow import ShadowScorer
from relay_serve.router.startup import PairStartup
from relay_serve.router.streaming import events

log = logging.getLogger(__name__)

MODEL_DESCRIPTIONS = {
    "relay": "RelayGen: the large model reasons, the small one writes cued sentences and the answer",
    "large": "the large model alone",
    "small": "the small model alone",
    "speculative-thinking": "Speculative Thinking: the small model leads, the large one takes reflective stretches",
    "auto": "relay or the large model alone, per generation: whichever has been faster at the current load",
}


class RelayRouter:
    def __init__(
        self,
        config: dict[str, Any],
        large=None,
        small=None,
        backend: Backend | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.cfg = AppConfig.model_validate(config)
        self.backend = backend if backend is not None else _serve_backend(self.cfg, large, small)
        self.cues = CueProvider(self.cfg, pair_fingerprint=None)  # the pair's, once the deployments said it
        self.metrics = metrics if metrics is not None else RouterMetrics(self.cfg.name)
        # the tokenizer, the pair's fingerprint and the context length come from the model
        # replicas: the router reads no model files (router/startup.py)
        self.startup = PairStartup(self.cfg, self.backend, on_pair=self._on_pair)
        self.generations = Generations(self.cfg, self.startup, self.backend, self.cues, self.metrics)
        self.stats_actor = None
        self._small = small
        self.api = build_api(self)
        with contextlib.suppress(RuntimeError):  # constructed off an event loop: started by the first request
            asyncio.get_running_loop()
            self.startup.start()

    def _on_pair(self, fingerprint: str) -> None:
        """Both deployments said what they serve: the calibrated cue sets of this pair apply, and
        online calibration starts."""
        self.cues.set_pair(fingerprint)
        if self.cfg.cues.online.enabled and self._small is not None and self.generations.shadow is None:
            self.generations.shadow = self._shadow(self.generations.codec, self._small, fingerprint)

    def _shadow(self, codec, small, fingerprint: str) -> ShadowScorer:
        """Online cue calibration: generations scored by the small deployment, margins to the
        app's shared statistics actor."""
        from relay_serve.calibration.cues import ModelPair
        from relay_serve.router.shadow import stats_actor

        pair = ModelPair(large=self.cfg.large.model, small=self.cfg.small.model, fingerprint=fingerprint)
        actor = self.stats_actor = stats_actor(self.cfg, pair)
        actor.configure.remote(
            self.cfg.model_dump(mode="json")
        )  # an actor found from an earlier deployment takes these settings
        actor.start.remote()

        async def score(token_ids: list[int], start: int) -> list[list[float]]:
            return await own_request(
                lambda: small.options(method_name="score").remote({"token_ids": token_ids, "start": start})
            )

        async def sink(margins: dict[str, Any]) -> None:
            await actor.add.remote(**margins)

        return ShadowScorer(self.cfg, codec, score, sink, count=self.metrics.shadow_generation)

    def __serve_build_asgi_app__(self):  # noqa: N802 - Ray Serve's hook name
        return self.api

    def __del__(self) -> None:
        """Ray Serve calls it when the replica stops: the leases go back, so the model replicas
        are not held waiting for this router's generations until their shutdown timeout."""
        startup = getattr(self, "startup", None)
        if startup is not None:
            startup.stop()
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.stop_sampling()
        generations = getattr(self, "generations", None)
        if generations is not None and generations.shadow is not None:
            generations.shadow.stop()

    @property
    def in_flight(self) -> int:
        return self.generations.in_flight

    # ---- routes --------------------------------------------------------------------------------

    async def health(self) -> JSONResponse:
        """200 once a request would be served without waiting for start-up (the large deployment
        answered, and the small one too unless it may scale to zero); 503 before, and for a pair
        that cannot be served, with what it waits for or why. The cue set's state rides along."""
        self.startup.start()
        await self.cues.maybe_refresh()
        cues = self.cues.status()
        models = self.startup.status()
        small_up = models["small"]["state"] == "up" or self.cfg.small.deployment.may_scale_to_zero
        if models["error"] is not None:
            status, code = "refused", 503
        elif not models["ready"] or not small_up:
            status, code = "starting", 503
        else:
            status, code = ("ok" if cues["ok"] and models["small"]["state"] == "up" else "degraded"), 200
        return JSONResponse({"status": status, "models": models, "cue_set": cues}, status_code=code)

    async def models(self) -> dict[str, Any]:
        prefix = self.cfg.router.model_name_prefix
        cards = [ModelCard(id=prefix + m, created=now(), description=MODEL_DESCRIPTIONS[m]) for m in MODEL_IDS]
        return {"object": "list", "data": [c.model_dump() for c in cards]}

    async def active_cues(self) -> dict[str, Any]:
        """The active set; with online calibration, its settings, this router's scoring counts and
        the shared statistics."""
        await self.cues.maybe_refresh()
        described = self.cues.describe()
        shadow = self.generations.shadow
        if shadow is not None:
            online = self.cfg.cues.online
            described["online"] = {
                **online.model_dump(
                    include={
                        "sample_rate",
                        "explore_rate",
                        "min_occurrences",
                        "confidence",
                        "rule",
                        "publish_interval_s",
                    }
                ),
                "this_router": {
                    "scored": shadow.scored,
                    "dropped": shadow.dropped,
                    "failed": shadow.failed,
                    "queued": shadow.queue.qsize(),
                },
                "shared": await self._shared_stats(),
            }
        return described

    async def _shared_stats(self) -> dict[str, Any] | None:
        if self.stats_actor is None:
            return None
        try:
            return await asyncio.wait_for(self.stats_actor.status.remote(), timeout=5)
        except Exception as e:  # noqa: BLE001 - the statistics are shown when they can be
            return {"error": f"{type(e).__name__}: {e}"}

    async def stats(self) -> dict[str, Any]:
        """This router replica's state: generations in flight, generations pinned to replicas
        (leases held, or remembered by the affinity routers), segments in flight per model, open
        segment channels, its resident memory and the number of memory blocks Python has
        allocated (what a leak of Python objects would grow)."""
        import sys

        import psutil

        segments = self.backend.segments_in_flight()
        held = self.backend.stats()
        return {
            "node_id": node_id(),
            "in_flight": self.in_flight,
            "pinned_generations": held.get("pinned_generations", 0),
            "leases": held.get("leases"),
            "idle_leases": held.get("idle_leases"),
            "channels": held.get("channels"),
            "segments_in_flight": segments,
            "auto": self.generations.auto.state(),
            "rss_bytes": psutil.Process().memory_info().rss,
            "python_blocks": sys.getallocatedblocks(),
        }

    async def chat_completions(self, request: Request):
        return await self._http(request, ChatCompletionRequest)

    async def completions(self, request: Request):
        return await self._http(request, CompletionRequest)

    async def _http(self, request: Request, model_cls: type[RequestModel]):
        arrived = time.perf_counter()
        try:
            req = await read_request(request, model_cls, self.cfg.router.max_request_bytes)
        except ClientError as e:
            self.metrics.request("unknown", e.status)
            raise
        return await self._serve(req, arrived)

    async def handle_request(self, body: dict[str, Any], chat: bool = True) -> dict[str, Any]:
        """For deployment-handle callers (batch jobs): one chat (or completion) request body in,
        ``{"response": ...}`` or ``{"error": {...OpenAI error...}, "status": <HTTP status>}`` out.
        Same validation, limits and policies as the HTTP API; no streaming."""
        arrived = time.perf_counter()
        try:
            try:
                req = validate(body, ChatCompletionRequest if chat else CompletionRequest)
            except ClientError as e:
                self.metrics.request(
                    self.generations.model_label(body.get("model") if isinstance(body, dict) else None), e.status
                )
                raise
            if req.stream:
                self.metrics.request(self.generations.model_label(req.model), 400)
                raise ClientError("stream is not supported through the deployment handle", param="stream")
            return {"response": await self._serve(req, arrived)}
        except (ClientError, ServerError) as e:
            return {**e.body(), "status": e.status}

    async def _serve(self, req: ChatCompletionRequest | CompletionRequest, arrived: float):
        self.metrics.start_sampling(self._gauges)
        try:
            g = await self.generations.prepare(req, arrived)
        except (ClientError, ServerError) as e:
            self.metrics.request(self.generations.model_label(req.model), e.status)
            raise
        if req.stream:
            return StreamingResponse(events(self.generations, g), media_type="text/event-stream")
        return await self.generations.run(g)

    def _gauges(self) -> tuple[int, dict[str, int] | None, dict[str, int] | None]:
        """Generations in flight and leases held and idle per model (none with the handle transport)."""
        held, idle = self.backend.lease_counts()
        return self.in_flight, held, idle


def _serve_backend(cfg: AppConfig, large, small) -> Backend:
    """The Backend over the model deployments' handles, as the router config says."""
    from relay_serve.router import affinity_registry
    from relay_serve.router.backend import ServeBackend

    return ServeBackend(
        large,
        small,
        cfg.router,
        in_rotation=lambda model, replica_id: affinity_registry.replica_running(cfg.name, model, replica_id),
    )
