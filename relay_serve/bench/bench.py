"""``relay-serve bench``: relay against the large model alone, on a cost-realistic trained pair.

By default the pair is ``toy:large-wide`` (the toy large model widened: the same function, about
ten times the small model's cost per token) and ``toy:small``. Stages:

1. **calibrate**: the calibration job selects the pair's cues and publishes them to the bench's
   own cue store (``<out>/cues``), so relay runs with the cues this pair would be served with;
2. **serve**: the relay app, and beside it vLLM's own OpenAI server with the large model and the
   same engine arguments (the baseline a user would pick instead);
3. **rounds**: in each round every mode (``large``, ``relay``, ``small``, ``speculative-thinking``
   on relay-serve; ``vllm-large`` on vLLM) runs at each concurrency on the same prompts and seeds,
   the modes in an order that rotates from round to round; every response is graded (pass@1);
4. optionally, relay on an app that differs in one setting (a new engine request per segment, the
   handle transport, a small-queue bound) deployed beside the default app, the two interleaved in
   rounds of their own;
5. the report (``report.py``) and its files (``render.py``): ``bench.json``, ``bench.md``, plots.

The engines time every engine request themselves (time to first token, decode time), so the
ideal speedup of a round is computed from that round's own decode costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from relay_serve.bench.report import BenchReport, PairInfo, RunMetrics, level_report, run_metrics
from relay_serve.client import chat_body, http_client, post_chat
from relay_serve.config import AppConfig, PaperSampling
from relay_serve.eval.datasets import Problem

MODES = ("large", "relay", "small", "speculative-thinking")
VLLM_MODE = "vllm-large"


class BenchSettings(PaperSampling):
    dataset: str = Field("toy", description="the prompts (graded for pass@1): toy, math500, gsm8k or jsonl:PATH")
    concurrency: list[int] = Field(default_factory=lambda: [1, 8])
    requests_per_level: int = Field(32, ge=1, description="requests per mode, concurrency and round (at least the concurrency)")
    rounds: int = Field(3, ge=1, description="every mode at every concurrency once a round")
    seed: int = 0
    max_tokens: int = 256
    calibrate: bool = Field(True, description="calibrate the pair's cues first (into the bench's own cue store)")
    vllm_baseline: bool = Field(True, description="also run the large model on vLLM's own OpenAI server")
    small_queue_bound: int | None = Field(
        None, ge=1, description="also run relay at the top concurrency with router.max_small_in_flight set to this"
    )
    compare_transports: bool = Field(False, description="also run relay with router.transport: handle")
    compare_resumable: bool = Field(
        False, description="also run relay with router.resumable_requests: false (a new engine request per segment)"
    )


def default_pair() -> AppConfig:
    """The benchmark's pair: ``configs/toy-wide-cpu.yaml``."""
    return AppConfig.model_validate({"large": {"model": "toy:large-wide"}})


# ---- requests ------------------------------------------------------------------------------------


def _bodies(s: BenchSettings, mode: str, model: str, problems: list[Problem], round_: int = 0) -> list[dict[str, Any]]:
    """One request per problem; the seeds are the same for every mode of a round and differ
    between rounds (so pass@1 counts every round's samples)."""
    relay_serve = mode != VLLM_MODE
    return [
        chat_body(
            model, p.problem, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            seed=s.seed + 1000 * round_ + i, relay_trace=True if relay_serve else None,
        )
        for i, p in enumerate(problems)
    ]  # fmt: skip


async def fire(base: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[list[dict[str, Any]], float]:
    """Send ``bodies`` with ``concurrency`` in flight; each result is the response with
    ``_latency_s``, or ``{"_error": ...}``. Returns the results in order and the wall time."""
    sem = asyncio.Semaphore(concurrency)
    async with http_client(600) as client:

        async def one(body: dict[str, Any]) -> dict[str, Any]:
            async with sem:
                t0 = time.perf_counter()
                try:
                    out = await post_chat(client, base, body)
                except Exception as e:  # noqa: BLE001 - a failed request is a result (it counts as wrong)
                    return {"_error": f"{type(e).__name__}: {e}"}
                out["_latency_s"] = time.perf_counter() - t0
                return out

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies))
        return list(results), time.perf_counter() - t0


def graded(results: list[dict[str, Any]], problems: list[Problem]) -> list[dict[str, Any]]:
    from relay_serve.eval.grading import is_correct

    for r, p in zip(results, problems):
        if "_error" not in r:
            r["_correct"] = is_correct(r["choices"][0]["message"]["content"], p.answer)
    return results


def measure(base: str, model: str, mode: str, s: BenchSettings, problems: list[Problem], c: int, round_: int) -> RunMetrics:
    n = max(c, s.requests_per_level)
    chosen = [problems[i % len(problems)] for i in range(n)]
    results, wall = asyncio.run(fire(base, _bodies(s, mode, model, chosen, round_), c))
    return run_metrics(mode, c, round_, graded(results, chosen), wall)


# ---- stages --------------------------------------------------------------------------------------


def calibrate(cfg: AppConfig, out: Path, progress: bool) -> None:
    """Select the pair's cues with the calibration job and publish them to ``cfg``'s cue store."""
    from calibration_jobs.calibrate import CalibrationConfig, run

    run(CalibrationConfig(app=cfg, report_dir=str(out / "calibration")), progress=progress)


