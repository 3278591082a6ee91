"""``relay-serve bench``: relay against what a user would pick instead, on a cost-realistic trained pair.

By default the pair is ``toy:large-wide`` (the toy large model widened: the same function, 15.7x
the small model's cost per token in ``relay-serve toy speed``) and ``toy:small``. Stages:

1. **calibrate**: the calibration job selects the pair's cues and publishes them to the bench's
   own cue store (``<out>/cues``), so relay runs with the cues this pair would be served with;
2. **serve**: the relay app; beside it the same pair with a speculative large engine (the small
   model as its draft model, ``spec_tokens`` a step: ``large+spec`` and ``relay+spec``), and vLLM's
   own OpenAI server with the large model and the same engine arguments (``vllm-large``);
3. **rounds**, for each sampling profile (``greedy``, ``paper``): in each round every mode runs at
   each concurrency on the same prompts and seeds, the modes in an order that is reversed every
   other round and rotates every two (``round_order``); every response is graded (pass@1); a
   request the service refuses (a speculative vLLM-CPU engine runs greedy sampling only) is a
   result, counted as refused;
4. optionally, relay on an app that differs in one setting (a new engine request per segment, the
   handle transport, a small-queue bound) deployed beside the default app, the two interleaved in
   rounds of their own;
5. the report (``report.py``) and its files (``render.py``): ``bench.json``, ``bench.md``, plots.

The engines time every engine request themselves (time to first token, decode time), so the
ideal speedup of a round is computed from that round's own decode costs; the speculative engine's
drafts (vLLM's spec-decode statistics) are read from its replica before and after every run.
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

from pydantic import BaseModel, Field, field_validator

from relay_serve.bench.report import (
    SPEC,
    BenchReport,
    PairInfo,
    RunMetrics,
    SpecStats,
    level_report,
    run_metrics,
)
from relay_serve.client import RequestFailed, chat_body, http_client, post_chat
from relay_serve.config import AppConfig
from relay_serve.eval.datasets import Problem

MODES = ("large", "relay", "auto", "small", "speculative-thinking")
SPEC_MODES = ("large", "relay", "auto")  # served by the speculative app too, as large+spec, relay+spec and auto+spec
VLLM_MODE = "vllm-large"
SPEC_APP = "spec"
# The draft length by batch size on this machine's wide pair, from `python -m relay_serve.bench.spec_sweep`
# (docs/bench/spec_sweep.md): the shortest exact k within 2% of the fastest at each measured batch size.
SPEC_SCHEDULE: tuple[tuple[int, int, int], ...] = ((1, 31, 8), (32, 1 << 16, 2))


class SamplingProfile(BaseModel):
    temperature: float
    top_p: float | None = None
    top_k: int | None = None


# greedy: what a speculative vLLM-CPU engine runs correctly; paper: the RelayGen paper's (and eval's)
PROFILES = {
    "greedy": SamplingProfile(temperature=0.0),
    "paper": SamplingProfile(temperature=0.6, top_p=0.95, top_k=20),
}


class BenchSettings(BaseModel):
    dataset: str = Field("toy", description="the prompts (graded for pass@1): toy, math500, gsm8k or jsonl:PATH")
    concurrency: list[int] = Field(default_factory=lambda: [1, 8, 32])
    requests_per_level: int = Field(
        32, ge=1, description="requests per mode, concurrency and round (at least twice the concurrency above 1)"
    )
    rounds: int = Field(3, ge=1, description="every mode at every concurrency once a round")
    sampling: list[str] = Field(
        default_factory=lambda: ["greedy", "paper"], description="sampling profiles, each a set of rounds"
    )
    seed: int = 0
    max_tokens: int = 256
    spec_tokens: int = Field(
        8,
        ge=0,
        description="large+spec and relay+spec: an app whose large engine drafts up to this many tokens with the small "
        "model (0: none)",
    )
    spec_schedule: list[tuple[int, int, int]] | None = Field(
        default_factory=lambda: list(SPEC_SCHEDULE),
        description="the draft length by the engine's batch size: (from, to, k) ranges (vLLM's "
        "num_speculative_tokens_per_batch_size); "
        "None: spec_tokens at every batch size",
    )
    auto_learn: int = Field(
        8,
        ge=0,
        description="before a profile's rounds, every auto mode runs this many times each level's concurrency (at "
        "least 16) of generations at that level, not measured, so that the rounds measure auto once it has learnt the "
        "level, as a service does after its first minutes (a level learns from blocks of each path, each twice its "
        "size, until each path has policy.auto.min_samples generations that ran among their own path: two blocks of "
        "each at levels 2-8); 0: measure it from scratch",
    )
    calibrate: bool = Field(True, description="calibrate the pair's cues first (into the bench's own cue store)")
    vllm_baseline: bool = Field(True, description="also run the large model on vLLM's own OpenAI server")
    small_queue_bound: int | None = Field(
        None, ge=1, description="also run relay at the top concurrency with router.max_small_in_flight set to this"
    )
    compare_transports: bool = Field(False, description="also run relay with router.transport: handle")
    compare_resumable: bool = Field(
        False, description="also run relay with router.resumable_requests: false (a new engine request per segment)"
    )
    compare_swaps: bool = Field(
        False,
        description="also run relay with no spare token ids (every stop looked ahead by pausing, not inside the "
        "engine)",
    )

    @field_validator("sampling")
    @classmethod
    def _profiles(cls, v: list[str]) -> list[str]:
        unknown = [p for p in v if p not in PROFILES]
        if unknown or not v:
            raise ValueError(f"sampling profiles are {', '.join(PROFILES)}; not {', '.join(unknown) or 'none'}")
        return list(dict.fromkeys(v))

    def requests(self, concurrency: int) -> int:
        """Requests a run sends: at least two waves at a concurrency above 1 (a steady state, not one burst)."""
        return max(self.requests_per_level, concurrency if concurrency == 1 else 2 * concurrency)


def default_pair() -> AppConfig:
    """The benchmark's pair: ``configs/toy-wide-cpu.yaml``."""
    return AppConfig.model_validate({"large": {"model": "toy:large-wide"}})


