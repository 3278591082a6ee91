"""Hot reload of the active cue set: new sets swap in between requests; a set for another pair, a
corrupt set or an unreachable store never replaces the last good one."""

from __future__ import annotations

import asyncio

from relay_serve.calibration.store import CueStore
from relay_serve.config import AppConfig
from relay_serve.router.cue_provider import CueProvider
from tests.calibration.test_store import make_set


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def provider(tmp_path, fingerprint="pair-A"):
    cfg = AppConfig.model_validate({"cues": {"store_uri": (tmp_path / "cues").as_uri(), "poll_interval_s": 5}})
    clock = Clock()
    return CueProvider(cfg, fingerprint, clock=clock), CueStore(cfg.cues.store_uri), clock


def test_default_until_a_set_is_published_then_swaps_after_the_poll_interval(tmp_path):
    p, store, clock = provider(tmp_path)
    asyncio.run(p.maybe_refresh())
    assert p.active().version == "default" and p.active().cues == ["Therefore,", "Thus,", "So,", "Hence,"]
    store.publish(make_set("v1", "pair-A", ["Wait,", "Thus,"]))
    clock.t = 4.9
    asyncio.run(p.maybe_refresh())
    assert p.active().version == "default"  # not polled yet
    before = p.active()
    clock.t = 5.0
    asyncio.run(p.maybe_refresh())
    assert p.active().version == "v1" and p.active().cues == ["Wait,", "Thus,"]
    assert before.version == "default"  # a request that started earlier keeps its set
    assert p.status()["ok"] and p.status()["source"].endswith("versions/v1.json")


def test_a_set_for_another_pair_is_refused(tmp_path):
    p, store, clock = provider(tmp_path)
    store.publish(make_set("v1", "pair-A"))
    p.refresh()
    store.publish(make_set("v2", "pair-B"))
    p.refresh()
    assert p.active().version == "v1"
    assert not p.status()["ok"] and "another model pair" in p.status()["last_error"]


def test_corrupt_set_and_unreachable_store_keep_the_last_good_set(tmp_path):
    p, store, clock = provider(tmp_path)
    store.publish(make_set("v1", "pair-A"))
    p.refresh()
    (tmp_path / "cues" / "versions" / "v2.json").write_text('{"version": "v2"}')
    (tmp_path / "cues" / "LATEST").write_text("v2")
    p.refresh()
    assert p.active().version == "v1" and "not a valid cue set" in p.status()["last_error"]
    cfg = AppConfig.model_validate(
        {
            "cues": {
                "store_uri": "s3://nowhere/x",
                "storage_options": {
                    "endpoint_url": "http://127.0.0.1:9",
                    "key": "k",
                    "secret": "s",
                    "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
                },
            }
        }
    )
    q = CueProvider(cfg, "pair-A")
    q.refresh()
    assert q.active().version == "default" and not q.status()["ok"]
