"""The benchmark report as markdown tables and PNG plots. A mode that failed or was refused is
reported as such and left out of the plots; nothing here assumes every mode ran."""

from __future__ import annotations

import statistics
from pathlib import Path

from relay_serve.bench.report import RATIO_LIMIT, SPLIT, BenchReport, LevelReport, Spread

MODE_ORDER = (
    "large",
    "large+spec",
    "vllm-large",
    "relay",
    "relay+spec",
    "auto",
    "auto+spec",
    "small",
    "speculative-thinking",
)
PROFILE_TEXT = {"greedy": "greedy (temperature 0)", "paper": "the paper's (temperature 0.6, top_p 0.95, top_k 20)"}


def _ordered(modes) -> list[str]:
    modes = set(modes)
    known = [m for m in MODE_ORDER if m in modes]
    return known + sorted(m for m in modes if m not in MODE_ORDER)


def _ratio_text(s) -> str:
    text = s.achieved_over_ideal.text()
    return f"{text} (above {RATIO_LIMIT}: a measurement error, not a result)" if s.measurement_error else text


def _cell(lv: LevelReport, mode: str) -> str:
    """p50 / tok/s / pass@1 of a mode at a level, or why it has none."""
    s = lv.modes.get(mode)
    if s is None:
        return "-"
    if not s.served:
        return "refused" if s.refused == s.errors and s.errors else "failed"
    return f"{s.latency_p50_s.median:.3f} s / {s.output_tokens_per_s.median:g} / {s.pass_at_1:.3f}"


def matrix(report: BenchReport, sampling: str) -> list[str]:
    """Every mode at every level of one profile: the cell a reader chooses by, and the winner."""
    levels = [lv for lv in report.levels if lv.sampling == sampling]
    modes = _ordered({m for lv in levels for m in lv.modes if m in MODE_ORDER})
    lines = [
        "| concurrency | " + " | ".join(modes) + " | fastest (p50, pass@1 within 0.03 of the best) |",
        "|---|" + "---|" * len(modes) + "---|",
    ]
    for lv in levels:
        lines.append(
            f"| {lv.concurrency} | "
            + " | ".join(_cell(lv, m) for m in modes)
            + f" | {lv.best([m for m in modes]) or '-'} |"
        )
    return lines


