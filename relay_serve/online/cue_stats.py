"""Online cue calibration's shared statistics and its publisher.

Every router replica sends the margins of the generations it scored (``router/shadow.py``) to one
Ray actor per app (``CueStatsActor``, detached, named after the app and the pair), which keeps the
calibration job's statistics over the newest ``window_generations`` scored generations (per
candidate cue: the mean margin in each scored occurrence's sentence; the mean margin of every
scored reasoning token, from the same generations) and writes them to the cue store
(``online/stats.json``) so that they outlive the actor too. Every ``publish_interval_s`` it
re-selects with the calibration job's own rule (``relay_serve.calibration.select``) and publishes a new
version when the selection differs from the active set's in ``confirm_rounds`` rounds in a row:
recorded with ``source: online``, the number of generations and their time window, moving
``LATEST`` only from the set it compared with (``store.py``'s conditional move). Routers pick it
up through the hot reload. A rollback pins ``LATEST``: nothing is published until it is unpinned.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field

from relay_serve.calibration.cues import CalibrationData, CueSet, ModelPair, Provenance
from relay_serve.calibration.store import CueStore, PublishConflict
from relay_serve.config import AppConfig, OnlineCalibration

log = logging.getLogger(__name__)


class ScoredGeneration(BaseModel):
    """One scored generation's evidence."""

    by_cue: dict[str, list[float]] = Field(default_factory=dict, description="cue -> per-occurrence mean margin")
    token_sum: float = 0.0
    token_count: int = 0
    at: datetime


