"""Batch inference: Ray Data reading with exact line numbers, malformed rows reported, parts written
whole, resume without duplicates; end to end through the real router's deployment handle."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relay_serve.jobs.batch import (
    ERRORS_FILE,
    BatchSettings,
    Output,
    run_batch,
    run_batch_async,
)


def fake_response(body: dict[str, Any]) -> dict[str, Any]:
    prompt = body["messages"][-1]["content"]
    return {
        "response": {
            "choices": [{"message": {"role": "assistant", "content": f"echo {prompt}"}, "finish_reason": "stop"}],
            "usage": {
                "prompt_tokens": 3,
                "completion_tokens": 4,
                "total_tokens": 7,
                "relay": {
                    "large_tokens": 3,
                    "small_tokens": 1,
                    "switches": 1,
                    "segments": 2,
                    "cached_prompt_tokens": 0,
                },
            },
        }
    }


def write_jsonl(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")


def read_results(out: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for part in sorted(out.glob("part-*")):
        assert not part.name.endswith(".tmp")
        if part.suffix == ".parquet":
            rows += pq.read_table(part).to_pylist()
        else:
            rows += [json.loads(line) for line in part.read_text().splitlines()]
    return rows


def read_errors(out: Path) -> list[dict[str, Any]]:
    path = out / ERRORS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.ray
def test_malformed_lines_are_reported_with_their_line_numbers(ray_cluster, tmp_path):
    src = tmp_path / "in.jsonl"
    write_jsonl(
        src,
        [
            json.dumps({"id": "a", "prompt": "one"}),  # 1
            json.dumps({"id": "b", "messages": [{"role": "user", "content": "two"}]}),  # 2
            "{not json",  # 3
            "",  # 4: blank, not a row
            json.dumps({"id": "c"}),  # 5: neither prompt nor messages
            json.dumps(["a", "list"]),  # 6
            json.dumps({"id": "a", "prompt": "again"}),  # 7: duplicate id
            json.dumps({"prompt": "no id", "max_tokens": 9}),  # 8: id defaults to line-8
            json.dumps({"id": "d", "prompt": "x", "max_tokens": "many"}),  # 9: wrong type
        ],
    )
    seen: list[dict[str, Any]] = []

    async def call(body: dict[str, Any]) -> dict[str, Any]:
        seen.append(body)
        return fake_response(body)

    s = BatchSettings(input=str(src), output=str(tmp_path / "out"), format="jsonl", max_tokens=32)
    summary = asyncio.run(run_batch_async(s, call, progress=False))

    results = read_results(tmp_path / "out")
    assert sorted(r["id"] for r in results) == ["a", "b", "line-8"]
    by_id = {r["id"]: r for r in results}
    assert by_id["a"]["line"] == 1 and by_id["line-8"]["line"] == 8
    assert by_id["b"]["text"] == "echo two" and by_id["a"]["small_tokens"] == 1
    errors = read_errors(tmp_path / "out")
    assert [(e["line"], e["kind"]) for e in sorted(errors, key=lambda e: e["line"])] == [
        (3, "malformed"),
        (5, "malformed"),
        (6, "malformed"),
        (7, "malformed"),
        (9, "malformed"),
    ]
    assert "max_tokens" in next(e for e in errors if e["line"] == 9)["error"]
    assert "duplicate id 'a'" in next(e for e in errors if e["line"] == 7)["error"]
    # the row's own max_tokens wins over the run's default
    assert {b["messages"][-1]["content"]: b["max_tokens"] for b in seen} == {"one": 32, "two": 32, "no id": 9}
    assert summary.written == 3 and summary.malformed == 5 and summary.failed == 0 and summary.rows_read == 8
    assert summary.small_token_share == 0.25
    assert json.loads((tmp_path / "out" / "_summary.json").read_text())["written"] == 3


@pytest.mark.ray
def test_stopped_run_resumes_without_duplicates(ray_cluster, tmp_path):
    n = 40
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": f"q{i}", "prompt": f"p{i}"} for i in range(n)]), src)
    out = tmp_path / "out"
    s = BatchSettings(input=str(src), output=str(out), concurrency=4, part_rows=3)
    calls = 0
    stop_after = 13

    async def stopping(body: dict[str, Any]) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls > stop_after:
            await asyncio.sleep(3600)  # hangs until the run is stopped
        await asyncio.sleep(0.001)
        return fake_response(body)

    async def stop_midway() -> None:
        task = asyncio.create_task(run_batch_async(s, stopping, progress=False))
        while calls <= stop_after + 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(stop_midway())
    first = read_results(out)
    assert len(first) == stop_after  # everything that finished was written, even the last partial part

    resumed: list[str] = []

    async def ok(body: dict[str, Any]) -> dict[str, Any]:
        resumed.append(body["messages"][-1]["content"])
        return fake_response(body)

    summary = asyncio.run(run_batch_async(s, ok, progress=False))
    assert summary.skipped_done == stop_after and summary.written == n - stop_after
    ids = [r["id"] for r in read_results(out)]
    assert sorted(ids) == sorted(f"q{i}" for i in range(n))  # all there, none twice
    assert len(resumed) == n - stop_after
    assert not set(resumed) & {r["text"].removeprefix("echo ") for r in first}
    assert Output(str(out), "parquet").done_ids() == set(ids)


@pytest.mark.ray
def test_server_errors_are_retried_and_client_errors_reported(ray_cluster, tmp_path):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [json.dumps({"id": f"r{i}", "prompt": f"p{i}"}) for i in range(3)])
    attempts: dict[str, int] = {}

    async def flaky(body: dict[str, Any]) -> dict[str, Any]:
        prompt = body["messages"][-1]["content"]
        attempts[prompt] = attempts.get(prompt, 0) + 1
        if prompt == "p0" and attempts[prompt] == 1:
            return {"error": {"message": "engine failed"}, "status": 503}
        if prompt == "p1":
            return {"error": {"message": "max_tokens too large", "param": "max_tokens"}, "status": 400}
        if prompt == "p2":
            raise RuntimeError("replica died")
        return fake_response(body)

    s = BatchSettings(input=str(src), output=str(tmp_path / "out"), retries=1)
    summary = asyncio.run(run_batch_async(s, flaky, progress=False))
    assert [r["id"] for r in read_results(tmp_path / "out")] == ["r0"]
    assert attempts == {"p0": 2, "p1": 1, "p2": 2}  # 4xx is not retried
    errors = {e["id"]: e for e in read_errors(tmp_path / "out")}
    assert errors["r1"]["kind"] == "failed" and "HTTP 400" in errors["r1"]["error"] and errors["r1"]["line"] == 2
    assert "replica died" in errors["r2"]["error"]
    assert summary.failed == 2 and summary.written == 1


def test_bad_input_path_is_refused(tmp_path):
    s = BatchSettings(input=str(tmp_path / "in.csv"), output=str(tmp_path / "out"))

    async def call(body: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("nothing may be sent")

    with pytest.raises(ValueError, match="jsonl or .parquet"):
        asyncio.run(run_batch_async(s, call, progress=False))


@pytest.mark.serve
def test_batch_through_the_router_handle(relay_app, tmp_path):
    from relay_serve.toy.world import ToyWorld

    problems = ToyWorld().sample_heldout(6, seed=11)
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": f"t{i}", "prompt": p.prompt}) for i, p in enumerate(problems)]
    write_jsonl(src, lines[:3] + ['{"id": "broken"'] + lines[3:])
    s = BatchSettings(input=str(src), output=str(tmp_path / "out"), concurrency=4, max_tokens=160, temperature=0.0)
    summary = run_batch(s, progress=False)
    results = read_results(tmp_path / "out")
    assert sorted(r["id"] for r in results) == [f"t{i}" for i in range(6)]
    assert summary.malformed == 1 and read_errors(tmp_path / "out")[0]["line"] == 4
    assert all(r["finish_reason"] == "stop" and "</think>" in r["text"] for r in results)
    assert sum(r["small_tokens"] for r in results) > 0 and all(r["cue_set_version"] for r in results)
    again = run_batch(s, progress=False)
    assert again.skipped_done == 6 and again.written == 0


@pytest.mark.ray
def test_rows_with_a_gold_answer_are_graded(ray_cluster, tmp_path):
    """A labelled batch reports pass@1: right, wrong and failed rows (a failed row counts as
    wrong), rows without an answer left out of it."""
    src = tmp_path / "in.jsonl"
    write_jsonl(
        src,
        [
            json.dumps({"id": "right", "prompt": "\\boxed{42}", "answer": "42"}),
            json.dumps({"id": "wrong", "prompt": "\\boxed{41}", "answer": 42}),
            json.dumps({"id": "fails", "prompt": "boom", "answer": "1"}),
            json.dumps({"id": "free", "prompt": "\\boxed{7}"}),
        ],
    )

    async def call(body: dict[str, Any]) -> dict[str, Any]:
        if body["messages"][-1]["content"] == "boom":
            return {"error": {"message": "bad"}, "status": 400}
        return fake_response(body)

    s = BatchSettings(input=str(src), output=str(tmp_path / "out"), format="jsonl")
    summary = asyncio.run(run_batch_async(s, call, progress=False))
    by_id = {r["id"]: r for r in read_results(tmp_path / "out")}
    assert by_id["right"]["correct"] is True and by_id["wrong"]["correct"] is False and "correct" not in by_id["free"]
    assert summary.graded == 3 and summary.pass_at_1 == round(1 / 3, 4)
    assert summary.output_tokens_per_s is not None and summary.output_tokens_per_s > 0


def test_problems_command_writes_batch_input():
    from typer.testing import CliRunner

    from relay_serve.cli import app

    out = CliRunner().invoke(app, ["problems", "--dataset", "toy", "--n", "3"])
    assert out.exit_code == 0, out.output
    rows = [json.loads(line) for line in out.output.splitlines()]
    assert len(rows) == 3 and all(set(r) == {"id", "prompt", "answer"} for r in rows)
    from relay_serve.jobs.batch import BatchRow

    assert all(BatchRow.model_validate(r).answer == r["answer"] for r in rows)
