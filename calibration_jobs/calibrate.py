"""Cue calibration as a Ray job: the large model writes sampled traces, the small model scores them
teacher-forced, cues are selected from their margins, and the cue set goes to the store.

    python -m calibration_jobs.calibrate [--config PATH] [--store URI] [--num-prompts N]
        [--samples-per-prompt K] [--workers W] [--rule ci-above-overall|mean-above-overall] [--dry-run]

Locally it starts a Ray of its own; under ``ray job submit`` it joins the job's cluster. Stages:
traces -> scoring -> statistics -> selection -> publish, each timed, the first two fanned out over
Ray workers that each hold one engine, with progress bars. Nothing is published when a stage fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from relay_serve import envs
from relay_serve.calibration.cues import (
    CalibrationData,
    CueSet,
    SelectionRule,
    model_pair,
)
from relay_serve.config import AppConfig, ModelSettings

TOY = "toy"


class CalibrationConfig(BaseModel):
    """The job's settings (``--config`` YAML). Without one it calibrates the toy pair."""

    model_config = ConfigDict(extra="forbid")

    app: AppConfig = Field(
        default_factory=AppConfig,
        description="the pair, its engines and the cue store: inline, or the path of an app config YAML (relative to "
        "this file)",
    )
    dataset: str = Field(
        TOY, description="'toy' (training problems), 'gsm8k', 'math500' or 'jsonl:PATH' of {\"problem\": ...} lines"
    )
    num_prompts: int = Field(40, ge=1)
    samples_per_prompt: int = Field(4, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(512, ge=1)
    seed: int = 0
    candidates: list[str] | None = Field(
        None, description="default: the discourse-word pool (relay_serve/calibration/candidates.py)"
    )
    rule: SelectionRule = Field(default_factory=SelectionRule)
    workers: int = Field(1, ge=1, description="Ray workers per stage, each holding one engine")
    worker_num_cpus: float | None = Field(None, gt=0.0, description="default: the model deployment's num_cpus")
    worker_num_gpus: float | None = Field(None, ge=0.0, description="default: the model deployment's num_gpus")
    batch_size: int = Field(16, ge=1, description="prompts per Ray task")
    report_dir: str | None = Field(None, description="default: <state dir>/calibration/<version>")

    @classmethod
    def load(cls, path: str | None) -> CalibrationConfig:
        if path is None:
            return cls()
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the config must be a mapping")
        if isinstance(data.get("app"), str):  # the service's own config file, shared
            data["app"] = AppConfig.from_yaml(Path(path).parent / data["app"])
        return cls.model_validate(data)

    def actor_options(self, m: ModelSettings) -> dict[str, Any]:
        """Ray options of a worker holding ``m``'s engine: its deployment's CPUs, GPUs, custom
        resources and runtime env (so it lands where that model's replicas land)."""
        actor = m.deployment.ray_actor_options
        opts: dict[str, Any] = {
            "num_cpus": self.worker_num_cpus if self.worker_num_cpus is not None else actor.get("num_cpus", 1),
            "num_gpus": self.worker_num_gpus if self.worker_num_gpus is not None else actor.get("num_gpus", 0),
        }
        for key in ("resources", "runtime_env", "accelerator_type", "memory"):
            if actor.get(key):
                opts[key] = actor[key]
        return opts


# ---- prompts ------------------------------------------------------------------------------------


def calibration_prompts(cfg: CalibrationConfig) -> list[str]:
    from relay_serve.eval.datasets import DatasetError, calibration_problems

    try:
        return [p.problem for p in calibration_problems(cfg.dataset, cfg.num_prompts, seed=cfg.seed)]
    except DatasetError as e:
        raise ValueError(f"calibration dataset: {e}") from e


# ---- Ray workers --------------------------------------------------------------------------------


class _EngineWorker:
    """One engine in one Ray actor (trace writer or scorer)."""

    def __init__(self, model: dict[str, Any]) -> None:
        envs.route_vllm_logs_to_stderr()
        from relay_serve.engine.vllm_engine import OfflineEngine

        m = ModelSettings.model_validate(model)
        self.engine = OfflineEngine(m.model_path, m.resolved_engine_args)

    def traces(
        self, prompts: list[list[int]], k: int, max_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[list[int]]:
        expanded = [p for p in prompts for _ in range(k)]
        return self.engine.generate(expanded, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)

    def score(self, sequences: list[list[int]], starts: list[int]) -> list[list[list[float]]]:
        return self.engine.score(sequences, starts, top_k=2)

    def shutdown(self) -> None:
        self.engine.shutdown()


def _run_stage(name: str, workers, calls, progress: bool) -> list:
    """Run ``calls`` (one (method, args) per task) over ``workers`` round robin; results in order."""
    import ray
    from tqdm import tqdm

    refs = [getattr(workers[i % len(workers)], method).remote(*args) for i, (method, args) in enumerate(calls)]
    index = {r: i for i, r in enumerate(refs)}
    results: list = [None] * len(refs)
    pending = list(refs)
    with tqdm(total=len(refs), desc=name, unit="batch", disable=not progress, file=sys.stderr) as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                results[index[ref]] = ray.get(ref)
            bar.update(len(done))
    return results


# ---- the job ------------------------------------------------------------------------------------


class StageTimes(BaseModel):
    startup_s: float = 0.0
    traces_s: float = 0.0
    scoring_s: float = 0.0
    statistics_s: float = 0.0
    publish_s: float = 0.0


class CalibrationResult(BaseModel):
    cue_set: CueSet
    times: StageTimes
    published_uri: str | None
    report_json: str
    report_png: str
    paper_rule_selected: list[str]


def run(cfg: CalibrationConfig, dry_run: bool = False, progress: bool = True) -> CalibrationResult:
    """Traces, scoring, statistics and selection, report, publish: each stage timed."""
    from relay_serve.calibration.store import CueStore
    from relay_serve.tokenizer import check_pair

    times = StageTimes()
    codec = check_pair(cfg.app)
    store = None if dry_run else CueStore(cfg.app.cues.store_uri, cfg.app.cues.storage_options)
    prompts = [codec.encode(codec.render_chat([{"role": "user", "content": p}])) for p in calibration_prompts(cfg)]
    traces = _traces(cfg, prompts, times, progress)
    scored = _scores(cfg, prompts, traces, times, progress)
    t0 = time.time()
    cue_set, paper_selected = _select(cfg, codec, prompts, traces, scored)
    times.statistics_s = time.time() - t0

    from relay_serve.calibration.report import write_report

    report_dir = Path(cfg.report_dir) if cfg.report_dir else envs.state_dir() / "calibration" / cue_set.version
    report_json, report_png = write_report(cue_set, report_dir, paper_selected=paper_selected, times=times.model_dump())
    published = None
    if store is not None:
        t0 = time.time()
        report_uri = store.put_report(cue_set.version, [str(report_json), str(report_png)])
        published = store.publish(cue_set)  # LATEST moves last, after the report is in place
        times.publish_s = time.time() - t0
        report_json, report_png = f"{report_uri}/report.json", f"{report_uri}/margins.png"
    return CalibrationResult(
        cue_set=cue_set,
        times=times,
        published_uri=published,
        report_json=str(report_json),
        report_png=str(report_png),
        paper_rule_selected=paper_selected,
    )


def _workers(cfg: CalibrationConfig, model: ModelSettings, times: StageTimes) -> list:
    """``cfg.workers`` Ray actors holding ``model``'s engine, placed as its deployment's replicas."""
    import ray

    t0 = time.time()
    actor = ray.remote(_EngineWorker)
    workers = [
        actor.options(**cfg.actor_options(model)).remote(model.model_dump(mode="json")) for _ in range(cfg.workers)
    ]
    ray.get([w.__ray_ready__.remote() for w in workers])
    times.startup_s += time.time() - t0
    return workers


def _stop(workers: list) -> None:
    """Shut the workers' engines down (their engine-core processes with them), then the actors."""
    import ray

    ray.get([w.shutdown.remote() for w in workers])
    for w in workers:
        ray.kill(w)


def _traces(cfg: CalibrationConfig, prompts: list[list[int]], times: StageTimes, progress: bool) -> list[list[int]]:
    """The large model's ``samples_per_prompt`` sampled traces of every prompt, in order."""
    writers = _workers(cfg, cfg.app.large, times)
    t0 = time.time()
    batches = [prompts[i : i + cfg.batch_size] for i in range(0, len(prompts), cfg.batch_size)]
    calls = [
        ("traces", (b, cfg.samples_per_prompt, cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.seed + 1000 * i))
        for i, b in enumerate(batches)
    ]
    traces = [t for part in _run_stage("traces", writers, calls, progress) for t in part]
    times.traces_s = time.time() - t0
    _stop(writers)
    return traces


def _scores(
    cfg: CalibrationConfig, prompts: list[list[int]], traces: list[list[int]], times: StageTimes, progress: bool
) -> list:
    """The small model's top-2 log-probabilities at every token of every trace, teacher-forced."""
    scorers = _workers(cfg, cfg.app.small, times)
    t0 = time.time()
    expanded = [p for p in prompts for _ in range(cfg.samples_per_prompt)]
    seqs = [p + t for p, t in zip(expanded, traces, strict=True)]
    step = cfg.batch_size * cfg.samples_per_prompt
    calls = [
        ("score", (seqs[i : i + step], [len(p) for p in expanded[i : i + step]])) for i in range(0, len(seqs), step)
    ]
    scored = [r for part in _run_stage("scoring", scorers, calls, progress) for r in part]
    times.scoring_s = time.time() - t0
    _stop(scorers)
    return scored


def _select(
    cfg: CalibrationConfig, codec, prompts: list[list[int]], traces: list[list[int]], scored: list
) -> tuple[CueSet, list[str]]:
    """The candidates' margins after them, the selection by ``cfg.rule`` (and by the paper's, for
    the report), as a new cue set document."""
    from relay_serve.calibration.candidates import default_candidates
    from relay_serve.calibration.margins import trace_margins
    from relay_serve.calibration.select import select_cues

    candidates = cfg.candidates or default_candidates()
    by_cue: dict[str, list[float]] = {}
    all_tokens: list[float] = []
    for trace, rows in zip(traces, scored, strict=True):
        m = trace_margins(codec, trace, rows, candidates)
        all_tokens += m.all_tokens
        for cue, values in m.by_cue.items():
            by_cue.setdefault(cue, []).extend(values)
    if not all_tokens:
        raise RuntimeError("the traces hold no reasoning tokens: nothing to calibrate on")
    overall = sum(all_tokens) / len(all_tokens)
    table, selected = select_cues(by_cue, candidates, overall, cfg.rule)
    _, paper_selected = select_cues(
        by_cue, candidates, overall, cfg.rule.model_copy(update={"rule": "mean-above-overall"})
    )
    if not selected:
        raise RuntimeError("no candidate cue passed the selection rule; nothing to publish")
    cue_set = CueSet(
        version=datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6],
        pair=model_pair(cfg.app),
        candidates=table,
        overall_mean=overall,
        overall_count=len(all_tokens),
        selected=selected,
        rule=cfg.rule,
        data=CalibrationData(
            source=cfg.dataset,
            num_prompts=len(prompts),
            samples_per_prompt=cfg.samples_per_prompt,
            num_traces=len(traces),
            num_tokens=sum(len(t) for t in traces),
        ),
        created_at=datetime.now(UTC),
        job_id=_job_id(),
    )
    return cue_set, paper_selected


def _job_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_job_id()
    except Exception:  # noqa: BLE001 - not in a Ray job
        return None


def build_config(args: argparse.Namespace) -> CalibrationConfig:
    cfg = CalibrationConfig.load(args.config)
    updates: dict[str, Any] = {}
    for field in ("num_prompts", "samples_per_prompt", "workers", "seed"):
        if getattr(args, field) is not None:
            updates[field] = getattr(args, field)
    cfg = cfg.model_copy(update=updates)
    if args.rule is not None:
        cfg.rule = cfg.rule.model_copy(update={"rule": args.rule})
    if args.store is not None:
        cfg.app.cues.store_uri = args.store
    return CalibrationConfig.model_validate(cfg.model_dump())


def main(args: argparse.Namespace) -> int:
    from relay_serve.cluster import init_ray

    envs.route_vllm_logs_to_stderr()
    cfg = build_config(args)
    init_ray(cfg.app.env_vars, num_cpus=max(envs.num_cpus(), cfg.workers), log_to_driver=False)
    t0 = time.time()
    try:
        result = run(cfg, dry_run=args.dry_run, progress=not args.json)
    except Exception as e:  # noqa: BLE001 - the job fails with a message, nothing published
        print(f"calibration failed, nothing published: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    summary = {
        "version": result.cue_set.version,
        "selected": result.cue_set.selected,
        "paper_rule_selected": result.paper_rule_selected,
        "overall_mean": round(result.cue_set.overall_mean, 4),
        "margins": {
            s.cue: round(s.mean, 4)
            for s in result.cue_set.candidates
            if s.cue in result.cue_set.selected and s.mean is not None
        },
        "published": result.published_uri,
        "report": result.report_json,
        "plot": result.report_png,
        "times_s": {k: round(v, 2) for k, v in result.times.model_dump().items()},
        "wall_s": round(time.time() - t0, 2),
        "workers": cfg.workers,
        "traces": result.cue_set.data.num_traces,
    }
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="calibration config YAML (default: the toy pair)")
    p.add_argument("--store", help="cue store URI (default: the config's, else file://<state dir>/cues)")
    p.add_argument("--num-prompts", type=int, help="calibration prompts (default 40)")
    p.add_argument("--samples-per-prompt", type=int, help="sampled traces per prompt (default 4)")
    p.add_argument("--workers", type=int, help="Ray workers per stage (default 1)")
    p.add_argument("--seed", type=int)
    p.add_argument("--rule", choices=["ci-above-overall", "mean-above-overall"])
    p.add_argument("--dry-run", action="store_true", help="calibrate and report, publish nothing")
    p.add_argument("--json", action="store_true", help="one JSON line of results, no progress bars")
    return p


if __name__ == "__main__":
    sys.exit(main(parser().parse_args()))
