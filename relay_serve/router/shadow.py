"""Online cue calibration on the router side: which generations are scored, which explore, and the
scoring itself, in the background.

- ``sample_rate`` r: about r of a router's finished relay generations are scored: the small model
  scores the generation teacher-forced (``ModelServer.score``, prompt log-probabilities), and the
  calibration job's own code turns that into margins (``relay_serve.calibration.margins.trace_margins``),
  counting only the tokens the large model wrote. The margins go to the app's shared statistics
  (``online/cue_stats.py``).
- ``explore_rate`` e: about e of relay generations hand off nothing during the reasoning (the large
  model writes all of it; the small model still writes the answer) and are always scored: the
  large model never writes the sentence after a selected cue otherwise, so without them the
  selected cues would get no evidence. ``usage.relay.explored`` says so.
- Scoring never slows serving down: one generation at a time per router, at most
  ``max_queue`` waiting; more are dropped (counted in ``relay_serve_shadow_generations_total``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from relay_serve.calibration.cues import ModelPair
from relay_serve.config import AppConfig
from relay_serve.tokenizer import Codec

log = logging.getLogger(__name__)

Scorer = Callable[[list[int], int], Awaitable[list[list[float]]]]  # (token ids, start) -> top-2 log-probs
Sink = Callable[[dict[str, Any]], Awaitable[None]]  # the margins of one generation -> the shared statistics


@dataclass
class ShadowItem:
    prompt_ids: list[int]
    token_ids: list[int]
    large_written: list[bool]
    explored: bool


class ShadowScorer:
    def __init__(
        self,
        cfg: AppConfig,
        codec: Codec,
        score: Scorer,
        sink: Sink,
        count: Callable[[str], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        from relay_serve.calibration.candidates import default_candidates

        self.online = cfg.cues.online
        self.codec = codec
        self.think_close = cfg.policy.think_close
        self.candidates = self.online.candidates or default_candidates()
        self._score, self._sink = score, sink
        self._count = count or (lambda outcome: None)
        self.rng = rng or random.Random()
        self.queue: asyncio.Queue[ShadowItem] = asyncio.Queue(maxsize=self.online.max_queue)
        self._worker: asyncio.Task | None = None
        self.scored = self.dropped = self.failed = 0

    def explore(self) -> bool:
        """Whether a new relay generation explores (its reasoning on the large model alone)."""
        return self.rng.random() < self.online.explore_rate

    def offer(self, prompt_ids: list[int], token_ids: list[int], owners: list[str], explored: bool) -> None:
        """A finished relay generation: queued for scoring when sampled (always when it explored);
        dropped when the queue is full."""
        if not explored and self.rng.random() >= self.online.sample_rate:
            return
        item = ShadowItem(list(prompt_ids), list(token_ids), [o == "large" for o in owners], explored)
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.dropped += 1
            self._count("dropped")
            return
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            item = await self.queue.get()
            try:
                await self.score_one(item)
                self.scored += 1
                self._count("scored")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a failed score loses one sample, never a request
                self.failed += 1
                self._count("failed")
                log.warning("scoring a served generation failed: %s: %s", type(e).__name__, e)

    async def score_one(self, item: ShadowItem) -> dict[str, Any]:
        from relay_serve.calibration.margins import trace_margins

        # a hung replica must not wedge the only scoring worker: give the sample up
        rows = await asyncio.wait_for(
            self._score(item.prompt_ids + item.token_ids, len(item.prompt_ids)), self.online.score_timeout_s
        )
        m = await asyncio.to_thread(
            trace_margins,
            self.codec,
            item.token_ids,
            rows,
            self.candidates,
            think_close=self.think_close,
            counted=item.large_written,
        )
        margins = {
            "by_cue": m.by_cue,
            "token_sum": float(sum(m.all_tokens)),
            "token_count": len(m.all_tokens),
            "explored": item.explored,
        }
        await self._sink(margins)
        return margins

    def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()


def stats_actor(cfg: AppConfig, pair: ModelPair):
    """The app's shared statistics actor for ``pair`` (as the model replicas reported it):
    created by the first router that asks, found by the others (and by a router that replaced
    one); detached, so it outlives every router replica (its statistics are in the store, so it
    may go: ``relay-serve cues`` says so). Every router that finds it hands it the app's settings
    (``configure``): a redeployed app's ``cues.online`` applies, not the first router's."""
    import ray

    from relay_serve.online.cue_stats import CueStatsActor

    name = f"relay-cue-stats-{cfg.name}-{pair.fingerprint}"
    options = {k: v for k, v in cfg.router.deployment.ray_actor_options.items() if k in ("resources", "runtime_env")}
    actor = (
        ray.remote(CueStatsActor)
        .options(
            name=name,
            namespace="relay-serve",
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,
            **options,
        )
        .remote(cfg.model_dump(mode="json"), pair.model_dump(mode="json"))
    )
    return actor
