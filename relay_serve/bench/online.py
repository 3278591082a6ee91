"""The self-calibration demonstration on the toy pair: a service whose active cue set is the hard
cues, with online calibration on, serves toy traffic sent as ``relay-serve eval --url`` sends it,
round after round; each round records relay pass@1, the small model's token share and the active
set. It stops a few rounds after the active set is the easy cues, and measures the large model's
pass@1 on the same problems as the bar to recover to.

``relay-serve cues converge`` runs it on the embedded app and writes ``converge.json`` and
``converge.png``; tests/serve/test_online_e2e.py runs it on an app of the test cluster.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
from pydantic import BaseModel

from relay_serve.config import AppConfig
from relay_serve.toy.world import EASY_CUES, HARD_CUES


class Round(BaseModel):
    round: int
    served: int  # relay generations served so far, this round's included
    pass_at_1: float
    small_token_share: float
    active_version: str  # after the round
    active_cues: list[str]
    active_source: str  # the version's file inside the cue store (the store is a temporary directory)
    scored: int | None  # generations in the shared statistics


class Convergence(BaseModel):
    rounds: list[Round]
    converged_after: int | None  # relay generations served when the easy set became active
    recovered_pass_at_1: float | None  # relay, once converged, on the problems large_pass_at_1 is measured on
    large_pass_at_1: float
    start_cues: list[str]
    target_cues: list[str]


def online_config(base: AppConfig, store_uri: str, **online) -> AppConfig:
    """``base`` with its cue store at ``store_uri`` and online calibration on with ``online``."""
    cfg = base.model_copy(deep=True)
    cfg.cues.store_uri = store_uri
    cfg.cues.poll_interval_s = 1.0
    cfg.cues.online = cfg.cues.online.model_copy(update={"enabled": True, **online})
    return cfg


def publish_start_set(cfg: AppConfig, cues: list[str]) -> str:
    """Make ``cues`` the active set of ``cfg``'s store (a manual version), as the demonstration's start."""
    from relay_serve.calibration.cues import manual_cue_set, model_pair
    from relay_serve.calibration.store import CueStore

    cue_set = manual_cue_set(model_pair(cfg), cues)
    CueStore(cfg.cues.store_uri, cfg.cues.storage_options).publish(cue_set)
    return cue_set.version


def _in_store(source: str) -> str:
    """A cue set's source without the store's location (``versions/<version>.json``): no machine
    path in a committed result."""
    head, sep, rest = source.rpartition("/versions/")
    return "versions/" + rest if sep else source


def converge(
    base: str,
    per_round: int = 16,
    max_rounds: int = 30,
    after: int = 3,
    concurrency: int = 8,
    target: list[str] | None = None,
    progress: bool = True,
) -> tuple[list[Round], int | None]:
    """Rounds of ``per_round`` toy relay requests against ``base`` until the active set is
    ``target`` (the easy cues) and ``after`` more rounds ran, or ``max_rounds``."""
    from relay_serve.eval.runner import EvalSettings, run_eval

    target = list(target or EASY_CUES)
    rounds: list[Round] = []
    converged_after: int | None = None
    work = Path(tempfile.mkdtemp(prefix="relay-converge-"))
    for i in range(max_rounds):
        s = EvalSettings(
            dataset="toy", mode="relay", n=per_round, seed=1000 + i, concurrency=concurrency, max_tokens=400
        )
        summary = run_eval(s, base, work / f"round-{i}.jsonl", progress=False)
        cues = httpx.get(base + "/v1/relay/cues", timeout=30).json()
        shared = ((cues.get("online") or {}).get("shared") or {}) if isinstance(cues.get("online"), dict) else {}
        row = Round(
            round=i,
            served=per_round * (i + 1),
            pass_at_1=summary.pass_at_1,
            small_token_share=summary.small_token_share,
            active_version=cues["version"],
            active_cues=cues["cues"],
            active_source=_in_store(cues.get("source", "")),
            scored=shared.get("generations"),
        )
        rounds.append(row)
        if progress:
            print(
                f"round {i}: {row.served} served, pass@1 {row.pass_at_1:.3f}, small share {row.small_token_share:.3f}, "
                f"active {row.active_version} {row.active_cues}",
                flush=True,
            )
        if converged_after is None and set(row.active_cues) == set(target):
            converged_after = row.served
        if converged_after is not None and row.served >= converged_after + after * per_round:
            break
    return rounds, converged_after


def summarize(
    rounds: list[Round],
    converged_after: int | None,
    relay_pass_at_1: float | None,
    large_pass_at_1: float,
    start: list[str],
    target: list[str],
) -> Convergence:
    return Convergence(
        rounds=rounds,
        converged_after=converged_after,
        recovered_pass_at_1=relay_pass_at_1,
        large_pass_at_1=large_pass_at_1,
        start_cues=start,
        target_cues=target,
    )


def final_pass_at_1(base: str, n: int = 96, seed: int = 5000, concurrency: int = 8) -> tuple[float, float]:
    """Relay's and the large model's pass@1 on the same ``n`` toy problems, once converged: the
    recovery the demonstration claims, on more problems than a round holds."""
    from relay_serve.eval.runner import EvalSettings, run_eval

    work = Path(tempfile.mkdtemp(prefix="relay-converge-final-"))
    scores = []
    for mode in ("relay", "large"):
        s = EvalSettings(dataset="toy", mode=mode, n=n, seed=seed, concurrency=concurrency, max_tokens=400)
        scores.append(run_eval(s, base, work / f"{mode}.jsonl", progress=False).pass_at_1)
    return scores[0], scores[1]


def plot(c: Convergence, path: Path) -> None:
    from relay_serve.extras import pyplot

    plt = pyplot()

    x = [r.served for r in c.rounds]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.plot(x, [r.pass_at_1 for r in c.rounds], marker="o", label="relay pass@1")
    ax.plot(x, [r.small_token_share for r in c.rounds], marker="s", label="small-model token share")
    ax.axhline(c.large_pass_at_1, color="grey", linestyle="--", label=f"large pass@1 ({c.large_pass_at_1:.3f})")
    if c.converged_after is not None:
        ax.axvline(
            c.converged_after, color="green", linestyle=":", label=f"easy cues active ({c.converged_after} generations)"
        )
    previous = None
    for r in c.rounds:  # each newly active set, written where it was first seen
        if r.active_version != previous:
            ax.annotate(
                " ".join(r.active_cues),
                (r.served, 0.03),
                xytext=(3, 0),
                textcoords="offset points",
                rotation=90,
                fontsize=7,
                color="dimgrey",
                ha="left",
                va="bottom",
            )
            previous = r.active_version
    ax.set_xlabel("relay generations served")
    ax.set_ylim(0, 1.05)
    ax.set_title(
        f"Online cue calibration on the toy pair: from {' '.join(c.start_cues)} to {' '.join(c.target_cues)}",
        fontsize=10,
    )
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


START_CUES, TARGET_CUES = list(HARD_CUES), list(EASY_CUES)


class CostRow(BaseModel):
    setting: str
    sample_rate: float
    explore_rate: float
    requests: int
    latency_p50_s: float
    latency_p90_s: float
    pass_at_1: float


def scoring_cost(
    bases: dict[str, str],
    rates: dict[str, tuple[float, float]],
    rounds: int = 3,
    per_round: int = 32,
    concurrency: int = 8,
) -> list[CostRow]:
    """Relay latency with online calibration off and on, side by side: each round runs the same
    toy problems on every app (``bases``: setting -> URL), in a rotating order."""
    import json
    import statistics

    from relay_serve.eval.runner import EvalSettings, run_eval

    work = Path(tempfile.mkdtemp(prefix="relay-online-cost-"))
    latencies: dict[str, list[float]] = {k: [] for k in bases}
    passed: dict[str, list[float]] = {k: [] for k in bases}
    names = list(bases)
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            s = EvalSettings(
                dataset="toy", mode="relay", n=per_round, seed=2000 + i, concurrency=concurrency, max_tokens=400
            )
            path = work / f"{name}-{i}.jsonl"
            summary = run_eval(s, bases[name], path, progress=False)
            latencies[name] += [json.loads(line)["latency_s"] for line in path.read_text().splitlines() if line.strip()]
            passed[name].append(summary.pass_at_1)
    rows = []
    for name in names:
        q = statistics.quantiles(latencies[name], n=10)
        rows.append(
            CostRow(
                setting=name,
                sample_rate=rates[name][0],
                explore_rate=rates[name][1],
                requests=len(latencies[name]),
                latency_p50_s=statistics.median(latencies[name]),
                latency_p90_s=q[8],
                pass_at_1=statistics.fmean(passed[name]),
            )
        )
    return rows
