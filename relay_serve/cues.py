"""Cue sets: the calibrated switch cues of one model pair, as a versioned pydantic document, and
the router's view of the active set.

Until a calibrated set for the serving pair exists in the store, the router uses the documented
default set (``CueSettings.default_cues``), reported with version ``"default"``.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from relay_serve.config import AppConfig, ModelSettings

DEFAULT_VERSION = "default"


class CueStats(BaseModel):
    cue: str
    count: int = Field(description="occurrences with at least one scored token")
    mean: float | None = Field(None, description="mean over occurrences of the mean margin in its sentence")
    ci_low: float | None = None
    ci_high: float | None = None


class SelectionRule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rule: Literal["ci-above-overall", "mean-above-overall"] = Field(
        "ci-above-overall",
        description="ci-above-overall: the lower end of the cue's interval is above the overall mean "
        "(ours); mean-above-overall: the cue's mean is (the paper's)",
    )
    min_occurrences: int = Field(5, ge=1)
    confidence: float = Field(0.95, gt=0.0, lt=1.0)


class ModelPair(BaseModel):
    large: str
    small: str
    fingerprint: str = Field(description="of both models' weights and config and of the shared tokenizer")


class CalibrationData(BaseModel):
    source: str
    num_prompts: int
    samples_per_prompt: int
    num_traces: int
    num_tokens: int


class CueSet(BaseModel):
    schema_version: Literal[1] = 1
    version: str
    pair: ModelPair
    candidates: list[CueStats]
    overall_mean: float
    overall_count: int
    selected: list[str]
    rule: SelectionRule
    data: CalibrationData
    created_at: datetime
    job_id: str | None = None


class ActiveCues(BaseModel):
    """The set a request runs with."""

    version: str
    cues: list[str]
    loaded_at: datetime
    source: str = Field(description="'default' or the store URI of the set")


def _file_digest(path: Path, h) -> None:
    h.update(path.name.encode())
    h.update(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))  # the head of the file: headers and the first weights


def model_fingerprint(model: ModelSettings) -> str:
    """Of a local model folder's config and weight files; of the id for a hub model."""
    h = hashlib.sha256()
    root = Path(model.model_path)
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if path.suffix in (".json", ".safetensors", ".bin") and path.name != "train_report.json":
                _file_digest(path, h)
    else:
        h.update(model.model_path.encode())
    return h.hexdigest()[:16]


def pair_fingerprint(cfg: AppConfig) -> str:
    from relay_serve.tokenizer import load_codec

    tok = load_codec(cfg.large.tokenizer_path).fingerprint
    blob = json.dumps([model_fingerprint(cfg.large), model_fingerprint(cfg.small), tok])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def model_pair(cfg: AppConfig) -> ModelPair:
    return ModelPair(large=cfg.large.model, small=cfg.small.model, fingerprint=pair_fingerprint(cfg))


class CueProvider:
    """The router's active cue set, hot-reloaded from the store.

    ``maybe_refresh`` (called before each request and by the health check) re-reads the store at
    most every ``poll_interval_s``; a request keeps the set it started with. A set for another
    pair, a corrupt set or an unreachable store never replaces the last good set: the error is
    logged and reported by ``status``.
    """

    def __init__(self, cfg: AppConfig, pair_fingerprint: str, store=None, clock=None) -> None:
        import time

        self.cfg = cfg
        self.pair_fingerprint = pair_fingerprint
        self._clock = clock or time.monotonic
        self._store = store
        self._active = ActiveCues(
            version=DEFAULT_VERSION,
            cues=list(cfg.cues.default_cues),
            loaded_at=datetime.now(timezone.utc),
            source="default",
        )
        self.last_error: str | None = None
        self.last_checked: datetime | None = None
        self._next_poll = 0.0
        self._lock = None

    @property
    def store(self):
        if self._store is None:
            from relay_serve.store import CueStore

            self._store = CueStore(self.cfg.cues.store_uri, self.cfg.cues.storage_options)
        return self._store

    def active(self) -> ActiveCues:
        return self._active

    async def maybe_refresh(self) -> None:
        import asyncio

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
        import logging

        log = logging.getLogger(__name__)
        self.last_checked = datetime.now(timezone.utc)
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
            loaded_at=datetime.now(timezone.utc),
            source=f"{self.store.uri}/versions/{cue_set.version}.json",
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
        return {**self._active.model_dump(mode="json"), "pair_fingerprint": self.pair_fingerprint, **{
            k: v for k, v in self.status().items() if k in ("store", "ok", "last_error", "last_checked")
        }}
