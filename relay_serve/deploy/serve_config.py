"""A Ray Serve config file for the app (``serve deploy``, and the RayService's ``serveConfigV2``):
one application whose builder takes the whole app config as ``args``."""

from __future__ import annotations

from typing import Any

import yaml

from relay_serve.config import AppConfig


def serve_config(cfg: AppConfig, host: str = "0.0.0.0", port: int = 8000) -> dict[str, Any]:
    """A Ray Serve config file (``serve deploy``) for ``cfg``."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": host, "port": port},
        "applications": [
            {
                "name": cfg.name,
                "route_prefix": cfg.route_prefix,
                "import_path": "relay_serve.app:app_builder",
                "args": cfg.model_dump(mode="json"),
            }
        ],
    }


def serve_config_yaml(cfg: AppConfig, host: str = "0.0.0.0", port: int = 8000) -> str:
    return yaml.safe_dump(serve_config(cfg, host, port), sort_keys=False)
