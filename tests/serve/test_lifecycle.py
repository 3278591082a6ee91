"""`relay-serve serve` as a user runs it: it says it is ready only once a request is as quick as
the ones after it, and Ctrl-C (SIGTERM) stops it promptly, with no warning or traceback."""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from relay_serve.cluster import free_port

pytestmark = [pytest.mark.serve, pytest.mark.vllm]


def test_ready_means_ready_and_ctrl_c_stops_promptly(tmp_path):
    port, metrics_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RELAY_RAY_ADDRESS")}  # a Ray of its own
    env["RELAY_STATE_DIR"] = str(tmp_path)
    cli = Path(sys.executable).parent / "relay-serve"
    log = tmp_path / "serve.err"  # a file, not a pipe: the engines' logs must not fill a pipe nobody reads
    with log.open("w") as err_file:
        proc = subprocess.Popen(
            [str(cli), "serve", "--port", str(port), "--metrics-port", str(metrics_port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=err_file,
            text=True,
        )
    try:
        ready = proc.stdout.readline()  # blocks until the service says it is ready (or exits)
        assert "is ready at" in ready, ready + log.read_text()[-3000:]
        body = {
            "model": "relay",
            "messages": [{"role": "user", "content": "Start at k11. Follow the map four times."}],
            "max_tokens": 200,
        }
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
            times.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
        warm = statistics.median(times[1:])
        assert times[0] < 5 * warm + 1.0, times  # the first request pays no start-up cost (it paid 20-25 s)
        # the metrics URL it printed is on the port asked for and counts the warm-up and these 4
        metrics_line = proc.stdout.readline()
        assert metrics_line.startswith("metrics (Prometheus) at http://") and metrics_line.rstrip().endswith(
            f":{metrics_port}/metrics"
        ), metrics_line
        assert exported_requests(metrics_line.split(" at ")[1].strip(), expect=5) == 5
        before_stop = len(log.read_text())
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        stop_s = time.perf_counter() - t0
        err = log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "stopped in" in out, out + err[-3000:]
    print(
        f"first request {times[0]:.2f} s, the next ones {', '.join(f'{t:.2f}' for t in times[1:])} s; stopped in "
        f"{stop_s:.1f} s"
    )
    assert stop_s < 12, f"stopping took {stop_s:.1f} s"  # 6.6-8.6 s here (33 s before)
    for bad in ("Traceback", "Logging error", "failed to shut down", "did not drain"):
        assert bad not in err, err[err.index(bad) - 2000 : err.index(bad) + 500]
    stopping = err[before_stop:].splitlines()  # what it logged from Ctrl-C on: no warning, no error
    loud = [line for line in stopping if re.search(r"\b(WARNING|ERROR|CRITICAL|Warning:|Error:)", line)]
    assert not loud, "\n".join(loud[:20])


def exported_requests(url: str, expect: float, timeout_s: float = 60.0) -> float:
    """relay_serve_requests_total{model_id="relay",status="200"} as Ray's metrics agent exports it
    (with Ray's ``ray_`` prefix), once it reaches ``expect`` or ``timeout_s`` passed."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.time() + timeout_s
    while True:
        text = httpx.get(url, timeout=10).text
        n = sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "ray_relay_serve_requests_total"
            and s.labels.get("model_id") == "relay"
            and s.labels.get("status") == "200"
        )
        if n >= expect or time.time() > deadline:
            return n
        time.sleep(1)
