"""The ``auto`` model: each generation runs as relay or as the large model alone, whichever has
been faster at the current load. Pure bookkeeping: knows nothing of Ray, vLLM or HTTP.

Which path is faster depends on the pair, the engines (a speculative large engine already lets the
small model write most tokens) and the load: relay saves decode steps of the large model, which
count most while the engines are latency-bound and least when they are compute-bound, and each of
its handoffs costs a prefill and a wait for the next step. Rather than model all that, the chooser
measures it: for each load level (generations in flight, in power-of-two buckets) it keeps each
path's seconds per output token over its last ``window`` generations (their seconds summed over
their tokens summed: a generation counts by its tokens, as in a throughput, and a short one's
first-token wait does not swing the figure as it does a mean of per-generation ratios), tries each
path until it has ``min_samples`` figures, then takes the faster one, and still runs the other one
in one block in ``explore_every`` so that its figure follows the engines as they change. A block of
the slower path costs its margin, and a path far behind is unlikely to overtake soon: a margin wider
than ``explore_margin`` stretches the interval in proportion (up to ``explore_stretch`` times), so
that exploring costs about ``explore_margin`` / ``explore_every`` of the time whatever the margin (at
concurrency 1 relay was 25% faster here, and one block in 20 on the large path cost 1.3%).

The two paths are compared only by generations that ran near in time: the machine's speed drifts
(another process, a slow minute: 10% between the bench's rounds here), and the path a level does
not run has a figure from its last block, minutes old, while the other's is from the last seconds.
Compared so, a 10% margin read the wrong way round (the bench at 8 relayed a slow round, found
relay's fresh figure slower than the large path's from before it, and ran the large path while
relay was 3-13% faster). So each generation that teaches a figure is also set beside the other
path's generations that ended within its last ``block_turnovers`` + 1 lives (a *pair*: its seconds
against what its tokens took the other path then), and the level chooses by the last ``window``
pairs (both ways: relay against large, large against relay); only with no pair at all by the
figures themselves.

A path's figure must be what that path costs when it is the policy, not what one generation of it
costs among generations of the other: a relay generation among large ones gets the small model's
fast tokens while its handoffs' prefills slow everyone else down, so judged alone it looks better
than relay for all is. So a level runs *blocks*: ``block_turnovers`` x the level's size of
generations in a row on one path (at level 32, 64 generations, enough for the engines to hold
only that path), and a generation teaches its path's figure only when at least ``min_purity`` of
the generations beside it over its life ran the same path (``LoadClock.share_since``).

A generation teaches the level of the load it ran under (the mean of the generations in flight
over its life, from a ``LoadClock``), and is chosen at the level of the most generations in flight
over the recent past (``LoadClock.peak``; by default the last generations' mean life), not of those
in flight when it starts: the first generations of a burst start with few others in flight and run
under all of them. Chosen by their start count, those of a burst of 64 that start with 45 or fewer
in flight were chosen at levels 1-32, in blocks those levels ran for loads they never saw; taught by
it, they taught the low levels what the high load costs. The window is as long as a generation
lives because that is how far back a start still runs beside a generation starting now: a fixed
30 s window chose the first 20 generations of a single client (1.5 s each) at the level of the 8
clients that had stopped before it started.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Path = Literal["relay", "large"]
PATHS: tuple[Path, ...] = ("relay", "large")


def other(path: Path) -> Path:
    """The path that is not ``path``."""
    return "large" if path == "relay" else "relay"


class AutoSettings(BaseModel):
    """How ``auto`` learns (the ``policy.auto`` section of the app config)."""

    model_config = ConfigDict(extra="forbid")

    min_samples: int = Field(
        8, ge=1, description="generations of each path a load level learns from before it chooses by their speed"
    )
    explore_every: int = Field(
        20, ge=2, description="one block in this many runs the other path, so that its figure stays current"
    )
    explore_margin: float = Field(
        0.05,
        gt=0.0,
        description="a margin between the paths (|log| of their ratio) above this explores less often in proportion: "
        "a margin 3x as wide explores one block in 3 x explore_every",
    )
    explore_stretch: float = Field(
        4.0,
        ge=1.0,
        description="a wide margin explores at most this many times less often than explore_every (the longest a "
        "level runs before it can notice that the other path overtook)",
    )
    block_turnovers: float = Field(
        2.0, ge=1.0, description="a block is this many times the load level's size of generations in a row on one path"
    )
    min_purity: float = Field(
        0.75,
        ge=0.0,
        le=1.0,
        description="a generation teaches its path's figure when at least this share of the load over its life ran "
        "that path",
    )
    window: int = Field(
        32,
        ge=1,
        description="a path's figure at a level: the seconds of its last this many generations that taught it over "
        "their output tokens",
    )
    load_window_s: float | None = Field(
        None,
        ge=0.0,
        description="a generation is chosen at the level of the most generations in flight over this many seconds "
        "before it starts (or of those in flight now, if more): a burst's generations start one by one but run under "
        "all of it; None: the mean life of the router's last generations",
    )


def bucket(load: float) -> int:
    """The load level of ``load`` generations in flight: 1, 2, 4, 8, ..., the power of two nearest to it
    on a log scale (a closed loop of 32 clients averages just under 32 in flight: level 32, as the
    32 in flight that its generations start with)."""
    return 1 << max(0, round(math.log2(max(1.0, load))))


@dataclass(frozen=True)
class Mark:
    """Where a generation entered a :class:`LoadClock`."""

    t: float
    area: float
    path_area: float
    path: str


class LoadClock:
    """The generations in flight, in all and by path, and their integrals over time, so that a
    generation's mean load over its life and the share of it that ran its own path cost O(1):
    ``enter`` when it starts, ``mean_since`` and ``share_since`` when it ends."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.n = 0
        self._peaks: deque[tuple[float, int]] = deque()  # (when, most in flight then): later ones with fewer
        self._kept_s = 0.0  # the longest window asked of peak()
        self._by_path: dict[str, int] = {}
        self._area = 0.0  # generation-seconds so far
        self._path_area: dict[str, float] = {}
        self._t = clock()
        self.mean_life_s = 0.0  # of the generations that left, a moving average (0 before any left)

    def _advance(self) -> float:
        now = self.clock()
        dt = now - self._t
        self._area += self.n * dt
        for path, n in self._by_path.items():
            self._path_area[path] = self._path_area.get(path, 0.0) + n * dt
        self._t = now
        return now

    def enter(self, path: str = "") -> Mark:
        """One more in flight (on ``path``); the mark to give ``mean_since`` when it ends."""
        now = self._advance()
        self.n += 1
        self._by_path[path] = self._by_path.get(path, 0) + 1
        self._keep_peak(now, self.n)
        return Mark(now, self._area, self._path_area.get(path, 0.0), path)

    def _keep_peak(self, now: float, n: int) -> None:
        while self._peaks and self._peaks[-1][1] <= n:  # a later moment with as many in flight
            self._peaks.pop()
        self._peaks.append((now, n))

    def peak(self, window_s: float) -> int:
        """The most in flight at any moment of the last ``window_s`` seconds. The count is a step
        function: its most over a window is the count after each enter inside it, before each leave
        inside it (which was in force up to that leave, from inside the window or before it) and now.
        Kept: those moments with more in flight than any later one (a falling queue), as far back as
        the longest window asked."""
        now = self.clock()
        self._kept_s = max(self._kept_s, window_s)
        while self._peaks and self._peaks[0][0] < now - self._kept_s:  # too old for any window asked
            self._peaks.popleft()
        # the first moment kept inside the window had more in flight than any later one
        inside = next((n for t, n in self._peaks if t >= now - window_s), 0)
        return max(self.n, inside)

    def leave(self, mark: Mark) -> None:
        """The generation that entered at ``mark`` has ended."""
        now = self._advance()
        self._keep_peak(now, self.n)  # in force until now
        self.n -= 1
        self._by_path[mark.path] -= 1
        life = now - mark.t
        self.mean_life_s = life if not self.mean_life_s else 0.9 * self.mean_life_s + 0.1 * life

    def mean_since(self, mark: Mark) -> float:
        """The mean number in flight since ``mark`` (the marked generation included, while in flight)."""
        now = self._advance()
        return (self._area - mark.area) / (now - mark.t) if now > mark.t else float(self.n)

    def share_since(self, mark: Mark) -> float:
        """The share of the generation-seconds since ``mark`` that ran the marked path (1.0: only it)."""
        self._advance()
        area = self._area - mark.area
        if area <= 0:
            return self._by_path.get(mark.path, 0) / self.n if self.n else 1.0
        return (self._path_area.get(mark.path, 0.0) - mark.path_area) / area


