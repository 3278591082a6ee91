"""The router's live cue set: the cue store's latest set for this pair, hot-reloaded between
requests. The document it reads is ``cues.py``'s; the store, ``store.py``."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime

from relay_serve.calibration.cues import DEFAULT_VERSION, ActiveCues
from relay_serve.calibration.store import CueStore
from relay_serve.config import AppConfig

log = logging.getLogger(__name__)


class CueProvider:
    """The router's active cue set, hot-reloaded from the store.

    ``maybe_refresh`` (called before each request and by the health check) re-reads the store at
    most every ``poll_interval_s``; a request keeps the set it started with. A set for another
    pair, a corrupt set or an unreachable store never replaces the last good set: the error is
    logged and reported by ``status``.
    """

    def __init__(self, cfg: AppConfig, pair_fingerprint: str | None, store: CueStore | None = None, clock=None) -> None:
        self.cfg = cfg
        self.pair_fingerprint = pair_fingerprint
        self._clock = clock or time.monotonic
        self._store = store
        self._active = ActiveCues(
            version=DEFAULT_VERSION,
            cues=list(cfg.cues.default_cues),
            loaded_at=datetime.now(UTC),
            source="default",
        )
        self.last_error: str | None = None
        self.last_checked: datetime | None = None
        self._next_poll = 0.0
        self._lock = None

    @property
    def store(self) -> CueStore:
        if self._store is None:
            self._store = CueStore(self.cfg.cues.store_uri, self.cfg.cues.storage_options)
        return self._store

    def set_pair(self, fingerprint: str) -> None:
        """The pair's fingerprint, once the model deployments said it (``router/startup.py``): until
        then the default set serves, since a calibrated set is for one pair."""
        if fingerprint != self.pair_fingerprint:
            self.pair_fingerprint = fingerprint
            self._next_poll = 0.0  # read the store at the next request

    def active(self) -> ActiveCues:
        return self._active

    async def maybe_refresh(self) -> None:
        if self._clock() < self._next_poll:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        if self._lock.locked():
            return  # another request is reading the store; use the current set
        async with self._lock:
            self._next_poll = self._clock() + self.cfg.cues.poll_interval_s
            await asyncio.to_thread(self.refresh)

    def refresh(self) -> None:
        """Read the store's latest set now; swap it in if it is new, valid and for this pair."""
        self.last_checked = datetime.now(UTC)
        if self.pair_fingerprint is None:
            self.last_error = None  # the small deployment has not said what it serves yet: the default set
            return
        try:
            version = self.store.latest_version()
            if version is None or version == self._active.version:
                self.last_error = None
                return
            cue_set = self.store.load(version)
            if cue_set.pair.fingerprint != self.pair_fingerprint:
                raise ValueError(
                    f"cue set {version} is for another model pair ({cue_set.pair.large} + {cue_set.pair.small}, "
                    f"fingerprint {cue_set.pair.fingerprint}; this pair is {self.pair_fingerprint})"
                )
            if not cue_set.selected:
                raise ValueError(f"cue set {version} selects no cue")
        except Exception as e:  # noqa: BLE001 - any failure keeps the last good set
            msg = f"{type(e).__name__}: {e}"
            if msg != self.last_error:
                log.warning("keeping cue set %s: %s", self._active.version, msg)
            self.last_error = msg
            return
        self._active = ActiveCues(
            version=cue_set.version,
            cues=list(cue_set.selected),
            loaded_at=datetime.now(UTC),
            source=f"{self.store.uri}/versions/{cue_set.version}.json",
            created_at=cue_set.created_at,
        )
        self.last_error = None
        log.info("loaded cue set %s: %s", cue_set.version, ", ".join(cue_set.selected))

    def status(self) -> dict:
        return {
            "version": self._active.version,
            "source": self._active.source,
            "store": self.cfg.cues.store_uri,
            "ok": self.last_error is None,
            "last_error": self.last_error,
            "last_checked": self.last_checked.isoformat() if self.last_checked else None,
        }

    def describe(self) -> dict:
        return {
            **self._active.model_dump(mode="json"),
            "pair_fingerprint": self.pair_fingerprint,
            **{k: v for k, v in self.status().items() if k in ("store", "ok", "last_error", "last_checked")},
        }
