"""The call-cost micro-benchmark on a local Ray: every path is timed idle and busy, and its report
table and JSON carry each figure."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.serve


def test_every_path_is_timed_idle_and_busy(capsys):
    from relay_serve.bench.calls import PATHS, main

    main(["--n", "20", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert report["n"] == 20 and [p["path"] for p in report["paths"]] == list(PATHS)
    for p in report["paths"]:
        assert 0 < p["idle_ms_median"] <= p["idle_ms_p90"] and 0 < p["busy_ms_median"] <= p["busy_ms_p90"], p
        assert any(line.startswith(f"| {p['path']} | {p['idle_ms_median']} |") for line in out), out


def test_too_few_calls_are_refused():
    from relay_serve.bench.calls import main

    with pytest.raises(SystemExit) as e:
        main(["--n", "5"])
    assert e.value.code == 2
