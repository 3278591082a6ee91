"""The handoff micro-benchmark on a real engine (the narrow toy model, two trials): every way of
resuming is timed, and only the resumable ones skip computing the context again."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_every_resume_is_timed_and_the_resumable_ones_compute_only_what_is_new():
    from relay_serve.bench.handoff import run

    report = run("toy:large", trials=2, small_tokens=9)
    by = {m.method: m for m in report.methods}
    assert set(by) == {"new request", "resumable", "resumable, pre-fed"}
    assert report.decode_step_ms > 0 and all(m.ttft_ms_median > 0 for m in report.methods)
    assert (
        by["resumable"].recomputed_tokens == 10 and by["resumable, pre-fed"].recomputed_tokens == 1
    )  # the pending token and the sentence
    assert by["new request"].recomputed_tokens >= 10  # the sentence and the pending token, plus the last block's tail
    from vllm.platforms import current_platform

    if current_platform.is_cpu():  # vLLM-CPU's attention takes blocks of a multiple of 32 tokens only
        assert report.block_16.startswith("refused") and "32" in report.block_16, report.block_16
    else:
        assert report.block_16 == "accepted", report.block_16
    assert "| new request |" in report.table()
