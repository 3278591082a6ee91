"""The ``auto`` model: each generation runs as relay or as the large model alone, whichever has
been faster at the current load. Pure bookkeeping: knows nothing of Ray, vLLM or HTTP.

Which path is faster depends on the pair, the engines (a speculative large engine already lets the
small model write most tokens) and the load: relay saves decode steps of the large model, which
count most while the engines are latency-bound and least when they are compute-bound, and each of
its handoffs costs a prefill and a wait for the next step. Rather than model all that, the chooser
measures it: for each load level (generations in flight, in power-of-two buckets) it keeps a moving
average of each path's seconds per output token, tries each path ``min_samples`` times, then takes the
faster one, and still runs the other one generation in ``explore_every`` so that its figure follows
the engines as they change.

A generation is chosen by the load when it starts but teaches the level of the load it ran under
(the mean of the generations in flight over its life, from a ``LoadClock``): the first generations of
a burst start with few others in flight and run under all of them, and taught the low levels what
the high load costs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
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


def bucket(load: float) -> int:
    """The load level of ``load`` generations in flight: 1, 2, 4, 8, ..., the power of two nearest to it
    on a log scale (a closed loop of 32 clients averages just under 32 in flight: level 32, as the
    32 in flight that its generations start with)."""
    return 1 << max(0, round(math.log2(max(1.0, load))))


class LoadClock:
    """The generations in flight, and their integral over time, so that a generation's mean load
    over its life costs O(1): ``mark`` when it starts, ``mean_since`` when it ends."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.n = 0
        self._area = 0.0  # generation-seconds so far
        self._t = clock()

    def _advance(self) -> float:
        now = self.clock()
        self._area += self.n * (now - self._t)
        self._t = now
        return now

    def enter(self) -> tuple[float, float]:
        """One more in flight; the mark to give ``mean_since`` when it ends."""
        now = self._advance()
        self.n += 1
        return now, self._area

    def leave(self) -> None:
        self._advance()
        self.n -= 1

    def mean_since(self, mark: tuple[float, float]) -> float:
        """The mean number in flight since ``mark`` (the marked generation included, while in flight)."""
        now = self._advance()
        t0, area0 = mark
        return (self._area - area0) / (now - t0) if now > t0 else float(self.n)


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

    def record(self, path: Path, load: float, seconds: float, tokens: int) -> None:
        """A generation of ``path`` that ran under ``load`` in flight (its mean) took ``seconds`` for ``tokens`` output tokens."""
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