MIN_PAIRED = 2  # generations of the other path a generation is set beside (one is a single sample of noise)


@dataclass(frozen=True)
class _Run:
    end: float  # when it was recorded (the chooser's clock)
    seconds: float
    tokens: int


def _s_per_token(runs: Iterable[_Run]) -> float | None:
    seconds = tokens = 0.0
    for r in runs:
        seconds += r.seconds
        tokens += r.tokens
    return seconds / tokens if tokens else None


@dataclass
class _Figure:
    """A path's last generations at a level."""

    window: int
    runs: deque[_Run] = field(init=False)
    samples: int = 0  # all it learnt from, the ones that left the window included

    def __post_init__(self) -> None:
        self.runs = deque(maxlen=self.window)

    def add(self, run: _Run) -> None:
        self.runs.append(run)
        self.samples += 1

    @property
    def s_per_token(self) -> float | None:
        return _s_per_token(self.runs)

    def since(self, t: float) -> list[_Run]:
        """Its generations recorded at ``t`` or later."""
        return [r for r in self.runs if r.end >= t]


@dataclass(frozen=True)
class _Pair:
    """A generation of ``path`` beside the other path's generations of the same time: its seconds,
    and what its tokens took the other path then."""

    path: Path
    seconds: float
    other_seconds: float


