"""The look-ahead's cost micro-benchmark on a real engine (the narrow toy model, one run each way):
the swaps of the sentence stops and cues are found in the toy's spare ids, both ways write
tokens, and the report says what a step costs."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_both_ways_are_timed_with_swaps_on_the_toys_spare_ids():
    from relay_serve.bench.swaps import run

    report = run("toy:large", batch=2, runs=1)
    assert report.triggers > 0 and report.standins > 0
    assert len(report.tok_s_without) == len(report.tok_s_with) == 1
    assert min(report.tok_s_without + report.tok_s_with) > 0
    assert "| with swaps on every request |" in report.table() and "ms more" in report.table()
