"""Every environment variable relay-serve reads, with its default. Nothing else calls os.getenv.

RELAY_STATE_DIR     local state (cue store, run records); default: ./.relay-state
RELAY_CUE_STORE     cue store URI; default: file://<RELAY_STATE_DIR>/cues
RELAY_API_KEY       API key that eval, bench and soak send to a --url server (the router's own keys
                    come from the files or variables its config names)
RELAY_RAY_ADDRESS   Ray cluster address to join (serve, the jobs); default: RAY_ADDRESS (what `ray job
                    submit` sets for a job's driver), else start a local Ray
RELAY_NUM_CPUS      logical CPUs of a local Ray; default: 8
RAY_worker_niceness Ray's own; set to 0 (unless set) before a local Ray starts, so the engines run at
                    normal priority
"""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    return Path(os.environ.get("RELAY_STATE_DIR", ".relay-state")).absolute()


def cue_store_uri() -> str:
    return os.environ.get("RELAY_CUE_STORE") or (state_dir() / "cues").as_uri()


def api_key() -> str | None:
    return os.environ.get("RELAY_API_KEY") or None


def ray_address() -> str | None:
    return os.environ.get("RELAY_RAY_ADDRESS") or os.environ.get("RAY_ADDRESS") or None


def num_cpus() -> int:
    return int(os.environ.get("RELAY_NUM_CPUS", "8"))


def run_local_ray_workers_at_normal_priority() -> None:
    """Ray starts its workers at niceness 15 (behind its own daemons). On one machine serving
    models that is the engines, which then lose the CPU to any daemon: run them at 0 (before
    ``ray.init`` starts the local raylet, which reads RAY_worker_niceness)."""
    os.environ.setdefault("RAY_worker_niceness", "0")


def get(name: str) -> str | None:
    """A variable named in a config (e.g. the file or variable holding an API key)."""
    return os.environ.get(name)


def route_vllm_logs_to_stderr() -> None:
    """Keep stdout for a command's own output (vLLM logs to stdout by default); child processes
    inherit it."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
