"""The app on a local multi-node Ray cluster (tests/serve/multinode.py, in a process of its own):
four raylets on this machine, a head that takes no work and one node each offering
``relay_large``, ``relay_small`` and ``relay_router`` as the KubeRay worker groups do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relay_serve.eval.grading import is_correct

pytestmark = [pytest.mark.serve, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RELAY_RAY_ADDRESS")}
    env["RELAY_STATE_DIR"] = str(tmp_path_factory.mktemp("multinode-state"))
    log = tmp_path_factory.mktemp("multinode") / "stderr.log"
    with log.open("w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.serve.multinode"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=900,
        )
    from tests.serve.multinode import RESULT

    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + log.read_text()[-3000:]
    return json.loads(lines[-1][len(RESULT) :])


def test_each_deployment_lands_on_its_own_node(run):
    nodes, placed = run["nodes"], run["placed"]
    assert len(set(nodes.values())) == 3
    assert placed == {"large": nodes["relay_large"], "small": nodes["relay_small"]}
    assert run["router"]["node_id"] == nodes["relay_router"]


def test_segments_cross_nodes_over_the_channel(run):
    """The router (its own node) holds a channel to each model's replica (on theirs), and every
    relay request had segments written by both replicas."""
    assert run["router"]["channels"] == 2
    for r in run["before"]:
        assert r["status"] == 200, r
        served_by = {(e["model"], e["replica_id"]) for e in r["engine_requests"]}
        assert served_by == {("large", run["replicas"]["large"]), ("small", run["replicas"]["small"])}, served_by
        assert r["usage"]["relay"]["small_tokens"] > 0 and not r["usage"]["relay"]["degraded"]
        assert is_correct(r["text"], run["answers"][r["prompt"]])


def test_losing_the_small_models_node_under_load_fails_no_request(run):
    """As the README promises: relay requests degrade to the large model, none fails, every
    answer stays right; requests in flight when the node went finish within the small model's
    deadline (3 s here)."""
    removed = run["small_node_removed_at"]
    during, after = run["during"], run["after"]
    assert [r for r in during + after if r["status"] != 200] == []
    in_flight = [r for r in during if r["start"] < removed < r["end"]]
    assert in_flight, "no request was in flight when the node went"
    # under the load, after the node went, relay degraded (a request in flight may have had no
    # handoff left to make, or its last one may have been answered before the replica died)
    assert any(r["usage"]["relay"]["degraded"] for r in during if r["end"] > removed)
    for r in during + after:
        assert is_correct(r["text"], run["answers"][r["prompt"]]), r["text"][-300:]
        u = r["usage"]
        assert u["relay"]["large_tokens"] + u["relay"]["small_tokens"] == u["completion_tokens"]
    assert all(r["usage"]["relay"]["degraded"] and r["usage"]["relay"]["small_tokens"] == 0 for r in after)
    # the node's loss costs a request in flight at most the small model's deadline (3 s, with 1 s of
    # slack for the machine) over the slowest request it did not reach
    unhit = [r["end"] - r["start"] for r in during + after if r not in in_flight]
    assert max(r["end"] - r["start"] for r in in_flight) <= max(unhit) + 3.0 + 1.0, (in_flight, max(unhit))
    print(
        f"{len(during)} requests under load, {len(in_flight)} in flight when the small node went "
        f"(they took {max(r['end'] - r['start'] for r in in_flight):.1f} s at most), {len(after)} after it"
    )
