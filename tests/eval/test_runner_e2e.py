"""``relay-serve eval`` against the running toy app: records, summary, answer agreement."""

from __future__ import annotations

import json

import pytest

from relay_serve.eval.runner import EvalSettings, run_agreement, run_eval, summarize

pytestmark = pytest.mark.serve


def test_eval_large_and_relay(relay_app, tmp_path):
    large = run_eval(
        EvalSettings(mode="large", n=8, temperature=0.0, max_tokens=200),
        relay_app,
        tmp_path / "large.jsonl",
        progress=False,
    )
    assert large.n == 8 and large.errors == 0
    assert large.pass_at_1 == 1.0  # the trained large model solves the toy task greedily
    assert large.small_token_share == 0.0 and large.switches_per_request == 0.0
    relay = run_eval(
        EvalSettings(mode="relay", n=8, samples=2, max_tokens=200), relay_app, tmp_path / "relay.jsonl", progress=False
    )
    records = [json.loads(line) for line in (tmp_path / "relay.jsonl").read_text().splitlines()]
    assert len(records) == 16 and {r["sample"] for r in records} == {0, 1}
    assert relay.small_token_share > 0 and relay.switches_per_request > 0
    assert relay.pass_at_1 == summarize(EvalSettings(mode="relay"), records, "x").pass_at_1


def test_answer_agreement(relay_app, tmp_path):
    result = run_agreement(EvalSettings(n=6, max_tokens=200), relay_app, tmp_path / "agree.jsonl", progress=False)
    assert result.n == 6 and result.large_correct == 1.0
    assert 0.0 <= result.agreement <= 1.0
    lines = (tmp_path / "agree.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all("</think>" not in json.loads(line)["small_answer"] for line in lines)


def test_failed_requests_count_as_wrong(relay_app, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"problem": "x " * 5000, "answer": "1"}) + "\n")  # longer than the context
    out = run_eval(
        EvalSettings(dataset=f"jsonl:{path}", mode="large", n=1), relay_app, tmp_path / "r.jsonl", progress=False
    )
    assert out.errors == 1 and out.pass_at_1 == 0.0
    assert "HTTP 400" in json.loads((tmp_path / "r.jsonl").read_text())["error"]


def test_eval_with_the_requests_own_cues(relay_app, tmp_path):
    hard = ["First,", "Next,", "Now,"]
    out = run_eval(
        EvalSettings(mode="relay", n=6, max_tokens=200, cues=hard), relay_app, tmp_path / "hard.jsonl", progress=False
    )
    records = [json.loads(line) for line in (tmp_path / "hard.jsonl").read_text().splitlines()]
    assert out.errors == 0 and out.cues == hard and out.switches_per_request > 0
    assert all(r["cues"] == hard and r["cue_set_version"] == "request" for r in records)
    shared = run_eval(
        EvalSettings(mode="relay", n=2, max_tokens=200), relay_app, tmp_path / "shared.jsonl", progress=False
    )
    assert shared.cues != hard  # the request's cues never reached the shared set


def test_cues_are_for_relay_only():
    with pytest.raises(ValueError, match="relay mode only"):
        EvalSettings(mode="large", cues=["Thus,"])
