"""Per-token probability margins and their grouping by cue: the pure core of cue calibration.

The margin of a token is p(top1) - p(top2) under the scoring (small) model, teacher-forced on a
trace the large model wrote. For a cue occurrence, the margins that count are those of the tokens
from just after the cue to the end of its sentence (the same cue and sentence rules the router
uses: :mod:`relay_serve.relay.text`). No Ray, no engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, Field

from relay_serve.relay.text import find_all_cues, sentence_end


def margin_from_logprobs(top_logprobs: Sequence[float]) -> float:
    """p(top1) - p(top2) from the (at least two) largest log-probabilities at one position."""
    if len(top_logprobs) < 2:
        raise ValueError("a margin needs the top 2 log-probabilities")
    a, b = sorted(top_logprobs, reverse=True)[:2]
    return math.exp(a) - math.exp(b)


class TraceMargins(BaseModel):
    """The margins of one scored trace, grouped."""

    by_cue: dict[str, list[float]] = Field(default_factory=dict, description="cue -> per-occurrence mean margin")
    all_tokens: list[float] = Field(default_factory=list, description="margin of every reasoning token")


def group_margins(
    thinking: str,
    token_spans: Sequence[tuple[int, int]],
    margins: Sequence[float],
    cues: Sequence[str],
) -> TraceMargins:
    """Group the margins of one trace's reasoning tokens by the cue whose sentence holds them.

    ``thinking`` is the reasoning text (what lies between ``<think>`` and ``</think>``);
    ``token_spans[i]`` is the character span of token ``i`` in it and ``margins[i]`` its margin.
    Each cue occurrence contributes one value: the mean margin of the tokens that start at or after
    the cue's end and before its sentence's end. Occurrences with no such token contribute nothing.
    """
    if len(token_spans) != len(margins):
        raise ValueError(f"{len(token_spans)} token spans but {len(margins)} margins")
    out = TraceMargins(all_tokens=[float(m) for m in margins])
    starts = [s for s, _ in token_spans]
    for match in find_all_cues(thinking, list(cues)):
        stop = sentence_end(thinking, match.end)
        stop = len(thinking) if stop is None else stop
        inside = [m for s, m in zip(starts, margins, strict=True) if match.end <= s < stop]
        if inside:
            out.by_cue.setdefault(match.cue, []).append(sum(inside) / len(inside))
    return out


def token_spans(codec, token_ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """The decoded text of ``token_ids`` and each token's character span in it."""
    from relay_serve.relay.output import Output

    out = Output(codec)
    out.append(list(token_ids), "large")
    ends = out.starts[1:] + [len(out.text)]
    return out.text, list(zip(out.starts, ends, strict=False))


def trace_margins(
    codec,
    completion_ids: Sequence[int],
    top_logprobs: Sequence[Sequence[float]],
    cues: Sequence[str],
    think_open: str = "<think>",
    think_close: str = "</think>",
    counted: Sequence[bool] | None = None,
) -> TraceMargins:
    """Margins of one scored trace: ``top_logprobs[i]`` are the scoring model's largest
    log-probabilities at completion token ``i``. Only the reasoning (between ``think_open`` and
    ``think_close``, or to the end when it never closes) counts, and with ``counted`` only the
    tokens it marks (a served relay generation: the large model's; the small model's own sentences
    say nothing about how it would have written them)."""
    if len(top_logprobs) != len(completion_ids):
        raise ValueError(f"{len(completion_ids)} tokens but {len(top_logprobs)} scored positions")
    if counted is not None and len(counted) != len(completion_ids):
        raise ValueError(f"{len(completion_ids)} tokens but {len(counted)} counted flags")
    text, spans = token_spans(codec, completion_ids)
    lo = text.find(think_open)
    lo = 0 if lo == -1 else lo + len(think_open)
    hi = text.find(think_close, lo)
    hi = len(text) if hi == -1 else hi
    kept_spans, kept = [], []
    for i, ((a, b), lps) in enumerate(zip(spans, top_logprobs, strict=True)):
        if a >= lo and b <= hi and b > a and (counted is None or counted[i]):
            kept_spans.append((a - lo, b - lo))
            kept.append(margin_from_logprobs(lps))
    return group_margins(text[lo:hi], kept_spans, kept, cues)
