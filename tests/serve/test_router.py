"""The router's HTTP API over a scripted backend (no Ray, no vLLM): shapes, usage, errors."""

from __future__ import annotations

import asyncio
import itertools
import json
import tempfile
from pathlib import Path

import httpx
import pytest

from relay_serve.protocol import EngineChunk
from relay_serve.relay.generation import EngineError
from relay_serve.router.ingress import RelayRouter
from relay_serve.toy.tokenizer import TOKENIZER_DIR
from tests.fakes import FakeBackend, follow

REF = (
    "<think>\nFirst, b3 -> c12.\n\nThus, we are at c12.\n\nNext, c12 -> d4.\n\n"
    "Therefore, the answer is d4.\n</think>\n\nThe answer is \\boxed{d4}."
)


def make_router(scripts=None, started=True, backend_kw=None, policy=None, **router_cfg):
    cfg = {
        "large": {"model": "toy:large", "tokenizer": str(TOKENIZER_DIR)},
        "small": {"model": "toy:small", "tokenizer": str(TOKENIZER_DIR)},
        "policy": policy or {},
        "router": {"session_affinity": False, **router_cfg},
        "cues": {"store_uri": Path(tempfile.mkdtemp()).as_uri()},
    }
    from relay_serve.tokenizer import load_codec

    backend = FakeBackend(
        load_codec(str(TOKENIZER_DIR)), scripts or {"large": follow(REF), "small": follow(REF)}, **(backend_kw or {})
    )
    router = RelayRouter(cfg, backend=backend)
    if started:
        asyncio.run(router.startup.answered())  # both fake deployments said what they serve
    return router, backend


def call(router, method, path, body=None, content=None, headers=None):
    async def go():
        transport = httpx.ASGITransport(app=router.api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            if method == "GET":
                return await c.get(path)
            if content is not None:
                return await c.post(path, content=content, headers=headers or {"content-type": "application/json"})
            return await c.post(path, json=body)

    return asyncio.run(go())


def chat(model="relay", **extra):
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Start at b3. Follow the map two times."}],
        **extra,
    }


def test_models_and_health():
    router, _ = make_router()
    ids = [m["id"] for m in call(router, "GET", "/v1/models").json()["data"]]
    assert ids == ["relay", "large", "small", "speculative-thinking", "auto"]
    health = call(router, "GET", "/health").json()
    assert health["status"] == "ok" and health["cue_set"]["version"] == "default"


def test_chat_completion_reports_relay_usage_and_trace():
    router, _ = make_router()
    r = call(router, "POST", "/v1/chat/completions", chat(relay_trace=True))
    assert r.status_code == 200, r.text
    body = r.json()
    text = body["choices"][0]["message"]["content"]
    assert text == REF and body["choices"][0]["finish_reason"] == "stop"
    u = body["usage"]
    assert u["relay"]["large_tokens"] + u["relay"]["small_tokens"] == u["completion_tokens"] > 0
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["relay"]["switches"] >= 4 and u["relay"]["cue_set_version"] == "default"
    trace = body["relay_trace"]
    assert trace[0]["start"] == 0 and trace[-1]["end"] == len(text)
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(trace))
    assert {"model": "small", "cue": "Thus,"}.items() <= trace[1].items()


