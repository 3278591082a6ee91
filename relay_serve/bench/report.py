"""The benchmark's figures: per run (one mode at one concurrency in one round) from the responses
and the engines' own timings, then per concurrency over the rounds (median, min and max), as typed
models, a markdown report and plots. Pure: no HTTP, no Ray.

The speedup is a ratio of times per output token (the modes write different texts on the same
prompts): large's over relay's. Its *ideal* is the bound for the very run it is measured in: the
relay's time per token had each token cost only what its model's decode steps cost inside the
engines in that run (no handoff: no prefill of the other model's tokens, no wait for a first token,
no router). achieved / ideal is the relay's time per token in the engines' decode steps over its
time per token; a ratio above ``RATIO_LIMIT`` cannot be a result and is reported as a measurement
error.
"""

from __future__ import annotations

import hashlib
import statistics
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

RATIO_LIMIT = 1.05
MODELS = ("large", "small")
SPLIT = ("decode", "first_token", "handoffs", "router", "outside")  # a relay request's time, in order
SPEC = "+spec"  # a mode on the app whose large engine speculates (large+spec, relay+spec, auto+spec)
# relay (or auto) modes and the single-model mode on the same engines they are measured against
PAIRS = {"relay": "large", "relay+spec": "large+spec", "auto": "large", "auto+spec": "large+spec"}
# each auto mode and the fixed modes on the same engines it chooses between
AUTO_CHOICES = {"auto": ("relay", "large"), "auto+spec": ("relay+spec", "large+spec")}
# modes that write the same text under greedy sampling: engines with and without speculation, relay-serve and vLLM
SAME_TEXT = (("large", "large+spec"), ("relay", "relay+spec"), ("large", "vllm-large"))


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (linear interpolation), NaN when empty."""
    return float(np.quantile(values, q)) if values else float("nan")


class Spread(BaseModel):
    """A figure over the rounds."""

    median: float | None = None
    min: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: list[float | None], digits: int = 4) -> Spread:
        xs = [v for v in values if v is not None]
        if not xs:
            return cls()
        return cls(median=round(statistics.median(xs), digits), min=round(min(xs), digits), max=round(max(xs), digits))

    def text(self) -> str:
        if self.median is None:
            return "-"
        if self.min == self.max:
            return f"{self.median:g}"
        return f"{self.median:g} [{self.min:g}-{self.max:g}]"


class HandoffCost(BaseModel):
    """One model's segments after a handoff (every engine request of a relay generation but its
    first), inside the engine."""

    resumed_per_request: float = Field(
        description="engine requests of this model after the generation's first, per request"
    )
    ttft_ms: float | None = Field(None, description="mean time from the engine's receipt to the first token")
    decode_ms: float | None = Field(None, description="the model's decode step in the same run, for comparison")
    recomputed_tokens: float | None = Field(None, description="mean prompt tokens not served from the prefix cache")


class SpecStats(BaseModel):
    """A speculative engine's drafts during one run (vLLM's spec-decode statistics, read from the
    replica before and after it)."""

    drafts: int
    acceptance_length: float | None = Field(description="mean tokens a speculative step wrote (1 + accepted per draft)")
    acceptance_rate: float | None = Field(description="accepted draft tokens over proposed ones")


class RunMetrics(BaseModel):
    """One mode at one concurrency in one round."""

    mode: str
    concurrency: int
    round: int
    sampling: str = Field("paper", description="the sampling profile: greedy or paper")
    requests: int
    errors: int
    refused: int = Field(
        0, description="of the errors, requests the service refused (HTTP 4xx): a setting the mode cannot run"
    )
    first_error: str | None = None
    latency_p50_s: float | None
    latency_p90_s: float | None
    latency_mean_s: float | None
    s_per_token: float | None = Field(description="summed latency over summed output tokens")
    output_tokens_per_s: float
    pass_at_1: float
    small_token_share: float | None = None
    switches_per_request: float | None = None
    cached_prompt_token_ratio: float | None = None
    router_overhead_per_switch_ms_p50: float | None = None
    decode_ms_per_token: dict[str, float] = Field(default_factory=dict, description="in-engine decode cost per model")
    ideal_s_per_token: float | None = Field(
        None, description="committed tokens at their model's decode cost, per token"
    )
    handoff: dict[str, HandoffCost] = Field(default_factory=dict)
    split_ms: dict[str, float] | None = Field(
        None,
        description="a request's mean time (ms): its tokens at their decode cost, its first token (the first engine "
        "request's), the rest inside the engines (handoffs), the router, outside the router",
    )
    false_stops_per_request: float | None = Field(
        None, description="segments ended on a cue's stop string where no cue was"
    )
    pauses_per_request: float | None = Field(
        None, description="pauses of resumable requests on a possible stop that was none"
    )
    degraded_requests: int = 0
    kept_on_large_per_request: float = 0.0
    auto_relay_share: float | None = Field(None, description="auto: the share of requests it ran as relay")
    spec: SpecStats | None = None
    texts: list[str] = Field(
        default_factory=list, description="a digest of each request's text, in request order ('' when it failed)"
    )


def _content(response: dict[str, Any]) -> str:
    choices = response.get("choices") or [{}]
    return str((choices[0].get("message") or {}).get("content") or "")


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def run_metrics(
    mode: str, concurrency: int, round_: int, results: list[dict[str, Any]], wall_s: float, sampling: str = "paper"
) -> RunMetrics:
    """Figures of one run from its results: each a response with ``_latency_s`` and ``_correct``,
    or ``{"_error": ..., "_status": ...}`` for a request that failed (it counts as wrong)."""
    ok = [r for r in results if "_error" not in r]
    lat = [r["_latency_s"] for r in ok]
    tokens = [r["usage"]["completion_tokens"] for r in ok]
    relay = [r["usage"]["relay"] for r in ok if "relay" in r["usage"]]
    m = RunMetrics(
        mode=mode,
        concurrency=concurrency,
        round=round_,
        sampling=sampling,
        requests=len(results),
        errors=len(results) - len(ok),
        refused=sum(1 for r in results if "_error" in r and 400 <= (r.get("_status") or 0) < 500),
        texts=[text_digest(_content(r)) if "_error" not in r else "" for r in results],
        first_error=next((r["_error"][:300] for r in results if "_error" in r), None),
        latency_p50_s=_round(pct(lat, 0.5)) if lat else None,
        latency_p90_s=_round(pct(lat, 0.9)) if lat else None,
        latency_mean_s=_round(statistics.fmean(lat)) if lat else None,
        s_per_token=_round(sum(lat) / sum(tokens), 6) if sum(tokens) else None,
        output_tokens_per_s=round(sum(tokens) / wall_s, 1) if wall_s > 0 else 0.0,
        pass_at_1=round(sum(1 for r in ok if r["_correct"]) / max(1, len(results)), 4),
    )
    if not relay:
        return m  # a server without relay-serve's usage (plain vLLM)
    if any("policy" in u for u in relay):
        m.auto_relay_share = round(sum(1 for u in relay if u.get("policy") == "relay") / len(relay), 4)
    engine_reqs = [e for r in ok for e in r.get("relay_engine_requests", [])]
    prompt = sum(e["prompt_tokens"] for e in engine_reqs)
    overhead = [(u["wall_s"] - u["engine_s"]) / u["switches"] for u in relay if u["switches"] > 0]
    m.small_token_share = round(sum(u["small_tokens"] for u in relay) / max(1, sum(tokens)), 4)
    m.switches_per_request = round(statistics.fmean(u["switches"] for u in relay), 3)
    m.cached_prompt_token_ratio = round(sum(e["cached_tokens"] for e in engine_reqs) / prompt, 4) if prompt else None
    m.router_overhead_per_switch_ms_p50 = round(1000 * pct(overhead, 0.5), 3) if overhead else None
    m.degraded_requests = sum(1 for u in relay if u.get("degraded"))
    m.kept_on_large_per_request = round(statistics.fmean(u.get("kept_on_large", 0) for u in relay), 3)
    if all("false_stops" in u for u in relay):
        m.false_stops_per_request = round(statistics.fmean(u["false_stops"] for u in relay), 3)
    m.pauses_per_request = round(sum(e.get("pauses", 0) for e in engine_reqs) / len(ok), 3)
    m.decode_ms_per_token = _decode_costs(engine_reqs)
    if sum(tokens) and all(u[f"{x}_tokens"] == 0 or x in m.decode_ms_per_token for u in relay for x in MODELS):
        decode_s = [sum(u[f"{x}_tokens"] * m.decode_ms_per_token.get(x, 0.0) / 1000 for x in MODELS) for u in relay]
        m.ideal_s_per_token = _round(sum(decode_s) / sum(tokens), 6)
        # the generation's first token (its prompt's prefill and the wait for it): paid by the large model alone too
        first = [reqs[0]["ttft_s"] or 0.0 for r in ok if (reqs := r.get("relay_engine_requests"))]
        first_s = statistics.fmean(first) if first else 0.0
        m.split_ms = {
            "decode": _ms(statistics.fmean(decode_s)),
            "first_token": _ms(first_s),
            "handoffs": _ms(statistics.fmean(u["engine_s"] for u in relay) - statistics.fmean(decode_s) - first_s),
            "router": _ms(statistics.fmean(u["wall_s"] - u["engine_s"] for u in relay)),
            "outside": _ms(statistics.fmean(lat) - statistics.fmean(u["wall_s"] for u in relay)),
        }
    m.handoff = _handoff_costs([r.get("relay_engine_requests", []) for r in ok], m.decode_ms_per_token)
    return m


def _decode_costs(engine_reqs: list[dict[str, Any]]) -> dict[str, float]:
    """Each model's decode cost per token inside the engine: decode time over the decode steps the
    engine reports for it (the tokens after each chunk's first: a resumable request that paused
    wrote its first token of every chunk after a prefill, not a decode step)."""
    costs = {}
    for model in MODELS:
        timed = [e for e in engine_reqs if e["model"] == model and e.get("decode_s") is not None and _steps(e) > 0]
        steps = sum(_steps(e) for e in timed)
        if steps:
            costs[model] = round(1000 * sum(e["decode_s"] for e in timed) / steps, 3)
    return costs


def _steps(e: dict[str, Any]) -> int:
    steps = e.get("decode_steps")
    return int(steps) if steps is not None else e["output_tokens"] - 1


def _handoff_costs(per_request: list[list[dict[str, Any]]], decode_ms: dict[str, float]) -> dict[str, HandoffCost]:
    out = {}
    n = max(1, len(per_request))
    for model in MODELS:
        resumed = [e for reqs in per_request for e in reqs[1:] if e["model"] == model]
        if not resumed:
            continue
        ttft = [e["ttft_s"] for e in resumed if e.get("ttft_s") is not None]
        out[model] = HandoffCost(
            resumed_per_request=round(len(resumed) / n, 3),
            ttft_ms=_ms(statistics.fmean(ttft)) if ttft else None,
            decode_ms=decode_ms.get(model),
            recomputed_tokens=round(statistics.fmean(e["prompt_tokens"] - e["cached_tokens"] for e in resumed), 2),
        )
    return out


def _round(x: float, digits: int = 4) -> float:
    return round(x, digits)


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 2)


# ---- over the rounds -----------------------------------------------------------------------------


class ModeSummary(BaseModel):
    runs: int
    errors: int
    refused: int = 0
    first_error: str | None = None
    latency_p50_s: Spread
    latency_p90_s: Spread
    output_tokens_per_s: Spread
    pass_at_1: float = Field(description="over every request of every round")
    small_token_share: Spread
    switches_per_request: Spread
    cached_prompt_token_ratio: Spread
    router_overhead_per_switch_ms_p50: Spread
    false_stops_per_request: Spread
    pauses_per_request: Spread
    handoffs_ms: Spread = Field(
        description="a request's time inside the engines beyond its tokens' decode cost and its first token"
    )
    kept_on_large_per_request: Spread
    decode_ms_per_token: dict[str, Spread]
    spec_acceptance_length: Spread = Field(
        default_factory=Spread, description="a speculative engine's mean tokens a step"
    )
    spec_acceptance_rate: Spread = Field(default_factory=Spread)
    auto_relay_share: Spread = Field(default_factory=Spread, description="auto: the share of requests it ran as relay")

    @property
    def served(self) -> bool:
        """Whether any of its requests succeeded."""
        return self.latency_p50_s.median is not None


class Speedup(BaseModel):
    """A relay mode against the single-model mode on the same engines, over the rounds."""

    over: str
    speedup: Spread = Field(description="the other mode's time per output token over this one's, per round")
    ideal: Spread = Field(description="the same with this mode's tokens at their models' in-engine decode cost")
    achieved_over_ideal: Spread
    measurement_error: bool = Field(description=f"a round's achieved / ideal exceeded {RATIO_LIMIT}")


class AutoAgainstBest(BaseModel):
    """An auto mode against the best fixed mode it chooses between, at one level."""

    best: str = Field(description="the fixed mode with the lowest median p50 (pass@1 within 0.03 of the best)")
    p50_ratio: Spread = Field(description="the best mode's p50 latency over the auto mode's, per round (1: as fast)")


class LevelReport(BaseModel):
    concurrency: int
    sampling: str = Field("paper", description="the sampling profile of every run at this level")
    modes: dict[str, ModeSummary]
    speedup: Spread = Field(description="large's time per output token over relay's, per round")
    ideal: Spread = Field(description="the same with relay's tokens at their models' in-engine decode cost")
    achieved_over_ideal: Spread
    measurement_error: bool = Field(description=f"a round's achieved / ideal exceeded {RATIO_LIMIT}")
    cost_ratio: Spread = Field(description="large's in-engine decode cost per token over small's (each model alone)")
    relay_split_ms: dict[str, Spread] = Field(default_factory=dict)
    relay_handoff: dict[str, HandoffCost] = Field(default_factory=dict, description="the median round's")
    speedups: dict[str, Speedup] = Field(
        default_factory=dict, description="each relay mode against its single-model mode (PAIRS)"
    )
    same_text: dict[str, float] = Field(
        default_factory=dict,
        description="greedy: of requests both modes answered, the share whose texts are identical ('a=b')",
    )
    auto: dict[str, AutoAgainstBest] = Field(
        default_factory=dict, description="each auto mode against the best of the fixed modes it chooses between"
    )

    def best(self, modes: list[str] | None = None) -> str | None:
        """The mode with the lowest p50 latency among ``modes`` (default: all that served), among
        those whose pass@1 is within 0.03 of the best pass@1 of them."""
        cands = {m: s for m, s in self.modes.items() if s.served and (modes is None or m in modes)}
        if not cands:
            return None
        top = max(s.pass_at_1 for s in cands.values())
        good = {m: s for m, s in cands.items() if s.pass_at_1 >= top - 0.03}
        return min(good, key=lambda m: good[m].latency_p50_s.median or float("inf"))


def summarize_mode(runs: list[RunMetrics]) -> ModeSummary:
    models = sorted({k for r in runs for k in r.decode_ms_per_token})
    requests = sum(r.requests for r in runs)
    return ModeSummary(
        runs=len(runs),
        errors=sum(r.errors for r in runs),
        latency_p50_s=Spread.of([r.latency_p50_s for r in runs]),
        latency_p90_s=Spread.of([r.latency_p90_s for r in runs]),
        output_tokens_per_s=Spread.of([r.output_tokens_per_s for r in runs], 1),
        pass_at_1=round(sum(r.pass_at_1 * r.requests for r in runs) / max(1, requests), 4),
        small_token_share=Spread.of([r.small_token_share for r in runs]),
        switches_per_request=Spread.of([r.switches_per_request for r in runs], 3),
        cached_prompt_token_ratio=Spread.of([r.cached_prompt_token_ratio for r in runs]),
        router_overhead_per_switch_ms_p50=Spread.of([r.router_overhead_per_switch_ms_p50 for r in runs], 3),
        false_stops_per_request=Spread.of([r.false_stops_per_request for r in runs], 3),
        pauses_per_request=Spread.of([r.pauses_per_request for r in runs], 3),
        handoffs_ms=Spread.of([r.split_ms["handoffs"] if r.split_ms else None for r in runs], 2),
        kept_on_large_per_request=Spread.of([r.kept_on_large_per_request for r in runs], 3),
        decode_ms_per_token={m: Spread.of([r.decode_ms_per_token.get(m) for r in runs], 3) for m in models},
        refused=sum(r.refused for r in runs),
        first_error=next((r.first_error for r in runs if r.first_error), None),
        spec_acceptance_length=Spread.of([r.spec.acceptance_length if r.spec else None for r in runs], 3),
        spec_acceptance_rate=Spread.of([r.spec.acceptance_rate if r.spec else None for r in runs], 3),
        auto_relay_share=Spread.of([r.auto_relay_share for r in runs], 3),
    )


def level_report(concurrency: int, runs: list[RunMetrics]) -> LevelReport:
    by_mode: dict[str, list[RunMetrics]] = {}
    for r in runs:
        by_mode.setdefault(r.mode, []).append(r)
    rounds = sorted({r.round for r in runs})

    def one(mode: str, round_: int) -> RunMetrics | None:
        return next((r for r in by_mode.get(mode, []) if r.round == round_), None)

    speedups = {}
    for mode, over in PAIRS.items():
        if mode in by_mode and over in by_mode:
            speedups[mode] = _speedup(over, [(one(over, k), one(mode, k)) for k in rounds])
    cost = []
    for k in rounds:
        large, small = one("large", k), one("small", k)
        if large and small and "large" in large.decode_ms_per_token and "small" in small.decode_ms_per_token:
            cost.append(large.decode_ms_per_token["large"] / small.decode_ms_per_token["small"])
    relay = speedups.get("relay") or Speedup(
        over="large", speedup=Spread(), ideal=Spread(), achieved_over_ideal=Spread(), measurement_error=False
    )
    relay_runs = [r for r in by_mode.get("relay", []) if r.split_ms]
    split = {key: Spread.of([r.split_ms[key] for r in relay_runs], 2) for key in SPLIT} if relay_runs else {}
    median_run = sorted(relay_runs, key=lambda r: r.s_per_token or 0.0)[len(relay_runs) // 2] if relay_runs else None
    level = LevelReport(
        concurrency=concurrency,
        sampling=runs[0].sampling if runs else "paper",
        modes={mode: summarize_mode(rs) for mode, rs in by_mode.items()},
        speedup=relay.speedup,
        ideal=relay.ideal,
        achieved_over_ideal=relay.achieved_over_ideal,
        measurement_error=relay.measurement_error,
        cost_ratio=Spread.of(cost, 2),
        relay_split_ms=split,
        relay_handoff=median_run.handoff if median_run else {},
        speedups=speedups,
        same_text={
            f"{a}={b}": share
            for a, b in SAME_TEXT
            if (share := _same_text(by_mode.get(a, []), by_mode.get(b, []))) is not None
        },
    )
    for mode, fixed in AUTO_CHOICES.items():
        best = level.best(list(fixed)) if mode in level.modes and level.modes[mode].served else None
        if best is not None:
            level.auto[mode] = AutoAgainstBest(
                best=best, p50_ratio=_p50_ratio([(one(best, k), one(mode, k)) for k in rounds])
            )
    return level


def _p50_ratio(rounds: list[tuple[RunMetrics | None, RunMetrics | None]]) -> Spread:
    """The first mode's p50 latency over the second's, per round both served. The best fixed
    mode is chosen once over all rounds (a user fixes a mode), so this is not biased the way a
    per-round minimum of several modes would be; pairing by round takes out the machine's drift."""
    return Spread.of(
        [a.latency_p50_s / b.latency_p50_s for a, b in rounds if a and b and a.latency_p50_s and b.latency_p50_s], 3
    )


