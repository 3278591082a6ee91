"""The benchmark: per-run figures from responses and engine timings, the speedup against its bound
over rounds, the report files and summary line, the vLLM baseline's command line; and, on the real
app, that engines report their timings and that vLLM's own server writes what relay-serve's large
mode writes for the same seed."""

from __future__ import annotations

import math

import pytest

from relay_serve.bench.report import (
    BenchReport,
    PairInfo,
    level_report,
    pct,
    run_metrics,
)
from relay_serve.bench.vllm_baseline import engine_cli_args


def engine_request(model: str, prompt: int, cached: int, out: int, ttft: float, decode: float) -> dict:
    return {
        "model": model,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": out,
        "ttft_s": ttft,
        "decode_s": decode,
        "engine_s": ttft + decode + 0.001,
        "wall_s": ttft + decode + 0.002,
    }


def relay_result(latency: float, correct: bool = True) -> dict:
    """A relay response: large writes 11 tokens, small 5, large 4 more (2 switches)."""
    reqs = [
        engine_request("large", 20, 0, 11, ttft=0.030, decode=10 * 0.020),
        engine_request("small", 31, 0, 5, ttft=0.008, decode=4 * 0.002),
        engine_request("large", 36, 32, 4, ttft=0.040, decode=3 * 0.020),
    ]
    engine_s = sum(e["engine_s"] for e in reqs)
    usage = {
        "completion_tokens": 20,
        "relay": {
            "large_tokens": 15,
            "small_tokens": 5,
            "switches": 2,
            "wall_s": engine_s + 0.004,
            "engine_s": engine_s,
        },
    }
    return {
        "_latency_s": latency,
        "_correct": correct,
        "usage": usage,
        "relay_engine_requests": reqs,
        "choices": [{"message": {"content": "x"}}],
    }


def single_result(latency: float, model: str, tokens: int, step: float) -> dict:
    reqs = [engine_request(model, 20, 0, tokens, ttft=0.03, decode=(tokens - 1) * step)]
    relay = {
        "large_tokens": tokens if model == "large" else 0,
        "small_tokens": tokens if model == "small" else 0,
        "switches": 0,
        "wall_s": latency - 0.01,
        "engine_s": reqs[0]["engine_s"],
    }
    return {
        "_latency_s": latency,
        "_correct": True,
        "usage": {"completion_tokens": tokens, "relay": relay},
        "relay_engine_requests": reqs,
    }


def test_pct():
    values = [3.0, 1.0, 7.0, 2.0, 10.0]
    assert (pct(values, 0.0), pct(values, 0.5), pct(values, 1.0)) == (1.0, 3.0, 10.0)
    assert pct(values, 0.9) == pytest.approx(8.8)
    assert math.isnan(pct([], 0.5))


def test_run_metrics_of_relay_responses():
    results = [relay_result(0.40), relay_result(0.50, correct=False), {"_error": "HTTP 502: engine"}]
    m = run_metrics("relay", 1, 0, results, wall_s=1.0)
    assert (m.requests, m.errors, m.pass_at_1) == (3, 1, round(1 / 3, 4))
    assert m.latency_p50_s == 0.45 and m.s_per_token == pytest.approx(0.9 / 40)
    assert m.small_token_share == 0.25 and m.switches_per_request == 2
    assert m.decode_ms_per_token == {"large": 20.0, "small": 2.0}  # decode time over the steps after each first token
    # ideal: 15 large tokens at 20 ms and 5 small at 2 ms, per token
    assert m.ideal_s_per_token == pytest.approx((15 * 0.020 + 5 * 0.002) / 20)
    assert m.router_overhead_per_switch_ms_p50 == pytest.approx(2.0)
    assert m.cached_prompt_token_ratio == round(32 / 87, 4)
    # every engine request after a generation's first is a handoff
    assert (
        m.handoff["large"].resumed_per_request == 1
        and m.handoff["large"].ttft_ms == 40.0
        and m.handoff["large"].recomputed_tokens == 4
    )
    assert m.handoff["small"].ttft_ms == 8.0 and m.handoff["small"].recomputed_tokens == 31
    split = m.split_ms
    assert split["decode"] == pytest.approx(310.0) and split["router"] == pytest.approx(4.0)
    engine_ms = 1000 * results[0]["usage"]["relay"]["engine_s"]
    # the first engine request's 30 ms to its first token is the generation's, not a handoff's
    assert split["first_token"] == pytest.approx(30.0)
    assert split["handoffs"] == pytest.approx(engine_ms - 310.0 - 30.0, abs=0.01)
    assert split["outside"] == pytest.approx(450.0 - engine_ms - 4.0, abs=0.01)


