"""Session affinity, measured: with 2 replicas of each model and N concurrent relay requests, the
share of segment requests (after a generation's first on that model) that land on the replica that
served the generation's previous segment, and the cached-prompt-token ratio; against the same app
without affinity (Serve places every segment: a lease a segment with the direct transport, the
default request router with the handle transport) in the same run.

    python -m relay_serve.bench.affinity [--requests 16] [--replicas 2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from relay_serve.client import chat_body, http_client
from relay_serve.config import AppConfig


def affinity_figures(responses: list[dict]) -> dict:
    """Share of follow-up segment requests on their generation's previous replica; cache ratio."""
    same = follow_ups = cached = prompt = 0
    for body in responses:
        last: dict[str, str | None] = {}
        for rec in body["relay_engine_requests"]:
            cached += rec["cached_tokens"]
            prompt += rec["prompt_tokens"]
            prev = last.get(rec["model"])
            if rec["model"] in last:
                follow_ups += 1
                same += prev is not None and prev == rec["replica_id"]
            last[rec["model"]] = rec["replica_id"]
    return {
        "follow_up_requests": follow_ups,
        "same_replica_share": round(same / follow_ups, 4) if follow_ups else None,
        "cached_prompt_token_ratio": round(cached / prompt, 4) if prompt else None,
    }


async def _fire(url: str, prompts: list[str]) -> list[dict]:
    async with http_client(300) as client:

        async def one(p: str) -> dict:
            r = await client.post(
                url + "/v1/chat/completions",
                json=chat_body("relay", p, relay_trace=True),
            )
            r.raise_for_status()
            return r.json()

        return await asyncio.gather(*(one(p) for p in prompts))


def measure(affinity: bool, requests: int, replicas: int, port: int) -> dict:
    from ray import serve

    from relay_serve.app.local import start
    from relay_serve.toy.world import ToyWorld

    cfg = AppConfig()
    cfg.router.session_affinity = affinity
    for m in (cfg.large, cfg.small):
        m.deployment.num_replicas = replicas
    t0 = time.time()
    url = start(cfg, port=port)
    startup = time.time() - t0
    prompts = [p.prompt for p in ToyWorld().sample_heldout(requests, seed=42)]
    asyncio.run(_fire(url, prompts[:2]))  # warm up
    t1 = time.time()
    bodies = asyncio.run(_fire(url, prompts))
    out = {"router": "session-affinity" if affinity else "serve-places-each-segment", "startup_s": round(startup, 1)}
    out.update(affinity_figures(bodies))
    out["wall_s"] = round(time.time() - t1, 2)
    serve.delete(cfg.name)
    return out


def main(args: argparse.Namespace) -> None:
    from relay_serve.cluster import init_ray

    init_ray(num_cpus=args.num_cpus, log_to_driver=False)
    results = [measure(a, args.requests, args.replicas, args.port) for a in (True, False)]
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            print(
                f"{r['router']:>18}: same-replica share {r['same_replica_share']}, cached prompt tokens "
                f"{r['cached_prompt_token_ratio']}, {r['follow_up_requests']} follow-up segments, {r['wall_s']} s"
            )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16, help="concurrent relay requests")
    p.add_argument("--replicas", type=int, default=2, help="replicas of each model")
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the local Ray")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--json", action="store_true")
    main(p.parse_args())