def _speedup(over: str, rounds: list[tuple[RunMetrics | None, RunMetrics | None]]) -> Speedup:
    """``over``'s time per output token over the relay mode's, per round, and the bound from the
    relay mode's own in-engine decode costs."""
    speedup, ideal, ratio = [], [], []
    for base, relay in rounds:
        if base and relay and base.s_per_token and relay.s_per_token:
            speedup.append(base.s_per_token / relay.s_per_token)
            if relay.ideal_s_per_token:
                ideal.append(base.s_per_token / relay.ideal_s_per_token)
                ratio.append(relay.ideal_s_per_token / relay.s_per_token)
    return Speedup(
        over=over,
        speedup=Spread.of(speedup, 3),
        ideal=Spread.of(ideal, 3),
        achieved_over_ideal=Spread.of(ratio, 3),
        measurement_error=any(x > RATIO_LIMIT for x in ratio),
    )


def _same_text(a: list[RunMetrics], b: list[RunMetrics]) -> float | None:
    """Of the requests both modes answered in the same rounds (same prompts and seeds), the share
    with identical texts; greedy runs only (sampled texts differ between engines by design)."""
    pairs = [
        (x, y)
        for ra in a
        for rb in b
        if ra.round == rb.round and ra.sampling == rb.sampling == "greedy"
        for x, y in zip(ra.texts, rb.texts, strict=False)
        if x and y
    ]
    return round(sum(1 for x, y in pairs if x == y) / len(pairs), 4) if pairs else None


