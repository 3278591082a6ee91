"""Online cue calibration's shared statistics and its publisher.

Every router replica sends the margins of the generations it scored (``serve/shadow.py``) to one
Ray actor per app (``CueStatsActor``, detached, named after the app and the pair), which keeps the
calibration job's statistics (per candidate cue: the mean margin in each scored occurrence's
sentence; the mean margin of every scored reasoning token) and writes them to the cue store
(``online/stats.json``) so that they outlive the actor too. Every ``publish_interval_s`` it
re-selects with the calibration job's own rule (``calibration_jobs.select``) and publishes a new
version when the selection differs from the active set's: recorded with ``source: online``, the
number of generations and their time window. Routers pick it up through the hot reload. A
rollback pins ``LATEST`` (``store.py``): nothing is published until it is unpinned.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, Field

from relay_serve.config import AppConfig, OnlineCalibration
from relay_serve.cues import CalibrationData, CueSet, ModelPair, Provenance
from relay_serve.store import CueStore

log = logging.getLogger(__name__)

MAX_OCCURRENCES_PER_CUE = 5000  # the newest are kept: statistics follow the traffic as it drifts


class CueStatistics(BaseModel):
    """What the scored generations say, summed; persisted as ``online/stats.json``."""

    pair_fingerprint: str
    by_cue: dict[str, list[float]] = Field(default_factory=dict, description="cue -> per-occurrence mean margin")
    overall_sum: float = 0.0
    overall_count: int = 0
    generations: int = 0
    explored: int = 0
    window_start: datetime | None = None
    window_end: datetime | None = None

    def add(self, by_cue: dict[str, list[float]], token_sum: float, token_count: int, explored: bool, at: datetime) -> None:
        for cue, values in by_cue.items():
            kept = self.by_cue.setdefault(cue, [])
            kept.extend(values)
            del kept[:-MAX_OCCURRENCES_PER_CUE]
        self.overall_sum += token_sum
        self.overall_count += token_count
        self.generations += 1
        self.explored += int(explored)
        self.window_start = self.window_start or at
        self.window_end = at

    @property
    def overall_mean(self) -> float | None:
        return self.overall_sum / self.overall_count if self.overall_count else None


def reselect(stats: CueStatistics, candidates: list[str], online: OnlineCalibration, active: list[str],
             active_version: str, pair: ModelPair) -> CueSet | None:  # fmt: skip
    """A new cue set when the calibration rule, applied to ``stats``, selects other cues than
    ``active`` (and at least one); else None."""
    from calibration_jobs.select import select_cues

    overall = stats.overall_mean
    if overall is None:
        return None
    rule = online.selection_rule()
    table, selected = select_cues(stats.by_cue, candidates, overall, rule)
    if not selected or set(selected) == set(active):
        return None
    now = datetime.now(timezone.utc)
    return CueSet(
        version=now.strftime("%Y%m%dT%H%M%S") + "-online-" + uuid.uuid4().hex[:6],
        pair=pair,
        candidates=table,
        overall_mean=overall,
        overall_count=stats.overall_count,
        selected=selected,
        rule=rule,
        data=CalibrationData(source="served traffic", num_prompts=stats.generations, samples_per_prompt=1,
                             num_traces=stats.generations, num_tokens=stats.overall_count),  # fmt: skip
        created_at=now,
        provenance=Provenance(source="online", generations=stats.generations, window_start=stats.window_start,
                              window_end=stats.window_end, previous=active_version),  # fmt: skip
    )


class CueStatsActor:
    """The app's shared statistics (a Ray actor: ``shadow.stats_actor`` creates or finds it)."""

    def __init__(self, config: dict[str, Any], pair: dict[str, Any]) -> None:
        from calibration_jobs.candidates import default_candidates

        self.cfg = AppConfig.model_validate(config)
        self.online = self.cfg.cues.online
        self.candidates = self.online.candidates or default_candidates()
        self.pair = ModelPair.model_validate(pair)  # as the model replicas reported it: this actor reads no model files
        self.store = CueStore(self.cfg.cues.store_uri, self.cfg.cues.storage_options)
        self.stats = self._load()
        self.published: list[str] = []
        self.last_error: str | None = None
        self._dirty = False
        self._loop: asyncio.Task | None = None

    def _load(self) -> CueStatistics:
        try:
            raw = self.store.online_stats()
            if raw is not None:
                stats = CueStatistics.model_validate_json(raw)
                if stats.pair_fingerprint == self.pair.fingerprint:
                    log.info("online cue statistics: %d generations read from %s", stats.generations, self.store.uri)
                    return stats
        except Exception as e:  # noqa: BLE001 - a corrupt or unreadable file starts afresh, said so
            log.warning("online cue statistics not read (starting afresh): %s", e)
        return CueStatistics(pair_fingerprint=self.pair.fingerprint)

    async def start(self) -> None:
        """Start the publishing loop (once; every router calls it)."""
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._publish_loop())

    async def add(self, by_cue: dict[str, list[float]], token_sum: float, token_count: int, explored: bool) -> None:
        self.stats.add(by_cue, token_sum, token_count, explored, datetime.now(timezone.utc))
        self._dirty = True

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(self.online.publish_interval_s)
            try:
                # a copy taken on the actor's loop: add() goes on changing the statistics meanwhile
                await asyncio.to_thread(self.publish_if_changed, self.stats.model_copy(deep=True))
                self.last_error = None
            except Exception as e:  # noqa: BLE001 - the next round tries again; status() shows it
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("online cue calibration: %s", self.last_error)

    def publish_if_changed(self, stats: CueStatistics | None = None) -> str | None:
        """Persist the statistics (``stats``: a copy of them); publish a re-selected set when it
        differs (not while pinned)."""
        stats = self.stats if stats is None else stats
        if self._dirty:
            self._dirty = False  # before the write: what add() brings meanwhile is written next time
            try:
                self.store.put_online_stats(stats.model_dump_json().encode())
            except Exception:
                self._dirty = True
                raise
        if self.store.pinned() is not None:
            return None
        latest = self.store.load_latest()
        active, version = (latest.selected, latest.version) if latest is not None else (self.cfg.cues.default_cues, "default")
        cue_set = reselect(stats, self.candidates, self.online, active, version, self.pair)
        if cue_set is None:
            return None
        self.store.publish(cue_set)
        self.published.append(cue_set.version)
        log.info("online cue calibration published %s: %s (was %s: %s)", cue_set.version, cue_set.selected, version, active)
        return cue_set.version

    async def status(self) -> dict[str, Any]:
        s = self.stats
        return {
            "generations": s.generations,
            "explored": s.explored,
            "scored_tokens": s.overall_count,
            "overall_mean": s.overall_mean,
            "occurrences": {cue: len(v) for cue, v in sorted(s.by_cue.items())},
            "window_start": s.window_start.isoformat() if s.window_start else None,
            "window_end": s.window_end.isoformat() if s.window_end else None,
            "published": list(self.published),
            "pinned": self.store.pinned(),
            "last_error": self.last_error,
        }
