"""Cue statistics and selection: the pure core the calibration job calls. No Ray, no engine.

For each candidate cue: its count (occurrences with at least one scored token), the mean over
occurrences of the mean margin in its sentence, and a t-interval at ``rule.confidence``. Our rule
keeps a cue whose interval lies wholly above the overall mean margin of all reasoning tokens; the
paper's rule (``mean-above-overall``) compares the means only. Both need ``min_occurrences``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from relay_serve.calibration.cues import CueStats, SelectionRule


def cue_stats(cue: str, values: Sequence[float], confidence: float) -> CueStats:
    n = len(values)
    if n == 0:
        return CueStats(cue=cue, count=0)
    mean = statistics.fmean(values)
    if n == 1:
        return CueStats(cue=cue, count=1, mean=mean)
    from scipy import stats

    half = stats.t.ppf(0.5 + confidence / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return CueStats(cue=cue, count=n, mean=mean, ci_low=mean - half, ci_high=mean + half)


def is_selected(s: CueStats, overall_mean: float, rule: SelectionRule) -> bool:
    if s.count < rule.min_occurrences or s.mean is None:
        return False
    if rule.rule == "mean-above-overall":
        return s.mean > overall_mean
    return s.ci_low is not None and s.ci_low > overall_mean


def select_cues(
    margins_by_cue: Mapping[str, Sequence[float]],
    candidates: Sequence[str],
    overall_mean: float,
    rule: SelectionRule,
) -> tuple[list[CueStats], list[str]]:
    """Statistics of every candidate (in candidate order) and the selected cues (best mean first)."""
    table = [cue_stats(c, margins_by_cue.get(c, []), rule.confidence) for c in candidates]
    chosen = sorted((s for s in table if is_selected(s, overall_mean, rule)), key=lambda s: -(s.mean or 0.0))
    return table, [s.cue for s in chosen]
