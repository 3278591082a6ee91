"""``relay-serve eval``: pass@1 of one mode on a dataset, through the service's HTTP API (a running
server, or an app it starts itself), with per-problem records, a summary table and a JSON line.
Also the answer-stage agreement check: the large model's reasoning, answered by each model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
from pydantic import BaseModel, Field, model_validator

from relay_serve.client import RequestFailed, chat_body, http_client, post_chat
from relay_serve.config import PaperSampling
from relay_serve.eval.datasets import Problem, load_problems
from relay_serve.eval.grading import (
    THINK_CLOSE,
    answer_part,
    extracted,
    is_correct,
    same_answer,
)


class EvalSettings(PaperSampling):
    dataset: str = "toy"
    mode: str = "relay"
    n: int | None = 100
    samples: int = 1
    seed: int = 0
    max_tokens: int = 512
    concurrency: int = 16
    cues: list[str] | None = Field(
        None, description="relay only: these cues instead of the service's active set (ablations)"
    )

    @model_validator(mode="after")
    def _cues_for_relay(self) -> EvalSettings:
        if self.cues is not None and self.mode != "relay":
            raise ValueError("cues apply to the relay mode only")
        return self


class EvalSummary(BaseModel):
    dataset: str
    mode: str
    n: int
    samples: int
    pass_at_1: float
    small_token_share: float
    switches_per_request: float
    mean_latency_s: float
    errors: int = 0
    cues: list[str] | None = Field(None, description="relay: the cues its requests handed off on (the most common set)")
    records: str


@contextlib.contextmanager
def service(url: str | None) -> Iterator[str]:
    """``url`` as given, or the embedded default app started (and stopped) here."""
    if url:
        yield url.rstrip("/").removesuffix("/v1")
        return
    import ray
    from ray import serve

    from relay_serve.app.local import start
    from relay_serve.cluster import free_port
    from relay_serve.config import AppConfig

    base = start(AppConfig(), port=free_port())
    try:
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()


async def _run_samples(base: str, s: EvalSettings, problems: list[Problem], sink, progress: bool) -> list[dict]:
    """Every sample of every problem; each record goes to ``sink`` (a text file) as it completes,
    so an interrupted run keeps what it finished. A failed request is a record with ``error``."""
    from tqdm import tqdm

    sem = asyncio.Semaphore(s.concurrency)
    jobs = [(p, k) for p in problems for k in range(s.samples)]
    bar = tqdm(total=len(jobs), desc=f"eval {s.mode}", disable=not progress)

    async def one(client, p: Problem, k: int) -> dict:
        body = chat_body(
            s.mode,
            p.problem,
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed * 1000 + k,
            relay_cues=s.cues,
        )
        async with sem:
            t0 = time.perf_counter()
            try:
                resp = await post_chat(client, base, body)
            except (RequestFailed, httpx.HTTPError) as e:
                resp = None
                error = f"{type(e).__name__}: {e}"
            latency = time.perf_counter() - t0
        bar.update(1)
        if resp is None:
            return _emit(sink, {"id": p.id, "sample": k, "answer": p.answer, "correct": False, "error": error})
        text = resp["choices"][0]["message"]["content"]
        relay = resp["usage"]["relay"]
        return _emit(
            sink,
            {
                "id": p.id,
                "sample": k,
                "answer": p.answer,
                "extracted": extracted(text),
                "correct": is_correct(text, p.answer),
                "latency_s": round(latency, 4),
                "completion_tokens": resp["usage"]["completion_tokens"],
                "large_tokens": relay["large_tokens"],
                "small_tokens": relay["small_tokens"],
                "switches": relay["switches"],
                "cue_set_version": relay["cue_set_version"],
                "cues": relay.get("cues", []),
                "finish_reason": resp["choices"][0]["finish_reason"],
                "text": text,
            },
        )

    async with http_client(600) as client:
        try:
            return await asyncio.gather(*(one(client, p, k) for p, k in jobs))
        finally:
            bar.close()


def _emit(sink, record: dict) -> dict:
    sink.write(json.dumps(record) + "\n")
    sink.flush()
    return record


def summarize(s: EvalSettings, records: list[dict], path: str) -> EvalSummary:
    """pass@1 over every sample (a failed request counts as wrong); token statistics over the
    requests that returned."""
    by_problem: dict[str, list[bool]] = {}
    for r in records:
        by_problem.setdefault(r["id"], []).append(r["correct"])
    ok = [r for r in records if "error" not in r]
    completion = sum(r["completion_tokens"] for r in ok)
    return EvalSummary(
        dataset=s.dataset,
        mode=s.mode,
        n=len(by_problem),
        samples=s.samples,
        pass_at_1=round(statistics.fmean(statistics.fmean(v) for v in by_problem.values()), 4),
        small_token_share=round(sum(r["small_tokens"] for r in ok) / max(1, completion), 4),
        switches_per_request=round(statistics.fmean(r["switches"] for r in ok), 3) if ok else 0.0,
        mean_latency_s=round(statistics.fmean(r["latency_s"] for r in ok), 4) if ok else 0.0,
        errors=len(records) - len(ok),
        cues=_most_common_cues(ok) if s.mode == "relay" else None,
        records=path,
    )


def _most_common_cues(records: list[dict]) -> list[str] | None:
    sets = Counter(tuple(r.get("cues", ())) for r in records)
    return list(sets.most_common(1)[0][0]) if sets else None


def run_eval(s: EvalSettings, url: str | None, out: Path, progress: bool = True) -> EvalSummary:
    problems = load_problems(s.dataset, s.n, seed=s.seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    with service(url) as base, out.open("w") as sink:
        records = asyncio.run(_run_samples(base, s, problems, sink, progress))
    return summarize(s, records, str(out))


def table(summary: EvalSummary) -> str:
    rows = [
        ("dataset", summary.dataset),
        ("mode", summary.mode),
        ("problems", summary.n),
        ("samples", summary.samples),
        ("pass@1", f"{summary.pass_at_1:.4f}"),
        ("small token share", f"{summary.small_token_share:.4f}"),
        ("switches / request", f"{summary.switches_per_request:.3f}"),
        ("mean latency", f"{summary.mean_latency_s:.3f} s"),
        ("failed requests", summary.errors),
        ("records", summary.records),
    ]
    if summary.cues is not None:
        rows.insert(2, ("cues", ", ".join(summary.cues) or "(none)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---- answer-stage agreement ---------------------------------------------------------------------


class AgreementSummary(BaseModel):
    dataset: str
    n: int
    agreement: float
    large_correct: float
    small_correct: float
    records: str


async def _agreement(base: str, problems: list[Problem], s: EvalSettings, sink, progress: bool) -> list[dict]:
    from tqdm import tqdm

    from relay_serve.config import AppConfig
    from relay_serve.tokenizer import load_codec

    sem = asyncio.Semaphore(s.concurrency)
    bar = tqdm(total=len(problems), desc="answer agreement", disable=not progress)
    codec = load_codec(AppConfig().large.tokenizer_path)

    async def one(client, p: Problem) -> dict:
        async with sem:
            think = await post_chat(
                client,
                base,
                chat_body("large", p.problem, stop=[THINK_CLOSE], max_tokens=s.max_tokens, temperature=0.0),
            )
            reasoning = think["choices"][0]["message"]["content"] + THINK_CLOSE
            prompt = codec.render_chat([{"role": "user", "content": p.problem}]) + reasoning
            answers = {}
            for model in ("large", "small"):
                r = await client.post(
                    base + "/v1/completions",
                    json={"model": model, "prompt": prompt, "max_tokens": 128, "temperature": 0.0},
                )
                r.raise_for_status()
                answers[model] = THINK_CLOSE + r.json()["choices"][0]["text"]
        bar.update(1)
        return _emit(
            sink,
            {
                "id": p.id,
                "answer": p.answer,
                "large_answer": answer_part(answers["large"]),
                "small_answer": answer_part(answers["small"]),
                "agree": same_answer(answers["large"], answers["small"]),
                "large_correct": is_correct(answers["large"], p.answer),
                "small_correct": is_correct(answers["small"], p.answer),
            },
        )

    async with http_client(600) as client:
        try:
            return await asyncio.gather(*(one(client, p) for p in problems))
        finally:
            bar.close()


def run_agreement(s: EvalSettings, url: str | None, out: Path, progress: bool = True) -> AgreementSummary:
    problems = load_problems(s.dataset, s.n, seed=s.seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    with service(url) as base, out.open("w") as sink:
        records = asyncio.run(_agreement(base, problems, s, sink, progress))
    n = len(records)
    return AgreementSummary(
        dataset=s.dataset,
        n=n,
        agreement=round(sum(r["agree"] for r in records) / n, 4),
        large_correct=round(sum(r["large_correct"] for r in records) / n, 4),
        small_correct=round(sum(r["small_correct"] for r in records) / n, 4),
        records=str(out),
    )