def test_run_metrics_of_a_plain_openai_server():
    plain = {
        "_latency_s": 1.0,
        "_correct": True,
        "usage": {"completion_tokens": 50},
        "choices": [{"message": {"content": "x"}}],
    }
    m = run_metrics("vllm-large", 1, 0, [plain], wall_s=1.0)
    assert m.latency_p50_s == 1.0 and m.pass_at_1 == 1.0 and m.s_per_token == 0.02
    assert m.small_token_share is None and m.ideal_s_per_token is None and m.decode_ms_per_token == {}


def runs_of_three_rounds(relay_latency: float = 0.40):
    runs = []
    for k, jitter in enumerate((0.0, 0.05, -0.05)):
        runs.append(run_metrics("large", 1, k, [single_result(0.60 + jitter, "large", 20, 0.02)], 1.0))
        runs.append(run_metrics("small", 1, k, [single_result(0.06, "small", 20, 0.002)], 1.0))
        runs.append(run_metrics("relay", 1, k, [relay_result(relay_latency + jitter)], 1.0))
    return runs


def test_speedup_and_its_bound_over_rounds():
    lv = level_report(1, runs_of_three_rounds())
    # per round: large 0.6 s / 20 tokens against relay 0.4 s / 20 tokens; ideal: relay at decode cost (0.31 s)
    assert lv.speedup.median == pytest.approx(1.5) and lv.speedup.min < lv.speedup.median < lv.speedup.max
    assert lv.ideal.median == pytest.approx(0.6 / 0.31, abs=1e-3)
    assert lv.achieved_over_ideal.median == pytest.approx(0.31 / 0.40, abs=1e-3) and not lv.measurement_error
    assert lv.cost_ratio.median == 10.0  # large's in-engine decode cost over small's, each alone
    assert set(lv.relay_split_ms) == {"decode", "first_token", "handoffs", "router", "outside"}
    assert lv.modes["relay"].pass_at_1 == 1.0 and lv.modes["large"].latency_p50_s.median == 0.6


def test_an_achieved_speedup_above_its_bound_is_a_measurement_error():
    # a relay faster than its own decode steps allow: the engines' timings and the client's disagree
    lv = level_report(1, runs_of_three_rounds(relay_latency=0.28))
    assert lv.achieved_over_ideal.max > 1.05 and lv.measurement_error
    from relay_serve.bench.render import markdown

    report = BenchReport(
        started="t",
        machine="m",
        command="relay-serve bench",
        settings={"rounds": 3},
        pair=PairInfo(large="a", small="b"),
        levels=[lv],
        runs=[],
    )
    assert "a measurement error, not a result" in markdown(report)