def spec_app(cfg: AppConfig, k: int, schedule: list[tuple[int, int, int]] | None = None) -> AppConfig:
    """The same app with a large engine that speculates with the small model as its draft model
    (up to ``k`` tokens a step; by ``schedule`` at each batch size), served beside it under ``/spec``."""
    spec = cfg.model_copy(deep=True, update={"name": SPEC_APP, "route_prefix": f"/{SPEC_APP}"})
    draft: dict[str, Any] = {"method": "draft_model", "model": cfg.small.model, "num_speculative_tokens": k}
    if schedule:
        draft["num_speculative_tokens_per_batch_size"] = [list(r) for r in schedule]
    spec.large.engine_args = {**spec.large.engine_args, "speculative_config": draft}
    return spec


def parse_schedule(text: str) -> list[tuple[int, int, int]] | None:
    """``"1-31:8,32-63:4,64-:0"`` (from-to batch sizes: draft length; an open end reaches any
    batch) as vLLM's schedule; ``"none"``: one draft length at every batch size."""
    if text.strip().lower() in ("", "none"):
        return None
    out = []
    for part in text.split(","):
        try:
            sizes, k = part.split(":")
            lo, _, hi = sizes.partition("-")
            out.append((int(lo), int(hi) if hi else 1 << 16, int(k)))
        except ValueError:
            raise ValueError(f"{part!r}: FROM-TO:K, e.g. 1-31:8 (TO may be left out on the last)") from None
    if out[0][0] != 1 or any(lo > hi or k < 0 for lo, hi, k in out):
        raise ValueError(f"{text!r}: ranges from batch size 1 on, each FROM <= TO, K >= 0")
    return out


# ---- requests ------------------------------------------------------------------------------------


class Target(BaseModel):
    """Where a mode is served: the base URL, the model id, and the Serve app (None: not relay-serve)."""

    base: str
    model: str
    app: str | None = None


