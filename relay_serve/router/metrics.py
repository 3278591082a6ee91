"""The router's metrics, recorded through Ray's metrics API (``ray.util.metrics``) and exported by
the metrics agent of every Ray node on its metrics export port, for Prometheus to scrape.

Ray prefixes application metrics with ``ray_``: the scrape configuration in ``monitoring/prometheus.yml``
(and the PodMonitor in ``k8s/``) drops that prefix for these, so they are stored under the names
below. Every series carries the app's name (``app``); Ray adds the node and worker. The model
deployments' engine figures (running and waiting sequences, KV cache usage, prefix-cache hits)
are vLLM's own metrics, exported the same way by vLLM's Ray stat logger (``ray_vllm_*``,
``model_name`` = the deployment: large or small).

Outside a Ray worker the metrics record nothing (Ray's metrics are no-ops there); tests pass a
recording ``factory`` with the same three classes.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from types import ModuleType
from typing import Any

from relay_serve.protocol import ModelRole
from relay_serve.relay.types import GenerationResult

log = logging.getLogger(__name__)

# Seconds: from a few milliseconds (a handoff, a token) to the longest generations.
LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
TOKEN_LATENCY_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5]
SWITCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
GAUGE_INTERVAL_S = 5.0  # how often the router's gauges (leases, generations in flight) are sampled

ROLES: tuple[ModelRole, ...] = ("large", "small")


class RouterMetrics:
    """What one router replica records per request, plus gauges it samples every few seconds."""

    def __init__(self, app: str, factory: ModuleType | Any | None = None) -> None:
        if factory is None:
            from ray.util import metrics as factory
        self.app = app
        m = factory

        def tagged(metric):
            metric.set_default_tags({"app": app})
            return metric

        self.requests = tagged(
            m.Counter(
                "relay_serve_requests_total",
                description="Requests by model id and HTTP status (499: the client went away; model_id 'unknown': "
                "a body with no known model).",
                tag_keys=("app", "model_id", "status"),
            )
        )
        self.e2e = tagged(
            m.Histogram(
                "relay_serve_e2e_request_latency_seconds",
                description="Seconds from a request's arrival at the router to its last token.",
                boundaries=LATENCY_BUCKETS_S,
                tag_keys=("app", "model_id"),
            )
        )
        self.ttft = tagged(
            m.Histogram(
                "relay_serve_time_to_first_token_seconds",
                description="Seconds from a streamed request's arrival to its first text (streamed requests only).",
                boundaries=LATENCY_BUCKETS_S,
                tag_keys=("app", "model_id"),
            )
        )
        self.itl = tagged(
            m.Histogram(
                "relay_serve_inter_token_latency_seconds",
                description="A streamed request's mean seconds between output tokens after the first.",
                boundaries=TOKEN_LATENCY_BUCKETS_S,
                tag_keys=("app", "model_id"),
            )
        )
        self.switches = tagged(
            m.Histogram(
                "relay_serve_switches_per_request",
                description="Switches between the large and the small model in a finished generation.",
                boundaries=SWITCH_BUCKETS,
                tag_keys=("app", "model_id"),
            )
        )
        self.handoff = tagged(
            m.Histogram(
                "relay_serve_handoff_latency_seconds",
                description="Seconds from the last token of one model (a cue, a sentence end) to the first of the "
                "other's next segment.",
                boundaries=LATENCY_BUCKETS_S,
                tag_keys=("app", "to"),
            )
        )
        self.tokens = tagged(
            m.Counter(
                "relay_serve_generated_tokens_total",
                description="Output tokens of finished generations by the engine that wrote them (large, small).",
                tag_keys=("app", "model_id", "engine"),
            )
        )
        self.degraded = tagged(
            m.Counter(
                "relay_serve_degraded_requests_total",
                description="Finished generations whose small-model work the large model wrote (small deployment "
                "failed, unreachable or past its bound).",
                tag_keys=("app", "model_id"),
            )
        )
        self.kept_on_large = tagged(
            m.Counter(
                "relay_serve_handoffs_kept_on_large_total",
                description="Handoffs to the small model that the large model kept.",
                tag_keys=("app", "model_id"),
            )
        )
        self.retries = tagged(
            m.Counter(
                "relay_serve_engine_retries_total",
                description="Engine requests sent again after a replica failed.",
                tag_keys=("app", "model_id"),
            )
        )
        # one series a router replica, whatever the number of versions published (a version label
        # would add a series per published set, forever: Ray's metrics cannot remove one)
        self.cue_set = tagged(
            m.Gauge(
                "relay_serve_cue_set_created_timestamp_seconds",
                description="When the cue set this router replica hands off on was calibrated (Unix seconds; 0: the "
                "default set).",
                tag_keys=("app",),
            )
        )
        self.leases = tagged(
            m.Gauge(
                "relay_serve_leases",
                description="Model replicas this router replica holds leases on: held by a generation, or idle (kept "
                "for reuse).",
                tag_keys=("app", "engine", "state"),
            )
        )
        self.in_flight = tagged(
            m.Gauge(
                "relay_serve_generations_in_flight",
                description="Generations this router replica is running.",
                tag_keys=("app",),
            )
        )
        self.shadow = tagged(
            m.Counter(
                "relay_serve_shadow_generations_total",
                description="Online cue calibration: served relay generations scored, dropped (the scoring queue was "
                "full) or failed.",
                tag_keys=("app", "outcome"),
            )
        )
        self.auto = tagged(
            m.Counter(
                "relay_serve_auto_choices_total",
                description="Generations of the auto model by the policy it ran them as (relay or large).",
                tag_keys=("app", "policy"),
            )
        )
        self._sampler: asyncio.Task | None = None

    # ---- per request ---------------------------------------------------------------------------

    def request(self, model: str, status: int | str, e2e_s: float | None = None) -> None:
        """A request ended (any outcome); ``e2e_s`` for those that ran a generation."""
        self.requests.inc(1, tags={"model_id": model, "status": str(status)})
        if e2e_s is not None:
            self.e2e.observe(e2e_s, tags={"model_id": model})

    def generation(
        self, model: str, result: GenerationResult, ttft_s: float | None = None, e2e_s: float | None = None
    ) -> None:
        """What a finished generation did: its tokens by engine, switches, handoffs, degradation,
        retries; for a streamed one its time to first token and inter-token latency."""
        u = result.usage
        tags = {"model_id": model}
        for role, n in (("large", u.large_tokens), ("small", u.small_tokens)):
            if n:
                self.tokens.inc(n, tags={**tags, "engine": role})
        self.switches.observe(u.switches, tags=tags)
        for h in result.handoffs:
            self.handoff.observe(h.latency_s, tags={"to": h.to})
        if u.degraded:
            self.degraded.inc(1, tags=tags)
        if u.kept_on_large:
            self.kept_on_large.inc(u.kept_on_large, tags=tags)
        if u.retries:
            self.retries.inc(u.retries, tags=tags)
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags=tags)
            n = len(result.token_ids)
            if e2e_s is not None and n > 1:
                self.itl.observe(max(0.0, e2e_s - ttft_s) / (n - 1), tags=tags)

    def auto_choice(self, policy: str) -> None:
        self.auto.inc(1, tags={"policy": policy})

    def shadow_generation(self, outcome: str) -> None:
        self.shadow.inc(1, tags={"outcome": outcome})

    def cue_set_active(self, created_at: datetime | None) -> None:
        """The router hands off on the set calibrated at ``created_at`` (None: the default set)."""
        self.cue_set.set(created_at.timestamp() if created_at is not None else 0.0)

    # ---- gauges, sampled -----------------------------------------------------------------------

    def sample(self, in_flight: int, held: dict[str, int] | None, idle: dict[str, int] | None) -> None:
        self.in_flight.set(in_flight)
        for state, counts in (("held", held), ("idle", idle)):
            for role in ROLES:
                if counts is not None:
                    self.leases.set(counts.get(role, 0), tags={"engine": role, "state": state})

    def start_sampling(self, read: Any, interval_s: float = GAUGE_INTERVAL_S) -> None:
        """Sample the gauges every ``interval_s`` on the running loop (once; a router calls it
        from a request, where a loop runs). ``read()`` returns :meth:`sample`'s arguments."""
        if self._sampler is not None and not self._sampler.done():
            return

        async def loop() -> None:
            while True:
                try:
                    self.sample(*read())
                except Exception:  # noqa: BLE001 - a failed sample must not end the sampling
                    log.warning("sampling the router's gauges failed", exc_info=True)
                await asyncio.sleep(interval_s)

        self._sampler = asyncio.get_running_loop().create_task(loop())

    def stop_sampling(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
