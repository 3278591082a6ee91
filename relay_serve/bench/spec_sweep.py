"""Speculative decoding on the pair, in one vLLM engine: which draft length to serve, and what
the engine can run.

    python -m relay_serve.bench.spec_sweep [--model toy:large-wide] [--draft toy:small] [--ks 0,2,4,8,12] \
        [--batch 1,8,32,64] [--n 64] [--max-tokens 256] [--no-sampled] [--no-resumable] [--json]

For each draft length k (0: no speculation; the small model is the draft model, ``draft_model``),
the large model's offline engine (its serving engine arguments and environment) writes greedy
answers to ``--n`` toy problems at each batch size: output tokens a second, the mean acceptance
length (tokens a speculative step writes, vLLM's spec-decode statistics), the share of texts
identical to k=0's and pass@1. Then, at the largest batch, the same problems sampled (temperature
0.6, top_p 0.95; top_k is left out: it kills a speculative vLLM-CPU engine) for pass@1. Last, in
a process of its own (it may kill its engine), whether a resumable request (vLLM's streaming
input, what relay-serve uses without speculation) survives a pause on a speculative engine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from pydantic import BaseModel, Field

SAMPLED = {"temperature": 0.6, "top_p": 0.95}


class BatchFigures(BaseModel):
    batch: int
    tok_s: float
    acceptance_length: float | None = Field(
        description="mean tokens a speculative step wrote; None without speculation"
    )
    same_text_as_k0: float = Field(description="share of the answers identical to the engine's without speculation")
    pass_at_1: float


class DraftLength(BaseModel):
    k: int
    batches: list[BatchFigures]
    sampled_pass_at_1: float | None = Field(None, description="temperature 0.6, top_p 0.95, at the largest batch")
    sampled_tokens: int | None = None


class SweepReport(BaseModel):
    model: str
    draft: str
    problems: int
    ks: list[DraftLength]
    resumable: str = Field(description="what a resumable request did on a speculative engine")

    def best_k(self, batch: int, tolerance: float = 0.02) -> int:
        """The draft length to serve at a batch size: of the exact ones (every greedy text as without
        speculation), the shortest within ``tolerance`` of the fastest (a longer draft costs more
        compute for the same speed, which a busier engine feels first)."""

        def speed(d: DraftLength) -> float:
            return next(b for b in d.batches if b.batch == batch).tok_s

        exact = [d for d in self.ks if next(b for b in d.batches if b.batch == batch).same_text_as_k0 == 1.0]
        top = max(speed(d) for d in exact)
        return min(d.k for d in exact if speed(d) >= (1 - tolerance) * top)

    def schedule(self) -> list[list[int]]:
        """vLLM's ``num_speculative_tokens_per_batch_size`` from the sweep: from each measured batch
        size to the next, the draft length chosen there (0: no speculation at that load); ranges
        with the same k merged."""
        sizes = sorted(b.batch for b in self.ks[0].batches)
        ends = [n - 1 for n in sizes[1:]] + [1 << 16]
        out: list[list[int]] = []
        for lo, hi in zip(sizes, ends, strict=False):
            k = self.best_k(lo)
            if out and out[-1][2] == k:
                out[-1][1] = hi
            else:
                out.append([lo, hi, k])
        out[0][0] = 1
        return out

    def table(self) -> str:
        batches = [b.batch for b in self.ks[0].batches]
        head = " | ".join(f"batch {b}: tok/s (x k=0), acceptance, same text" for b in batches)
        lines = [
            f"{self.model} with {self.draft} as its draft model, {self.problems} toy problems, greedy:",
            "",
            f"| k | {head} | greedy pass@1 | sampled pass@1 (tokens) |",
            "|---|" + "---|" * len(batches) + "---|---|",
        ]
        base = {b.batch: b.tok_s for b in self.ks[0].batches}
        for d in self.ks:
            cells = " | ".join(
                f"{b.tok_s:g} ({b.tok_s / base[b.batch]:.2f}x), "
                f"{b.acceptance_length if b.acceptance_length is None else round(b.acceptance_length, 2)}, "
                f"{b.same_text_as_k0:.2f}"
                for b in d.batches
            )
            sampled = "-" if d.sampled_pass_at_1 is None else f"{d.sampled_pass_at_1:.3f} ({d.sampled_tokens})"
            lines.append(f"| {d.k} | {cells} | {d.batches[0].pass_at_1:.3f} | {sampled} |")
        lines += [
            "",
            "k to serve (the shortest exact one within 2% of the fastest): "
            + ", ".join(f"batch {b}: {self.best_k(b)}" for b in batches),
            f"As a schedule (speculative_config.num_speculative_tokens_per_batch_size): {json.dumps(self.schedule())}",
            "",
            f"Resumable request: {self.resumable}",
        ]
        return "\n".join(lines)


def _engine(model: str, draft: str, k: int):
    from relay_serve.config import ModelSettings, resolve_model
    from relay_serve.engine.vllm_engine import OfflineEngine

    m = ModelSettings(model=model)
    args = m.resolved_engine_args
    if k:
        args["speculative_config"] = {
            "method": "draft_model",
            "model": resolve_model(draft),
            "num_speculative_tokens": k,
        }
    return OfflineEngine(m.model_path, {**args, "disable_log_stats": False})


def _accepted(engine) -> tuple[float, float]:
    found = {m.name: m for m in engine.llm.get_metrics()}
    drafts = found.get("vllm:spec_decode_num_drafts")
    accepted = found.get("vllm:spec_decode_num_accepted_tokens")
    return (float(drafts.value) if drafts else 0.0), (float(accepted.value) if accepted else 0.0)


def sweep_k(
    model: str,
    draft: str,
    k: int,
    batches: list[int],
    prompts: list[list[int]],
    answers: list[str],
    max_tokens: int,
    sampled: bool,
    reference: dict[int, list[str]] | None,
) -> tuple[DraftLength, dict[int, list[str]]]:
    from relay_serve.config import ModelSettings
    from relay_serve.eval.grading import is_correct
    from relay_serve.tokenizer import load_codec

    codec = load_codec(ModelSettings(model=model).tokenizer_path)
    texts: dict[int, list[str]] = {}
    figures = []
    with _engine(model, draft, k) as engine:
        engine.generate(prompts[:2], max_tokens=8)  # warm up
        for b in batches:
            d0, a0 = _accepted(engine)
            t0 = time.perf_counter()
            out = [
                ids
                for i in range(0, len(prompts), b)
                for ids in engine.generate(prompts[i : i + b], max_tokens=max_tokens)
            ]
            wall = time.perf_counter() - t0
            d1, a1 = _accepted(engine)
            texts[b] = [codec.decode(ids) for ids in out]
            same = reference[b] if reference is not None else texts[b]
            figures.append(
                BatchFigures(
                    batch=b,
                    tok_s=round(sum(len(ids) for ids in out) / wall, 1),
                    acceptance_length=1 + (a1 - a0) / (d1 - d0) if d1 > d0 else None,
                    same_text_as_k0=round(sum(x == y for x, y in zip(texts[b], same, strict=False)) / len(same), 4),
                    pass_at_1=round(
                        sum(is_correct(t, a) for t, a in zip(texts[b], answers, strict=True)) / len(answers), 4
                    ),
                )
            )
        result = DraftLength(k=k, batches=figures)
        if sampled:
            b = max(batches)
            out = [
                ids
                for i in range(0, len(prompts), b)
                for ids in engine.generate(prompts[i : i + b], max_tokens=max_tokens, seed=0, **SAMPLED)
            ]
            result.sampled_pass_at_1 = round(
                sum(is_correct(codec.decode(ids), a) for ids, a in zip(out, answers, strict=True)) / len(answers), 4
            )
            result.sampled_tokens = sum(len(ids) for ids in out)
    return result, texts


RESUMABLE_PROBE = """
import asyncio, sys
from relay_serve.bench.spec_sweep import resumable_probe
print("RESULT", asyncio.run(resumable_probe(sys.argv[1], sys.argv[2], int(sys.argv[3]))), flush=True)
"""


async def resumable_probe(model: str, draft: str, k: int) -> str:
    """One relay-like resumable segment with a pause (a sentence stop) on a speculative engine."""
    from relay_serve.config import ModelSettings, resolve_model
    from relay_serve.engine.session import EngineSession
    from relay_serve.engine.stops import PauseTokens
    from relay_serve.engine.vllm_engine import VLLMEngine
    from relay_serve.protocol import SamplingSettings, SegmentRequest
    from relay_serve.relay.text import SENTENCE_STOPS
    from relay_serve.tokenizer import load_codec
    from relay_serve.toy.world import ToyWorld

    m = ModelSettings(model=model)
    spec = {"method": "draft_model", "model": resolve_model(draft), "num_speculative_tokens": k}
    engine = VLLMEngine(m.model_path, m.tokenizer_path, {**m.engine_args, "speculative_config": spec})
    engine._resumable = True  # what relay-serve refuses to do: try it
    codec = load_codec(m.tokenizer_path)
    prompt = codec.encode(
        codec.render_chat([{"role": "user", "content": ToyWorld().sample_heldout(1, seed=3)[0].prompt}])
    )
    session = EngineSession(engine, "probe", PauseTokens(engine.token_texts()))
    req = SegmentRequest(
        model="large",
        prompt_token_ids=prompt,
        max_tokens=64,
        stop=list(SENTENCE_STOPS),
        session_id="probe",
        sampling=SamplingSettings(temperature=0.0),
        resume=True,
    )
    try:
        out = [c async for c in session.segment(req, stream=False)][-1]
        return f"works ({len(out.token_ids)} tokens, {out.pauses} pauses)"
    except Exception as e:  # noqa: BLE001 - what the probe reports
        return f"fails: {type(e).__name__}: {e}"
    finally:
        engine.shutdown()


def probe_resumable(model: str, draft: str, k: int) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", RESUMABLE_PROBE, model, draft, str(k)], capture_output=True, text=True, timeout=600
    )
    result = next((line[len("RESULT ") :] for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result is not None and result.startswith("fails"):
        cause = next(
            (line.split("] ", 1)[-1] for line in proc.stderr.splitlines() if "Error" in line and "core.py" in line), ""
        )
        assert_line = next(
            (line.split("] ", 1)[-1].strip() for line in proc.stderr.splitlines() if "assert " in line), ""
        )
        return f"{result}; the engine core died: {assert_line or cause}".strip()
    return result or f"the probe ended with status {proc.returncode} and no result"


def run(
    model: str, draft: str, ks: list[int], batches: list[int], n: int, max_tokens: int, sampled: bool, resumable: bool
) -> SweepReport:
    from relay_serve.config import ModelSettings
    from relay_serve.eval.datasets import load_problems
    from relay_serve.tokenizer import load_codec

    codec = load_codec(ModelSettings(model=model).tokenizer_path)
    problems = load_problems("toy", n, seed=5)
    prompts = [codec.encode(codec.render_chat([{"role": "user", "content": p.problem}])) for p in problems]
    answers = [p.answer for p in problems]
    ks = sorted(set([0, *ks]))
    reference = None
    found = []
    for k in ks:
        d, texts = sweep_k(model, draft, k, batches, prompts, answers, max_tokens, sampled, reference)
        reference = reference or texts
        found.append(d)
        print(
            f"k={k}: " + ", ".join(f"batch {b.batch} {b.tok_s} tok/s" for b in d.batches), file=sys.stderr, flush=True
        )
    probe = probe_resumable(model, draft, max(ks)) if resumable and max(ks) > 0 else "not tried"
    return SweepReport(model=model, draft=draft, problems=n, ks=found, resumable=probe)


def main(argv: list[str] | None = None) -> None:
    from relay_serve import envs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="toy:large-wide")
    p.add_argument("--draft", default="toy:small")
    p.add_argument("--ks", default="0,2,4,8,12", help="draft lengths (0 is always measured: the reference)")
    p.add_argument("--batch", default="1,8,32,64", help="batch sizes")
    p.add_argument("--n", type=int, default=64, help="toy problems (at least the largest batch)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--no-sampled", action="store_true", help="skip the sampled pass@1")
    p.add_argument("--no-resumable", action="store_true", help="skip the resumable-request probe")
    p.add_argument("--json", action="store_true", help="the report as the last line, one JSON object")
    args = p.parse_args(argv)
    envs.route_vllm_logs_to_stderr()
    for key, value in {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": "1",
    }.items():  # as the model deployments run
        os.environ.setdefault(key, value)
    report = run(
        args.model,
        args.draft,
        [int(k) for k in args.ks.split(",")],
        [int(b) for b in args.batch.split(",")],
        args.n,
        args.max_tokens,
        not args.no_sampled,
        not args.no_resumable,
    )
    print(report.model_dump_json() if args.json else report.table(), flush=True)


if __name__ == "__main__":
    main()