def _bodies(
    s: BenchSettings, mode: str, model: str, problems: list[Problem], round_: int = 0, sampling: str = "paper"
) -> list[dict[str, Any]]:
    """One request per problem; the seeds are the same for every mode of a round and differ
    between rounds (so pass@1 counts every round's samples)."""
    relay_serve = mode != VLLM_MODE
    profile = PROFILES[sampling]
    return [
        chat_body(
            model,
            p.problem,
            max_tokens=s.max_tokens,
            temperature=profile.temperature,
            top_p=profile.top_p,
            top_k=profile.top_k,
            seed=s.seed + 1000 * round_ + i,
            relay_trace=True if relay_serve else None,
        )
        for i, p in enumerate(problems)
    ]


async def fire(base: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[list[dict[str, Any]], float]:
    """Send ``bodies`` with ``concurrency`` in flight; each result is the response with
    ``_latency_s``, or ``{"_error": ..., "_status": ...}``. Returns the results in order and the wall time."""
    sem = asyncio.Semaphore(concurrency)
    async with http_client(600) as client:

        async def one(body: dict[str, Any]) -> dict[str, Any]:
            async with sem:
                t0 = time.perf_counter()
                try:
                    out = await post_chat(client, base, body)
                except RequestFailed as e:  # a failed request is a result (it counts as wrong)
                    return {"_error": str(e), "_status": e.status}
                except Exception as e:  # noqa: BLE001 - the same, without an HTTP status
                    return {"_error": f"{type(e).__name__}: {e}", "_status": None}
                out["_latency_s"] = time.perf_counter() - t0
                return out

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies))
        return list(results), time.perf_counter() - t0


def graded(results: list[dict[str, Any]], problems: list[Problem]) -> list[dict[str, Any]]:
    from relay_serve.eval.grading import is_correct

    for r, p in zip(results, problems, strict=True):
        if "_error" not in r:
            r["_correct"] = is_correct(r["choices"][0]["message"]["content"], p.answer)
    return results


def spec_counts(app: str | None):
    """The speculative drafts of ``app``'s large engine so far (None: not a speculative engine)."""
    if app is None:
        return None
    from ray import serve

    from relay_serve.engine.base import SpecDecodeCounts

    info = serve.get_deployment_handle("large", app_name=app).info.remote().result(timeout_s=60)
    return SpecDecodeCounts.model_validate(info["spec_decode"]) if info.get("spec_decode") else None


def measure(
    target: Target, mode: str, s: BenchSettings, problems: list[Problem], c: int, round_: int, sampling: str = "paper"
) -> RunMetrics:
    n = s.requests(c)
    chosen = [problems[i % len(problems)] for i in range(n)]
    before = spec_counts(target.app)
    results, wall = asyncio.run(fire(target.base, _bodies(s, mode, target.model, chosen, round_, sampling), c))
    m = run_metrics(mode, c, round_, graded(results, chosen), wall, sampling=sampling)
    if before is not None:
        d = spec_counts(target.app) - before
        m.spec = SpecStats(
            drafts=d.drafts, acceptance_length=_r(d.acceptance_length()), acceptance_rate=_r(d.acceptance_rate())
        )
    return m


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# ---- stages --------------------------------------------------------------------------------------


def calibrate(cfg: AppConfig, out: Path, progress: bool) -> None:
    """Select the pair's cues with the calibration job and publish them to ``cfg``'s cue store."""
    from calibration_jobs.calibrate import CalibrationConfig, run

    run(CalibrationConfig(app=cfg, report_dir=str(out / "calibration")), progress=progress)


class Variant(BaseModel):
    """relay on an app that differs in one setting, run in every round beside the default app."""

    mode: str
    label: str
    router: dict[str, Any] = Field(default_factory=dict)
    models: dict[str, Any] = Field(default_factory=dict, description="set on both models' settings")


