"""What a handoff costs inside one engine, by how the next segment reaches it.

    python -m relay_serve.bench.handoff [--model toy:large-wide] [--trials 12] [--small-tokens 9] [--json]

A relay handoff back to the large model: it wrote a stretch, the small model wrote a sentence of
``--small-tokens`` tokens, and the large model resumes. Measured on one vLLM engine (the model's
serving engine arguments and environment), the time from the resuming request's arrival to its
first token, against a decode step, when the resume is

- ``new request``: a new engine request over the whole context (the prefix cache holds the full
  KV blocks of what the engine saw; the rest of the last block and the sentence are computed again);
- ``resumable``: the generation's resumable request, fed the pending token and the sentence;
- ``resumable, pre-fed``: the same, fed the sentence but its last token while the small model was
  still writing (a chunk of its own), then that last token.

It also tries a KV block of 16 tokens (which would shrink what a new request computes again).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys

from pydantic import BaseModel


class ResumeCost(BaseModel):
    method: str
    ttft_ms_median: float
    ttft_ms_mean: float
    over_decode_step_ms: float
    recomputed_tokens: float


class HandoffReport(BaseModel):
    model: str
    small_tokens: int
    trials: int
    decode_step_ms: float
    methods: list[ResumeCost]
    block_16: str

    def table(self) -> str:
        lines = [
            f"{self.model}: decode step {self.decode_step_ms} ms; the small model's sentence: {self.small_tokens} "
            f"tokens; {self.trials} trials",
            "",
            "| resume by | time to first token, median (ms) | mean (ms) | over a decode step (ms) | prompt tokens "
            "computed again |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {m.method} | {m.ttft_ms_median} | {m.ttft_ms_mean} | {m.over_decode_step_ms} | {m.recomputed_tokens} |"
            for m in self.methods
        ]
        lines += ["", f"KV block of 16 tokens: {self.block_16}"]
        return "\n".join(lines)


async def _measure(
    model: str, trials: int, small_tokens: int, stretch: int = 40
) -> tuple[float, dict[str, list[tuple[float, int]]]]:
    from relay_serve.config import ModelSettings
    from relay_serve.engine.vllm_engine import VLLMEngine
    from relay_serve.protocol import SamplingSettings, SegmentRequest
    from relay_serve.tokenizer import load_codec
    from relay_serve.toy.world import ToyWorld

    m = ModelSettings(model=model)
    engine = VLLMEngine(m.model_path, m.tokenizer_path, m.engine_args)
    codec = load_codec(m.tokenizer_path)
    prompts = iter(
        codec.encode(codec.render_chat([{"role": "user", "content": p.prompt}]))
        for p in ToyWorld().sample_heldout(3 * trials + 1, seed=5)
    )
    rng = random.Random(0)
    vocab = len(engine.token_texts())
    greedy = SamplingSettings(temperature=0.0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(20, vocab) for _ in range(n)]

    async def plain(context: list[int], n: int):
        req = SegmentRequest(model="large", prompt_token_ids=context, max_tokens=n, sampling=greedy, session_id="h")
        return [c async for c in engine.generate(req, f"h-{rng.getrandbits(48)}", stream=False)][-1]

    async def chunk(request, feed: list[int], n: int):
        return [c async for c in request.chunk(feed, n, (), greedy)]

    results: dict[str, list[tuple[float, int]]] = {"new request": [], "resumable": [], "resumable, pre-fed": []}
    steps: list[float] = []
    try:
        await plain(next(prompts), 8)  # warm up
        for _ in range(trials):
            sentence = tokens(small_tokens)
            # a new request per segment: the stretch, then the whole context again
            context = next(prompts)
            first = await plain(context, stretch)
            resumed = await plain(context + first.token_ids + sentence, 4)
            results["new request"].append(
                (resumed.ttft_s, len(context) + len(first.token_ids) + small_tokens - resumed.cached_tokens)
            )
            steps.append(first.decode_s / first.decode_steps)
            for method in ("resumable", "resumable, pre-fed"):
                request = engine.resumable(f"h-{rng.getrandbits(48)}")
                outs = await chunk(request, next(prompts), stretch)
                pending = [outs[-1].token_ids[-1]]
                if method == "resumable":
                    feed = pending + sentence
                else:
                    await chunk(
                        request, pending + sentence[:-1], 1
                    )  # while the small model writes; its sample is dropped
                    feed = sentence[-1:]
                outs = await chunk(request, feed, 4)
                results[method].append((outs[-1].ttft_s, len(feed)))
                await request.close()
    finally:
        engine.shutdown()
    return statistics.median(steps), results


def _block_16(model: str) -> str:
    """Whether the engine starts with a KV block of 16 tokens (the error when it does not)."""
    from relay_serve.config import ModelSettings
    from relay_serve.engine.vllm_engine import OfflineEngine

    m = ModelSettings(model=model)
    try:
        engine = OfflineEngine(m.model_path, {**m.engine_args, "block_size": 16})
    except Exception as e:  # noqa: BLE001 - the refusal is the finding
        return f"refused: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    engine.shutdown()
    return "accepted"


def run(model: str = "toy:large-wide", trials: int = 12, small_tokens: int = 9) -> HandoffReport:
    from relay_serve.config import ModelSettings, default_cpu_engine_env

    env = (ModelSettings(model=model).deployment.ray_actor_options.get("runtime_env") or {}).get(
        "env_vars"
    ) or default_cpu_engine_env()
    for key, value in env.items():
        os.environ.setdefault(key, value)  # as the model's serving replica runs its engine
    step, results = asyncio.run(_measure(model, trials, small_tokens))
    methods = []
    for method, rows in results.items():
        ttft = [1000 * t for t, _ in rows]
        methods.append(
            ResumeCost(
                method=method,
                ttft_ms_median=round(statistics.median(ttft), 2),
                ttft_ms_mean=round(statistics.fmean(ttft), 2),
                over_decode_step_ms=round(statistics.median(ttft) - 1000 * step, 2),
                recomputed_tokens=round(statistics.fmean(n for _, n in rows), 1),
            )
        )
    return HandoffReport(
        model=model,
        small_tokens=small_tokens,
        trials=trials,
        decode_step_ms=round(1000 * step, 2),
        methods=methods,
        block_16=_block_16(model),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="toy:large-wide", help="a model reference (toy:large-wide, a path, a hub id)")
    p.add_argument("--trials", type=int, default=12)
    p.add_argument(
        "--small-tokens",
        type=int,
        default=9,
        help="tokens of the small model's sentence (the relay's mean on the toy pair)",
    )
    p.add_argument("--json", action="store_true", help="the report as one JSON line")
    args = p.parse_args(argv)
    from relay_serve import envs

    envs.route_vllm_logs_to_stderr()
    report = run(args.model, args.trials, args.small_tokens)
    print(report.model_dump_json() if args.json else report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
