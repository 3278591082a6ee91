"""The module boundaries docs/architecture.md states, checked on the source: what each layer must
not import (anywhere in the module, lazily or not)."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The folders that each run in one kind of process (docs/architecture.md, "Where code runs").
PROCESSES = ("relay_serve.router", "relay_serve.replica", "relay_serve.online", "relay_serve.app")


def _others(*mine: str) -> tuple[str, ...]:
    return tuple(p for p in PROCESSES if p not in mine)


# module glob -> imports it must not make (prefixes)
RULES = {
    "relay_serve/relay/*.py": (
        "ray",
        "vllm",
        "fastapi",
        "torch",
        *PROCESSES,
        "relay_serve.engine",
        "relay_serve.config",
    ),
    "relay_serve/engine/*.py": ("ray", "fastapi", *PROCESSES),
    "relay_serve/engine/session.py": ("vllm",),
    "relay_serve/engine/stops.py": ("vllm",),
    "relay_serve/engine/base.py": ("vllm",),
    "relay_serve/protocol.py": ("ray", "vllm", "relay_serve"),
    "relay_serve/extras.py": ("ray", "vllm", "relay_serve"),
    "relay_serve/cluster.py": ("vllm", *PROCESSES),
    # A router replica loads no model and no engine.
    "relay_serve/router/*.py": (
        "vllm",
        "torch",
        "relay_serve.engine",
        "calibration_jobs",
        *_others("relay_serve.router"),
    ),
    "relay_serve/router/http.py": ("ray", "relay_serve.relay"),
    "relay_serve/router/generations.py": ("ray", "fastapi", "starlette"),
    "relay_serve/router/streaming.py": ("ray", "fastapi", "starlette"),
    "relay_serve/router/openai_api.py": ("ray",),
    "relay_serve/router/channel.py": ("ray",),
    "relay_serve/replica/*.py": ("fastapi", *_others("relay_serve.replica", "relay_serve.app")),
    "relay_serve/replica/channel.py": ("ray", "vllm", "relay_serve.engine"),
    "relay_serve/online/*.py": (
        "vllm",
        "fastapi",
        "relay_serve.engine",
        "calibration_jobs",
        *_others("relay_serve.online"),
    ),
    "relay_serve/app/*.py": ("vllm", "relay_serve.engine", "relay_serve.online"),
    # Serve's controller imports the policy: nothing of the replica but the name of its statistic.
    "relay_serve/app/autoscaling.py": (
        "ray",
        "relay_serve.engine",
        "relay_serve.replica.model_server",
        *_others("relay_serve.app", "relay_serve.replica"),
    ),
    "relay_serve/replica/load.py": ("relay_serve",),
    "relay_serve/tokenizer.py": (*PROCESSES, "ray", "vllm"),
    "relay_serve/client.py": ("ray", "vllm", *PROCESSES),
    "relay_serve/calibration/cues.py": ("relay_serve.calibration.store", *PROCESSES),
    "relay_serve/calibration/store.py": PROCESSES,
    "relay_serve/bench/report.py": ("ray", "httpx", "vllm"),
    "calibration_jobs/*.py": ("relay_serve.toy", "fastapi", *PROCESSES),
    "relay_serve/config.py": ("ray",),
    "relay_serve/envs.py": ("ray",),
    "relay_serve/deploy/*.py": ("ray", "vllm", *PROCESSES),
    "relay_serve/toy/*.py": ("relay_serve.config", "relay_serve.calibration", "relay_serve.engine", *PROCESSES),
    "relay_serve/bench/render.py": ("ray", "httpx"),
}

# The one call across processes that names the other side's code: the router's scoring side
# starts (or finds) the statistics actor, whose class Ray needs to create it.
ALLOWED = {("relay_serve/router/shadow.py", "relay_serve.online.cue_stats")}


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
        and (str(p.relative_to(ROOT)), name) not in ALLOWED
    ]
    assert not bad, bad


def test_vllm_is_imported_by_the_engine_modules_alone():
    """The engine behind the Engine interface, and the logits processor vLLM's engine core loads."""
    users = sorted(
        str(p.relative_to(ROOT))
        for p in list((ROOT / "relay_serve").rglob("*.py")) + list((ROOT / "calibration_jobs").rglob("*.py"))
        if any(n == "vllm" or n.startswith("vllm.") for n in imports(p))
    )
    assert users == ["relay_serve/engine/vllm_engine.py", "relay_serve/engine/vllm_swaps.py"], users


def _part(module: str) -> str | None:
    """The top-level part a module belongs to: a package under relay_serve (``relay_serve.router``),
    a module directly under it (``relay_serve.config``), or ``calibration_jobs``."""
    bits = module.split(".")
    if bits[0] == "calibration_jobs":
        return "calibration_jobs"
    return bits[1] if bits[0] == "relay_serve" and len(bits) > 1 else None


def _runtime_imports(path: Path) -> set[str]:
    """Imports that run (lazy ones included), not those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from relay_serve import envs`` imports the part ``envs``
            found.update(f"{node.module}.{a.name}" for a in node.names) if node.module == "relay_serve" else found.add(
                node.module
            )
    return found


def test_no_import_cycle_between_top_level_parts():
    edges: dict[str, dict[str, str]] = {}
    for p in sorted((ROOT / "relay_serve").rglob("*.py")) + sorted((ROOT / "calibration_jobs").rglob("*.py")):
        src = _part(".".join(p.relative_to(ROOT).with_suffix("").parts))
        if src is None or src == "__init__":
            continue
        for name in _runtime_imports(p):
            dst = _part(name)
            if dst and dst != src:
                edges.setdefault(src, {}).setdefault(dst, str(p.relative_to(ROOT)))
    # depth-first search for a back edge; report the cycle with a file for each step
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, {})):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            steps = [f"{a} -> {b} ({edges[a][b]})" for a, b in itertools.pairwise(cycle)]
            raise AssertionError("an import cycle between parts: " + "; ".join(steps))