class CueStatistics(BaseModel):
    """What the newest ``window`` scored generations say; persisted as ``online/stats.json``. The
    cues' occurrences and the baseline (the mean margin of every scored token) come from the same
    generations, so a cue is compared with the traffic of its own time."""

    pair_fingerprint: str
    window: int = Field(2000, ge=1, description="scored generations kept (the newest)")
    recent: list[ScoredGeneration] = Field(default_factory=list)
    generations: int = Field(0, description="scored generations ever added")
    explored: int = 0

    def add(
        self, by_cue: dict[str, list[float]], token_sum: float, token_count: int, explored: bool, at: datetime
    ) -> None:
        self.recent.append(ScoredGeneration(by_cue=by_cue, token_sum=token_sum, token_count=token_count, at=at))
        del self.recent[: -self.window]
        self.generations += 1
        self.explored += int(explored)

    def resize(self, window: int) -> None:
        self.window = window
        del self.recent[: -self.window]

    @property
    def by_cue(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for g in self.recent:
            for cue, values in g.by_cue.items():
                out.setdefault(cue, []).extend(values)
        return out

    @property
    def overall_count(self) -> int:
        return sum(g.token_count for g in self.recent)

    @property
    def overall_mean(self) -> float | None:
        n = self.overall_count
        return sum(g.token_sum for g in self.recent) / n if n else None

    @property
    def window_start(self) -> datetime | None:
        return self.recent[0].at if self.recent else None

    @property
    def window_end(self) -> datetime | None:
        return self.recent[-1].at if self.recent else None


def reselect(
    stats: CueStatistics,
    candidates: list[str],
    online: OnlineCalibration,
    active: list[str],
    active_version: str,
    pair: ModelPair,
) -> CueSet | None:
    """A new cue set when the calibration rule, applied to ``stats``, selects other cues than
    ``active`` (and at least one); else None."""
    from relay_serve.calibration.select import select_cues

    overall = stats.overall_mean
    if overall is None:
        return None
    rule = online.selection_rule()
    table, selected = select_cues(stats.by_cue, candidates, overall, rule)
    generations = len(stats.recent)
    if not selected or set(selected) == set(active):
        return None
    now = datetime.now(UTC)
    return CueSet(
        version=now.strftime("%Y%m%dT%H%M%S") + "-online-" + uuid.uuid4().hex[:6],
        pair=pair,
        candidates=table,
        overall_mean=overall,
        overall_count=stats.overall_count,
        selected=selected,
        rule=rule,
        data=CalibrationData(
            source="served traffic",
            num_prompts=generations,
            samples_per_prompt=1,
            num_traces=generations,
            num_tokens=stats.overall_count,
        ),
        created_at=now,
        provenance=Provenance(
            source="online",
            generations=generations,
            window_start=stats.window_start,
            window_end=stats.window_end,
            previous=active_version,
        ),
    )


class CueStatsActor:
    """The app's shared statistics (a Ray actor: ``shadow.stats_actor`` creates or finds it)."""

    def __init__(self, config: dict[str, Any], pair: dict[str, Any]) -> None:
        self.pair = ModelPair.model_validate(pair)  # as the model replicas reported it: this actor reads no model files
        self._apply(config)
        self.stats = self._load()
        self.published: list[str] = []
        self.last_error: str | None = None
        self.conflicts = 0
        self._dirty = False
        self._pending: tuple[frozenset[str], int] | None = (
            None  # a different selection, and how many rounds in a row gave it
        )
        self._loop: asyncio.Task | None = None

    def _apply(self, config: dict[str, Any]) -> None:
        from relay_serve.calibration.candidates import default_candidates

        self.cfg = AppConfig.model_validate(config)
        self.online = self.cfg.cues.online
        self.candidates = self.online.candidates or default_candidates()
        self.store = CueStore(self.cfg.cues.store_uri, self.cfg.cues.storage_options)

    async def configure(self, config: dict[str, Any]) -> None:
        """The settings of the app deployed now (every router hands them over when it finds this
        actor): a redeployed ``cues.online`` applies at once; the publishing loop restarts on its
        interval."""
        if config == self.cfg.model_dump(mode="json"):
            return
        self._apply(config)
        self.stats.resize(self.online.window_generations)
        self._pending = None
        if self._loop is not None and not self._loop.done():
            self._loop.cancel()
            self._loop = asyncio.get_running_loop().create_task(self._publish_loop())
        log.info("online cue calibration reconfigured: %s", self.online.model_dump(mode="json"))

    def _load(self) -> CueStatistics:
        try:
            raw = self.store.online_stats()
            if raw is not None:
                stats = CueStatistics.model_validate_json(raw)
                if stats.pair_fingerprint == self.pair.fingerprint:
                    log.info("online cue statistics: %d generations read from %s", stats.generations, self.store.uri)
                    stats.resize(self.online.window_generations)
                    return stats
        except Exception as e:  # noqa: BLE001 - a corrupt or unreadable file (or an older format) starts afresh, said so
            log.warning("online cue statistics not read (starting afresh): %s", e)
        return CueStatistics(pair_fingerprint=self.pair.fingerprint, window=self.online.window_generations)

    async def start(self) -> None:
        """Start the publishing loop (once; every router calls it)."""
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._publish_loop())

    async def add(self, by_cue: dict[str, list[float]], token_sum: float, token_count: int, explored: bool) -> None:
        self.stats.add(by_cue, token_sum, token_count, explored, datetime.now(UTC))
        self._dirty = True

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(self.online.publish_interval_s)
            await self.publish_round()

    async def publish_round(self) -> str | None:
        """One round: the statistics as they stand (a copy, taken on the actor's loop together with
        the dirty flag, so an ``add()`` that comes while the copy is written is written next round),
        persisted and re-selected in a worker thread."""
        stats, dirty = self.stats.model_copy(deep=True), self._dirty
        self._dirty = False
        try:
            version = await asyncio.to_thread(self.publish_if_changed, stats, dirty)
            self.last_error = None
            return version
        except Exception as e:  # noqa: BLE001 - the next round tries again; status() shows it
            self._dirty = self._dirty or dirty
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("online cue calibration: %s", self.last_error)
            return None

    def publish_if_changed(self, stats: CueStatistics | None = None, persist: bool | None = None) -> str | None:
        """Persist the statistics (``stats``: a copy of them; ``persist``: whether they changed);
        publish a re-selected set once ``confirm_rounds`` rounds in a row gave it (not while
        pinned), as a conditional move of ``LATEST`` from the set it was compared with."""
        if stats is None:
            stats, persist = self.stats, self._dirty
            self._dirty = False
        if persist:
            self.store.put_online_stats(stats.model_dump_json().encode())
        if self.store.pinned() is not None:
            self._pending = None
            return None
        head = self.store.head()[1]  # the newest move, which the conditional publish starts from
        latest = self.store.load(head) if head is not None else None
        active, version = (
            (latest.selected, latest.version) if latest is not None else (self.cfg.cues.default_cues, "default")
        )
        cue_set = reselect(stats, self.candidates, self.online, active, version, self.pair)
        if cue_set is None:
            self._pending = None
            return None
        chosen = frozenset(cue_set.selected)
        rounds = self._pending[1] + 1 if self._pending is not None and self._pending[0] == chosen else 1
        self._pending = (chosen, rounds)
        if rounds < self.online.confirm_rounds:
            log.info(
                "online cue calibration: %s selected (%d of %d rounds in a row)",
                cue_set.selected,
                rounds,
                self.online.confirm_rounds,
            )
            return None
        try:
            self.store.publish(cue_set, expect_latest=head)
        except PublishConflict as e:  # the offline job (or a rollback) moved LATEST meanwhile: decide again on it
            self.conflicts += 1
            self._pending = None
            log.warning("online cue calibration: not published: %s", e)
            return None
        self._pending = None
        self.published.append(cue_set.version)
        log.info(
            "online cue calibration published %s: %s (was %s: %s)", cue_set.version, cue_set.selected, version, active
        )
        return cue_set.version

    async def status(self) -> dict[str, Any]:
        s = self.stats
        return {
            "generations": s.generations,
            "window_generations": len(s.recent),
            "explored": s.explored,
            "scored_tokens": s.overall_count,
            "overall_mean": s.overall_mean,
            "occurrences": {cue: len(v) for cue, v in sorted(s.by_cue.items())},
            "window_start": s.window_start.isoformat() if s.window_start else None,
            "window_end": s.window_end.isoformat() if s.window_end else None,
            "pending": {"cues": sorted(self._pending[0]), "rounds": self._pending[1]} if self._pending else None,
            "published": list(self.published),
            "conflicts": self.conflicts,
            "pinned": self.store.pinned(),
            "settings": self.online.model_dump(mode="json"),
            "lifetime": "detached: outlives router replicas and the app (its statistics are in the store); "
            "removing it (`ray kill` of relay-cue-stats-<app>-<pair>) loses nothing",
            "last_error": self.last_error,
        }
