"""Replica faults on the real stack (Ray Serve, vLLM-CPU, the toy pair): replicas killed under
16 streaming relay requests, the small deployment scaled to zero.

The app here runs two replicas of each model beside the shared default app (``/faults``), so a
killed replica leaves another to retry on. Every check compares a streamed text with the router's
own record of it (the trace's character offsets, the token count), so a repeated or lost piece of
text fails the test.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import httpx
import pytest

pytestmark = [pytest.mark.serve, pytest.mark.vllm]

APP = "faults"
N_REQUESTS = 16


def fault_config(small_at_zero: bool = False):
    """Two replicas a model; with ``small_at_zero`` the small deployment autoscales from zero
    replicas (and starts none before a request waits for it)."""
    from relay_serve.config import AppConfig

    cfg = AppConfig(name=APP, route_prefix="/" + APP)
    for m in (cfg.large, cfg.small):
        m.deployment.num_replicas = 2
        m.deployment.ray_actor_options["num_cpus"] = 0.5
    if small_at_zero:
        cfg.small.deployment.num_replicas = None
        cfg.small.deployment.autoscaling_config = {
            "min_replicas": 0,
            "initial_replicas": 0,
            "max_replicas": 1,
            "upscale_delay_s": 60,
        }
    cfg.router.deployment.ray_actor_options["num_cpus"] = 0.5
    cfg.router.small_timeout_s = 3.0
    cfg.router.small_retry_after_s = 30.0
    return cfg


def deploy(cfg) -> None:
    from ray import serve

    from relay_serve.app.builder import build_app

    serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.route_prefix, blocking=False)
    deadline = time.time() + 300
    while serve.status().applications[cfg.name].status != "RUNNING":
        assert time.time() < deadline, serve.status().applications[cfg.name]
        time.sleep(1)


@pytest.fixture(scope="module")
def faults_url(relay_app):
    from ray import serve

    deploy(fault_config())
    yield relay_app + "/" + APP
    serve.delete(APP)


def replicas(deployment: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{APP}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def kill_one(deployment: str, busy_within_s: float = 5.0) -> str:
    """Kill the replica of ``deployment`` with the most segments in its engine, asked of each
    replica's actor directly (``record_routing_stats``); if none has one within ``busy_within_s``,
    the first by name. A call through the deployment's handle cannot choose: Serve sends it to the
    replica with the fewest ongoing calls, the idler one, whose few short segments may end before
    the kill lands."""
    import ray

    from relay_serve.replica.load import ENGINE_LOAD

    deadline = time.monotonic() + busy_within_s
    while True:
        names = replicas(deployment)
        calls = {name: ray.get_actor(name, namespace="serve").record_routing_stats.remote() for name in names}
        load = {}
        for name, call in calls.items():
            try:
                load[name] = ray.get(call, timeout=5)[ENGINE_LOAD]
            except Exception:  # a replica starting or stopping
                load[name] = 0.0
        busiest = max(names, key=lambda name: load[name])
        if load[busiest] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    ray.kill(ray.get_actor(busiest, namespace="serve"), no_restart=True)
    return busiest


def wait_for_replicas(deployment: str, n: int, timeout_s: float = 180) -> None:
    """``n`` replicas of ``deployment``, the deployment healthy and (a model deployment) every
    replica answering its actor: one Serve started in place of a killed one is listed, and the
    deployment may still read healthy, while its engine starts."""
    import ray
    from ray import serve

    deadline = time.time() + timeout_s
    while True:
        dep = serve.status().applications[APP].deployments[deployment]
        names = replicas(deployment)
        if dep.status == "HEALTHY" and len(names) == n:
            if deployment == "router":
                return
            try:
                ray.get([ray.get_actor(a, namespace="serve").record_routing_stats.remote() for a in names], timeout=5)
                return
            except Exception:  # noqa: BLE001 - a replica still starting (or gone meanwhile): ask again
                pass
        assert time.time() < deadline, dep
        time.sleep(1)


def prompts(n: int, seed: int) -> list[str]:
    from relay_serve.eval.datasets import load_problems

    return [p.problem for p in load_problems("toy", n, seed=seed)]


async def stream_one(client: httpx.AsyncClient, url: str, prompt: str, seed: int, started: asyncio.Event) -> dict:
    body = {
        "model": "relay",
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "relay_trace": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "seed": seed,
    }
    text, tail, errors, done, finish = [], None, [], False, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                errors.append(event["error"])
            elif event.get("choices"):
                choice = event["choices"][0]
                text.append(choice["delta"].get("content") or "")
                finish = choice["finish_reason"] or finish
                if text[-1]:
                    started.set()
            else:
                tail = event
    return {"text": "".join(text), "tail": tail, "errors": errors, "done": done, "finish": finish}


async def run_with_a_kill(
    url: str, deployment: str, seed: int, before_s: float = 2.0, after_s: float = 3.0
) -> tuple[list[dict], str]:
    """16 clients stream relay requests back to back; one replica of ``deployment`` is killed
    ``before_s`` into the run, and the clients go on for ``after_s`` more (a request under way
    then is finished, whatever the time)."""
    started = asyncio.Event()
    stop_at = [float("inf")]
    pool = prompts(64, seed)

    async def client_loop(client: httpx.AsyncClient, k: int) -> list[dict]:
        out, i = [], 0
        while time.monotonic() < stop_at[0]:
            out.append(
                await stream_one(client, url, pool[(k + i * N_REQUESTS) % len(pool)], seed + k * 1000 + i, started)
            )
            i += 1
        return out

    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [asyncio.create_task(client_loop(client, k)) for k in range(N_REQUESTS)]
        await started.wait()
        await asyncio.sleep(before_s)
        killed = await asyncio.to_thread(kill_one, deployment)  # the clients stream on meanwhile
        stop_at[0] = time.monotonic() + after_s
        results = [r for rs in await asyncio.gather(*tasks) for r in rs]
    return results, killed


def check_whole(result: dict) -> dict:
    """The stream ended cleanly and its text is exactly the text the router recorded."""
    assert result["errors"] == [] and result["done"] and result["finish"] in ("stop", "length"), result
    trace, usage = result["tail"]["relay_trace"], result["tail"]["usage"]
    text = result["text"]
    assert trace[0]["start"] == 0 and trace[-1]["end"] == len(text)
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(trace))
    assert sum(s["tokens"] for s in trace) == usage["completion_tokens"]
    relay = usage["relay"]
    assert relay["large_tokens"] + relay["small_tokens"] == usage["completion_tokens"]
    assert "</think>" in text and "\\boxed{" in text  # the toy answer's shape survived
    return relay


def kill_under_load(url: str, deployment: str, seed: int, hit, attempts: int = 3) -> tuple[list[dict], str]:
    """Kill a replica of ``deployment`` under load until a request shows the fault (``hit``);
    every request of every attempt must come through whole. A kill can land while the replica
    has nothing in flight (on 2 cores the timing varies): then Serve replaces the replica and the
    next attempt kills again."""
    from collections import Counter

    seen = []
    for attempt in range(attempts):
        results, killed = asyncio.run(run_with_a_kill(url, deployment, seed=seed + 1000 * attempt))
        relays = [check_whole(r) for r in results]
        wait_for_replicas(deployment, 2)
        if any(hit(r) for r in relays):
            return relays, killed
        served = Counter(
            e["replica_id"] for r in results for e in r["tail"]["relay_engine_requests"] if e["model"] == deployment
        )
        seen.append(
            f"attempt {attempt + 1}: killed {killed}; {len(results)} requests; {deployment} engine requests by replica "
            f"{dict(served)}"
        )
    pytest.fail("no request was under way on the killed replica:\n" + "\n".join(seen))


def test_killing_a_small_replica_loses_no_request_and_no_text(faults_url):
    relays, killed = kill_under_load(faults_url, "small", seed=100, hit=lambda r: r["degraded"])
    hit = [r for r in relays if r["degraded"]]
    replica_id = killed.rsplit("#", 1)[1]
    assert all(replica_id in r["degraded_reason"] for r in hit), (killed, hit)  # names the replica that failed
    assert sum(r["small_tokens"] for r in relays) > 0


def test_killing_a_large_replica_continues_on_the_other_one(faults_url):
    relays, _ = kill_under_load(faults_url, "large", seed=200, hit=lambda r: r["retries"] > 0)
    assert all(r["retries"] <= 2 for r in relays)


def test_router_forgets_every_session_after_the_faults(faults_url):
    stats = httpx.get(faults_url + "/v1/relay/stats", timeout=30).json()
    assert stats["in_flight"] == 0 and stats["pinned_generations"] == 0, stats


def model_replica_holdings() -> dict[str, tuple[int, int] | None]:
    """Per model replica Ray names: the leases and engine sessions it holds (None: it did not
    answer), asked of each replica's actor directly through Serve's routing-stats hook. A call
    through the deployment's handle cannot ask a given replica: the handle picks one."""
    import ray

    names = [name for deployment in ("large", "small") for name in replicas(deployment)]
    calls = [ray.get_actor(name, namespace="serve").record_routing_stats.remote() for name in names]
    seen: dict[str, tuple[int, int] | None] = {}
    for name, call in zip(names, calls, strict=True):
        try:
            stats = ray.get(call, timeout=10)
            seen[name] = (stats["leases_held"], stats["sessions"])
        except Exception:  # a replica starting or stopping
            seen[name] = None
    return seen


