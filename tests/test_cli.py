"""Bad command-line input gets a usage error naming the option, never a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from relay_serve.cli import app

runner = CliRunner()


def test_bench_concurrency_is_checked():
    r = runner.invoke(app, ["bench", "--concurrency", "1,x"])
    assert r.exit_code == 2 and "--concurrency" in r.output and r.exception.__class__ is SystemExit


def test_batch_refuses_a_bad_input_before_starting_anything(tmp_path):
    r = runner.invoke(app, ["batch", "--input", str(tmp_path / "in.csv"), "--output", str(tmp_path / "out")])
    assert r.exit_code == 2 and "--input" in r.output and ".parquet" in r.output


def test_eval_unknown_dataset_is_named(tmp_path):
    r = runner.invoke(app, ["eval", "--dataset", "aime", "--records", str(tmp_path / "r.jsonl")])
    assert r.exit_code == 2 and "--dataset" in r.output and "unknown dataset" in r.output


def test_config_into_needs_k8s(tmp_path):
    manifest = tmp_path / "m.yaml"
    manifest.write_text("spec:\n  serveConfigV2: |\n    x: 1\n")
    r = runner.invoke(app, ["config", "--into", str(manifest)])
    assert r.exit_code == 2 and "--into" in r.output
    r = runner.invoke(app, ["config", "--format", "k8s", "--into", str(manifest)])
    assert r.exit_code == 0 and "import_path: relay_serve.app:app_builder" in manifest.read_text()


def test_cues_history_rollback_and_unpin(tmp_path):
    import json

    from relay_serve.calibration.store import CueStore
    from tests.calibration.test_store import make_set

    store = CueStore((tmp_path / "cues").as_uri())
    store.publish(make_set("v1", selected=("First,",)))
    store.publish(make_set("v2", selected=("Thus,", "Wait,")))
    cfg = tmp_path / "app.yaml"
    cfg.write_text(f"cues: {{store_uri: {store.uri}}}\n")
    rows = json.loads(runner.invoke(app, ["cues", "history", "--config", str(cfg), "--json"]).output)
    assert [(r["version"], r["selected"], r["latest"], r["pinned"]) for r in rows] == [
        ("v1", ["First,"], False, False),
        ("v2", ["Thus,", "Wait,"], True, False),
    ]
    r = runner.invoke(app, ["cues", "rollback", "v1", "--config", str(cfg)])
    assert r.exit_code == 0 and "pinned" in r.output
    assert store.latest_version() == "v1" and store.pinned() == "v1"
    text = runner.invoke(app, ["cues", "history", "--config", str(cfg)]).output
    assert "LATEST PINNED" in text.splitlines()[0] and "First," in text.splitlines()[0]
    r = runner.invoke(app, ["cues", "rollback", "v7", "--config", str(cfg)])
    assert r.exit_code == 2 and "no version 'v7'" in r.output
    assert runner.invoke(app, ["cues", "unpin", "--config", str(cfg)]).output.strip() == "unpinned v1"
    assert store.pinned() is None


def test_a_report_records_its_command_without_the_machines_output_folder():
    from relay_serve.cli import recorded_command

    assert (
        recorded_command(["bench", "--concurrency", "1,8", "--out", "/home/me/runs/x", "--json"])
        == "relay-serve bench --concurrency 1,8 --out DIR --json"
    )
    assert recorded_command(["bench", "--out=/tmp/a b"]) == "relay-serve bench --out=DIR"


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_json_output_keeps_its_progress_bars_on_a_terminal_only(monkeypatch, tty):
    """`--json` prints its JSON on stdout; the bars go to stderr, shown when a person watches it (an
    87-minute bench run showed nothing at all), never into a pipe or a log."""
    from relay_serve import cli

    monkeypatch.setattr(cli.sys, "stderr", _Stream(tty))
    assert cli.show_progress(as_json=True) is tty
    assert cli.show_progress(as_json=False) is True
