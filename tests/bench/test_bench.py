"""The benchmark's arithmetic (quantiles, per-level metrics, ideal speedup), its report files, and
the replay mode reproducing a recorded schedule on the real app."""

from __future__ import annotations

import math

import httpx
import pytest

from relay_serve.bench.bench import ideal_speedup, latency_split, level_metrics, markdown, pct, per_token_cost, plots


def result(latency: float, large: int, small: int, switches: int, wall: float, engine: float, cached: int = 0) -> dict:
    return {
        "_latency_s": latency,
        "usage": {
            "completion_tokens": large + small,
            "relay": {"large_tokens": large, "small_tokens": small, "switches": switches, "wall_s": wall, "engine_s": engine},
        },
        "relay_engine_requests": [{"prompt_tokens": 100, "cached_tokens": cached}],
    }


def test_pct():
    values = [3.0, 1.0, 7.0, 2.0, 10.0]
    assert (pct(values, 0.0), pct(values, 0.5), pct(values, 1.0)) == (1.0, 3.0, 10.0)
    assert pct(values, 0.9) == pytest.approx(8.8)
    assert math.isnan(pct([], 0.5))


def test_level_metrics():
    results = [result(1.0, 30, 10, 2, wall=1.0, engine=0.99, cached=50), result(3.0, 40, 0, 0, wall=3.0, engine=2.998)]
    m = level_metrics(results, wall_s=4.0)
    assert m["latency_p50_s"] == 2.0 and m["output_tokens"] == 80 and m["output_tokens_per_s"] == 20.0
    assert m["small_token_share"] == 0.125 and m["switches_per_request"] == 1.0
    assert m["cached_prompt_token_ratio"] == 0.25
    assert m["router_overhead_per_switch_ms_p50"] == pytest.approx(5.0)  # (1.0 - 0.99) / 2 switches
    assert m["router_overhead_per_request_ms_p50"] == pytest.approx(6.0)


def test_ideal_speedup():
    relay = [result(1.0, 50, 50, 4, 1, 1)]
    # large costs 10x small per token: 100 large tokens = 100 units; relay = 50 + 5 units
    assert ideal_speedup(relay, c_large=0.010, c_small=0.001) == pytest.approx(100 / 55)
    assert per_token_cost([result(2.0, 100, 0, 0, 2, 2)]) == pytest.approx(0.02)


def test_latency_split():
    relay = [result(1.0, 50, 50, 4, wall=0.9, engine=0.8), result(2.0, 100, 0, 0, wall=1.9, engine=1.85)]
    x = latency_split(relay, c_large=0.010, c_small=0.001)
    assert x == {"latency_ms": 1500.0, "engine_ms": 1325.0, "router_ms": 75.0, "outside_router_ms": 100.0, "ideal_ms": 775.0}


def test_report_files(tmp_path):
    level = level_metrics([result(1.0, 30, 10, 2, 1.0, 0.99)], 1.0)
    relay = {**level, "achieved_speedup": 1.1, "ideal_speedup": 1.2}
    report = {
        "started": "2026-12-03 12:00",
        "machine": "x86_64, 2 CPUs",
        "trained": {"levels": {"large": {1: level}, "relay": {1: relay}}, "per_token_cost_ms": {"large": 4.0, "small": 2.0}},
        "replay": {"levels": {1: {"relay": level, "speedup": {"per_token_cost_ms": {"large": 9.0, "small": 1.0}, "ideal": 1.3, "achieved": 1.25, "achieved_over_ideal": 0.962,
                                                                "relay_latency_split": {"latency_ms": 900.0, "engine_ms": 850.0, "router_ms": 5.0, "outside_router_ms": 45.0, "ideal_ms": 800.0}}}}},
        "transports": {"levels": [1], "direct": {1: level}, "handle": {"1": {**level, "router_overhead_per_switch_ms_p50": 9.5}}},
    }
    bounded = {**level, "kept_on_large_per_request": 1.5, "degraded_requests": 1}
    report["overload"] = {"bound": 4, "concurrency": 1, "unbounded": relay, "bounded": bounded}
    md = markdown(report)
    assert "| relay | 1 |" in md and "1.1 / 1.2" in md and "0.962" in md
    assert "a bound of 4 small-model segments" in md and "| 4 | 1.0 | 1.0 | 40.0 | 0.25 | 1.5 | 1 |" in md
    assert "| direct | 1 | 1.0 | 40.0 | 5.0 | 10.0 |" in md and "| handle | 1 | 1.0 | 40.0 | 9.5 | 10.0 |" in md
    assert "| 1 | 900.0 | 850.0 | 5.0 | 45.0 | 800.0 |" in md
    paths = plots(report, tmp_path)
    assert [p.name for p in paths] == ["latency.png", "speedup.png", "relay_time_split.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in paths)


@pytest.mark.serve
def test_replay_reproduces_the_schedule(relay_app):
    schedule = [{"model": "large", "tokens": 9}, {"model": "small", "tokens": 4}, {"model": "large", "tokens": 6}, {"model": "small", "tokens": 12}]
    body = {
        "model": "relay",
        "messages": [{"role": "user", "content": "Start at e3. Follow the map four times."}],
        "max_tokens": 40,
        "relay_replay": schedule,
        "relay_trace": True,
    }
    r = httpx.post(relay_app + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    got = [{"model": s["model"], "tokens": s["tokens"]} for s in out["relay_trace"]]
    assert got == schedule
    assert out["usage"]["relay"]["small_tokens"] == 16 and out["usage"]["relay"]["switches"] == 3
    assert out["usage"]["relay"]["engine_s"] <= out["usage"]["relay"]["wall_s"]
    bad = httpx.post(relay_app + "/v1/chat/completions", json={**body, "relay_replay": [{"model": "medium", "tokens": 3}]}, timeout=30)
    assert bad.status_code == 400 and "relay_replay" in bad.json()["error"]["param"]
