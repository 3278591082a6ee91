"""The module boundaries docs/architecture.md states, checked on the source: what each layer must
not import (anywhere in the module, lazily or not)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# module glob -> imports it must not make (prefixes)
RULES = {
    "relay_serve/relay/*.py": ("ray", "vllm", "fastapi", "torch", "relay_serve.serve", "relay_serve.engine", "relay_serve.config"),
    "relay_serve/engine/*.py": ("ray", "fastapi", "relay_serve.serve"),
    "relay_serve/engine/session.py": ("vllm",),
    "relay_serve/engine/stops.py": ("vllm",),
    "relay_serve/engine/base.py": ("vllm",),
    "relay_serve/serve/router.py": ("vllm", "relay_serve.engine", "torch"),
    "relay_serve/serve/http.py": ("vllm", "ray", "relay_serve.engine", "relay_serve.relay"),
    "relay_serve/serve/generations.py": ("vllm", "ray", "fastapi", "starlette", "relay_serve.engine"),
    "relay_serve/serve/streaming.py": ("vllm", "ray", "fastapi", "starlette", "relay_serve.engine"),
    "relay_serve/serve/openai_api.py": ("vllm", "ray", "relay_serve.engine"),
    "relay_serve/serve/backend.py": ("vllm", "relay_serve.engine"),
    "relay_serve/serve/transport.py": ("vllm", "relay_serve.engine"),
    "relay_serve/serve/channel.py": ("vllm", "ray", "relay_serve.engine"),
    "relay_serve/serve/metrics.py": ("vllm", "relay_serve.engine"),
    "relay_serve/serve/autoscaling.py": ("vllm", "ray", "relay_serve.engine"),
    "relay_serve/serve/placement.py": ("vllm", "relay_serve.engine"),
    "relay_serve/serve/shadow.py": ("vllm", "relay_serve.engine", "fastapi"),
    "relay_serve/serve/cue_stats.py": ("vllm", "relay_serve.engine", "fastapi"),
    "relay_serve/tokenizer.py": ("relay_serve.serve", "ray", "vllm"),
    "relay_serve/client.py": ("ray", "vllm", "relay_serve.serve"),
    "relay_serve/cues.py": ("relay_serve.store", "relay_serve.serve"),
    "relay_serve/store.py": ("relay_serve.serve",),
    "relay_serve/bench/report.py": ("ray", "httpx", "vllm"),
    "calibration_jobs/*.py": ("relay_serve.serve.router", "fastapi"),
    "relay_serve/config.py": ("ray",),
    "relay_serve/envs.py": ("ray",),
    "relay_serve/deploy/*.py": ("ray", "vllm", "relay_serve.serve"),
    "relay_serve/toy/*.py": ("relay_serve.serve",),
    "relay_serve/bench/render.py": ("ray", "httpx"),
}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


@pytest.mark.parametrize("pattern", sorted(RULES))
def test_layers_keep_to_their_imports(pattern):
    paths = sorted(ROOT.glob(pattern))
    assert paths, pattern
    bad = [
        f"{p.relative_to(ROOT)} imports {name}"
        for p in paths
        for name in sorted(imports(p))
        if any(name == f or name.startswith(f + ".") for f in RULES[pattern])
    ]
    assert not bad, bad


def test_vllm_is_imported_by_the_engine_module_alone():
    users = sorted(
        str(p.relative_to(ROOT))
        for p in list((ROOT / "relay_serve").rglob("*.py")) + list((ROOT / "calibration_jobs").rglob("*.py"))
        if any(n == "vllm" or n.startswith("vllm.") for n in imports(p))
    )
    assert users == ["relay_serve/engine/vllm_engine.py"], users
