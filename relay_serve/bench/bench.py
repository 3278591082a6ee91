"""``relay-serve bench``: large, relay, small and speculative-thinking side by side, on the same
prompts and seeds, at several concurrencies; then the recorded relay schedules replayed on the
speed pair (random weights, a large model ~10x the small one per token) to tell whether the system
or the model is the bottleneck. Writes JSON, a markdown table and PNG plots.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from relay_serve.config import PaperSampling
from relay_serve.serve.local import http_client

MODES = ("large", "relay", "small", "speculative-thinking")


class BenchSettings(PaperSampling):
    concurrency: list[int] = Field(default_factory=lambda: [1, 8, 32])
    requests_per_level: int = Field(32, description="requests per mode and concurrency (at least the concurrency)")
    seed: int = 0
    max_tokens: int = 256
    replay_requests: int = 16
    replay_concurrency: list[int] = Field(default_factory=lambda: [1, 8])
    small_queue_bound: int | None = Field(
        4, ge=1, description="also run relay at the top concurrency with router.max_small_in_flight set to this (None: skip)"
    )
    compare_transports: bool = Field(
        True, description="also run relay at the lowest two concurrencies with router.transport: handle"
    )


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (linear interpolation), NaN when empty."""
    return float(np.quantile(values, q)) if values else float("nan")


async def _fire(base: str, bodies: list[dict], concurrency: int) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(concurrency)
    async with http_client(600) as client:

        async def one(body: dict) -> dict:
            async with sem:
                t0 = time.perf_counter()
                r = await client.post(base + "/v1/chat/completions", json=body)
                latency = time.perf_counter() - t0
            r.raise_for_status()
            out = r.json()
            out["_latency_s"] = latency
            return out

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies))
        return results, time.perf_counter() - t0


def level_metrics(results: list[dict], wall_s: float) -> dict[str, Any]:
    lat = [r["_latency_s"] for r in results]
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    relay = [r["usage"]["relay"] for r in results]
    engine_reqs = [e for r in results for e in r.get("relay_engine_requests", [])]
    prompt = sum(e["prompt_tokens"] for e in engine_reqs)
    overhead = [
        (u["wall_s"] - u["engine_s"]) / u["switches"] for u in relay if u["switches"] > 0
    ]
    per_request_overhead = [u["wall_s"] - u["engine_s"] for u in relay]
    return {
        "requests": len(results),
        "latency_p50_s": round(pct(lat, 0.5), 4),
        "latency_p90_s": round(pct(lat, 0.9), 4),
        "latency_mean_s": round(statistics.fmean(lat), 4),
        "output_tokens_per_s": round(tokens / wall_s, 1),
        "output_tokens": tokens,
        "small_token_share": round(sum(u["small_tokens"] for u in relay) / max(1, tokens), 4),
        "switches_per_request": round(statistics.fmean(u["switches"] for u in relay), 3),
        "cached_prompt_token_ratio": round(sum(e["cached_tokens"] for e in engine_reqs) / prompt, 4) if prompt else None,
        "router_overhead_per_switch_ms_p50": round(1000 * pct(overhead, 0.5), 3) if overhead else None,
        "router_overhead_per_request_ms_p50": round(1000 * pct(per_request_overhead, 0.5), 3),
        "degraded_requests": sum(1 for u in relay if u.get("degraded")),
        "kept_on_large_per_request": round(statistics.fmean(u.get("kept_on_large", 0) for u in relay), 3),
    }


