"""What the look-ahead inside the engine costs the engine's steps (``engine/vllm_swaps.py``).

    python -m relay_serve.bench.swaps [--model toy:large-wide] [--batch 8] [--runs 8] [--json]

One vLLM engine (the model's serving engine arguments, its spare token ids), ``--batch`` resumable
requests at a time, each one chunk from a toy problem's prompt to its end under the paper's
sampling: with the stand-ins of the sentence stops and the cues on every request (the logits
processor masks each row's stand-ins and looks up its last token at every step; the triggers are
spare ids, so no swap changes the text and both ways write the same tokens), and without (the
processor has no row), the two interleaved ``--runs`` times. Prints output tokens a second each
way and the difference a step.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from pydantic import BaseModel

CUES = ("Thus,", "Therefore,", "So,", "Hence,")


class SwapsReport(BaseModel):
    model: str
    batch: int
    runs: int
    triggers: int
    standins: int
    tok_s_without: list[float]
    tok_s_with: list[float]

    @property
    def step_overhead_ms(self) -> float:
        """The median step's time with the swaps over without, in ms (a step writes ``batch`` tokens)."""
        without, with_ = statistics.median(self.tok_s_without), statistics.median(self.tok_s_with)
        return round(1000 * self.batch * (1 / with_ - 1 / without), 3)

    def table(self) -> str:
        return "\n".join(
            [
                f"{self.model}, batch {self.batch}, {self.runs} runs each way, interleaved; swaps: {self.triggers} "
                f"triggers, {self.standins} stand-ins",
                "",
                "| requests | output tok/s, median [min-max] |",
                "|---|---|",
                f"| without swaps | {_spread(self.tok_s_without)} |",
                f"| with swaps on every request | {_spread(self.tok_s_with)} |",
                "",
                f"a step with the swaps takes {self.step_overhead_ms} ms more (median runs)",
            ]
        )


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"


async def _measure(model: str, batch: int, runs: int) -> SwapsReport:
    from relay_serve.config import ModelSettings
    from relay_serve.engine.stops import PauseIds, PauseTokens
    from relay_serve.engine.vllm_engine import VLLMEngine
    from relay_serve.eval.datasets import load_problems
    from relay_serve.protocol import SamplingSettings
    from relay_serve.relay.text import SENTENCE_STOPS
    from relay_serve.tokenizer import load_codec

    m = ModelSettings(model=model)
    engine = VLLMEngine(m.model_path, m.tokenizer_path, m.engine_args, spare_ids=m.resolved_spare_token_ids)
    try:
        codec = load_codec(m.tokenizer_path)
        prompts = [
            codec.encode(codec.render_chat([{"role": "user", "content": p.problem}]))
            for p in load_problems("toy", batch, seed=3)
        ]
        found = PauseTokens(engine.token_texts(), spare_ids=engine.spare_ids())
        stops = found.ids((*SENTENCE_STOPS, *CUES, "</think>"), frozenset(CUES))
        # the same stand-ins and completing tokens after triggers the model never writes (spare ids that
        # stand in for nothing): every step masks each row's stand-ins and looks its last token up, as in
        # service, and no swap changes what a request writes (a swap is a few index operations once a stop)
        never = [i for i in engine.spare_ids() if i not in stops.real]
        swapped = PauseIds([], swaps=dict(zip(never, stops.swaps.values(), strict=False)))
        if not stops.swaps or len(never) < len(stops.swaps):
            raise SystemExit(f"{model}: too few spare ids ({len(engine.spare_ids())}) for the stops' swaps")
        sampling = SamplingSettings(temperature=0.6, top_p=0.95, top_k=20)

        async def one(k: int, pauses: PauseIds, tag: str) -> int:
            request = engine.resumable(f"{tag}-{k}")
            try:
                seeded = sampling.model_copy(update={"seed": k})
                return sum([len(out.token_ids) async for out in request.chunk(prompts[k], 256, pauses, seeded)])
            finally:
                await request.close()

        async def run(pauses: PauseIds, tag: str) -> float:
            t = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(k, pauses, tag) for k in range(batch))))
            return round(tokens / (time.perf_counter() - t), 1)

        await run(PauseIds([]), "warm")
        without, with_ = [], []
        for r in range(runs):
            without.append(await run(PauseIds([]), f"n{r}"))
            with_.append(await run(swapped, f"s{r}"))
        return SwapsReport(
            model=model,
            batch=batch,
            runs=runs,
            triggers=len(swapped.swaps),
            standins=len(swapped.real),
            tok_s_without=without,
            tok_s_with=with_,
        )
    finally:
        engine.shutdown()


def run(model: str = "toy:large-wide", batch: int = 8, runs: int = 8) -> SwapsReport:
    return asyncio.run(_measure(model, batch, runs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="toy:large-wide", help="a model reference (toy:large-wide, a path, a hub id)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--json", action="store_true", help="the report as one JSON line")
    args = p.parse_args(argv)
    from relay_serve import envs

    envs.route_vllm_logs_to_stderr()
    report = run(args.model, args.batch, args.runs)
    print(report.model_dump_json() if args.json else report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