def markdown(report: BenchReport) -> str:
    r = report
    rounds = r.settings.get("rounds")
    lines = [
        f"Benchmark {r.started} on {r.machine}: `{r.command}`",
        "",
        f"Pair: large `{r.pair.large}`, small `{r.pair.small}`; cue set {r.pair.cue_set_version} {r.pair.cues}. "
        f"{rounds} rounds; each round runs every mode on the same prompts and seeds, the modes in a rotating order. "
        "Figures are the median over the rounds, [min-max] beside it. `+spec`: the same pair with a large engine that "
        f"speculates with the small model as its draft model ({r.settings.get('spec_tokens')} tokens a step).",
    ]
    for sampling in r.profiles():
        lines += [
            "",
            f"## Sampling: {PROFILE_TEXT.get(sampling, sampling)}",
            "",
            "Each cell: p50 latency / output tok/s / pass@1.",
            "",
        ]
        lines += matrix(r, sampling)
        lines += ["", *_speedups(r, sampling), *_auto(r, sampling)]
    lines += [
        "",
        "Every mode:",
        "",
        "| sampling | mode | concurrency | p50 latency (s) | p90 latency (s) | output tok/s | pass@1 | small share | "
        "switches/req | "
        "spec acceptance length | spec acceptance rate | false stops/req | pauses/req | cached prompt ratio | "
        "router overhead/switch p50 (ms) | decode ms/token (large, small) | failed (refused) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in r.levels:
        for mode in _ordered(m for m in lv.modes if m in MODE_ORDER):
            s = lv.modes[mode]
            dec = ", ".join(
                s.decode_ms_per_token[m].text() if m in s.decode_ms_per_token else "-" for m in ("large", "small")
            )
            lines.append(
                f"| {lv.sampling} | {mode} | {lv.concurrency} | {s.latency_p50_s.text()} | {s.latency_p90_s.text()} | "
                f"{s.output_tokens_per_s.text()} | {s.pass_at_1:.3f} | {s.small_token_share.text()} | "
                f"{s.switches_per_request.text()} | "
                f"{s.spec_acceptance_length.text()} | {s.spec_acceptance_rate.text()} | "
                f"{s.false_stops_per_request.text()} | "
                f"{s.pauses_per_request.text()} | {s.cached_prompt_token_ratio.text()} | "
                f"{s.router_overhead_per_switch_ms_p50.text()} | "
                f"{dec} | {s.errors} ({s.refused}) |"
            )
    errors = [run for run in r.runs if run.errors]
    if errors:
        lines += ["", "Failed or refused requests (the first error of each mode):", ""]
        seen = set()
        for run in errors:
            key = (run.sampling, run.mode)
            if key not in seen:
                seen.add(key)
                n = sum(x.errors for x in errors if (x.sampling, x.mode) == key)
                lines.append(f"- {run.mode}, {run.sampling} sampling: {n} failed in all; {run.first_error}")
    lines += [
        "",
        "Where a relay request's time goes (ms, mean a request): its tokens at their models' decode cost, the rest of "
        "the time inside the engines: the generation's first token (its prompt's prefill and the wait for it, as the "
        "large model alone pays) and the handoffs (prefill of the other model's tokens, a resumed segment's wait for "
        "its first token, pauses), the router, and outside the router (HTTP, Serve's proxy):",
        "",
        "| sampling | concurrency | decode | first token | handoffs | router | outside the router |",
        "|---|---|---|---|---|---|---|",
    ]
    for lv in r.levels:
        sp = lv.relay_split_ms
        if sp:
            lines.append(f"| {lv.sampling} | {lv.concurrency} | " + " | ".join(sp[key].text() for key in SPLIT) + " |")
    lines += [
        "",
        "What a handoff costs inside the engine (relay, the median round): segments after a generation's first, their "
        "time to "
        "first token against a decode step of the same model, and the prompt tokens they computed again (not served "
        "from the "
        "prefix cache):",
        "",
        "| sampling | concurrency | model | resumed segments/req | time to first token (ms) | decode step (ms) | "
        "recomputed tokens/segment |",
        "|---|---|---|---|---|---|---|",
    ]
    for lv in r.levels:
        for model, h in lv.relay_handoff.items():
            lines.append(
                f"| {lv.sampling} | {lv.concurrency} | {model} | {h.resumed_per_request} | {h.ttft_ms} | {h.decode_ms} "
                f"| {h.recomputed_tokens} |"
            )
    if r.variants:
        lines += ["", *_variants(r)]
    return "\n".join(lines) + "\n"


def _speedups(r: BenchReport, sampling: str) -> list[str]:
    lines = [
        "Relay against the single model on the same engines (time per output token; ideal: the relay mode's tokens at "
        "their "
        "models' in-engine decode cost in the same run):",
        "",
        "| concurrency | relay mode | over | speedup | ideal | achieved / ideal | large / small decode cost |",
        "|---|---|---|---|---|---|---|",
    ]
    found = False
    for lv in (lv for lv in r.levels if lv.sampling == sampling):
        for mode, s in lv.speedups.items():
            if s.speedup.median is not None:
                found = True
                lines.append(
                    f"| {lv.concurrency} | {mode} | {s.over} | {s.speedup.text()} | {s.ideal.text()} | "
                    f"{_ratio_text(s)} | {lv.cost_ratio.text()} |"
                )
    if not found:
        lines.append("| - | (no relay mode and its single-model mode both served) | | | | | |")
    same = [(lv.concurrency, k, v) for lv in r.levels if lv.sampling == sampling for k, v in lv.same_text.items()]
    if same:
        lines += [
            "",
            "Identical text (greedy, same prompts and seeds): "
            + "; ".join(f"{k} at {c}: {v:.3f}" for c, k, v in same)
            + ".",
        ]
    return lines


def _auto(r: BenchReport, sampling: str) -> list[str]:
    """Each auto mode against the best fixed mode it chooses between (none: no lines)."""
    rows = [
        f"| {lv.concurrency} | {mode} | {a.best} | {a.p50_ratio.text()} | {lv.modes[mode].auto_relay_share.text()} |"
        for lv in r.levels
        if lv.sampling == sampling
        for mode, a in lv.auto.items()
    ]
    if not rows:
        return []
    return [
        "",
        "`auto` against the best fixed mode it chooses between (that mode's p50 latency over auto's, per round; 1: as "
        "fast):",
        "",
        "| concurrency | auto mode | best fixed mode | best p50 / auto p50 | share run as relay |",
        "|---|---|---|---|---|",
        *rows,
    ]


def _variants(r: BenchReport) -> list[str]:
    """relay beside the same relay on an app that differs in one setting, in rounds of their own."""
    lines = [
        "relay against an app that differs in one setting, deployed beside it, the two interleaved in rounds of their "
        "own:",
        "",
        "| relay with | sampling | concurrency | p50 latency (s) | output tok/s | handoffs (ms/req) | pauses/req | "
        "false stops/req | "
        "router overhead/switch p50 (ms) | handoffs kept on large/req | small share |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, label in r.variants.items():
        for lv in r.levels:
            for key, name in ((f"relay-beside-{mode}", "the defaults"), (mode, label)):
                m = lv.modes.get(key)
                if m is not None:
                    lines.append(
                        f"| {name} | {lv.sampling} | {lv.concurrency} | {m.latency_p50_s.text()} | "
                        f"{m.output_tokens_per_s.text()} | "
                        f"{m.handoffs_ms.text()} | {m.pauses_per_request.text()} | {m.false_stops_per_request.text()} "
                        "| "
                        f"{m.router_overhead_per_switch_ms_p50.text()} | {m.kept_on_large_per_request.text()} | "
                        f"{m.small_token_share.text()} |"
                    )
    return lines


def _err(spreads: list[Spread]) -> list[list[float]]:
    med = [s.median or 0.0 for s in spreads]
    lo = [m - (s.min if s.min is not None else m) for m, s in zip(med, spreads, strict=True)]
    hi = [(s.max if s.max is not None else m) - m for m, s in zip(med, spreads, strict=True)]
    return [lo, hi]


def plots(report: BenchReport, out: Path) -> list[Path]:
    """``speedup.png`` (each relay mode against its single-model mode, every profile and level),
    ``modes-<profile>.png`` (p50 latency and throughput against concurrency, a line a mode that
    served) and ``relay_time_split-<profile>.png``; each only when it has something to draw."""
    from relay_serve.extras import pyplot

    plt = pyplot()

    paths: list[Path] = []
    bars = [(lv, mode, s) for lv in report.levels for mode, s in lv.speedups.items() if s.speedup.median is not None]
    if bars:
        fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(bars) + 2), 4))
        x = list(range(len(bars)))
        ax.bar(
            [i - 0.18 for i in x],
            [s.ideal.median or 0.0 for _, _, s in bars],
            width=0.35,
            yerr=_err([s.ideal for _, _, s in bars]),
            capsize=4,
            label="ideal (in-engine decode costs)",
        )
        ax.bar(
            [i + 0.18 for i in x],
            [s.speedup.median or 0.0 for _, _, s in bars],
            width=0.35,
            yerr=_err([s.speedup for _, _, s in bars]),
            capsize=4,
            label="achieved",
        )
        for i, (_, _, s) in zip(x, bars, strict=False):
            if s.achieved_over_ideal.median is not None:
                ax.text(
                    i + 0.18,
                    (s.speedup.max or s.speedup.median or 0.0) + 0.02,
                    f"{s.achieved_over_ideal.median:.2f}",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(x, [f"{mode}/{s.over}\n{lv.sampling} c={lv.concurrency}" for lv, mode, s in bars], fontsize=7)
        ax.set_ylabel("speedup (time per token), of ideal above")
        ax.set_title(
            f"relay against the large model on the same engines, {report.pair.large} + {report.pair.small}", fontsize=9
        )
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "speedup.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    for sampling in report.profiles():
        levels = [lv for lv in report.levels if lv.sampling == sampling]
        modes = [
            m
            for m in _ordered({m for lv in levels for m in lv.modes if m in MODE_ORDER})
            if any(lv.modes[m].served for lv in levels if m in lv.modes)
        ]
        if modes:
            fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
            for mode in modes:
                pts = [(lv.concurrency, lv.modes[mode]) for lv in levels if mode in lv.modes and lv.modes[mode].served]
                cs = [c for c, _ in pts]
                left.plot(
                    cs,
                    [s.latency_p50_s.median for _, s in pts],
                    marker="o",
                    label=f"{mode} (pass@1 {statistics.fmean(s.pass_at_1 for _, s in pts):.2f})",
                )
                right.plot(cs, [s.output_tokens_per_s.median for _, s in pts], marker="o", label=mode)
            right.set_yscale("log")  # the small model alone writes several times faster than the rest
            for ax, label in ((left, "p50 latency (s)"), (right, "output tokens/s (log scale)")):
                ax.set_xscale("log", base=2)
                ax.set_xticks([lv.concurrency for lv in levels], [str(lv.concurrency) for lv in levels])
                ax.set_xlabel("concurrent requests")
                ax.set_ylabel(label)
                ax.grid(alpha=0.3)
            left.legend(fontsize=7)
            fig.suptitle(
                f"every mode, {PROFILE_TEXT.get(sampling, sampling)} sampling (refused or failed modes left out)",
                fontsize=9,
            )
            fig.tight_layout()
            paths.append(out / f"modes-{sampling}.png")
            fig.savefig(paths[-1], dpi=120)
            plt.close(fig)

        split_levels = [lv for lv in levels if lv.relay_split_ms]
        if split_levels:
            fig, ax = plt.subplots(figsize=(8.5, 4))
            x = list(range(len(split_levels)))
            bottom = [0.0] * len(split_levels)
            for key, label in (
                ("decode", "decode steps"),
                ("first_token", "first token (in the engines)"),
                ("handoffs", "handoffs (in the engines)"),
                ("router", "router"),
                ("outside", "outside the router"),
            ):
                values = [lv.relay_split_ms[key].median or 0.0 for lv in split_levels]
                ax.bar(x, values, bottom=bottom, width=0.5, label=label)
                bottom = [b + v for b, v in zip(bottom, values, strict=False)]
            # The split is a mean over requests: the large model's mean latency is its yardstick.
            large = [_median_mean_latency_ms(report, "large", lv.concurrency, sampling) for lv in split_levels]
            if all(v is not None for v in large):
                ax.hlines(
                    large,
                    [i - 0.3 for i in x],
                    [i + 0.3 for i in x],
                    colors="black",
                    linewidth=2,
                    label="large alone (mean)",
                    zorder=3,
                )
            ax.set_xticks(x, [f"c={lv.concurrency}" for lv in split_levels])
            ax.set_ylabel("ms per request (mean, median round)")
            ax.set_title(f"where a relay request's time goes, {sampling} sampling")
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
            fig.tight_layout()
            paths.append(out / f"relay_time_split-{sampling}.png")
            fig.savefig(paths[-1], dpi=120)
            plt.close(fig)
    return paths


def _median_mean_latency_ms(report: BenchReport, mode: str, concurrency: int, sampling: str) -> float | None:
    means = [
        r.latency_mean_s
        for r in report.runs
        if r.mode == mode and r.concurrency == concurrency and r.sampling == sampling and r.latency_mean_s is not None
    ]
    return 1000 * statistics.median(means) if means else None
