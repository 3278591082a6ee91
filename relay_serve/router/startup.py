"""What the router learns from the model replicas before it serves (it reads no model files: its
pods do not mount the weights): the tokenizer both models share, the pair's fingerprint, and the
context length their engines allow. Runs in the router replica.

The large deployment's answer makes the router ready: a relay generation needs the large model,
and its tokenizer is the pair's. The small deployment's answer, when it comes (it may be scaled to
zero, and relay then degrades to the large model; a deployment that may scale to zero is asked only
once one of its segments was answered, since a call queued for it would scale it up), must report
the same tokenizer, and gives the
pair's fingerprint: until then the router keeps the default cue set (a calibrated set is for one
pair) and online calibration waits. A pair that does not share a tokenizer, or whose decoding
loses the reasoning end marker, is refused: ``/health`` and every request say why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relay_serve.calibration.cues import combine_fingerprints
from relay_serve.config import AppConfig
from relay_serve.protocol import ModelIdentity, ModelRole
from relay_serve.relay.types import Backend
from relay_serve.tokenizer import Codec, check_marker, check_shared

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 30.0  # one ask of a deployment (a call waits for a replica to start); then asked again
ASK_BACKOFF_S = 2.0  # after an ask that failed at once
LAZY_POLL_S = (
    1.0  # a deployment that may scale to zero is asked once a segment of it was answered: looked at this often
)


@dataclass(frozen=True)
class ServedPair:
    """The shared tokenizer and the usable context (the smaller of the engines' that answered)."""

    codec: Codec
    max_model_len: int


class PairRefused(RuntimeError):
    """The deployments serve a pair relay cannot run (different tokenizers, a lost reasoning marker)."""


class PairStartup:
    """Asks both deployments what they serve, in the background, until each has answered."""

    def __init__(self, cfg: AppConfig, backend: Backend, on_pair: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.backend = backend
        self.on_pair = on_pair  # the pair's fingerprint, once both answered
        self.identities: dict[ModelRole, ModelIdentity] = {}
        self.pair: ServedPair | None = None
        self.fingerprint: str | None = None
        self.error: str | None = None
        self.last_failure: dict[ModelRole, str] = {}
        self.started_at = time.monotonic()
        self._tasks: dict[ModelRole, asyncio.Task] = {}

    def start(self) -> None:
        """Start asking, on the running event loop, each deployment that has not answered and is
        not being asked (again after a task was cancelled with its loop)."""
        loop = asyncio.get_running_loop()
        for model in ("large", "small"):
            task = self._tasks.get(model)
            if model in self.identities or self.error is not None:
                continue
            if task is None or (task.done() and task.get_loop() is not loop) or task.get_loop().is_closed():
                self._tasks[model] = loop.create_task(self._ask(model))

    def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()

    @property
    def ready(self) -> bool:
        return self.pair is not None and self.error is None

    async def wait(self, timeout_s: float) -> ServedPair:
        """The pair once the router can serve; ``PairRefused`` when it never will, ``TimeoutError``
        when the large deployment has not answered within ``timeout_s``."""
        self.start()
        if self.error is None and self.pair is None:
            await asyncio.wait_for(asyncio.shield(self._tasks["large"]), timeout_s)
        if self.error is not None:
            raise PairRefused(self.error)
        assert self.pair is not None
        return self.pair

    async def answered(self) -> None:
        """Until both deployments answered (or the pair was refused)."""
        self.start()
        pending = [t for m, t in self._tasks.items() if m not in self.identities and self.error is None]
        await asyncio.gather(*(asyncio.shield(t) for t in pending))

    def status(self) -> dict[str, Any]:
        """For ``/health``: what has answered and what the router waits for."""

        def model(role: ModelRole) -> dict[str, Any]:
            known = self.identities.get(role)
            if known is not None:
                return {
                    "state": "up",
                    "max_model_len": known.max_model_len,
                    "model_fingerprint": known.model_fingerprint,
                }
            return {"state": "starting", "last_failure": self.last_failure.get(role)}

        return {
            "ready": self.ready,
            "error": self.error,
            "waiting_s": None if self.ready else round(time.monotonic() - self.started_at, 1),
            "pair_fingerprint": self.fingerprint,
            "large": model("large"),
            "small": model("small"),
        }

    async def _ask(self, model: ModelRole) -> None:
        if self._deployment(model).may_scale_to_zero:
            # a call queued for a deployment without replicas would scale it up (Serve counts it as
            # demand): ask once a segment of it has been answered, so it has a replica
            while not self.backend.has_replied(model):
                await asyncio.sleep(LAZY_POLL_S)
        while model not in self.identities:
            t0 = time.monotonic()
            try:
                # the pair's tokenizer is the large model's; of the small one its fingerprint is enough
                identity = await asyncio.wait_for(
                    self.backend.identity(model, tokenizer=model == "large"), ASK_TIMEOUT_S
                )
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - starting, scaled to zero, restarting: asked again
                self.last_failure[model] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                log.info(
                    "the %s deployment has not said what it serves yet (%s); asking again",
                    model,
                    self.last_failure[model],
                )
                await asyncio.sleep(max(0.0, ASK_BACKOFF_S - (time.monotonic() - t0)))
                continue
            try:
                codec = await asyncio.to_thread(self._codec, identity) if model == "large" else None
                self._learn(model, identity, codec)
            except Exception as e:  # noqa: BLE001 - refused for good: said by /health and every request
                self.error = f"{type(e).__name__}: {e}"
                log.error("refusing to serve this pair: %s", self.error)
            return

    def _deployment(self, model: ModelRole):
        return (self.cfg.large if model == "large" else self.cfg.small).deployment

    def _codec(self, identity: ModelIdentity) -> Codec:
        """The large deployment's tokenizer, checked (off the event loop: a real vocabulary takes a
        second to load and check)."""
        codec = Codec.from_files(
            identity.tokenizer_files, source=f"the large deployment's tokenizer ({self.cfg.large.model})"
        )
        if codec.fingerprint != identity.tokenizer_fingerprint:
            raise PairRefused(
                f"the tokenizer rebuilt from the large deployment's files ({codec.fingerprint}) is not the one its "
                f"engine uses ({identity.tokenizer_fingerprint})"
            )
        check_marker(codec, self.cfg.policy.think_close)
        return codec

    def _learn(self, model: ModelRole, identity: ModelIdentity, codec: Codec | None) -> None:
        self.identities[model] = identity
        self.last_failure.pop(model, None)
        large, small = self.identities.get("large"), self.identities.get("small")
        if large is not None and small is not None:
            check_shared(
                large.tokenizer_fingerprint, small.tokenizer_fingerprint, "the large deployment", "the small deployment"
            )
            self.fingerprint = combine_fingerprints(
                large.model_fingerprint, small.model_fingerprint, large.tokenizer_fingerprint
            )
        codec = codec if codec is not None else (self.pair.codec if self.pair is not None else None)
        if codec is not None:  # the usable context: the smaller of the engines that answered
            self.pair = ServedPair(codec=codec, max_model_len=min(i.max_model_len for i in self.identities.values()))
        if self.fingerprint is not None:
            self.on_pair(self.fingerprint)
