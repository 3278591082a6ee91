"""The soak script against the shared app, briefly: it counts every request, and the router's
in-flight count and affinity map are back at their start afterwards."""

from __future__ import annotations

import pytest

from relay_serve.bench.soak import SoakSettings, run_soak


@pytest.mark.serve
@pytest.mark.vllm
def test_a_short_soak_passes_and_the_router_returns_to_its_start(relay_app):
    report = run_soak(relay_app, SoakSettings(clients=12, duration_s=6.0, settle_s=2.0, max_tokens=96), progress=False)
    assert report["requests"] >= 12 and report["errors"] == 0, report["first_errors"]
    assert report["passed"]
    aff = report["affinity_sessions"]
    assert aff["after"] == aff["before"] and report["router_after"]["in_flight"] == 0
    assert report["router_rss_mib"]["after"] > 0