def test_report_files_and_summary_line(tmp_path):
    from relay_serve.bench.render import markdown, plots

    runs = runs_of_three_rounds()
    runs += [
        run_metrics(
            "vllm-large", 1, k, [{"_latency_s": 0.55, "_correct": True, "usage": {"completion_tokens": 20}}], 1.0
        )
        for k in range(3)
    ]
    runs += [run_metrics("relay-bounded", 1, k, [relay_result(0.45)], 1.0) for k in range(3)]
    runs += [run_metrics("relay-beside-relay-bounded", 1, k, [relay_result(0.42)], 1.0) for k in range(3)]
    report = BenchReport(
        started="2026-12-04 12:00",
        machine="x86_64, 2 CPUs",
        command="relay-serve bench",
        settings={"rounds": 3},
        pair=PairInfo(large="toy:large-wide", small="toy:small", cue_set_version="v1", cues=["Thus,"]),
        levels=[level_report(1, runs)],
        runs=runs,
        variants={"relay-bounded": "at most 4 small-model segments in flight"},
    )
    md = markdown(report)
    assert "`relay-serve bench`" in md and "toy:large-wide" in md and "| 1 | relay | large | 1.5 [" in md
    assert (
        "| paper | vllm-large | 1 | 0.55 |" in md
        and "| at most 4 small-model segments in flight | paper | 1 | 0.45 |" in md
    )
    assert "| the defaults | paper | 1 | 0.42 |" in md
    assert "| paper | 1 | large | 1.0 | 40.0 | 20.0 | 4.0 |" in md
    paths = plots(report, tmp_path)
    assert [p.name for p in paths] == ["speedup.png", "modes-paper.png", "relay_time_split-paper.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    summary = report.summary()
    (level,) = summary["levels"]
    assert set(level) == {
        "concurrency",
        "speedup",
        "ideal",
        "achieved_over_ideal",
        "measurement_error",
        "relay_pass_at_1",
        "large_pass_at_1",
        "relay_p50_s",
        "large_p50_s",
        "vllm_large_p50_s",
        "router_overhead_per_switch_ms",
        "modes",
        "auto_over_best",
        "spec_acceptance_length",
    }
    assert (
        level["vllm_large_p50_s"] == 0.55
        and summary["pair"]["large"] == "toy:large-wide"
        and summary["sampling"] == "paper"
    )
    assert level["modes"]["vllm-large"] == {"p50_s": 0.55, "tok_s": 20.0, "pass_at_1": 1.0}
    assert (
        BenchReport.model_validate_json(report.model_dump_json()) == report
    )  # bench.json reads back as the typed report


def test_engine_arguments_become_vllm_flags():
    flags = engine_cli_args(
        {
            "max_model_len": 1024,
            "enforce_eager": True,
            "dtype": "float32",
            "speculative_config": {"method": "eagle3"},
            "x": False,
        }
    )
    assert flags == [
        "--enable-prefix-caching",
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--speculative-config",
        '{"method": "eagle3"}',
        "--no-x",
    ]
    assert engine_cli_args({"enable_prefix_caching": False})[0] == "--no-enable-prefix-caching"


@pytest.mark.serve
def test_engines_time_their_requests_on_the_real_app(relay_app):
    from relay_serve.bench.bench import BenchSettings, Target, measure
    from relay_serve.eval.datasets import load_problems

    s = BenchSettings(requests_per_level=3, max_tokens=120)
    m = measure(Target(base=relay_app, model="relay"), "relay", s, load_problems("toy", 6), c=3, round_=0)
    assert m.errors == 0 and m.switches_per_request > 0
    assert set(m.decode_ms_per_token) == {"large", "small"} and all(0 < v < 100 for v in m.decode_ms_per_token.values())
    assert m.ideal_s_per_token is not None and m.ideal_s_per_token < m.s_per_token  # a bound, in a real run
    assert all(h.ttft_ms is not None and h.ttft_ms > 0 for h in m.handoff.values())


@pytest.mark.serve
@pytest.mark.vllm
def test_vllm_serve_writes_what_the_large_mode_writes(relay_app, tmp_path):
    """The baseline runs the same engine with the same arguments: for a seed, relay-serve's large
    mode (whose single engine request samples with the request's seed) and vLLM's server agree.
    The server's IPC sockets are in a folder of its own, gone when it stops."""
    import asyncio

    from relay_serve.bench.bench import fire
    from relay_serve.bench.vllm_baseline import VLLMServer
    from relay_serve.client import chat_body
    from relay_serve.cluster import free_port
    from relay_serve.config import AppConfig

    body = dict(max_tokens=200, temperature=0.8, top_p=0.95, top_k=20)
    prompts = ["Start at b3. Follow the map four times.", "Start at k11. Follow the map five times."]
    ours, _ = asyncio.run(
        fire(relay_app, [chat_body("large", p, seed=7 + i, **body) for i, p in enumerate(prompts)], 2)
    )
    with VLLMServer(AppConfig().large, port=free_port(), log=tmp_path / "vllm.log") as vllm:
        theirs, _ = asyncio.run(
            fire(vllm.base, [chat_body(vllm.served_name, p, seed=7 + i, **body) for i, p in enumerate(prompts)], 2)
        )
        folder = vllm.ipc_dir
        assert folder is not None and any(f.is_socket() for f in folder.iterdir())
    assert not folder.exists()
    texts = [[r["choices"][0]["message"]["content"] for r in rs] for rs in (ours, theirs)]
    assert texts[0] == texts[1] and all("</think>" in t for t in texts[0])


def spec_result(latency: float, accepted: bool = True) -> dict:
    r = single_result(latency, "large", 20, 0.005)
    r["choices"] = [{"message": {"content": "same" if accepted else "other"}}]
    return r


def test_profiles_refused_modes_and_speculative_pairs(tmp_path):
    """Two sampling profiles: greedy, where every mode served, and paper, where the speculative
    modes were refused (HTTP 400): the report keeps both, says which were refused, draws what
    it has, and prints one summary line a profile with every mode's cell."""
    from relay_serve.bench.render import markdown, plots
    from relay_serve.bench.report import SpecStats

    refused = {
        "_error": "HTTP 400: temperature=0.6: the large model's engine runs only greedy sampling correctly",
        "_status": 400,
    }
    runs = []
    for sampling in ("greedy", "paper"):
        for k in range(3):
            runs.append(
                run_metrics(
                    "large",
                    1,
                    k,
                    [single_result(0.60, "large", 20, 0.02) | {"choices": [{"message": {"content": "same"}}]}],
                    1.0,
                    sampling,
                )
            )
            runs.append(run_metrics("relay", 1, k, [relay_result(0.40)], 1.0, sampling))
            if sampling == "greedy":
                fast = run_metrics("large+spec", 1, k, [spec_result(0.20)], 1.0, sampling)
                fast.spec = SpecStats(drafts=5, acceptance_length=4.2, acceptance_rate=0.8)
                other = relay_result(0.25) | {"choices": [{"message": {"content": "y"}}]}  # relay wrote "x"
                runs += [fast, run_metrics("relay+spec", 1, k, [other], 1.0, sampling)]
            else:
                runs += [run_metrics(m, 1, k, [refused], 1.0, sampling) for m in ("large+spec", "relay+spec")]
    levels = [level_report(1, [r for r in runs if r.sampling == p]) for p in ("greedy", "paper")]
    report = BenchReport(
        started="t",
        machine="m",
        command="relay-serve bench --sampling greedy,paper",
        settings={"rounds": 3, "spec_tokens": 4},
        pair=PairInfo(large="a", small="b"),
        levels=levels,
        runs=runs,
    )
    greedy, paper = levels
    assert greedy.speedups["relay+spec"].over == "large+spec" and greedy.speedups[
        "relay+spec"
    ].speedup.median == pytest.approx(0.8)
    assert "relay+spec" not in paper.speedups or paper.speedups["relay+spec"].speedup.median is None
    assert greedy.same_text == {"large=large+spec": 1.0, "relay=relay+spec": 0.0}
    assert paper.same_text == {}  # sampled texts are not compared
    assert paper.modes["large+spec"].refused == 3 and not paper.modes["large+spec"].served
    assert greedy.best() == "large+spec" and paper.best() == "relay"
    md = markdown(report)
    assert "## Sampling: greedy" in md and "## Sampling: the paper's" in md and "| refused |" in md
    assert "large+spec, paper sampling: 3 failed in all; HTTP 400: temperature=0.6" in md
    names = [p.name for p in plots(report, tmp_path)]
    assert names == [
        "speedup.png",
        "modes-greedy.png",
        "relay_time_split-greedy.png",
        "modes-paper.png",
        "relay_time_split-paper.png",
    ]
    lines = report.summaries()
    assert [line["sampling"] for line in lines] == ["greedy", "paper"]
    g, p = (line["levels"][0] for line in lines)
    assert g["spec_acceptance_length"] == 4.2 and p["spec_acceptance_length"] is None
    assert g["modes"]["large+spec"] == {"p50_s": 0.2, "tok_s": 20.0, "pass_at_1": 1.0}
    assert p["modes"]["relay+spec"] == {"p50_s": None, "tok_s": 0.0, "pass_at_1": None}


def test_decode_cost_counts_the_steps_the_engine_reports():
    """A resumable segment that paused twice wrote three chunks: its first token of each chunk came
    after a prefill, so 20 tokens took 17 decode steps, not 19."""
    r = relay_result(0.4)
    r["relay_engine_requests"][0] |= {"output_tokens": 20, "decode_s": 17 * 0.02, "decode_steps": 17}
    r["relay_engine_requests"][2] |= {"decode_steps": 3}
    m = run_metrics("relay", 1, 0, [r], 1.0)
    assert m.decode_ms_per_token["large"] == pytest.approx(20.0)


def test_the_speculative_app_and_its_schedule():
    from relay_serve.bench.bench import default_pair, parse_schedule, spec_app

    assert parse_schedule("1-31:8,32-63:4,64-:0") == [(1, 31, 8), (32, 63, 4), (64, 1 << 16, 0)]
    assert parse_schedule("none") is None
    for bad in ("2-31:8", "1-31", "1-31:x", "1-0:4", "1-9:-1"):
        with pytest.raises(ValueError):
            parse_schedule(bad)
    cfg = default_pair()
    spec = spec_app(cfg, 8, parse_schedule("1-31:8,32-:0"))
    draft = spec.large.engine_args["speculative_config"]
    assert (spec.name, spec.route_prefix, draft["method"], draft["model"]) == (
        "spec",
        "/spec",
        "draft_model",
        "toy:small",
    )
    assert spec.large.resolved_engine_args["speculative_config"]["model"] == cfg.small.model_path
    assert draft["num_speculative_tokens"] == 8 and draft["num_speculative_tokens_per_batch_size"] == [
        [1, 31, 8],
        [32, 1 << 16, 0],
    ]
    assert "speculative_config" not in cfg.large.engine_args  # the default app is left as it was
    assert spec.cues.store_uri == cfg.cues.store_uri  # the same pair: the same calibrated cues


def test_the_sweep_serves_the_shortest_exact_draft_within_two_percent_of_the_fastest():
    from relay_serve.bench.spec_sweep import BatchFigures, DraftLength, SweepReport

    def k(n, speeds, same=1.0):
        return DraftLength(
            k=n,
            batches=[
                BatchFigures(batch=b, tok_s=v, acceptance_length=None, same_text_as_k0=same, pass_at_1=1.0)
                for b, v in zip((1, 8, 32, 64), speeds, strict=True)
            ],
        )

    report = SweepReport(
        model="l",
        draft="s",
        problems=64,
        resumable="fails",
        ks=[
            k(0, [100, 400, 800, 900]),
            k(2, [200, 700, 960, 950]),
            k(8, [340, 800, 930, 905]),
            k(12, [345, 790, 915, 700]),
            k(16, [400, 900, 990, 999], same=0.9),  # fastest, but not exact: never chosen
        ],
    )
    assert [report.best_k(b) for b in (1, 8, 32, 64)] == [8, 8, 2, 2]  # 12 is faster at 1, but within 2%
    assert report.schedule() == [[1, 31, 8], [32, 1 << 16, 2]]
    assert "1-31" not in report.table() and "[[1, 31, 8], [32, 65536, 2]]" in report.table()


def test_auto_modes_learn_every_level_before_the_rounds(monkeypatch):
    """Only the auto modes learn, at each level with max(16, auto_learn x level) generations at that
    concurrency, on seeds of no measured round; a mode its app refuses stops at its first level;
    auto_learn 0 runs nothing."""
    from relay_serve.bench import bench
    from relay_serve.bench.bench import BenchSettings, Target, learn_auto
    from relay_serve.eval.datasets import load_problems

    calls = []

    async def fake_fire(base, bodies, concurrency):
        calls.append((base, len(bodies), concurrency, {b["seed"] for b in bodies}))
        if base == "spec":  # the speculative app refuses sampled requests
            return [{"_error": "HTTP 400: temperature", "_status": 400} for _ in bodies], 0.1
        return [{"choices": []} for _ in bodies], 0.1

    monkeypatch.setattr(bench, "fire", fake_fire)
    found = {
        "large": Target(base="main", model="large"),
        "auto": Target(base="main", model="auto"),
        "relay+spec": Target(base="spec", model="relay"),
        "auto+spec": Target(base="spec", model="auto"),
    }
    s = BenchSettings(concurrency=[1, 8, 32], rounds=2, auto_learn=6, seed=0)
    ran = learn_auto(found, s, load_problems("toy", 64), progress=False, sampling="paper")
    assert ran == {"auto": 16 + 48 + 192, "auto+spec": 16}
    assert [(b, n, c) for b, n, c, _ in calls] == [("main", 16, 1), ("main", 48, 8), ("main", 192, 32), ("spec", 16, 1)]
    measured_seeds = {s.seed + 1000 * k + i for k in range(s.rounds) for i in range(192)}
    assert all(not seeds & measured_seeds for *_, seeds in calls)
    calls.clear()
    assert learn_auto(found, s.model_copy(update={"auto_learn": 0}), [], progress=False, sampling="paper") == {
        "auto": 0,
        "auto+spec": 0,
    }
    assert calls == []


def test_auto_is_measured_against_the_fixed_mode_that_was_best_over_all_rounds():
    """The best fixed mode is chosen once (lowest median p50), then compared with auto round by
    round: in the round where large happened to beat relay, auto is still set against relay."""
    from relay_serve.bench.render import markdown

    large_p50, relay_p50, auto_p50 = (0.60, 0.30, 0.70), (0.40, 0.45, 0.38), (0.42, 0.44, 0.40)
    runs = []
    for k in range(3):
        auto = relay_result(auto_p50[k])
        auto["usage"]["relay"]["policy"] = "relay" if k else "large"
        runs += [
            run_metrics("large", 8, k, [single_result(large_p50[k], "large", 20, 0.02)], 1.0),
            run_metrics("relay", 8, k, [relay_result(relay_p50[k])], 1.0),
            run_metrics("auto", 8, k, [auto], 1.0),
        ]
    lv = level_report(8, runs)
    assert set(lv.auto) == {"auto"}  # no auto+spec ran
    assert lv.auto["auto"].best == "relay"  # median 0.40 against large's 0.60
    ratios = sorted(r / a for r, a in zip(relay_p50, auto_p50, strict=True))
    assert lv.auto["auto"].p50_ratio.median == pytest.approx(ratios[1], abs=1e-3)
    assert lv.auto["auto"].p50_ratio.min == pytest.approx(ratios[0], abs=1e-3)
    report = BenchReport(
        started="t",
        machine="m",
        command="relay-serve bench",
        settings={"rounds": 3},
        pair=PairInfo(large="a", small="b"),
        levels=[lv],
        runs=runs,
    )
    (line,) = report.summaries()
    assert line["levels"][0]["auto_over_best"] == {"auto": lv.auto["auto"].p50_ratio.median}
    assert f"| 8 | auto | relay | {lv.auto['auto'].p50_ratio.text()} | 1 [0-1] |" in markdown(report)


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_two_rounds_run_each_pair_of_modes_once_each_way_round_and_every_mode_at_the_same_mean_place(n: int):
    from relay_serve.bench.bench import round_order

    modes = [f"m{i}" for i in range(n)]
    for j in range(4):
        first, second = round_order(modes, 2 * j), round_order(modes, 2 * j + 1)
        assert sorted(first) == sorted(second) == modes
        for a in modes:
            for b in modes:
                if a != b:
                    assert (first.index(a) < first.index(b)) != (second.index(a) < second.index(b))
            assert first.index(a) + second.index(a) == n - 1
    assert n < 2 or len({round_order(modes, 2 * j)[0] for j in range(n)}) == n  # each mode leads a round pair
