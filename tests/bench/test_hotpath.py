"""The hot-path bench runs the real router and replica code over a vocabulary of Qwen3's size and
reports its figures (no Ray, no vLLM: a stand-in engine writes a fixed trace)."""

from __future__ import annotations

import json

from relay_serve.bench.hotpath import parse_contexts


def test_the_hotpath_bench_reports_every_figure(capsys):
    from relay_serve.bench.hotpath import main

    main(["--contexts", "1k,2k", "--tokens", "128", "--repeats", "1", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["vocab_size"] == 151_936 and report["index_build_s"] > 0
    assert 0 < report["pause_ids_ms"] < report["pause_ids_scan_ms"] and report["pause_ids_64_chars_ms"] > 0
    for key in (
        "router_cpu_ms_per_switch",
        "replica_cpu_ms_per_segment",
        "router_cpu_us_per_token",
        "replica_cpu_us_per_token",
        "prompt_tokenize_ms",
    ):
        assert set(report[key]) == {"1k", "2k"} and all(v > 0 for v in report[key].values()), key
    handling = report["replica_segment_handling_ms"]
    assert set(handling) == {"1k", "2k"}
    assert all(set(h) == {"first", "continuing"} and all(v > 0 for v in h.values()) for h in handling.values())
    assert all(n >= 2 for n in report["switches_per_request"].values())  # the trace's cues made the models switch
    assert 0 < report["pause_ids_count"] < 151_936 and 0 < report["pause_ids_64_chars_count"] < 151_936
    assert set(report["full_collection_ms"]) == {"frozen", "unfrozen"}
    assert all(v >= 0 for v in report["full_collection_ms"].values())


def test_contexts_are_read_in_tokens():
    assert parse_contexts("1k, 8k,32k") == {"1k": 1024, "8k": 8192, "32k": 32768}
    assert parse_contexts("3000") == {"3000": 3000}