def sse_events(text: str) -> list:
    events = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_streamed_chat_equals_the_non_streamed_text():
    router, _ = make_router()
    plain = call(router, "POST", "/v1/chat/completions", chat(seed=3)).json()
    r = call(router, "POST", "/v1/chat/completions", chat(seed=3, stream=True, stream_options={"include_usage": True}))
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    deltas = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e.get("choices"))
    assert deltas == plain["choices"][0]["message"]["content"]
    usage = [e for e in events[:-1] if e.get("usage")][0]["usage"]
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_completions_take_text_or_token_ids():
    router, _ = make_router()
    r = call(router, "POST", "/v1/completions", {"model": "large", "prompt": "Start at b3.", "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert r.json()["choices"][0]["finish_reason"] == "length"
    ids = router.generations.codec.encode("Start at b3.")
    r2 = call(router, "POST", "/v1/completions", {"model": "large", "prompt": ids, "max_tokens": 5})
    assert r2.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    "body, param",
    [
        (chat(model="gpt-9"), "model"),
        (chat(n=2), "n"),
        (chat(max_tokens=-1), "max_tokens"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_completion_tokens=10**6), "max_completion_tokens"),
        (chat(max_tokens="ten"), "max_tokens"),
        (chat(temperature="hot"), "temperature"),
        (chat(temperature=True), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(top_k=0), "top_k"),
        (chat(stream="yes"), "stream"),
        (chat(stop=["x"] * 40), "stop"),
        (chat(stop=["y" * 500]), "stop"),
        ({"model": "relay", "messages": []}, "messages"),
        ({"model": "relay", "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"model": "relay"}, "messages"),
        ({"model": "relay", "messages": [{"role": "user", "content": "x " * 3000}]}, "messages"),
    ],
)
def test_bad_input_is_a_400_naming_the_parameter(body, param):
    router, backend = make_router()
    r = call(router, "POST", "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert backend.requests == []


@pytest.mark.parametrize("prompt", ["", []])
def test_an_empty_completion_prompt_is_a_400_naming_prompt_before_any_engine(prompt):
    router, backend = make_router()
    for model in ("relay", "large", "small"):
        r = call(router, "POST", "/v1/completions", {"model": model, "prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert backend.requests == []


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[1, 2]", b"\xff\xfe{}", b"[" * 100_000 + b"]" * 100_000, b""],
)
def test_malformed_bodies_are_400s(content):
    router, _ = make_router(max_request_bytes=1_000_000)
    r = call(router, "POST", "/v1/chat/completions", content=content)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_oversized_body_is_413():
    router, _ = make_router(max_request_bytes=2048)
    r = call(router, "POST", "/v1/chat/completions", chat(user="u" * 5000))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_chunked_body_without_a_length_past_the_limit_is_413():
    router, _ = make_router(max_request_bytes=2048)

    async def go():
        async def body():
            for _ in range(10):
                yield b'{"model": "relay", "user": "' + b"u" * 500  # never says how long it is

        transport = httpx.ASGITransport(app=router.api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.post("/v1/chat/completions", content=body(), headers={"content-type": "application/json"})

    r = asyncio.run(go())
    assert "content-length" not in {k.lower() for k in r.request.headers}
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_generation_past_the_request_timeout_is_a_504():
    router, backend = make_router(request_timeout_s=0.3)
    backend.delay_s = 0.05  # about 40 tokens: 2 s
    r = call(router, "POST", "/v1/chat/completions", chat(model="large"))
    assert r.status_code == 504 and "longer than 0.3 s" in r.json()["error"]["message"]
    events = sse_events(call(router, "POST", "/v1/chat/completions", chat(model="large", stream=True)).text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
    assert router.in_flight == 0 and backend.cancelled == 2  # both engine requests were aborted


def test_a_stream_past_its_deadline_while_a_slow_client_reads_still_ends_with_the_error_and_done():
    """The deadline fires while the client is being written to (it reads slowly): the generation
    stops, and the client still gets the timeout event and [DONE], counted as a 504."""
    from relay_serve.router.openai_api import ChatCompletionRequest
    from relay_serve.router.streaming import events

    router, backend = make_router(request_timeout_s=0.4)
    backend.delay_s = 0.02
    statuses = []
    router.metrics.request = lambda model, status, *a, **k: statuses.append(status)

    async def go():
        await router.startup.answered()
        g = await router.generations.prepare(ChatCompletionRequest.model_validate(chat(model="large", stream=True)))
        lines = []
        async for line in events(router.generations, g):
            lines.append(line)
            await asyncio.sleep(0.15)  # a slow client: most of the time is spent writing to it
        return lines

    lines = asyncio.run(go())
    assert lines[-1] == "data: [DONE]\n\n"
    assert json.loads(lines[-2][len("data: ") :])["error"]["code"] == "timeout"
    assert statuses == [504] and router.in_flight == 0


def test_unknown_route_has_an_error_body():
    router, _ = make_router()
    r = call(router, "GET", "/v2/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_engine_failure_is_a_5xx_with_an_error_body():
    router, backend = make_router()

    async def failing(request, stream=True, timeout_s=None):
        yield EngineChunk(token_ids=[1])
        raise EngineError("replica died")

    backend.generate = failing
    r = call(router, "POST", "/v1/chat/completions", chat(model="large"))
    assert r.status_code == 502 and "replica died" in r.json()["error"]["message"]
    rs = call(router, "POST", "/v1/chat/completions", chat(model="large", stream=True))
    events = sse_events(rs.text)
    assert events[-1] == "[DONE]" and "replica died" in events[-2]["error"]["message"]
    assert router.in_flight == 0


def test_a_bug_in_the_router_is_a_500_at_once_not_a_retried_engine_failure():
    router, backend = make_router()
    calls = []

    async def buggy(request, stream=True, timeout_s=None):
        calls.append(request)
        yield EngineChunk(token_ids=[1])
        raise TypeError("unsupported operand type(s) for -: 'float' and 'NoneType'")

    backend.generate = buggy
    r = call(router, "POST", "/v1/chat/completions", chat(model="large"))
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
    assert "TypeError" in r.json()["error"]["message"] and len(calls) == 1  # not asked again


def test_an_unavailable_small_model_is_a_503_for_the_modes_that_need_it():
    """small and speculative-thinking cannot do without the small model (503, model_unavailable);
    relay degrades to the large model instead (200)."""
    router, backend = make_router()
    backend.unavailable.add("small")
    for model in ("small", "speculative-thinking"):
        r = call(router, "POST", "/v1/chat/completions", chat(model=model))
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable", r.text
        events = sse_events(call(router, "POST", "/v1/chat/completions", chat(model=model, stream=True)).text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "model_unavailable"
    r = call(router, "POST", "/v1/chat/completions", chat(model="relay"))
    assert r.status_code == 200 and r.json()["usage"]["relay"]["degraded"]


def test_a_pair_with_different_tokenizers_is_refused(tmp_path):
    """The deployments report their tokenizers; the router refuses a pair that does not share one,
    in /health and in every request, naming why."""
    from transformers import AutoTokenizer

    from relay_serve.tokenizer import Codec

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(str(tmp_path))
    router, _ = make_router(backend_kw={"tokenizers": {"small": Codec.from_path(str(tmp_path))}})
    health = call(router, "GET", "/health")
    assert health.status_code == 503 and health.json()["status"] == "refused"
    assert "shares one tokenizer" in health.json()["models"]["error"]
    r = call(router, "POST", "/v1/chat/completions", chat())
    assert r.status_code == 503 and r.json()["error"]["code"] == "pair_refused"
    assert "shares one tokenizer" in r.json()["error"]["message"]


def test_a_pair_whose_decoding_loses_the_reasoning_end_marker_is_refused():
    router, _ = make_router(
        policy={"think_close": "<|im_end|>"}
    )  # an end-of-turn token: the router's decoding drops it
    health = call(router, "GET", "/health")
    assert health.status_code == 503 and "does not survive the tokenizer" in health.json()["models"]["error"]
    r = call(router, "POST", "/v1/chat/completions", chat())
    assert r.status_code == 503 and r.json()["error"]["code"] == "pair_refused"


def test_the_router_reads_no_model_files():
    """Model paths the router's process cannot read: it serves with what the deployments report
    (the tokenizer, the context length), and takes the pair's fingerprint from them."""
    from relay_serve.calibration.cues import combine_fingerprints
    from relay_serve.tokenizer import load_codec

    cfg = {
        "large": {"model": "/not-mounted/large"},
        "small": {"model": "/not-mounted/small"},
        "router": {"session_affinity": False},
        "cues": {"store_uri": Path(tempfile.mkdtemp()).as_uri()},
    }
    codec = load_codec(str(TOKENIZER_DIR))
    blind = RelayRouter(
        cfg, backend=FakeBackend(codec, {"large": follow(REF), "small": follow(REF)}, max_model_len=300)
    )
    asyncio.run(blind.startup.answered())
    r = call(blind, "POST", "/v1/chat/completions", chat())
    assert r.status_code == 200, r.text
    assert "\\boxed{d4}" in r.json()["choices"][0]["message"]["content"]
    described = call(blind, "GET", "/v1/relay/cues").json()
    assert described["pair_fingerprint"] == combine_fingerprints("fake-large", "fake-small", codec.fingerprint)
    # the engines' context, not a fallback: 300 tokens
    long = chat(messages=[{"role": "user", "content": "Start at b3. " * 100}])
    r = call(blind, "POST", "/v1/chat/completions", long)
    assert r.status_code == 400 and "300" in r.json()["error"]["message"], r.text


def test_health_says_starting_until_the_large_deployment_answers_and_requests_wait_for_it():
    router, backend = make_router(started=False)
    gate = backend.starting["large"] = asyncio.Event()

    async def go():
        transport = httpx.ASGITransport(app=router.api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as c:
            first = await c.get("/health")
            waiting = asyncio.ensure_future(c.post("/v1/chat/completions", json=chat()))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # the request waits for start-up, it is not refused
            gate.set()
            served = await waiting
            await router.startup.answered()
            return first, served, await c.get("/health")

    first, served, after = asyncio.run(go())
    assert first.status_code == 503 and first.json()["status"] == "starting"
    assert first.json()["models"]["large"]["state"] == "starting"
    assert served.status_code == 200, served.text
    assert after.status_code == 200 and after.json()["status"] == "ok"
    assert after.json()["models"]["large"]["state"] == after.json()["models"]["small"]["state"] == "up"


def test_a_deployment_that_may_scale_to_zero_is_asked_only_once_a_segment_of_it_was_answered(monkeypatch):
    """A call queued for a deployment without replicas would scale it up: the router asks the
    small deployment what it serves only once one of its segments was answered."""
    from relay_serve.router import startup

    monkeypatch.setattr(startup, "LAZY_POLL_S", 0.05)
    router, backend = make_router(started=False)
    router.cfg.small.deployment.num_replicas = None
    router.cfg.small.deployment.autoscaling_config = {"min_replicas": 0, "max_replicas": 1}
    replied = set()
    backend.has_replied = lambda model: model in replied
    asked = []
    identity = backend.identity

    async def recording(model, tokenizer=True):
        asked.append(model)
        return await identity(model, tokenizer)

    backend.identity = recording

    async def go():
        await router.startup.wait(10)
        await asyncio.sleep(0.3)
        before = (list(asked), router.startup.fingerprint)
        replied.add("small")  # a relay handoff reached a small replica
        await router.startup.answered()
        return before, list(asked), router.startup.fingerprint

    before, after, fingerprint = asyncio.run(go())
    assert before == (["large"], None)
    assert after == ["large", "small"] and fingerprint is not None


def test_a_small_deployment_that_may_scale_to_zero_does_not_hold_health_back():
    router, backend = make_router(started=False)
    backend.starting["small"] = asyncio.Event()  # never starts
    router.cfg.small.deployment.num_replicas = None
    router.cfg.small.deployment.autoscaling_config = {"min_replicas": 0, "max_replicas": 1}

    async def go():
        await router.startup.wait(10)
        transport = httpx.ASGITransport(app=router.api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.get("/health")

    health = asyncio.run(go())
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert health.json()["models"]["small"]["state"] == "starting"
    assert health.json()["cue_set"]["version"] == "default"  # no pair fingerprint yet: the default set


def test_no_request_field_multiplies_engine_work():
    """One HTTP request is one generation: a body asking for thousands of engine requests (the
    removed ``relay_replay``) runs exactly the engine requests a plain one does."""
    router, plain_backend = make_router()
    plain = call(router, "POST", "/v1/chat/completions", chat())
    router, backend = make_router()
    schedule = [{"model": "large", "tokens": 1}] * 10_000
    r = call(router, "POST", "/v1/chat/completions", chat(relay_replay=schedule))
    assert r.status_code == plain.status_code == 200
    assert len(backend.requests) == len(plain_backend.requests) == r.json()["usage"]["relay"]["engine_requests"]


def test_a_request_can_bring_its_own_cues_and_the_shared_set_stays():
    router, backend = make_router()
    own = call(router, "POST", "/v1/chat/completions", chat(relay_cues=["Therefore,"]))
    assert own.status_code == 200, own.text
    relay = own.json()["usage"]["relay"]
    assert relay["cues"] == ["Therefore,"] and relay["cue_set_version"] == "request"
    assert "Thus," not in backend.requests[0].stop and "Therefore," in backend.requests[0].stop
    shared = call(router, "POST", "/v1/chat/completions", chat()).json()["usage"]["relay"]
    assert shared["cue_set_version"] == "default" and shared["cues"] == router.cues.active().cues
    assert call(router, "GET", "/v1/relay/cues").json()["version"] == "default"


@pytest.mark.parametrize(
    "cues, why",
    [
        (["Thus,"] * 17, "at most 16"),
        (["x" * 33], "1-32 characters"),
        ([" "], "not only white space"),
        (["Thus,\nSo"], "on one line"),
        (["</think>"], "must not contain"),
        ("Thus,", "valid list"),
    ],
)
def test_bad_request_cues_are_a_400_naming_the_field(cues, why):
    router, backend = make_router()
    r = call(router, "POST", "/v1/chat/completions", chat(relay_cues=cues))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "relay_cues" and why in r.json()["error"]["message"]
    assert backend.requests == []


def test_request_cues_apply_to_relay_only():
    router, _ = make_router()
    r = call(router, "POST", "/v1/chat/completions", chat("large", relay_cues=["Thus,"]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "relay_cues"


def test_auto_runs_each_generation_as_relay_or_large_and_learns_their_speed():
    """The scripted models write the same text either way: auto's first generations try both
    paths (relay first), say which in usage.relay.policy, and the router's stats show what it
    learned; a request's own cues are relay's alone."""
    router, backend = make_router()
    policies = []
    for _ in range(10):
        r = call(router, "POST", "/v1/chat/completions", chat("auto"))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == REF and body["model"] == "auto"
        policies.append(body["usage"]["relay"]["policy"])
        if policies[-1] == "large":
            assert body["usage"]["relay"]["small_tokens"] == 0
    assert policies[:8].count("relay") == policies[:8].count("large") == 4  # learning: four of each
    level = call(router, "GET", "/v1/relay/stats").json()["auto"]["1"]
    assert level["relay"]["samples"] + level["large"]["samples"] == 10 and level["large"]["ms_per_token"] > 0
    assert "policy" not in call(router, "POST", "/v1/chat/completions", chat("relay")).json()["usage"]["relay"]
    r = call(router, "POST", "/v1/chat/completions", chat("auto", relay_cues=["Thus,"]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "relay_cues"


def auto_burst(router, n: int = 8) -> list:
    """``n`` auto requests sent at once to ``router``; their responses."""

    async def go():
        transport = httpx.ASGITransport(app=router.api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=chat("auto", seed=i)) for i in range(n)))

    return asyncio.run(go())


def test_auto_generations_that_ran_together_teach_the_load_they_ran_under():
    """Eight auto requests sent at once start with 1 to 8 in flight but all run beside each other:
    what they learn is level 8's, not that of the load each one started at."""
    router, backend = make_router()
    backend.delay_s = 0.005

    assert all(r.status_code == 200 for r in auto_burst(router))
    taught = {
        level: sum(f["samples"] for f in figures.values())
        for level, figures in call(router, "GET", "/v1/relay/stats").json()["auto"].items()
        if any(f["samples"] for f in figures.values())
    }
    assert taught == {"8": 8}


def test_auto_chooses_a_burst_at_the_level_of_the_last_burst():
    """The first of eight requests sent at once starts with few in flight: chosen by that count, it
    ran a block of level 1, 2 or 4; chosen by the most in flight of late, every one of a second
    burst runs level 8's."""
    router, backend = make_router()
    backend.delay_s = 0.005

    def started() -> dict[int, int]:
        return {size: sum(level.started.values()) for size, level in router.generations.auto.levels.items()}

    assert all(r.status_code == 200 for r in auto_burst(router))
    first = started()
    assert sum(first.values()) == 8
    assert all(r.status_code == 200 for r in auto_burst(router))
    second = started()
    assert {size: second[size] - first.get(size, 0) for size in second} == {**dict.fromkeys(first, 0), 8: 8}


def test_a_long_prompt_is_tokenized_off_the_event_loop_and_a_short_one_on_it():
    import threading

    from relay_serve.router.generations import OFF_LOOP_PROMPT_CHARS

    router, _ = make_router()
    codec = router.generations.codec
    threads = []
    encode = codec.encode

    def recording(text):
        threads.append(threading.current_thread() is threading.main_thread())
        return encode(text)

    codec.encode = recording
    try:
        short = call(router, "POST", "/v1/completions", {"model": "large", "prompt": "Start at b3.", "max_tokens": 2})
        long = "Start at b3. " * (OFF_LOOP_PROMPT_CHARS // 13 + 1)
        big = call(router, "POST", "/v1/completions", {"model": "large", "prompt": long, "max_tokens": 2})
    finally:
        codec.encode = encode
    assert short.status_code == 200 and threads[0] is True  # on the loop: a thread would cost more than it saves
    # the long one (past the toy's 1,024-token context: a 400, after tokenizing it) in a worker thread
    assert big.status_code == 400 and big.json()["error"]["code"] == "context_length_exceeded"
    assert threads[1:] and not any(threads[1:])