def variants(s: BenchSettings) -> list[Variant]:
    out = []
    if s.compare_resumable:
        out.append(
            Variant(
                mode="relay-per-segment", label="a new engine request per segment", router={"resumable_requests": False}
            )
        )
    if s.compare_swaps:
        out.append(
            Variant(
                mode="relay-pausing",
                label="every stop looked ahead by pausing (spare_token_ids: [])",
                models={"spare_token_ids": []},
            )
        )
    if s.compare_transports:
        out.append(
            Variant(mode="relay-handle", label="a Ray Serve handle call per segment", router={"transport": "handle"})
        )
    if s.small_queue_bound is not None:
        label = f"at most {s.small_queue_bound} small-model segments in flight (router.max_small_in_flight)"
        out.append(Variant(mode="relay-bounded", label=label, router={"max_small_in_flight": s.small_queue_bound}))
    return out


@contextlib.contextmanager
def targets(cfg: AppConfig, s: BenchSettings, out: Path, port: int) -> Iterator[dict[str, Target]]:
    """Each mode's target: the relay app started here on ``port`` (Serve's one HTTP port), beside
    it the same pair with a speculative large engine under ``/spec`` (``large+spec``,
    ``relay+spec``), and vLLM's own server."""
    from ray import serve

    from relay_serve.app.local import start
    from relay_serve.bench.vllm_baseline import VLLMServer
    from relay_serve.cluster import free_port

    base = start(cfg, port=port)
    found = {mode: Target(base=base, model=mode) for mode in MODES}
    apps = [cfg.name]
    try:
        if s.spec_tokens:
            spec = spec_app(cfg, s.spec_tokens, s.spec_schedule)
            apps.append(spec.name)
            spec_base = start(spec, port=port)
            found.update({mode + SPEC: Target(base=spec_base, model=mode, app=spec.name) for mode in SPEC_MODES})
        if s.vllm_baseline:
            with VLLMServer(cfg.large, port=free_port(), log=out / "vllm-serve.log") as vllm:
                found[VLLM_MODE] = Target(base=vllm.base, model=vllm.served_name)
                yield found
        else:
            yield found
    finally:
        for app in apps:
            serve.delete(app)


def rounds(
    found: dict[str, Target],
    s: BenchSettings,
    problems: list[Problem],
    progress: bool,
    desc: str = "bench",
    sampling: str = "paper",
) -> list[RunMetrics]:
    """Every mode at every concurrency, ``s.rounds`` times, the modes in ``round_order``. A
    mode whose warm-up fails (its engine cannot run this sampling) runs anyway: its refusals are
    results."""
    from tqdm import tqdm

    modes = list(found)
    for mode, t in found.items():  # warm up every engine and the prefix caches' empty state
        asyncio.run(fire(t.base, _bodies(s, mode, t.model, problems[:4], sampling=sampling), 4))
    learn_auto(found, s, problems, progress, sampling)
    runs = []
    with tqdm(
        total=s.rounds * len(s.concurrency) * len(modes), desc=f"{desc} ({sampling})", disable=not progress
    ) as bar:
        for k in range(s.rounds):
            order = round_order(modes, k)
            for c in s.concurrency:
                for mode in order:
                    runs.append(measure(found[mode], mode, s, problems, c, k, sampling))
                    bar.update(1)
    return runs


