"""The benchmark report as markdown tables and PNG plots."""

from __future__ import annotations

import statistics
from pathlib import Path

from relay_serve.bench.report import RATIO_LIMIT, BenchReport, Spread

MODE_ORDER = ("large", "vllm-large", "relay", "small", "speculative-thinking")


def _ratio_text(lv) -> str:
    text = lv.achieved_over_ideal.text()
    return f"{text} (above {RATIO_LIMIT}: a measurement error, not a result)" if lv.measurement_error else text


def markdown(report: BenchReport) -> str:
    r = report
    rounds = r.settings.get("rounds")
    lines = [
        f"Benchmark {r.started} on {r.machine}: `{r.command}`",
        "",
        f"Pair: large `{r.pair.large}`, small `{r.pair.small}`; cue set {r.pair.cue_set_version} {r.pair.cues}. "
        f"{rounds} rounds; each round runs every mode on the same prompts and seeds, the modes in a rotating order. "
        "Figures are the median over the rounds, [min-max] beside it.",
        "",
        "Speed (time per output token; ideal = relay's tokens at their models' in-engine decode cost in the same run):",
        "",
        "| concurrency | speedup of relay over large | ideal | achieved / ideal | large / small decode cost | relay p50 (s) | large p50 (s) | vLLM serve large p50 (s) | relay pass@1 | large pass@1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in r.levels:
        p50 = {m: s.latency_p50_s.text() for m, s in lv.modes.items()}
        p1 = {m: f"{s.pass_at_1:.3f}" for m, s in lv.modes.items()}
        lines.append(
            f"| {lv.concurrency} | {lv.speedup.text()} | {lv.ideal.text()} | {_ratio_text(lv)} | {lv.cost_ratio.text()} | "
            f"{p50.get('relay', '-')} | {p50.get('large', '-')} | {p50.get('vllm-large', '-')} | {p1.get('relay', '-')} | {p1.get('large', '-')} |"
        )
    lines += [
        "",
        "Every mode:",
        "",
        "| mode | concurrency | p50 latency (s) | p90 latency (s) | output tok/s | pass@1 | small share | switches/req | false stops/req | pauses/req | cached prompt ratio | router overhead/switch p50 (ms) | decode ms/token (large, small) | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in r.levels:
        for mode in sorted((m for m in lv.modes if m in MODE_ORDER), key=MODE_ORDER.index):
            s = lv.modes[mode]
            dec = ", ".join(s.decode_ms_per_token[m].text() if m in s.decode_ms_per_token else "-" for m in ("large", "small"))
            lines.append(
                f"| {mode} | {lv.concurrency} | {s.latency_p50_s.text()} | {s.latency_p90_s.text()} | {s.output_tokens_per_s.text()} | "
                f"{s.pass_at_1:.3f} | {s.small_token_share.text()} | {s.switches_per_request.text()} | {s.false_stops_per_request.text()} | "
                f"{s.pauses_per_request.text()} | "
                f"{s.cached_prompt_token_ratio.text()} | {s.router_overhead_per_switch_ms_p50.text()} | {dec} | {s.errors} |"
            )
    errors = [run for run in r.runs if run.errors]
    if errors:
        lines += ["", "Failed requests (the first error of each run):", ""]
        lines += [f"- {run.mode} at concurrency {run.concurrency}, round {run.round}: {run.errors} failed; {run.first_error}" for run in errors]
    lines += [
        "",
        "Where a relay request's time goes (ms, mean a request): its tokens at their models' decode cost, the rest of the time "
        "inside the engines (handoffs: prefill of the other model's tokens, waiting for a first token), the router, and outside "
        "the router (HTTP, Serve's proxy):",
        "",
        "| concurrency | decode | handoffs | router | outside the router |",
        "|---|---|---|---|---|",
    ]
    for lv in r.levels:
        sp = lv.relay_split_ms
        if sp:
            lines.append(f"| {lv.concurrency} | {sp['decode'].text()} | {sp['handoffs'].text()} | {sp['router'].text()} | {sp['outside'].text()} |")
    lines += [
        "",
        "What a handoff costs inside the engine (relay, the median round): segments after a generation's first, their time to "
        "first token against a decode step of the same model, and the prompt tokens they computed again (not served from the "
        "prefix cache):",
        "",
        "| concurrency | model | resumed segments/req | time to first token (ms) | decode step (ms) | recomputed tokens/segment |",
        "|---|---|---|---|---|---|",
    ]
    for lv in r.levels:
        for model, h in lv.relay_handoff.items():
            lines.append(f"| {lv.concurrency} | {model} | {h.resumed_per_request} | {h.ttft_ms} | {h.decode_ms} | {h.recomputed_tokens} |")
    if r.variants:
        lines += ["", *_variants(r)]
    return "\n".join(lines) + "\n"


def _variants(r: BenchReport) -> list[str]:
    """relay beside the same relay on an app that differs in one setting, in rounds of their own."""
    lines = [
        "relay against an app that differs in one setting, deployed beside it, the two interleaved in rounds of their own:",
        "",
        "| relay with | concurrency | p50 latency (s) | output tok/s | handoffs (ms/req) | pauses/req | false stops/req | router overhead/switch p50 (ms) | handoffs kept on large/req | small share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, label in r.variants.items():
        for lv in r.levels:
            for key, name in ((f"relay-beside-{mode}", "the defaults"), (mode, label)):
                m = lv.modes.get(key)
                if m is not None:
                    lines.append(
                        f"| {name} | {lv.concurrency} | {m.latency_p50_s.text()} | {m.output_tokens_per_s.text()} | {m.handoffs_ms.text()} | "
                        f"{m.pauses_per_request.text()} | {m.false_stops_per_request.text()} | {m.router_overhead_per_switch_ms_p50.text()} | "
                        f"{m.kept_on_large_per_request.text()} | {m.small_token_share.text()} |"
                    )
    return lines


def plots(report: BenchReport, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    levels = report.levels
    labels = [f"c={lv.concurrency}" for lv in levels]
    x = list(range(len(levels)))

    def bars(ax, offset: float, spreads: list[Spread], label: str) -> None:
        med = [s.median or 0.0 for s in spreads]
        err = [[m - (s.min if s.min is not None else m) for m, s in zip(med, spreads)], [(s.max if s.max is not None else m) - m for m, s in zip(med, spreads)]]
        ax.bar([i + offset for i in x], med, width=0.35, yerr=err, capsize=4, label=label)

    fig, ax = plt.subplots(figsize=(7, 4))
    bars(ax, -0.18, [lv.ideal for lv in levels], "ideal (in-engine decode costs)")
    bars(ax, 0.18, [lv.speedup for lv in levels], "achieved")
    for i, lv in zip(x, levels):
        if lv.achieved_over_ideal.median is not None:
            top = lv.speedup.max if lv.speedup.max is not None else lv.speedup.median or 0.0
            ax.text(i + 0.18, top + 0.02, f"{lv.achieved_over_ideal.median:.2f} of ideal", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(x, labels)
    ax.set_ylabel("relay speedup over large (time per token)")
    ax.set_title(f"relay against large, {report.pair.large} + {report.pair.small}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8.5, 4))
    modes = [m for m in MODE_ORDER if all(m in lv.modes for lv in levels)]
    width = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        spreads = [lv.modes[mode].latency_p50_s for lv in levels]
        med = [s.median or 0.0 for s in spreads]
        err = [[m - s.min for m, s in zip(med, spreads)], [s.max - m for m, s in zip(med, spreads)]]
        xs = [i - 0.4 + width * (j + 0.5) for i in x]
        ax.bar(xs, med, width=width, yerr=err, capsize=3, label=mode)
        for xi, lv, s in zip(xs, levels, spreads):
            quality = lv.modes[mode].pass_at_1
            if quality is not None:
                ax.text(xi, s.max or 0.0, f"{quality:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, labels)
    ax.set_ylabel("p50 latency (s), min-max over rounds")
    ax.set_title("latency per mode (pass@1 above each bar)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    paths.append(out / "latency.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    splits = [lv.relay_split_ms for lv in levels]
    if all(splits):
        fig, ax = plt.subplots(figsize=(8.5, 4))
        bottom = [0.0] * len(levels)
        for key, label in (("decode", "decode steps"), ("handoffs", "handoffs (in the engines)"), ("router", "router"), ("outside", "outside the router")):
            values = [sp[key].median or 0.0 for sp in splits]
            ax.bar(x, values, bottom=bottom, width=0.5, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        # The split is a mean over requests: the large model's mean latency is its yardstick.
        large = [_median_mean_latency_ms(report, "large", lv.concurrency) for lv in levels]
        if all(v is not None for v in large):
            ax.hlines(large, [i - 0.3 for i in x], [i + 0.3 for i in x], colors="black", linewidth=2, label="large alone (mean)", zorder=3)
        ax.set_xticks(x, labels)
        ax.set_ylabel("ms per request (mean, median round)")
        ax.set_title("where a relay request's time goes")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        fig.tight_layout()
        paths.append(out / "relay_time_split.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def _median_mean_latency_ms(report: BenchReport, mode: str, concurrency: int) -> float | None:
    means = [r.latency_mean_s for r in report.runs if r.mode == mode and r.concurrency == concurrency and r.latency_mean_s is not None]
    return 1000 * statistics.median(means) if means else None
