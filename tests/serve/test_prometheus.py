"""The relay metrics in a real Prometheus (Debian's ``prometheus``, which ``make test`` installs
where missing), scraping the test cluster's Ray metrics export with the project's own scrape
configuration and alerting rules (monitoring/): after N relay requests PromQL finds exactly N, the
switches the responses' usage adds up to, the tokens by engine, and non-empty latency histograms;
vLLM's engine figures of both deployments are there too."""

from __future__ import annotations

import asyncio
import math
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from relay_serve.cluster import free_port

pytestmark = [pytest.mark.serve, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
APP = "metrics"
N_PLAIN, N_STREAMED = 8, 4


@pytest.fixture(scope="module")
def prometheus(ray_cluster, tmp_path_factory):
    """A Prometheus on loopback scraping this cluster's node every second; yields its URL."""
    from relay_serve.cluster import node_metrics_port

    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus is not installed: `make test` installs it (apt-get install prometheus)"
    work = tmp_path_factory.mktemp("prometheus")
    cfg = yaml.safe_load((ROOT / "monitoring" / "prometheus.yml").read_text())
    # Every 5 s, with as long to answer: the test cluster's metrics page holds every app the session
    # deployed, and under the suite's load it can take more than a second (the default timeout of a
    # 1 s interval), which leaves rate() windows without two samples.
    cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = cfg["global"]["scrape_timeout"] = "5s"
    shutil.copy(ROOT / "monitoring" / "alerts.yml", work / "alerts.yml")
    (job,) = cfg["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{node_metrics_port()}"]}]
    (work / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    with (work / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "Prometheus did not become ready"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def metrics_app(relay_app):
    from ray import serve

    from relay_serve.config import AppConfig
    from tests.serve.test_faults import deploy

    cfg = AppConfig(name=APP, route_prefix="/" + APP)
    for d in (cfg.large.deployment, cfg.small.deployment, cfg.router.deployment):
        d.ray_actor_options["num_cpus"] = 0.5
    deploy(cfg)
    yield relay_app + "/" + APP
    serve.delete(APP)


def query(prometheus: str, promql: str) -> list[dict]:
    r = httpx.get(prometheus + "/api/v1/query", params={"query": promql}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    return r.json()["data"]["result"]


def scalar(prometheus: str, promql: str) -> float | None:
    result = query(prometheus, promql)
    return float(result[0]["value"][1]) if result else None


def wait_for(prometheus: str, promql: str, expected: float, timeout_s: float = 120) -> float | None:
    """The query's value once it equals ``expected`` (Ray exports every few seconds, Prometheus
    scrapes every 5), else the last value seen."""
    deadline = time.time() + timeout_s
    while True:
        value = scalar(prometheus, promql)
        if value is not None and math.isclose(value, expected) or time.time() > deadline:
            return value
        time.sleep(1)


def wait_for_series(prometheus: str, promql: str, timeout_s: float = 60) -> list:
    """The series ``promql`` returns once it returns any (Ray's agent exports a new series at its
    next report, and Prometheus sees it at its next scrape), or [] after ``timeout_s``."""
    deadline = time.time() + timeout_s
    while not (found := query(prometheus, promql)) and time.time() < deadline:
        time.sleep(1)
    return found


async def send_requests(url: str, model: str = "relay", n: int | None = None) -> list[dict]:
    """N_PLAIN plain and N_STREAMED streamed relay requests (or ``n`` plain ones of ``model``), four
    at a time; their usage."""
    from relay_serve.eval.datasets import load_problems

    problems = [p.problem for p in load_problems("toy", n or N_PLAIN + N_STREAMED, seed=7)]
    plain = n or N_PLAIN
    gate = asyncio.Semaphore(4)

    async def one(client: httpx.AsyncClient, i: int, prompt: str) -> dict:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 300, "seed": i}
        async with gate:
            if i < plain:
                r = await client.post(url + "/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["usage"]
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            usage = None
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage"' in line and '"choices": []' in line:
                        import json

                        usage = json.loads(line[6:])["usage"]
            assert usage is not None
            return usage

    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(problems)))


def test_prometheus_counts_exactly_what_the_responses_say(prometheus, metrics_app):
    usages = asyncio.run(send_requests(metrics_app))
    n = N_PLAIN + N_STREAMED
    relay = [u["relay"] for u in usages]
    switches = sum(u["switches"] for u in relay)
    assert switches > 0
    sel = f'app="{APP}"'

    assert wait_for(prometheus, f'sum(relay_serve_requests_total{{{sel},model_id="relay",status="200"}})', n) == n
    assert scalar(prometheus, f"sum(relay_serve_requests_total{{{sel}}})") == n  # nothing else counted
    assert wait_for(prometheus, f"sum(relay_serve_switches_per_request_sum{{{sel}}})", switches) == switches
    assert scalar(prometheus, f"sum(relay_serve_switches_per_request_count{{{sel}}})") == n
    for engine, key in (("large", "large_tokens"), ("small", "small_tokens")):
        expected = sum(u[key] for u in relay)
        assert (
            wait_for(prometheus, f'sum(relay_serve_generated_tokens_total{{{sel},engine="{engine}"}})', expected)
            == expected
        )
    # latency histograms: every request in the end-to-end one, a real median
    assert scalar(prometheus, f"sum(relay_serve_e2e_request_latency_seconds_count{{{sel}}})") == n
    p50 = scalar(
        prometheus, f"histogram_quantile(0.5, sum by (le) (relay_serve_e2e_request_latency_seconds_bucket{{{sel}}}))"
    )
    assert p50 is not None and 0 < p50 < 300
    assert scalar(prometheus, f"sum(relay_serve_time_to_first_token_seconds_count{{{sel}}})") == N_STREAMED
    assert scalar(prometheus, f"sum(relay_serve_inter_token_latency_seconds_count{{{sel}}})") == N_STREAMED
    for to in ("small", "large"):
        assert scalar(prometheus, f'sum(relay_serve_handoff_latency_seconds_count{{{sel},to="{to}"}})') > 0
    assert scalar(prometheus, f"relay_serve_cue_set_created_timestamp_seconds{{{sel}}}") == 0  # the default set
    assert scalar(prometheus, f"sum(relay_serve_degraded_requests_total{{{sel}}})") is None  # none degraded
    # the gauges the router samples, and the engines' own figures of both deployments
    assert wait_for(prometheus, f"count(relay_serve_leases{{{sel}}})", 4) == 4  # large/small x held/idle
    for model in ("large", "small"):
        for name in ("ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting", "ray_vllm_kv_cache_usage_perc"):
            assert wait_for_series(prometheus, f'{name}{{model_name="{model}"}}'), f"{name} of {model}"
        # prefix-cache hit rate = hits / queries (Ray exports a counter once it moved: no series is 0 hits)
        queries = scalar(prometheus, f'sum(ray_vllm_prefix_cache_queries_total{{model_name="{model}"}})')
        hits = scalar(prometheus, f'sum(ray_vllm_prefix_cache_hits_total{{model_name="{model}"}})') or 0.0
        assert queries and queries > 0 and 0 <= hits <= queries, (model, queries, hits)
    # the auto model: its generations by the policy it chose, as the responses say
    chosen = [u["relay"]["policy"] for u in asyncio.run(send_requests(metrics_app, model="auto", n=4))]
    for policy in ("relay", "large"):
        expected = chosen.count(policy)
        promql = f'sum(relay_serve_auto_choices_total{{{sel},policy="{policy}"}})'
        # a policy auto never chose has no series (auto learns in blocks: 4 generations can all be relay)
        found = (wait_for(prometheus, promql, expected) if expected else scalar(prometheus, promql)) or 0
        assert found == expected, (policy, chosen)


def test_every_dashboard_query_runs_and_has_data(prometheus, metrics_app):
    """Each panel's PromQL (monitoring/grafana-dashboard.json, with its variables filled in) is
    valid and returns series once the app served traffic (the test above sent it)."""
    import json

    dashboard = json.loads((ROOT / "monitoring" / "grafana-dashboard.json").read_text())
    targets = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(targets) >= 20
    # rate() needs two scrapes of a series: a series Ray exported for the first time just now has one
    deadline = time.time() + 60
    while True:
        empty = [
            (title, expr)
            for title, expr in targets
            if not query(prometheus, expr.replace("$app", APP).replace("$__rate_interval", "2m"))
        ]
        if not empty or time.time() > deadline:
            break
        time.sleep(2)
    assert not empty, empty


def test_the_alerting_rules_load_and_evaluate(prometheus, metrics_app):
    """monitoring/alerts.yml: every rule loaded and evaluated without error against the app's
    series; none fires on a healthy app."""
    deadline = time.time() + 30
    while True:
        groups = httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if (
            rules
            and all(r["health"] == "ok" and r.get("lastEvaluation", "").startswith("20") for r in rules)
            or time.time() > deadline
        ):
            break
        time.sleep(1)
    assert len(rules) == 5 and all(r["health"] == "ok" for r in rules), rules
    assert [r["name"] for r in rules if r["state"] != "inactive"] == []
