"""Run the relay app on a local (or given) Ray cluster: what ``relay-serve serve`` does."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any

from relay_serve.cluster import init_ray, metrics_url
from relay_serve.config import AppConfig

log = logging.getLogger(__name__)


def start(
    cfg: AppConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    num_cpus: int | None = None,
    metrics_port: int | None = None,
) -> str:
    """Start Ray (unless connected), Serve and the app; return the base URL once it is ready."""
    from ray import serve

    from relay_serve.app.builder import build_app

    init_ray(cfg.env_vars, num_cpus, metrics_port=metrics_port)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.route_prefix, blocking=False)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{shown}:{port}{cfg.route_prefix.rstrip('/')}"


def warm_up(base: str) -> None:
    """One relay request through the HTTP API before the service says it is ready: it takes the
    routes, the router's handles, a lease and a channel to each model and the engines' first
    steps, so the first user's request does not."""
    import httpx

    from relay_serve.client import api_headers, chat_body

    r = httpx.post(
        base + "/v1/chat/completions",
        json=chat_body("relay", "Start at b3. Follow the map two times.", max_tokens=64),
        headers=api_headers(),
        timeout=600,
    )
    if r.status_code != 200:
        raise RuntimeError(f"the warm-up request failed: HTTP {r.status_code}: {r.text[:300]}")


def serve_forever(cfg: AppConfig, host: str, port: int, metrics_port: int | None = None) -> None:
    t0 = time.time()
    url = start(cfg, host, port, metrics_port=metrics_port)
    warm_up(url)
    print(f"relay-serve is ready at {url}/v1 (started in {time.time() - t0:.1f} s); Ctrl-C stops it", flush=True)
    print(f"metrics (Prometheus) at {metrics_url()}", flush=True)

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM (kill, a container stop) shuts down as Ctrl-C does

    signal.signal(signal.SIGTERM, _terminate)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        import ray
        from ray import serve

        print("stopping relay-serve", flush=True)
        t0 = time.time()
        serve.delete(cfg.name)  # the app stops gracefully: its in-flight requests end first
        t1 = time.time()
        ray.shutdown()
        print(f"stopped in {time.time() - t0:.1f} s (Serve {t1 - t0:.1f} s, Ray {time.time() - t1:.1f} s)", flush=True)
        sys.stderr.flush()
        # Everything is stopped and written; the interpreter's own teardown of the libraries loaded
        # here (Ray's client, vLLM's and torch's modules) took 2-3 s more, so the process ends now.
        os._exit(0)