def test_killing_a_router_replica_frees_its_leases_and_sessions_on_the_model_replicas(faults_url):
    """The router dies under 16 relay streams: Serve does not cancel its lease calls, but its
    connections close, and within 10 s every model replica holds no lease and no session of it.
    The router Serve starts in its place serves every request."""
    import ray

    async def load_then_kill():
        started = asyncio.Event()
        pool = prompts(N_REQUESTS, seed=400)
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [
                asyncio.create_task(stream_one(client, faults_url, p, 400 + k, started)) for k, p in enumerate(pool)
            ]
            await started.wait()
            await asyncio.sleep(1.0)
            router_stats = (await client.get(faults_url + "/v1/relay/stats")).json()
            held = await asyncio.to_thread(model_replica_holdings)
            (router,) = await asyncio.to_thread(replicas, "router")
            await asyncio.to_thread(lambda: ray.kill(ray.get_actor(router, namespace="serve"), no_restart=True))
            t0, polls = time.monotonic(), []
            while True:
                now = await asyncio.to_thread(model_replica_holdings)
                polls.append((round(time.monotonic() - t0, 2), now))
                freed = len(now) == 4 and all(v == (0, 0) for v in now.values())
                if freed or time.monotonic() - t0 > 10:
                    break
                await asyncio.sleep(0.5)
            freed_s = time.monotonic() - t0
            await asyncio.gather(*tasks, return_exceptions=True)  # their router died under them
        return router_stats, held, polls, freed, freed_s

    router_stats, held, polls, freed, freed_s = asyncio.run(load_then_kill())
    assert router_stats["in_flight"] > 0 and router_stats["leases"] >= router_stats["in_flight"], (
        router_stats
    )  # one or two a generation
    assert len(held) == 4 and None not in held.values(), held  # 2 large, 2 small, each answered
    assert sum(leases for leases, _ in held.values()) > 0, held  # ...holding the router's leases
    assert freed and freed_s <= 10, polls
    wait_for_replicas("router", 1)
    with httpx.Client(timeout=120) as client:
        for i, prompt in enumerate(prompts(4, seed=500)):
            r = client.post(
                faults_url + "/v1/chat/completions",
                json={"model": "relay", "messages": [{"role": "user", "content": prompt}], "seed": i},
            )
            assert r.status_code == 200, r.text


def test_with_the_small_deployment_scaled_to_zero_relay_degrades_to_the_large_model(faults_url):
    deploy(fault_config(small_at_zero=True))
    deadline = time.time() + 120
    while replicas("small"):  # the old replicas drain and stop
        assert time.time() < deadline, replicas("small")
        time.sleep(1)
    with httpx.Client(timeout=120) as client:
        for i, prompt in enumerate(prompts(3, seed=300)):
            t0 = time.perf_counter()
            r = client.post(
                faults_url + "/v1/chat/completions",
                json={"model": "relay", "messages": [{"role": "user", "content": prompt}], "seed": i},
            )
            assert r.status_code == 200, r.text
            relay = r.json()["usage"]["relay"]
            assert relay["degraded"] and relay["small_tokens"] == 0 and relay["large_tokens"] > 0
            assert "did not answer within 3.0 s" in relay["degraded_reason"]
            assert "\\boxed{" in r.json()["choices"][0]["message"]["content"]
            if i > 0:  # the first request found out; the next ones do not wait for the small model
                assert time.perf_counter() - t0 < 3.0
