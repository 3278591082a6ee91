"""KubeRay: the ``serveConfigV2`` of ``k8s/rayservice.yaml``, rendered from an app config, and
written into the manifest in place (``relay-serve config --format k8s [--into MANIFEST]``)."""

from __future__ import annotations

import re

import yaml

from relay_serve.config import AppConfig
from relay_serve.deploy.serve_config import serve_config

SERVE_CONFIG_KEY = "serveConfigV2"


def serve_config_v2(cfg: AppConfig) -> str:
    """The Serve config a RayService runs: the relay app with ``cfg`` as its builder's args,
    proxies on every node on port 8000 (KubeRay's serve service points there)."""
    return yaml.safe_dump(serve_config(cfg, host="0.0.0.0", port=8000), sort_keys=False)


def embedded_serve_config(manifest: str) -> str:
    """The ``serveConfigV2`` string of the RayService document in ``manifest``."""
    for doc in yaml.safe_load_all(manifest):
        if isinstance(doc, dict) and doc.get("kind") == "RayService":
            return doc["spec"][SERVE_CONFIG_KEY]
    raise ValueError("the manifest holds no RayService")


def render_into(manifest: str, serve_yaml: str) -> str:
    """``manifest`` with its ``serveConfigV2: |`` block replaced by ``serve_yaml`` (the rest of
    the text, comments included, kept as it is)."""
    lines = manifest.splitlines(keepends=True)
    head = re.compile(rf"^(\s*){SERVE_CONFIG_KEY}:\s*\|[-+]?\s*(#.*)?$")
    for i, line in enumerate(lines):
        m = head.match(line.rstrip("\n"))
        if not m:
            continue
        indent = len(m.group(1)) + 2
        end = i + 1
        while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) >= indent):
            end += 1
        while end > i + 1 and not lines[end - 1].strip():  # keep the blank lines after the block
            end -= 1
        block = "".join(" " * indent + row + "\n" if row else "\n" for row in serve_yaml.rstrip("\n").split("\n"))
        return "".join(lines[: i + 1]) + block + "".join(lines[end:])
    raise ValueError(f"the manifest has no '{SERVE_CONFIG_KEY}: |' block")
