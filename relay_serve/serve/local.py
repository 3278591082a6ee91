"""Run the relay app on a local (or given) Ray cluster: what ``relay-serve serve`` does."""

from __future__ import annotations

import logging
import time
from typing import Any

import yaml

from relay_serve import envs
from relay_serve.config import AppConfig

log = logging.getLogger(__name__)


def serve_config(cfg: AppConfig, host: str = "0.0.0.0", port: int = 8000) -> dict[str, Any]:
    """A Ray Serve config file (``serve deploy``) for ``cfg``."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": host, "port": port},
        "applications": [
            {
                "name": cfg.name,
                "route_prefix": cfg.route_prefix,
                "import_path": "relay_serve.serve.app:app_builder",
                "args": cfg.model_dump(mode="json"),
            }
        ],
    }


def serve_config_yaml(cfg: AppConfig, host: str = "0.0.0.0", port: int = 8000) -> str:
    return yaml.safe_dump(serve_config(cfg, host, port), sort_keys=False)


def start(cfg: AppConfig, host: str = "127.0.0.1", port: int = 8000, num_cpus: int | None = None) -> str:
    """Start Ray (unless connected), Serve and the app; return the base URL once it is ready."""
    import ray
    from ray import serve

    from relay_serve.serve.app import build_app

    if not ray.is_initialized():
        address = envs.ray_address()
        if address:
            ray.init(address=address)
        else:
            ray.init(address="local", num_cpus=num_cpus or envs.num_cpus(), include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.route_prefix, blocking=False)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{shown}:{port}{cfg.route_prefix.rstrip('/')}"


def serve_forever(cfg: AppConfig, host: str, port: int) -> None:
    t0 = time.time()
    url = start(cfg, host, port)
    print(f"relay-serve is ready at {url}/v1 (started in {time.time() - t0:.1f} s); Ctrl-C stops it", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        import ray
        from ray import serve

        print("stopping relay-serve", flush=True)
        serve.shutdown()
        ray.shutdown()