@dataclass
class _Level:
    window: int
    figures: dict[str, _Figure] = field(init=False)
    pairs: deque[_Pair] = field(init=False)
    started: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))
    since_explore: int = 0  # blocks of the faster path since the level last explored
    path: Path = "relay"
    left: int = 0  # generations still to start in the current block

    def __post_init__(self) -> None:
        self.figures = {p: _Figure(self.window) for p in PATHS}
        self.pairs = deque(maxlen=self.window)

    def over_other(self, path: Path) -> tuple[float | None, int]:
        """By ``path``'s pairs in the window: its seconds over what its tokens took the other path
        at the same time (None without pairs), and how many."""
        own = [p for p in self.pairs if p.path == path]
        return (sum(p.seconds for p in own) / sum(p.other_seconds for p in own) if own else None), len(own)

    def relay_over_large(self) -> float | None:
        """Relay's seconds per token over the large path's, by the pairs: the geometric mean of relay's
        (relay against large) and the inverse of the large path's, weighted by their numbers."""
        logs = 0.0
        for path in PATHS:
            ratio, n = self.over_other(path)
            if ratio is not None:
                logs += n * math.log(ratio) * (1 if path == "relay" else -1)
        return math.exp(logs / len(self.pairs)) if self.pairs else None


class AutoChooser:
    """Chooses relay or large per generation, learning from finished ones."""

    def __init__(self, settings: AutoSettings | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.settings = settings or AutoSettings()
        self.clock = clock
        self.levels: dict[int, _Level] = {}

    def choose(self, load: int) -> Path:
        """The path of a generation that starts with ``load`` generations in flight (itself included)."""
        size = bucket(load)
        level = self._level(size)
        if level.left <= 0:
            level.path = self._next_block(level)
            level.left = math.ceil(self.settings.block_turnovers * size)
        level.left -= 1
        level.started[level.path] += 1
        return level.path

    def _level(self, size: int) -> _Level:
        if size not in self.levels:
            self.levels[size] = _Level(self.settings.window)
        return self.levels[size]

    def load_window_s(self, clock: LoadClock) -> float:
        """How far back ``clock.peak`` looks for the load a generation starting now will run under."""
        w = self.settings.load_window_s
        return clock.mean_life_s if w is None else w

    def load_ahead(self, clock: LoadClock) -> int:
        """The load a generation starting now will run under: the most in flight of late (a burst's
        first generations start with few others in flight), or those in flight now with it, if more."""
        return max(clock.n + 1, clock.peak(self.load_window_s(clock)))

    def _next_block(self, level: _Level) -> Path:
        short = [p for p in PATHS if level.figures[p].samples < self.settings.min_samples]
        if short:  # learn first: the path started fewer times, relay on ties
            return min(short, key=lambda p: level.started[p])
        ratio = level.relay_over_large()
        if ratio is None:  # no generation of either ran near one of the other: their own figures
            ratio = (level.figures["relay"].s_per_token or 0.0) / (level.figures["large"].s_per_token or 1.0)
        best: Path = "relay" if ratio <= 1.0 else "large"
        level.since_explore += 1
        if level.since_explore >= self.explore_interval(ratio):
            level.since_explore = 0
            return other(best)
        return best

    def explore_interval(self, ratio: float) -> float:
        """One block in this many explores the slower path, when relay's time over the large path's
        is ``ratio``: ``explore_every``, stretched by how far the margin is beyond ``explore_margin``."""
        s = self.settings
        margin = abs(math.log(ratio)) if ratio > 0 else math.inf
        return s.explore_every * min(s.explore_stretch, max(1.0, margin / s.explore_margin))

    def record(self, path: Path, load: float, seconds: float, tokens: int, purity: float = 1.0) -> None:
        """A generation of ``path`` that ran under ``load`` in flight (its mean), ``purity`` of
        that load on its own path, took ``seconds`` for ``tokens`` output tokens."""
        if tokens <= 0 or seconds <= 0 or purity < self.settings.min_purity:
            return
        level = self._level(bucket(load))
        run = _Run(self.clock(), seconds, tokens)
        near = level.figures[other(path)].since(run.end - (self.settings.block_turnovers + 1) * seconds)
        if len(near) >= MIN_PAIRED:
            level.pairs.append(_Pair(path, seconds, tokens * (_s_per_token(near) or 0.0)))
        level.figures[path].add(run)

    def state(self) -> dict[str, dict[str, dict[str, float | int | None]]]:
        """For ``/v1/relay/stats``: each load level's figures (ms per token) and samples, and what each
        path's pairs in the window say (``over_other``: its seconds over what its tokens took the other
        path at the same time, from ``pairs`` generations)."""
        out: dict[str, dict[str, dict[str, float | int | None]]] = {}
        for b, level in sorted(self.levels.items()):
            out[str(b)] = {}
            for p in PATHS:
                f, (ratio, n) = level.figures[p], level.over_other(p)
                out[str(b)][p] = {
                    "ms_per_token": None if f.s_per_token is None else round(1000 * f.s_per_token, 3),
                    "samples": f.samples,
                    "over_other": None if ratio is None else round(ratio, 4),
                    "pairs": n,
                }
        return out
