"""The ``auto`` model: each generation runs as relay or as the large model alone, whichever has
been faster at the current load. Pure bookkeeping: knows nothing of Ray, vLLM or HTTP.

Which path is faster depends on the pair, the engines (a speculative large engine already lets the
small model write most tokens) and the load: relay saves decode steps of the large model, which
count most while the engines are latency-bound and least when they are compute-bound, and each of
its handoffs costs a prefill and a wait for the next step. Rather than model all that, the chooser
measures it: for each load level (the generations in flight when a generation starts, in
power-of-two buckets) it keeps a moving average of each path's seconds per output token, tries each
path ``min_samples`` times, then takes the faster one, and still runs the other one generation in
``explore_every`` so that its figure follows the engines as they change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Path = Literal["relay", "large"]
PATHS: tuple[Path, ...] = ("relay", "large")


class AutoSettings(BaseModel):
    """How ``auto`` learns (the ``policy.auto`` section of the app config)."""

    model_config = ConfigDict(extra="forbid")

    min_samples: int = Field(4, ge=1, description="generations of each path a load level runs before it chooses by their speed")
    explore_every: int = Field(
        20, ge=2, description="one generation in this many runs the other path, so that its figure stays current"
    )
    smoothing: float = Field(0.2, gt=0.0, le=1.0, description="weight of the newest generation in a path's moving average")


def bucket(load: int) -> int:
    """The load level of ``load`` generations in flight: 1, 2, 4, 8, ... (the power of two at or below it)."""
    return 1 << (max(1, load).bit_length() - 1)


@dataclass
class _Figure:
    s_per_token: float | None = None
    samples: int = 0


@dataclass
class _Level:
    figures: dict[str, _Figure] = field(default_factory=lambda: {p: _Figure() for p in PATHS})
    started: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))
    decisions: int = 0


class AutoChooser:
    """Chooses relay or large per generation, learning from finished ones."""

    def __init__(self, settings: AutoSettings | None = None) -> None:
        self.settings = settings or AutoSettings()
        self.levels: dict[int, _Level] = {}

    def choose(self, load: int) -> Path:
        """The path of a generation that starts with ``load`` generations in flight (itself included)."""
        level = self.levels.setdefault(bucket(load), _Level())
        level.decisions += 1
        short = [p for p in PATHS if level.figures[p].samples < self.settings.min_samples]
        if short:  # learn first: the path started fewer times (a burst is split too), relay on ties
            path = min(short, key=lambda p: level.started[p])
        else:
            best = min(PATHS, key=lambda p: level.figures[p].s_per_token or 0.0)
            path = next(p for p in PATHS if p != best) if level.decisions % self.settings.explore_every == 0 else best
        level.started[path] += 1
        return path

    def record(self, path: Path, load: int, seconds: float, tokens: int) -> None:
        """A generation of ``path`` that started at ``load`` took ``seconds`` for ``tokens`` output tokens."""
        if tokens <= 0 or seconds <= 0:
            return
        figure = self.levels.setdefault(bucket(load), _Level()).figures[path]
        value = seconds / tokens
        a = self.settings.smoothing
        figure.s_per_token = value if figure.s_per_token is None else (1 - a) * figure.s_per_token + a * value
        figure.samples += 1

    def state(self) -> dict[str, dict[str, dict[str, float | int | None]]]:
        """For ``/v1/relay/stats``: each load level's figures (ms per token) and samples."""
        return {
            str(b): {
                p: {"ms_per_token": None if f.s_per_token is None else round(1000 * f.s_per_token, 3), "samples": f.samples}
                for p, f in level.figures.items()
            }
            for b, level in sorted(self.levels.items())
        }
