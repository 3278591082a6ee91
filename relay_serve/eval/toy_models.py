"""Evaluate the toy pair through vLLM: greedy accuracy, well-formedness, the small model's cue
margins on large-model traces, and per-token decode time."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

from pydantic import BaseModel

from relay_serve.toy.world import THINK_CLOSE, ToyWorld

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
TOY_ENGINE_ARGS = {
    "max_model_len": 1024,
    "enforce_eager": True,
    "dtype": "float32",
    "max_num_seqs": 256,
    "block_size": 32,
}


class ToyEvalResult(BaseModel):
    model: str
    n: int
    accuracy: float
    well_formed: float
    seconds: float
    output_tokens: int

    def summary(self) -> dict:
        return {"model": self.model, "n": self.n, "accuracy": self.accuracy, "well_formed": self.well_formed}

    def table(self) -> str:
        return (
            f"model {self.model}  n={self.n}  accuracy={self.accuracy:.3f}  well_formed={self.well_formed:.3f}  "
            f"({self.output_tokens} tokens in {self.seconds:.1f} s)"
        )


def grade(text: str, answer: str) -> tuple[bool, bool]:
    """(well formed, correct): a </think>, then a \\boxed{} after it, holding the answer."""
    _, closed, after = text.partition(THINK_CLOSE)
    m = BOXED.search(after) if closed else None
    return m is not None, m is not None and m.group(1).strip() == answer


def model_path(name: str, models_dir: Path | None = None) -> str:
    """A toy model's folder: ``name`` in ``models_dir``, else the package's (``large-wide`` is
    generated on first use)."""
    if models_dir is not None:
        return str(models_dir / name)
    from relay_serve.config import resolve_model

    return resolve_model(f"toy:{name}")


def _engine(name: str, models_dir: Path | None):
    from relay_serve.engine.vllm_engine import OfflineEngine

    return OfflineEngine(model_path(name, models_dir), TOY_ENGINE_ARGS)


def _prompts(world: ToyWorld, n: int, seed: int, models_dir: Path | None):
    from relay_serve.tokenizer import load_codec

    codec = load_codec(model_path("large", models_dir))
    problems = world.sample_heldout(n, seed=seed)
    ids = [codec.encode(codec.render_chat([{"role": "user", "content": p.prompt}])) for p in problems]
    return codec, problems, ids


def evaluate_model(
    name: str, n: int = 100, seed: int = 0, models_dir: Path | None = None, progress: bool = True
) -> ToyEvalResult:
    world = ToyWorld()
    codec, problems, prompts = _prompts(world, n, seed, models_dir)
    with _engine(name, models_dir) as engine:
        t0 = time.time()
        outs = engine.generate(prompts, max_tokens=256, progress=progress)
        seconds = time.time() - t0
    graded = [grade(codec.decode(o), world.answer(p)) for o, p in zip(outs, problems, strict=True)]
    return ToyEvalResult(
        model=name,
        n=n,
        accuracy=round(sum(c for _, c in graded) / n, 4),
        well_formed=round(sum(w for w, _ in graded) / n, 4),
        seconds=round(seconds, 2),
        output_tokens=sum(len(o) for o in outs),
    )


def cue_margins(n: int = 200, seed: int = 0, models_dir: Path | None = None, temperature: float = 1.0) -> dict:
    """The small model's mean margin after each toy cue, teacher-forced on traces the large model
    sampled (greedy traces never restate: the large model's likeliest next step is a new one)."""
    from relay_serve.calibration.margins import trace_margins
    from relay_serve.toy.world import EASY_CUES, HARD_CUES

    world = ToyWorld()
    codec, _, prompts = _prompts(world, n, seed, models_dir)
    with _engine("large", models_dir) as large:
        traces = large.generate(prompts, max_tokens=256, temperature=temperature, seed=seed)
    with _engine("small", models_dir) as small:
        rows = small.score([p + t for p, t in zip(prompts, traces, strict=True)], [len(p) for p in prompts])
    by_cue: dict[str, list[float]] = {}
    all_tokens: list[float] = []
    for trace, lps in zip(traces, rows, strict=True):
        m = trace_margins(codec, trace, lps, EASY_CUES + HARD_CUES)
        all_tokens += m.all_tokens
        for cue, values in m.by_cue.items():
            by_cue.setdefault(cue, []).extend(values)

    def mean(xs):
        return round(statistics.fmean(xs), 4) if xs else None

    easy = [v for c in EASY_CUES for v in by_cue.get(c, [])]
    hard = [v for c in HARD_CUES for v in by_cue.get(c, [])]
    return {
        "n": n,
        "temperature": temperature,
        "overall_mean": mean(all_tokens),
        "easy_mean": mean(easy),
        "hard_mean": mean(hard),
        "per_cue": {
            c: {"count": len(by_cue.get(c, [])), "mean": mean(by_cue.get(c, []))} for c in EASY_CUES + HARD_CUES
        },
    }


def decode_speed(
    name: str, batch: int, tokens: int = 128, models_dir: Path | None = None, engine=None, repeats: int = 3
) -> float:
    """Seconds per decode step (per token of one sequence) at a batch size, EOS ignored: the median
    of ``repeats`` timed runs after a warm-up."""
    world = ToyWorld()
    _, _, prompts = _prompts(world, batch, 0, models_dir)
    engine = engine or _engine(name, models_dir)
    engine.generate(prompts[:1], max_tokens=8, ignore_eos=True)  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.generate(prompts, max_tokens=tokens, ignore_eos=True)
        times.append((time.perf_counter() - t0) / tokens)
    return statistics.median(times)