class Variant(BaseModel):
    """relay on an app that differs in one setting, run in every round beside the default app."""

    mode: str
    label: str
    router: dict[str, Any]


def variants(s: BenchSettings) -> list[Variant]:
    out = []
    if s.compare_resumable:
        out.append(Variant(mode="relay-per-segment", label="a new engine request per segment", router={"resumable_requests": False}))
    if s.compare_transports:
        out.append(Variant(mode="relay-handle", label="a Ray Serve handle call per segment", router={"transport": "handle"}))
    if s.small_queue_bound is not None:
        label = f"at most {s.small_queue_bound} small-model segments in flight (router.max_small_in_flight)"
        out.append(Variant(mode="relay-bounded", label=label, router={"max_small_in_flight": s.small_queue_bound}))
    return out


@contextlib.contextmanager
def targets(cfg: AppConfig, s: BenchSettings, out: Path, port: int) -> Iterator[dict[str, tuple[str, str]]]:
    """Each mode's (base URL, model id): the relay app started here on ``port`` (Serve's one HTTP
    port), and vLLM's server."""
    from ray import serve

    from relay_serve.bench.vllm_baseline import VLLMServer
    from relay_serve.serve.local import free_port, start

    base = start(cfg, port=port)
    found = {mode: (base, mode) for mode in MODES}
    try:
        if s.vllm_baseline:
            with VLLMServer(cfg.large, port=free_port(), log=out / "vllm-serve.log") as vllm:
                found[VLLM_MODE] = (vllm.base, vllm.served_name)
                yield found
        else:
            yield found
    finally:
        serve.delete(cfg.name)


def rounds(found: dict[str, tuple[str, str]], s: BenchSettings, problems: list[Problem], progress: bool, desc: str = "bench") -> list[RunMetrics]:
    """Every mode at every concurrency, ``s.rounds`` times; the order of the modes rotates."""
    from tqdm import tqdm

    modes = list(found)
    for mode, (base, model) in found.items():  # warm up every engine and the prefix caches' empty state
        asyncio.run(fire(base, _bodies(s, mode, model, problems[:4]), 4))
    runs = []
    with tqdm(total=s.rounds * len(s.concurrency) * len(modes), desc=desc, disable=not progress) as bar:
        for k in range(s.rounds):
            order = modes[k % len(modes) :] + modes[: k % len(modes)]
            for c in s.concurrency:
                for mode in order:
                    base, model = found[mode]
                    runs.append(measure(base, model, mode, s, problems, c, k))
                    bar.update(1)
    return runs


def variant_rounds(cfg: AppConfig, s: BenchSettings, problems: list[Problem], port: int, progress: bool) -> list[RunMetrics]:
    """Each variant: its app deployed beside the default one (its name as route prefix), and
    ``s.rounds`` rounds of the two relays interleaved; then the variant app goes (one at a time:
    two apps are four engines)."""
    from ray import serve

    from relay_serve.serve.local import start

    runs = []
    base = start(cfg, port=port)
    try:
        for v in variants(s):
            variant = cfg.model_copy(deep=True, update={"name": v.mode, "route_prefix": f"/{v.mode}"})
            variant.router = variant.router.model_copy(update=v.router)
            pair = {f"relay-beside-{v.mode}": (base, "relay"), v.mode: (start(variant, port=port), "relay")}
            runs += rounds(pair, s, problems, progress, desc=v.mode)
            serve.delete(variant.name)
    finally:
        serve.delete(cfg.name)
    return runs


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU, Python {platform.python_version()}"


def run_bench(s: BenchSettings, out: Path, cfg: AppConfig | None = None, progress: bool = True, command: str = "relay-serve bench") -> BenchReport:
    import httpx
    import ray
    from ray import serve

    from relay_serve.bench.render import markdown, plots
    from relay_serve.client import api_headers
    from relay_serve.eval.datasets import load_problems
    from relay_serve.serve.local import free_port, init_ray

    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M")
    cfg = (cfg or default_pair()).model_copy(deep=True)
    problems = load_problems(s.dataset, max(max(s.concurrency), s.requests_per_level), seed=s.seed)
    init_ray(cfg.env_vars)
    port = free_port()
    try:
        if s.calibrate:
            cfg.cues.store_uri = (out / "cues").absolute().as_uri()
            calibrate(cfg, out, progress)
        with targets(cfg, s, out, port) as found:
            cues = httpx.get(found["relay"][0] + "/v1/relay/cues", headers=api_headers(), timeout=30).json()
            runs = rounds(found, s, problems, progress)
        if variants(s):
            runs += variant_rounds(cfg, s, problems, port, progress)
    finally:
        serve.shutdown()
        ray.shutdown()
    report = BenchReport(
        started=started,
        machine=machine(),
        command=command,
        settings=s.model_dump(),
        pair=PairInfo(large=cfg.large.model, small=cfg.small.model, cue_set_version=cues.get("version"), cues=cues.get("cues", [])),
        levels=[level_report(c, [r for r in runs if r.concurrency == c]) for c in s.concurrency],
        runs=runs,
        variants={v.mode: v.label for v in variants(s)},
    )
    (out / "bench.json").write_text(report.model_dump_json(indent=2) + "\n")
    (out / "bench.md").write_text(markdown(report))
    plots(report, out)
    return report


def summary_line(report: BenchReport) -> str:
    return json.dumps(report.summary())