def latency_split(relay_results: list[dict], c_large: float, c_small: float) -> dict[str, float]:
    """Where a relay request's time went, in ms (means over the requests): inside the engine
    replicas, in the router outside them, outside the router's session (HTTP, the proxy); and
    the ideal (each token at its model's measured per-token cost)."""
    n = len(relay_results)
    engine = sum(r["usage"]["relay"]["engine_s"] for r in relay_results) / n
    session = sum(r["usage"]["relay"]["wall_s"] for r in relay_results) / n
    latency = sum(r["_latency_s"] for r in relay_results) / n
    ideal = sum(r["usage"]["relay"]["large_tokens"] * c_large + r["usage"]["relay"]["small_tokens"] * c_small for r in relay_results) / n
    return {
        "latency_ms": round(1000 * latency, 1),
        "engine_ms": round(1000 * engine, 1),
        "router_ms": round(1000 * (session - engine), 1),
        "outside_router_ms": round(1000 * (latency - session), 1),
        "ideal_ms": round(1000 * ideal, 1),
    }


def per_token_cost(results: list[dict]) -> float:
    """Seconds per output token of one model alone, at concurrency 1."""
    return statistics.fmean(r["_latency_s"] / max(1, r["usage"]["completion_tokens"]) for r in results)


def ideal_speedup(relay_results: list[dict], c_large: float, c_small: float) -> float:
    """Large-only time over relay time if each token cost exactly its model's per-token cost."""
    n = sum(r["usage"]["completion_tokens"] for r in relay_results)
    nl = sum(r["usage"]["relay"]["large_tokens"] for r in relay_results)
    ns = sum(r["usage"]["relay"]["small_tokens"] for r in relay_results)
    return (n * c_large) / (nl * c_large + ns * c_small)


def _bodies(s: BenchSettings, mode: str, prompts: list[str], n: int) -> list[dict]:
    return [
        {
            "model": mode,
            "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "seed": s.seed + i,
            "relay_trace": True,
        }
        for i in range(n)
    ]


def _warmed_up_prompts(base: str, s: BenchSettings, n: int) -> list[str]:
    """``n`` held-out toy prompts (the same for every mode), after a few relay requests have
    warmed up both engines."""
    from relay_serve.toy.world import ToyWorld

    prompts = [p.prompt for p in ToyWorld().sample_heldout(n, seed=s.seed)]
    asyncio.run(_fire(base, _bodies(s, "relay", prompts, 4), 4))
    return prompts


def run_trained(base: str, s: BenchSettings, progress: bool = True) -> dict[str, Any]:
    """Every mode at every concurrency on the trained toy pair."""
    from tqdm import tqdm

    prompts = _warmed_up_prompts(base, s, max(max(s.concurrency), s.requests_per_level))
    levels: dict[str, dict[int, dict]] = {m: {} for m in MODES}
    raw: dict[tuple[str, int], list[dict]] = {}
    bar = tqdm(total=len(MODES) * len(s.concurrency), desc="bench", disable=not progress)
    for c in s.concurrency:
        n = max(c, s.requests_per_level)
        for mode in MODES:
            results, wall = asyncio.run(_fire(base, _bodies(s, mode, prompts, n), c))
            raw[(mode, c)] = results
            levels[mode][c] = level_metrics(results, wall)
            bar.update(1)
    bar.close()
    c1 = min(s.concurrency)
    c_large, c_small = per_token_cost(raw[("large", c1)]), per_token_cost(raw[("small", c1)])
    for c in s.concurrency:
        for mode in ("relay", "speculative-thinking"):
            achieved = levels["large"][c]["latency_mean_s"] / levels[mode][c]["latency_mean_s"]
            levels[mode][c]["achieved_speedup"] = round(achieved, 3)
            levels[mode][c]["ideal_speedup"] = round(ideal_speedup(raw[(mode, c)], c_large, c_small), 3)
    schedules = [
        [{"model": seg["model"], "tokens": seg["tokens"]} for seg in r["relay_trace"] if seg["tokens"] > 0]
        for r in raw[("relay", c1)]
    ]
    cost = {"large": round(1000 * c_large, 3), "small": round(1000 * c_small, 3)}
    return {"levels": levels, "schedules": schedules, "per_token_cost_ms": cost}


