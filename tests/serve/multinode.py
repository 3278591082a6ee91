"""The relay app on a local multi-node Ray cluster, the way KubeRay runs it: a head that takes no
work and three worker nodes, each offering one of ``relay_large``, ``relay_small`` and
``relay_router`` as the manifest's worker groups do. Run by tests/serve/test_multinode.py in a
process of its own (a process drives one Ray cluster); prints one JSON line of what it saw.

    python -m tests.serve.multinode
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx

N_BEFORE, N_AFTER, CONCURRENCY = 8, 8, 4
RESULT = "MULTINODE-RESULT "  # the line the test reads (the raylets print to stdout too)


def app_config():
    from relay_serve.config import AppConfig

    cfg = AppConfig(name="multinode")
    for d, resource in (
        (cfg.large.deployment, "relay_large"),
        (cfg.small.deployment, "relay_small"),
        (cfg.router.deployment, "relay_router"),
    ):
        d.ray_actor_options["num_cpus"] = 1
        d.ray_actor_options["resources"] = {resource: 1}
    cfg.router.small_timeout_s = 3.0  # a gone small node costs a relay request at most this
    cfg.router.small_retry_after_s = 30.0
    return cfg


def body(prompt: str, seed: int) -> dict:
    return {
        "model": "relay",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 400,
        "seed": seed,
        "relay_trace": True,
    }


async def one(client: httpx.AsyncClient, url: str, prompt: str, seed: int) -> dict:
    """One relay request: its status, usage, text, engine requests and when it ran."""
    t0 = time.time()
    r = await client.post(url + "/v1/chat/completions", json=body(prompt, seed))
    row = {"status": r.status_code, "prompt": prompt, "start": t0, "end": time.time()}
    if r.status_code != 200:
        return {**row, "error": r.text[:500]}
    data = r.json()
    return {
        **row,
        "usage": data["usage"],
        "text": data["choices"][0]["message"]["content"],
        "engine_requests": data.get("relay_engine_requests", []),
    }


async def send(url: str, prompts: list[str], seed0: int) -> list[dict]:
    """Each prompt once, CONCURRENCY at a time."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def gated(client: httpx.AsyncClient, i: int, prompt: str) -> dict:
        async with gate:
            return await one(client, url, prompt, seed0 + i)

    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(gated(client, i, p) for i, p in enumerate(prompts)))


async def load_through(url: str, prompts: list[str], event, after_s: float) -> list[dict]:
    """CONCURRENCY clients sending requests back to back; ``event()`` runs 2 s in, and the load
    goes on ``after_s`` after it."""
    rows: list[dict] = []
    stop_at = [float("inf")]

    async def client_loop(client: httpx.AsyncClient, k: int) -> None:
        i = k
        while time.time() < stop_at[0]:
            rows.append(await one(client, url, prompts[i % len(prompts)], 100 + i))
            i += CONCURRENCY

    async with httpx.AsyncClient(timeout=300) as client:
        clients = asyncio.gather(*(client_loop(client, k) for k in range(CONCURRENCY)))
        await asyncio.sleep(2.0)
        await asyncio.to_thread(event)
        stop_at[0] = time.time() + after_s
        await clients
    return rows


def main() -> None:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from relay_serve.app.builder import build_app
    from relay_serve.cluster import free_port
    from relay_serve.config import default_cpu_engine_env
    from relay_serve.eval.datasets import load_problems

    os.environ.update(default_cpu_engine_env())  # the raylets (and so every worker) start with it
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # the head takes no work
    nodes = {}
    for group in ("relay_large", "relay_small", "relay_router"):
        nodes[group] = cluster.add_node(num_cpus=1, resources={group: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    out: dict = {"nodes": {group: node.node_id for group, node in nodes.items()}}
    try:
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        cfg = app_config()
        serve.run(build_app(cfg), name=cfg.name, route_prefix="/", blocking=False)
        deadline = time.time() + 600
        while serve.status().applications[cfg.name].status != "RUNNING":
            assert time.time() < deadline, serve.status().applications[cfg.name]
            time.sleep(1)
        url = f"http://127.0.0.1:{port}"
        placed = {m: serve.get_deployment_handle(m, cfg.name).info.remote().result() for m in ("large", "small")}
        out["placed"] = {m: info["node_id"] for m, info in placed.items()}
        out["replicas"] = {m: info["replica_id"] for m, info in placed.items()}

        problems = load_problems("toy", N_BEFORE + N_AFTER + 32, seed=11)
        out["answers"] = {p.problem: p.answer for p in problems}
        prompts = [p.problem for p in problems]
        out["before"] = asyncio.run(send(url, prompts[:N_BEFORE], 0))
        out["router"] = httpx.get(url + "/v1/relay/stats", timeout=30).json()

        def remove_small_node() -> None:
            out["small_node_removed_at"] = time.time()
            cluster.remove_node(nodes["relay_small"], allow_graceful=False)

        out["during"] = asyncio.run(load_through(url, prompts[N_BEFORE + N_AFTER :], remove_small_node, after_s=8.0))
        out["after"] = asyncio.run(send(url, prompts[N_BEFORE : N_BEFORE + N_AFTER], 200))
    finally:
        print(RESULT + json.dumps(out), flush=True)
        ray.shutdown()  # not serve.shutdown(): it waits 30 s for the replica of the removed node
        cluster.shutdown()


if __name__ == "__main__":
    main()
