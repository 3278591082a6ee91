"""The session-affinity request router on real Ray Serve: a request that finds every replica full
waits without spinning. Serve retries such a request with sleeps only when the router marks it to
back off; before the fix, a router process with one request pending burned a whole core (found in
the benchmark: the spec app's router at 86% CPU while its model deployments were full)."""

from __future__ import annotations

import threading
import time

import pytest

pytestmark = pytest.mark.serve


def test_a_request_waiting_for_a_full_replica_does_not_spin(serve_port):
    import asyncio

    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.deployment(
        max_ongoing_requests=1,
        ray_actor_options={"num_cpus": 0},
        request_router_config=RequestRouterConfig(
            request_router_class="relay_serve.router.affinity.SessionAffinityRouter"
        ),
    )
    class Slow:
        async def __call__(self, s: float) -> float:
            await asyncio.sleep(s)
            return s

    handle = serve.run(Slow.bind(), name="affinity-spin", route_prefix=None)
    try:
        assert handle.remote(0.0).result(timeout_s=60) == 0.0  # the router knows the replica
        busy = handle.remote(6.0)  # holds the only slot
        time.sleep(0.5)
        waiting = handle.remote(0.0)  # every replica full: pending in this process's router
        cpu0, wall0 = time.process_time(), time.monotonic()
        threading.Event().wait(3.0)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        assert waiting.result(timeout_s=30) == 0.0 and busy.result(timeout_s=30) == 6.0
        assert cpu < 0.3 * wall, (
            f"this process used {cpu:.2f} s of CPU in {wall:.2f} s while a request waited for a replica"
        )
    finally:
        serve.delete("affinity-spin")
