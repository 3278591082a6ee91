"""The router's metrics over a scripted backend, read from a recording stand-in for Ray's metrics
API: every request counted once with its status, and the figures of each generation add up to
what its response says. (tests/serve/test_prometheus.py reads them from a real Prometheus.)"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from datetime import UTC

from relay_serve.router.ingress import RelayRouter
from relay_serve.router.metrics import RouterMetrics
from tests.serve.test_router import call, chat, make_router


class _Metric:
    def __init__(self, name, description="", tag_keys=(), boundaries=None):
        self.name, self.tag_keys, self.boundaries = name, tuple(tag_keys), boundaries
        self.default_tags: dict[str, str] = {}
        self.values: dict[tuple, float] = defaultdict(float)
        self.observed: dict[tuple, list[float]] = defaultdict(list)

    def set_default_tags(self, tags):
        self.default_tags = dict(tags)

    def _key(self, tags):
        full = {**self.default_tags, **(tags or {})}
        assert set(full) == set(self.tag_keys), (self.name, full, self.tag_keys)  # Ray refuses a missing tag
        return tuple(sorted(full.items()))

    def inc(self, value=1.0, tags=None):
        assert value > 0, (self.name, value)  # Ray counters only go up
        self.values[self._key(tags)] += value

    def set(self, value, tags=None):
        self.values[self._key(tags)] = value

    def observe(self, value, tags=None):
        self.observed[self._key(tags)].append(value)

    def total(self, **match) -> float:
        return sum(v for k, v in self.values.items() if match.items() <= dict(k).items())

    def samples(self, **match) -> list[float]:
        return [x for k, xs in self.observed.items() if match.items() <= dict(k).items() for x in xs]


class Recorder:
    Counter = Gauge = Histogram = _Metric


def router_with_metrics(**router_cfg) -> tuple[RelayRouter, RouterMetrics]:
    router, backend = make_router(**router_cfg)
    metrics = RouterMetrics(router.cfg.name, factory=Recorder)
    router.metrics = router.generations.metrics = metrics
    return router, metrics


def stream_usage(router, body) -> dict:
    r = call(
        router, "POST", "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return events[-1]["usage"]


def test_each_request_is_counted_once_and_the_figures_add_up_to_the_responses():
    router, m = router_with_metrics()
    usages = [call(router, "POST", "/v1/chat/completions", chat(seed=i)).json()["usage"] for i in range(3)]
    usages += [stream_usage(router, chat(seed=10 + i)) for i in range(2)]
    relay = [u["relay"] for u in usages]

    assert m.requests.total(model_id="relay", status="200") == 5
    assert m.requests.total() == 5
    assert len(m.e2e.samples(model_id="relay")) == 5
    switches = m.switches.samples(model_id="relay")
    assert sorted(switches) == sorted(u["switches"] for u in relay) and sum(switches) > 0
    assert m.tokens.total(engine="large") == sum(u["large_tokens"] for u in relay)
    assert m.tokens.total(engine="small") == sum(u["small_tokens"] for u in relay)
    # a handoff each way per switch the small model wrote text in; none outlasts its request
    handoffs = m.handoff.samples()
    assert m.handoff.samples(to="small") and m.handoff.samples(to="large")
    assert len(handoffs) <= sum(u["switches"] for u in relay)
    assert max(handoffs) <= max(m.e2e.samples())
    # time to first token and inter-token latency: streamed requests only
    assert len(m.ttft.samples(model_id="relay")) == 2 and len(m.itl.samples(model_id="relay")) == 2
    # each streamed request's first token came before its own end (the requests ran one after another:
    # the last two latencies are the streamed ones, in order)
    assert all(t <= e for t, e in zip(m.ttft.samples(), m.e2e.samples()[-2:], strict=True))
    assert m.cue_set.values[(("app", router.cfg.name),)] == 0  # the default set
    assert m.degraded.total() == 0 and m.retries.total() == 0


def test_rejected_requests_are_counted_with_their_status_and_a_bounded_model_label():
    router, m = router_with_metrics()
    assert call(router, "POST", "/v1/chat/completions", chat(model="gpt-17")).status_code == 400
    assert call(router, "POST", "/v1/chat/completions", content=b"{not json").status_code == 400
    assert call(router, "POST", "/v1/chat/completions", chat(max_tokens=0)).status_code == 400
    assert call(router, "POST", "/v1/chat/completions", chat(model="large", relay_cues=["Thus,"])).status_code == 400
    assert m.requests.total(model_id="unknown", status="400") == 2
    assert m.requests.total(model_id="relay", status="400") == 1
    assert m.requests.total(model_id="large", status="400") == 1
    assert not m.e2e.samples()  # no generation ran
    body = {"model": "small", "messages": [{"role": "user", "content": "x"}]}
    assert asyncio.run(router.handle_request({**body, "stream": True}))["status"] == 400
    assert m.requests.total(model_id="small", status="400") == 1


def test_failures_degradation_and_retries_are_counted():
    router, m = router_with_metrics()
    backend = router.backend
    backend.unavailable.add("small")
    assert call(router, "POST", "/v1/chat/completions", chat(model="small")).status_code == 503
    stream_usage_failed = call(router, "POST", "/v1/chat/completions", chat(model="small", stream=True))
    assert '"model_unavailable"' in stream_usage_failed.text
    r = call(router, "POST", "/v1/chat/completions", chat()).json()
    assert r["usage"]["relay"]["degraded"]
    assert m.requests.total(model_id="small", status="503") == 2
    assert m.degraded.total(model_id="relay") == 1
    assert m.kept_on_large.total(model_id="relay") == r["usage"]["relay"]["kept_on_large"] > 0
    backend.unavailable.clear()
    backend.faults.append(("large", 3))
    r = call(router, "POST", "/v1/chat/completions", chat(model="large")).json()
    assert m.retries.total(model_id="large") == r["usage"]["relay"]["retries"] == 1


def test_the_cue_set_gauge_follows_the_active_set_in_one_series_whatever_the_versions():
    from datetime import datetime

    _, m = router_with_metrics()
    for day in range(1, 30):  # a set published a day for a month
        m.cue_set_active(datetime(2026, 11, day, tzinfo=UTC))
    assert list(m.cue_set.values.values()) == [datetime(2026, 11, 29, tzinfo=UTC).timestamp()]
    m.cue_set_active(None)  # back to the default set
    assert list(m.cue_set.values.values()) == [0.0]


def test_gauges_sample_leases_per_model_and_generations_in_flight():
    _, m = router_with_metrics()
    m.sample(3, {"large": 2, "small": 1}, {"large": 0, "small": 4})
    held = {dict(k)["engine"]: v for k, v in m.leases.values.items() if dict(k)["state"] == "held"}
    idle = {dict(k)["engine"]: v for k, v in m.leases.values.items() if dict(k)["state"] == "idle"}
    assert held == {"large": 2, "small": 1} and idle == {"large": 0, "small": 4}
    assert m.in_flight.total() == 3


def test_the_dashboard_reads_only_metrics_the_router_exports():
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "monitoring" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"relay_serve_[a-z0-9_]+", e)}
    _, m = router_with_metrics()
    exported = {v.name for v in vars(m).values() if isinstance(v, _Metric)}
    assert used and used <= exported, used - exported
    assert exported - used == set(), f"exported but on no panel: {exported - used}"
