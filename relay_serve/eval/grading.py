"""Grading with math-verify: the text after ``</think>`` (the whole text if the reasoning never
closed), boxed answer first, then math-verify's usual fall-backs."""

from __future__ import annotations

from relay_serve.extras import need
from relay_serve.relay.text import THINK_CLOSE


def answer_part(text: str) -> str:
    head, closed, tail = text.rpartition(THINK_CLOSE)
    return tail if closed else text


def _parse(text: str):
    mv = need("math_verify")
    return mv.parse(
        text,
        extraction_config=[mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()],
        parsing_timeout=None,
    )


def parse_gold(answer: str):
    text = answer if ("$" in answer or "\\boxed" in answer) else f"${answer}$"
    return _parse(text)


def extracted(text: str) -> str | None:
    """The answer math-verify reads from a response, as a string (for records)."""
    parsed = _parse(answer_part(text))
    return str(parsed[-1]) if parsed else None


def is_correct(text: str, gold: str) -> bool:
    verify = need("math_verify").verify
    pred = _parse(answer_part(text))
    return bool(pred) and bool(verify(parse_gold(gold), pred, timeout_seconds=None))


def same_answer(a: str, b: str) -> bool:
    """Two responses give the same final answer (math-verify equivalence)."""
    verify = need("math_verify").verify
    pa, pb = _parse(answer_part(a)), _parse(answer_part(b))
    return bool(pa) and bool(pb) and bool(verify(pa, pb, timeout_seconds=None))