def round_order(modes: list[str], k: int) -> list[str]:
    """The order of the modes in round ``k``: rotated by ``k // 2``, reversed in odd rounds. Any two
    rounds 2j and 2j + 1 run each pair of modes once each way round and give every mode the same
    mean place, so that what a place costs (a machine that speeds up or slows down over a round,
    the engines' state that the mode before leaves) falls on every mode alike; by rotation alone,
    two rounds of five modes ran ``auto`` right after ``relay`` both times."""
    shift = (k // 2) % len(modes) if modes else 0
    order = modes[shift:] + modes[:shift]
    return order[::-1] if k % 2 else order


def learning_requests(s: BenchSettings, concurrency: int) -> int:
    """Generations an ``auto`` mode runs at a level before the rounds (``BenchSettings.auto_learn``)."""
    return max(16, s.auto_learn * concurrency)


def learn_auto(
    found: dict[str, Target], s: BenchSettings, problems: list[Problem], progress: bool, sampling: str
) -> dict[str, int]:
    """Every ``auto`` mode runs ``learning_requests`` generations at each level, not measured (the
    seeds of a round that is not measured); a mode its app refuses (every one failed) stops at
    once; none with ``auto_learn`` 0. Returns the generations that each mode ran."""
    from tqdm import tqdm

    learners = {mode: t for mode, t in found.items() if t.model == "auto"}
    ran = dict.fromkeys(learners, 0)
    if not s.auto_learn:
        return ran
    with tqdm(total=len(learners) * len(s.concurrency), desc=f"auto learns ({sampling})", disable=not progress) as bar:
        for mode, t in learners.items():
            for c in s.concurrency:
                chosen = [problems[i % len(problems)] for i in range(learning_requests(s, c))]
                results, _ = asyncio.run(fire(t.base, _bodies(s, mode, t.model, chosen, s.rounds, sampling), c))
                ran[mode] += len(results)
                bar.update(1)
                if all("_error" in r for r in results):
                    break
    return ran


def variant_rounds(
    cfg: AppConfig, s: BenchSettings, problems: list[Problem], port: int, progress: bool
) -> list[RunMetrics]:
    """Each variant: its app deployed beside the default one (its name as route prefix), and
    ``s.rounds`` rounds of the two relays interleaved; then the variant app goes (one at a time:
    two apps are four engines)."""
    from ray import serve

    from relay_serve.app.local import start

    runs = []
    base = start(cfg, port=port)
    try:
        for v in variants(s):
            variant = cfg.model_copy(deep=True, update={"name": v.mode, "route_prefix": f"/{v.mode}"})
            variant.router = variant.router.model_copy(update=v.router)
            variant.large = variant.large.model_copy(update=v.models)
            variant.small = variant.small.model_copy(update=v.models)
            pair = {
                f"relay-beside-{v.mode}": Target(base=base, model="relay"),
                v.mode: Target(base=start(variant, port=port), model="relay"),
            }
            for sampling in s.sampling:
                runs += rounds(pair, s, problems, progress, desc=v.mode, sampling=sampling)
            serve.delete(variant.name)
    finally:
        serve.delete(cfg.name)
    return runs


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU, Python {platform.python_version()}"


def run_bench(
    s: BenchSettings, out: Path, cfg: AppConfig | None = None, progress: bool = True, command: str = "relay-serve bench"
) -> BenchReport:
    import httpx
    import ray
    from ray import serve

    from relay_serve.bench.render import markdown, plots
    from relay_serve.client import api_headers
    from relay_serve.cluster import free_port, init_ray
    from relay_serve.eval.datasets import load_problems

    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M")
    cfg = (cfg or default_pair()).model_copy(deep=True)
    problems = load_problems(s.dataset, max(s.requests(c) for c in s.concurrency), seed=s.seed)
    init_ray(cfg.env_vars)
    port = free_port()
    try:
        if s.calibrate:
            cfg.cues.store_uri = (out / "cues").absolute().as_uri()
            calibrate(cfg, out, progress)
        with targets(cfg, s, out, port) as found:
            cues = httpx.get(found["relay"].base + "/v1/relay/cues", headers=api_headers(), timeout=30).json()
            runs = [run for sampling in s.sampling for run in rounds(found, s, problems, progress, sampling=sampling)]
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
        pair=PairInfo(
            large=cfg.large.model, small=cfg.small.model, cue_set_version=cues.get("version"), cues=cues.get("cues", [])
        ),
        levels=[
            level_report(c, [r for r in runs if r.concurrency == c and r.sampling == p])
            for p in s.sampling
            for c in s.concurrency
        ],
        runs=runs,
        variants={v.mode: v.label for v in variants(s)},
    )
    (out / "bench.json").write_text(report.model_dump_json(indent=2) + "\n")
    (out / "bench.md").write_text(markdown(report))
    plots(report, out)
    return report


def summary_lines(report: BenchReport) -> list[str]:
    """One JSON line per sampling profile (the last lines of ``relay-serve bench --json``)."""
    return [json.dumps(summary) for summary in report.summaries()]
