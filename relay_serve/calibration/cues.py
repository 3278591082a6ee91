"""Cue sets: the calibrated switch cues of one model pair, as a versioned pydantic document, the
active set a request runs with, and the pair's fingerprint. The router's hot-reloading view is
``router/cue_provider.py``; the store, ``store.py``.

Until a calibrated set for the serving pair exists in the store, the router uses the documented
default set (``CueSettings.default_cues``), reported with version ``"default"``.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from relay_serve.config import AppConfig, ModelSettings, SelectionRule

DEFAULT_VERSION = "default"


class CueStats(BaseModel):
    cue: str
    count: int = Field(description="occurrences with at least one scored token")
    mean: float | None = Field(None, description="mean over occurrences of the mean margin in its sentence")
    ci_low: float | None = None
    ci_high: float | None = None


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


class Provenance(BaseModel):
    """Where a version came from. Calibration-job versions before this field have none."""

    source: Literal["calibration", "online", "manual"] = "calibration"
    generations: int | None = Field(None, description="online: the served generations scored into the statistics")
    window_start: datetime | None = Field(None, description="online: the first scored generation")
    window_end: datetime | None = Field(None, description="online: the last one")
    previous: str | None = Field(None, description="online: the version active when this one was selected")


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
    provenance: Provenance = Field(default_factory=Provenance)


def manual_cue_set(pair: ModelPair, cues: list[str], version: str | None = None) -> CueSet:
    """A set an operator chose (no statistics behind it): ``source: manual``."""
    import uuid

    now = datetime.now(UTC)
    return CueSet(
        version=version or now.strftime("%Y%m%dT%H%M%S") + "-manual-" + uuid.uuid4().hex[:6],
        pair=pair,
        candidates=[],
        overall_mean=0.0,
        overall_count=0,
        selected=list(cues),
        rule=SelectionRule(),
        data=CalibrationData(source="manual", num_prompts=0, samples_per_prompt=0, num_traces=0, num_tokens=0),
        created_at=now,
        provenance=Provenance(source="manual"),
    )


class ActiveCues(BaseModel):
    """The set a request runs with."""

    version: str
    cues: list[str]
    loaded_at: datetime
    source: str = Field(description="'default' or the store URI of the set")
    created_at: datetime | None = Field(None, description="when the set was calibrated (None: the default set)")


def _file_digest(path: Path, h) -> None:
    h.update(path.name.encode())
    h.update(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))  # the head of the file: headers and the first weights


def _local_folder(model_path: str) -> Path | None:
    """The folder that holds ``model_path``: itself, or a hub id's snapshot in the local hub cache
    (where vLLM and transformers put what they download). None when neither exists here."""
    root = Path(model_path)
    if root.is_dir():
        return root
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_path, local_files_only=True))
    except Exception:  # noqa: BLE001 - not a hub id, or not downloaded here
        return None


def model_fingerprint(model: ModelSettings) -> str:
    """Of a model's config and weight files (names, sizes, heads): the same for a local folder
    and for a hub id whose snapshot holds the same files. Of the id only for a hub model not
    downloaded where this runs (the model replicas, which load it, always have it)."""
    h = hashlib.sha256()
    root = _local_folder(model.model_path)
    if root is not None:
        for path in sorted(root.iterdir()):
            if path.suffix in (".json", ".safetensors", ".bin") and path.name != "train_report.json":
                _file_digest(path, h)  # a hub snapshot's links are followed to the cache's blobs
    else:
        h.update(model.model_path.encode())
    return h.hexdigest()[:16]


def combine_fingerprints(large: str, small: str, tokenizer: str) -> str:
    """The pair's fingerprint from its models' and its tokenizer's: what the router computes from
    what the model replicas report, and the calibration job from the files it loads."""
    return hashlib.sha256(json.dumps([large, small, tokenizer]).encode()).hexdigest()[:16]


def pair_fingerprint(cfg: AppConfig) -> str:
    """The pair's fingerprint from the model files where this runs (calibration, the CLI)."""
    from relay_serve.tokenizer import load_codec

    return combine_fingerprints(
        model_fingerprint(cfg.large), model_fingerprint(cfg.small), load_codec(cfg.large.tokenizer_path).fingerprint
    )


def model_pair(cfg: AppConfig) -> ModelPair:
    return ModelPair(large=cfg.large.model, small=cfg.small.model, fingerprint=pair_fingerprint(cfg))
