"""The cue store on file:// and on a real S3 endpoint (moto's standalone server on loopback)."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from datetime import UTC, datetime

import pytest

from relay_serve.calibration.cues import (
    CalibrationData,
    CueSet,
    CueStats,
    ModelPair,
    SelectionRule,
)
from relay_serve.calibration.store import (
    CorruptCueSet,
    CueStore,
    StoreError,
    check_version,
)
from tests.conftest import free_port


def make_set(version: str, fingerprint: str = "fp", selected=("Thus,",)) -> CueSet:
    return CueSet(
        version=version,
        pair=ModelPair(large="toy:large", small="toy:small", fingerprint=fingerprint),
        candidates=[CueStats(cue="Thus,", count=9, mean=0.99, ci_low=0.98, ci_high=1.0)],
        overall_mean=0.9,
        overall_count=100,
        selected=list(selected),
        rule=SelectionRule(),
        data=CalibrationData(source="toy", num_prompts=1, samples_per_prompt=1, num_traces=1, num_tokens=10),
        created_at=datetime.now(UTC),
    )


def test_publish_then_latest(tmp_path):
    store = CueStore((tmp_path / "cues").as_uri())
    assert store.latest_version() is None and store.load_latest() is None
    store.publish(make_set("v1"))
    store.publish(make_set("v2"))
    assert store.latest_version() == "v2" and store.load_latest().version == "v2"
    assert store.versions() == ["v1", "v2"]
    with pytest.raises(StoreError, match="already exists"):
        store.publish(make_set("v2"))


def test_latest_moves_last(tmp_path, monkeypatch):
    store = CueStore((tmp_path / "cues").as_uri())
    store.publish(make_set("v1"))
    real = store.fs.pipe_file

    def fail_on_latest(path, data, **kw):
        if "LATEST" in path:
            raise OSError("disk full")
        return real(path, data, **kw)

    monkeypatch.setattr(store.fs, "pipe_file", fail_on_latest)
    with pytest.raises(StoreError, match="disk full"):
        store.publish(make_set("v2"))
    assert store.latest_version() == "v1"  # readers still see the old, whole set


def test_latest_is_never_rewritten_in_place_and_moves_after_the_version(tmp_path, monkeypatch):
    """On file://, LATEST is written under another name and renamed over the old one (a reader
    never sees it empty), after the version it names is written."""
    store = CueStore((tmp_path / "cues").as_uri())
    store.publish(make_set("v1"))
    ops = []
    pipe, mv = store.fs.pipe_file, store.fs.mv
    monkeypatch.setattr(
        store.fs, "pipe_file", lambda path, data, **kw: (ops.append(("write", path)), pipe(path, data, **kw))[1]
    )
    monkeypatch.setattr(store.fs, "mv", lambda src, dst, **kw: (ops.append(("rename", dst)), mv(src, dst, **kw))[1])
    store.publish(make_set("v2"))
    latest = store._path("LATEST")
    assert ("write", latest) not in ops  # never rewritten in place
    assert [op for op in ops if op[1] == latest] == [("rename", latest)]
    assert ops.index(("write", store._path("versions", "v2.json"))) < ops.index(("rename", latest))
    assert store.latest_version() == "v2" and not list((tmp_path / "cues").glob("*.tmp"))


def test_versions_cannot_leave_the_prefix(tmp_path):
    for bad in ("../x", "a/b", "", ".hidden", "x" * 200):
        with pytest.raises(ValueError):
            check_version(bad)
    store = CueStore((tmp_path / "cues").as_uri())
    with pytest.raises(ValueError):
        store.publish(make_set("v1").model_copy(update={"version": "../../etc"}))
    assert not (tmp_path / "etc").exists()


def test_corrupt_sets_are_reported(tmp_path):
    store = CueStore((tmp_path / "cues").as_uri())
    (tmp_path / "cues" / "versions").mkdir(parents=True)
    (tmp_path / "cues" / "versions" / "v9.json").write_text("{not json")
    (tmp_path / "cues" / "LATEST").write_text("v9")
    with pytest.raises(CorruptCueSet, match="not a valid cue set"):
        store.load_latest()
    (tmp_path / "cues" / "LATEST").write_text("v10")
    with pytest.raises(CorruptCueSet, match="does not exist"):
        store.load_latest()


@pytest.fixture(scope="module")
def s3_endpoint():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    for _ in range(100):
        try:
            urllib.request.urlopen(url, timeout=0.5)
            break
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_s3_store_on_a_real_endpoint(s3_endpoint, monkeypatch):
    import boto3

    boto3.client(
        "s3", endpoint_url=s3_endpoint, aws_access_key_id="k", aws_secret_access_key="s", region_name="us-east-1"
    ).create_bucket(Bucket="cues")
    # credentials and endpoint from config
    opts = {"key": "k", "secret": "s", "endpoint_url": s3_endpoint}
    store = CueStore("s3://cues/toy", opts)
    store.publish(make_set("s1"))
    assert CueStore("s3://cues/toy", opts).load_latest().version == "s1"
    # ... or from the usual AWS variables
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    env_store = CueStore("s3://cues/toy")
    env_store.publish(make_set("s2"))
    assert env_store.latest_version() == "s2" and env_store.versions() == ["s1", "s2"]


def test_unreachable_store_is_a_store_error():
    store = CueStore(
        "s3://cues/x",
        {
            "key": "k",
            "secret": "s",
            "endpoint_url": f"http://127.0.0.1:{free_port()}",
            "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
        },
    )
    with pytest.raises(StoreError):
        store.latest_version()


def test_rollback_pins_and_unpin_releases(tmp_path):
    store = CueStore((tmp_path / "cues").as_uri())
    store.publish(make_set("v1"))
    store.publish(make_set("v2"))
    assert store.pinned() is None
    store.rollback("v1")
    assert store.latest_version() == "v1" and store.pinned() == "v1"
    with pytest.raises(CorruptCueSet, match="v9"):
        store.rollback("v9")  # only an existing version
    assert store.latest_version() == "v1"
    store.unpin()
    assert store.pinned() is None
    store.unpin()  # twice is fine


def test_history_is_in_creation_order_with_provenance(tmp_path):
    from relay_serve.calibration.cues import Provenance

    store = CueStore((tmp_path / "cues").as_uri())
    store.publish(make_set("b-first"))
    online = make_set("a-second").model_copy(update={"provenance": Provenance(source="online", generations=40)})
    store.publish(online)
    history = store.history()
    assert [c.version for c in history] == ["b-first", "a-second"]
    assert [c.provenance.source for c in history] == ["calibration", "online"] and history[
        1
    ].provenance.generations == 40


def test_online_statistics_round_trip(tmp_path):
    store = CueStore((tmp_path / "cues").as_uri())
    assert store.online_stats() is None
    store.put_online_stats(b'{"n": 1}')
    store.put_online_stats(b'{"n": 2}')
    assert store.online_stats() == b'{"n": 2}'


def race(uri: str, opts: dict | None = None, trials: int = 50, most: int = 500) -> None:
    """The offline job and the online actor publish at once, ``trials`` times, each through a store
    of its own (as two processes). The online actor publishes only over the set it read; the job
    over whatever is there. Every time: the job's set is LATEST (the online one either moved first
    and was superseded, or found out and wrote nothing), LATEST is whole, and the move log is
    complete: each move starts from the one before it. The races go on past ``trials`` (up to
    ``most``) until the online actor has won one too: it reads once more before it writes, so on a
    loaded machine it can lose 50 in a row, and a run where it never won tested only half."""
    import threading

    from relay_serve.calibration.store import PublishConflict

    offline, online = CueStore(uri, opts), CueStore(uri, opts)
    offline.publish(make_set("start"))
    published = {"start"}
    for i in range(most):
        expect = online.head()[1]
        gate, results = threading.Barrier(2), {}

        def run(name, store, cue_set, gate=gate, results=results, **kw):
            gate.wait()
            try:
                store.publish(cue_set, **kw)
                results[name] = cue_set.version
            except PublishConflict:
                results[name] = None

        threads = [
            threading.Thread(target=run, args=("offline", offline, make_set(f"off-{i}"))),
            threading.Thread(
                target=run, args=("online", online, make_set(f"on-{i}")), kwargs={"expect_latest": expect}
            ),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results["offline"] == f"off-{i}", results
        published |= {v for v in results.values() if v}
        reader = CueStore(uri, opts)
        assert reader.latest_version() == f"off-{i}" and reader.load_latest().version == f"off-{i}"
        if i + 1 >= trials and any(v.startswith("on-") for v in published):
            break
    reader = CueStore(uri, opts)
    assert set(reader.versions()) == published  # a set that lost wrote nothing
    moves = reader.moves()
    assert [m["version"] for m in moves][-1] == f"off-{i}" and {m["version"] for m in moves} == published
    assert all(b["previous"] == a["version"] for a, b in itertools.pairwise(moves))  # no move was lost
    assert any(m["version"].startswith("on-") for m in moves)  # the online actor won some races too


def test_the_offline_job_and_the_online_actor_publishing_at_once_lose_nothing(tmp_path):
    race((tmp_path / "cues").as_uri())


def test_the_same_race_on_s3(s3_endpoint):
    import boto3

    boto3.client(
        "s3", endpoint_url=s3_endpoint, aws_access_key_id="k", aws_secret_access_key="s", region_name="us-east-1"
    ).create_bucket(Bucket="race")
    race("s3://race/cues", {"key": "k", "secret": "s", "endpoint_url": s3_endpoint})
