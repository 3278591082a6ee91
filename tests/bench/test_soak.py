"""The soak script: what it requires of the router afterwards, and a short run against the shared
app (every request counted, the router empty again)."""

from __future__ import annotations

import pytest

from relay_serve.bench.soak import SoakSettings, failed_checks, run_soak

EMPTY = {"in_flight": 0, "pinned_generations": 0, "segments_in_flight": {"large": 0, "small": 0}, "idle_leases": 0}


def test_the_router_must_be_empty_afterwards_not_just_back_where_it_was():
    assert failed_checks(0, EMPTY) == []
    # a session pinned before the load and still pinned after is a leak all the same
    assert failed_checks(0, {**EMPTY, "pinned_generations": 1}) == ["1 generations still pinned to replicas"]
    assert failed_checks(0, {**EMPTY, "segments_in_flight": {"large": 0, "small": 2}})[0].startswith(
        "segments still in flight"
    )
    assert failed_checks(0, {**EMPTY, "idle_leases": 3}) == ["3 idle leases did not expire"]
    assert failed_checks(2, {**EMPTY, "in_flight": 1}) == ["2 requests failed", "1 generations still in flight"]


@pytest.mark.serve
@pytest.mark.vllm
def test_a_short_soak_passes_and_leaves_the_router_empty(relay_app):
    # settle_s beyond router.lease_idle_s (2 s): the idle leases expire
    report = run_soak(relay_app, SoakSettings(clients=12, duration_s=6.0, settle_s=3.0, max_tokens=96), progress=False)
    assert report["requests"] >= 12 and report["errors"] == 0, report["first_errors"]
    assert report["passed"], report["failed_checks"]
    assert report["router_after"]["in_flight"] == 0 and report["router_after"]["idle_leases"] == 0
    assert report["router_rss_mib"]["after"] > 0