def run_overload(base: str, s: BenchSettings, unbounded: dict[str, Any]) -> dict[str, Any]:
    """relay at the top concurrency on an app whose router keeps handoffs on the large model past
    ``small_queue_bound`` small-model segments in flight, beside the same run without a bound."""
    c = max(s.concurrency)
    n = max(c, s.requests_per_level)
    prompts = _warmed_up_prompts(base, s, n)
    results, wall = asyncio.run(_fire(base, _bodies(s, "relay", prompts, n), c))
    return {"bound": s.small_queue_bound, "concurrency": c, "unbounded": unbounded, "bounded": level_metrics(results, wall)}


def run_transports(base: str, s: BenchSettings, direct: dict[int, dict]) -> dict[str, Any]:
    """relay at the lowest two concurrencies on an app whose segments are Ray Serve handle
    calls (``router.transport: handle``), beside the same runs over the direct channel."""
    levels = sorted(s.concurrency)[:2]
    prompts = _warmed_up_prompts(base, s, max(max(levels), s.requests_per_level))
    handle = {}
    for c in levels:
        results, wall = asyncio.run(_fire(base, _bodies(s, "relay", prompts, max(c, s.requests_per_level)), c))
        handle[c] = level_metrics(results, wall)
    return {"levels": levels, "direct": {c: direct[c] for c in levels}, "handle": handle}


