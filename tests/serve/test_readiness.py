"""/health means ready: polled from the moment an app is deployed, it answers 503 saying what is
starting until a request would be served without waiting for start-up; the first request after
the first 200 is about as quick as the ones after it."""

from __future__ import annotations

import statistics
import time

import httpx
import pytest

pytestmark = [pytest.mark.serve, pytest.mark.vllm]


def test_health_is_503_while_the_models_start_and_200_once_a_request_is_quick(relay_app):
    from ray import serve

    from relay_serve.app.builder import build_app
    from relay_serve.config import AppConfig

    cfg = AppConfig(name="fresh", route_prefix="/fresh")
    for d in (cfg.large.deployment, cfg.small.deployment, cfg.router.deployment):
        d.ray_actor_options["num_cpus"] = 0.5
    base = relay_app.split("/", 3)[:3]
    url = "/".join(base) + "/fresh"
    serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.route_prefix, blocking=False)
    seen: list[tuple[int, str | None]] = []
    try:
        deadline = time.time() + 300
        with httpx.Client(timeout=10) as client:
            while True:
                assert time.time() < deadline, seen[-5:]
                try:
                    r = client.get(url + "/health")
                except httpx.TransportError:
                    time.sleep(0.2)
                    continue
                body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                seen.append((r.status_code, body.get("status")))
                if r.status_code == 200:
                    break
                time.sleep(0.2)
            assert (503, "starting") in seen, seen  # the router was up before the models, and said so
            assert body["models"]["large"]["state"] == body["models"]["small"]["state"] == "up"
            chat = {
                "model": "relay",
                "messages": [{"role": "user", "content": "Start at k11. Follow the map four times."}],
                "max_tokens": 200,
            }
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                r = client.post(url + "/v1/chat/completions", json=chat, timeout=120)
                times.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
        warm = statistics.median(times[1:])
        print(
            f"health: {len(seen)} polls before 200; first request {times[0]:.2f} s, then "
            f"{', '.join(f'{t:.2f}' for t in times[1:])} s"
        )
        assert times[0] < 5 * warm + 1.0, (
            times
        )  # the first request after the first 200 pays no start-up (15.8 s before)
    finally:
        serve.delete(cfg.name)