class PairInfo(BaseModel):
    large: str
    small: str
    cue_set_version: str | None = None
    cues: list[str] = Field(default_factory=list)


class BenchReport(BaseModel):
    started: str
    machine: str
    command: str
    settings: dict[str, Any]
    pair: PairInfo
    levels: list[LevelReport]
    runs: list[RunMetrics]
    variants: dict[str, str] = Field(
        default_factory=dict, description="relay modes on apps that differ in one setting: what differs"
    )

    def level(self, concurrency: int, sampling: str | None = None) -> LevelReport:
        return next(
            lv for lv in self.levels if lv.concurrency == concurrency and (sampling is None or lv.sampling == sampling)
        )

    def profiles(self) -> list[str]:
        """The sampling profiles, in the order they ran."""
        return list(dict.fromkeys(lv.sampling for lv in self.levels))

    def summaries(self) -> list[dict[str, Any]]:
        """The last lines of ``relay-serve bench --json``, one per sampling profile."""
        return [self.summary(p) for p in self.profiles()]

    def summary(self, sampling: str | None = None) -> dict[str, Any]:
        """One profile's summary line (the first profile by default): medians over the rounds."""
        sampling = sampling or (self.profiles() or ["paper"])[0]
        levels = [lv for lv in self.levels if lv.sampling == sampling]

        def p50(lv: LevelReport, mode: str) -> float | None:
            return lv.modes[mode].latency_p50_s.median if mode in lv.modes else None

        def pass1(lv: LevelReport, mode: str) -> float | None:
            return lv.modes[mode].pass_at_1 if mode in lv.modes and lv.modes[mode].served else None

        def modes(lv: LevelReport) -> dict[str, dict[str, float | None]]:
            return {
                mode: {
                    "p50_s": s.latency_p50_s.median,
                    "tok_s": s.output_tokens_per_s.median,
                    "pass_at_1": pass1(lv, mode),
                }
                for mode, s in lv.modes.items()
            }

        def acceptance(lv: LevelReport) -> float | None:
            found = [
                s.spec_acceptance_length.median
                for s in lv.modes.values()
                if s.spec_acceptance_length.median is not None
            ]
            return round(statistics.median(found), 3) if found else None

        return {
            "pair": self.pair.model_dump(),
            "sampling": sampling,
            "levels": [
                {
                    "concurrency": lv.concurrency,
                    "speedup": lv.speedup.median,
                    "ideal": lv.ideal.median,
                    "achieved_over_ideal": lv.achieved_over_ideal.median,
                    "measurement_error": lv.measurement_error,
                    "relay_pass_at_1": pass1(lv, "relay"),
                    "large_pass_at_1": pass1(lv, "large"),
                    "relay_p50_s": p50(lv, "relay"),
                    "large_p50_s": p50(lv, "large"),
                    "vllm_large_p50_s": p50(lv, "vllm-large"),
                    "router_overhead_per_switch_ms": lv.modes["relay"].router_overhead_per_switch_ms_p50.median
                    if "relay" in lv.modes
                    else None,
                    "modes": modes(lv),
                    "auto_over_best": {mode: a.p50_ratio.median for mode, a in lv.auto.items()},
                    "spec_acceptance_length": acceptance(lv),
                }
                for lv in levels
            ],
        }