def run_replay(base: str, s: BenchSettings, schedules: list[list[dict]], progress: bool = True) -> dict[str, Any]:
    """The recorded relay schedules on the speed pair: relay against large-only and small-only
    replays of the same token counts."""
    chosen = schedules[: s.replay_requests]
    variants = {
        "relay": chosen,
        "large": [[{"model": "large", "tokens": sum(x["tokens"] for x in sch)}] for sch in chosen],
        "small": [[{"model": "small", "tokens": sum(x["tokens"] for x in sch)}] for sch in chosen],
    }

    def bodies(name: str) -> list[dict]:
        return [
            {"model": "relay", "messages": [{"role": "user", "content": "Start at b3. Follow the map four times."}],
             "max_tokens": sum(x["tokens"] for x in sch) + 1, "temperature": 0.0, "relay_replay": sch, "relay_trace": True}
            for sch in variants[name]
        ]  # fmt: skip

    from tqdm import tqdm

    asyncio.run(_fire(base, bodies("relay")[:2], 2))  # warm up
    out: dict[str, Any] = {"levels": {}}
    bar = tqdm(total=len(s.replay_concurrency) * len(variants), desc="replay on the speed pair", disable=not progress)
    for c in s.replay_concurrency:
        res = {}
        for name in variants:
            res[name] = asyncio.run(_fire(base, bodies(name), c))
            bar.update(1)
        level = {name: level_metrics(r, wall) for name, (r, wall) in res.items()}
        c_large = per_token_cost(res["large"][0])
        c_small = per_token_cost(res["small"][0])
        ideal = ideal_speedup(res["relay"][0], c_large, c_small)
        achieved = level["large"]["latency_mean_s"] / level["relay"]["latency_mean_s"]
        level["speedup"] = {
            "per_token_cost_ms": {"large": round(1000 * c_large, 3), "small": round(1000 * c_small, 3)},
            "ideal": round(ideal, 3),
            "achieved": round(achieved, 3),
            "achieved_over_ideal": round(achieved / ideal, 3),
            "relay_latency_split": latency_split(res["relay"][0], c_large, c_small),
        }
        out["levels"][c] = level
    bar.close()
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Benchmark {report['started']} on {report['machine']}",
        "",
        "Trained toy pair (same prompts and seeds for every mode):",
        "",
        "| mode | concurrency | p50 latency (s) | p90 latency (s) | output tok/s | small share | switches/req | cached prompt ratio | router overhead/switch p50 (ms) | speedup achieved / ideal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, levels in report["trained"]["levels"].items():
        for c, m in sorted(levels.items(), key=lambda kv: int(kv[0])):
            sp = f"{m['achieved_speedup']} / {m['ideal_speedup']}" if "achieved_speedup" in m else "-"
            lines.append(
                f"| {mode} | {c} | {m['latency_p50_s']} | {m['latency_p90_s']} | {m['output_tokens_per_s']} | "
                f"{m['small_token_share']} | {m['switches_per_request']} | {m['cached_prompt_token_ratio']} | "
                f"{m['router_overhead_per_switch_ms_p50'] if m['router_overhead_per_switch_ms_p50'] is not None else '-'} | {sp} |"
            )
    pc = report["trained"]["per_token_cost_ms"]
    lines += ["", f"Per-token cost at concurrency 1: large {pc['large']} ms, small {pc['small']} ms.", ""]
    if report.get("overload"):
        o = report["overload"]
        lines += [
            f"Overload: relay at concurrency {o['concurrency']}, without and with a bound of {o['bound']} small-model "
            "segments in flight (router.max_small_in_flight; past it the large model keeps the handoff):",
            "",
            "| small queue bound | p50 latency (s) | p90 latency (s) | output tok/s | small share | handoffs kept on large/req | degraded requests |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, m in (("none", o["unbounded"]), (str(o["bound"]), o["bounded"])):
            lines.append(
                f"| {name} | {m['latency_p50_s']} | {m['latency_p90_s']} | {m['output_tokens_per_s']} | {m['small_token_share']} | "
                f"{m.get('kept_on_large_per_request', 0)} | {m['degraded_requests']} |"
            )
        lines.append("")
    if report.get("transports"):
        t = report["transports"]
        lines += [
            "Relay by transport (segments over the leased replica's channel, or a Ray Serve handle call each):",
            "",
            "| transport | concurrency | p50 latency (s) | output tok/s | router overhead/switch p50 (ms) | router overhead/request p50 (ms) |",
            "|---|---|---|---|---|---|",
        ]
        for name in ("direct", "handle"):
            for c in t["levels"]:
                m = t[name][c] if c in t[name] else t[name][str(c)]
                lines.append(
                    f"| {name} | {c} | {m['latency_p50_s']} | {m['output_tokens_per_s']} | "
                    f"{m['router_overhead_per_switch_ms_p50']} | {m['router_overhead_per_request_ms_p50']} |"
                )
        lines.append("")
    if report.get("replay"):
        lines += [
            "Speed pair (random weights), replaying the relay's recorded segment schedules:",
            "",
            "| concurrency | large ms/token | small ms/token | ideal speedup | achieved speedup | achieved / ideal | router overhead/switch p50 (ms) |",
            "|---|---|---|---|---|---|---|",
        ]
        levels = sorted(report["replay"]["levels"].items(), key=lambda kv: int(kv[0]))
        for c, level in levels:
            sp = level["speedup"]
            lines.append(
                f"| {c} | {sp['per_token_cost_ms']['large']} | {sp['per_token_cost_ms']['small']} | {sp['ideal']} | "
                f"{sp['achieved']} | {sp['achieved_over_ideal']} | {level['relay']['router_overhead_per_switch_ms_p50']} |"
            )
        if all("relay_latency_split" in level["speedup"] for _, level in levels):
            lines += [
                "",
                "Where a relay request's time went on the speed pair (ms, mean a request): inside the engine replicas, in the "
                "router outside them, outside the router (HTTP and the proxy), against the ideal (each token at its model's "
                "per-token cost):",
                "",
                "| concurrency | latency | engine | router | outside the router | ideal |",
                "|---|---|---|---|---|---|",
            ]
            for c, level in levels:
                x = level["speedup"]["relay_latency_split"]
                lines.append(f"| {c} | {x['latency_ms']} | {x['engine_ms']} | {x['router_ms']} | {x['outside_router_ms']} | {x['ideal_ms']} |")
    return "\n".join(lines) + "\n"


def plots(report: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    levels = report["trained"]["levels"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, by_c in levels.items():
        cs = sorted(by_c, key=int)
        ax.plot([int(c) for c in cs], [by_c[c]["latency_p50_s"] for c in cs], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("p50 latency (s)")
    ax.set_title("latency per mode, trained toy pair")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "latency.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, ideal, achieved = [], [], []
    for c, m in sorted(levels["relay"].items(), key=lambda kv: int(kv[0])):
        labels.append(f"toy c={c}")
        ideal.append(m["ideal_speedup"])
        achieved.append(m["achieved_speedup"])
    for c, level in sorted(report.get("replay", {}).get("levels", {}).items(), key=lambda kv: int(kv[0])):
        labels.append(f"speed pair c={c}")
        ideal.append(level["speedup"]["ideal"])
        achieved.append(level["speedup"]["achieved"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], ideal, width=0.4, label="ideal")
    ax.bar([i + 0.2 for i in x], achieved, width=0.4, label="achieved")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(list(x), labels, rotation=20)
    ax.set_ylabel("relay speedup over large")
    ax.set_title("relay speedup: achieved against ideal")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    splits = [
        (c, level["speedup"]["relay_latency_split"])
        for c, level in sorted(report.get("replay", {}).get("levels", {}).items(), key=lambda kv: int(kv[0]))
        if "relay_latency_split" in level["speedup"]
    ]
    if splits:
        fig, ax = plt.subplots(figsize=(7, 4))
        x = list(range(len(splits)))
        bottom = [0.0] * len(splits)
        for key, label in (("engine_ms", "inside the engines"), ("router_ms", "router"), ("outside_router_ms", "outside the router")):
            values = [sp[key] for _, sp in splits]
            ax.bar(x, values, bottom=bottom, width=0.5, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.scatter(x, [sp["ideal_ms"] for _, sp in splits], marker="_", s=2000, color="black", label="ideal", zorder=3)
        ax.set_xticks(x, [f"c={c}" for c, _ in splits])
        ax.set_ylabel("ms per relay request (mean)")
        ax.set_title("where relay time goes, speed pair")
        ax.set_ylim(0, 1.3 * max(max(bottom), max(sp["ideal_ms"] for _, sp in splits)))
        ax.legend(loc="upper left", ncols=2, fontsize=8)
        fig.tight_layout()
        paths.append(out / "relay_time_split.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def machine() -> str:
    import os
    import platform

    return f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU, Python {platform.python_version()}"


def run_bench(s: BenchSettings, out: Path, replay: bool = True, progress: bool = True) -> dict[str, Any]:
    import ray
    from ray import serve

    from relay_serve.config import AppConfig
    from relay_serve.serve.local import free_port, start

    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "settings": s.model_dump()}
    port = free_port()
    base = start(AppConfig(), port=port)
    report["trained"] = run_trained(base, s, progress)
    serve.delete("relay")
    if s.small_queue_bound is not None:
        cfg = AppConfig()
        cfg.router.max_small_in_flight = s.small_queue_bound
        base = start(cfg, port=port)
        report["overload"] = run_overload(base, s, report["trained"]["levels"]["relay"][max(s.concurrency)])
        serve.delete("relay")
    if s.compare_transports:
        cfg = AppConfig()
        cfg.router.transport = "handle"
        base = start(cfg, port=port)
        report["transports"] = run_transports(base, s, report["trained"]["levels"]["relay"])
        serve.delete("relay")
    if replay:
        from relay_serve.toy.speed_pair import ensure_speed_pair

        large, small = ensure_speed_pair()
        cfg = AppConfig.model_validate({"large": {"model": str(large)}, "small": {"model": str(small)}})
        base = start(cfg, port=port)
        report["replay"] = run_replay(base, s, report["trained"]["schedules"], progress)
        serve.delete("relay")
    serve.shutdown()
    ray.shutdown()
    report["trained"]["schedules"] = report["trained"]["schedules"][:8]  # a sample, to keep the JSON small
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench.md").write_text(markdown(report))
    report["plots"] = [str(p) for p in plots(report, out)]
    return report
