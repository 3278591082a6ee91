"""Sampling an engine cannot run never reaches it: a speculative vLLM-CPU engine runs only greedy
sampling correctly (sampled, it writes wrong text; with top_k its engine core dies). The router
refuses such requests with a 400 naming the parameter before any segment is sent, the model
replica refuses such a segment without calling its engine (a request that got past a router),
and a request the engine refuses as invalid is a 400 at once, never retried as an engine failure.
No Ray, no vLLM."""

from __future__ import annotations

import asyncio

import pytest

from relay_serve.engine.base import EngineInfo
from relay_serve.engine.vllm_engine import speculative_traits
from relay_serve.protocol import (
    EngineTraits,
    InvalidRequest,
    SamplingSettings,
    SegmentRequest,
)
from relay_serve.replica.model_server import ModelServer
from relay_serve.router.backend import ServeBackend
from tests.serve.test_router import call, chat, make_router
from tests.serve.test_transport import FakeEngine, FakeHandle

GREEDY_ONLY = EngineTraits(speculative="draft_model k=8", greedy_only="speculative decoding on vLLM-CPU")


def router_with(traits: dict[str, EngineTraits], **cfg):
    router, backend = make_router(**cfg)

    async def engine_traits(model):
        return traits.get(model, EngineTraits())

    backend.traits = engine_traits
    return router, backend


@pytest.mark.parametrize("model", ["relay", "large", "speculative-thinking"])
def test_a_sampled_request_for_a_greedy_only_engine_is_a_400_naming_temperature(model):
    router, backend = router_with({"large": GREEDY_ONLY})
    for body in (chat(model, temperature=0.6, top_p=0.95, top_k=20), chat(model, temperature=0.6)):
        r = call(router, "POST", "/v1/chat/completions", body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "temperature" and "large model's engine" in err["message"] and "greedy" in err["message"]
    assert backend.requests == []  # nothing reached an engine


def test_a_greedy_request_and_a_model_without_limits_are_served():
    router, backend = router_with({"large": GREEDY_ONLY})
    assert call(router, "POST", "/v1/chat/completions", chat("relay", temperature=0.0, top_k=20)).status_code == 200
    assert call(router, "POST", "/v1/chat/completions", chat("small", temperature=0.6, top_k=20)).status_code == 200
    assert {r.model for r in backend.requests} == {"large", "small"}


def test_the_services_default_sampling_is_checked_too():
    router, _ = router_with({"large": GREEDY_ONLY})
    router.cfg.sampling.temperature = 0.6  # what a request that names no temperature gets
    r = call(router, "POST", "/v1/chat/completions", chat("large"))
    assert r.status_code == 400 and "default" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "temperature"


def test_a_streamed_request_is_refused_before_the_stream_starts():
    router, backend = router_with({"small": GREEDY_ONLY})
    r = call(router, "POST", "/v1/chat/completions", chat("relay", temperature=1.0, stream=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert backend.requests == []


def test_a_request_an_engine_refuses_as_invalid_is_a_400_at_once_not_a_retried_engine_failure():
    router, backend = make_router()
    plain = backend.generate

    def refusing(request, stream=True, timeout_s=None):
        if request.model == "large":
            raise InvalidRequest("The decoder prompt cannot be empty", param="prompt")
        return plain(request, stream, timeout_s)

    backend.generate = refusing
    r = call(router, "POST", "/v1/chat/completions", chat("relay"))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and "cannot be empty" in r.json()["error"]["message"]


def test_speculation_is_greedy_only_on_a_cpu_alone():
    spec = {"method": "draft_model", "model": "/m/small", "num_speculative_tokens": 8}
    assert speculative_traits(None, on_cpu=True) == EngineTraits()
    assert speculative_traits(spec, on_cpu=False) == EngineTraits(speculative="draft_model k=8")
    cpu = speculative_traits(spec, on_cpu=True)
    assert cpu.speculative == "draft_model k=8" and cpu.greedy_only
    with pytest.raises(InvalidRequest) as e:
        cpu.check("large", SamplingSettings(temperature=0.6, top_k=20))
    assert e.value.param == "temperature"
    cpu.check("large", SamplingSettings(temperature=0.0, top_k=20))  # vLLM drops top_k at temperature 0


class GreedyOnlyEngine(FakeEngine):
    def info(self):
        return EngineInfo(model="fake", max_model_len=1024, tokenizer_fingerprint="x", traits=GREEDY_ONLY)


def test_the_model_replica_refuses_a_sampled_segment_without_calling_its_engine():
    """A segment that got past a router (an older one, a direct caller) over the real channel:
    InvalidRequest for the router (no EngineError, no retry), the engine never sees it, and the
    lease and its connection serve the next segment."""

    async def go():
        large = ModelServer("large", {"model": "toy:large"}, engine_cls=GreedyOnlyEngine)
        backend = ServeBackend(FakeHandle(large), FakeHandle(None))
        sampled = SegmentRequest(
            model="large",
            prompt_token_ids=[1, 2],
            max_tokens=3,
            session_id="g",
            sampling=SamplingSettings(temperature=0.6, top_k=20),
        )
        with pytest.raises(InvalidRequest) as e:
            async for _ in backend.generate(sampled, stream=False):
                pass
        greedy = sampled.model_copy(update={"sampling": SamplingSettings(temperature=0.0)})
        out = [c async for c in backend.generate(greedy, stream=False)]
        stats = backend.stats()
        backend.close()
        return e.value, out, large.engine.requests, stats

    error, out, seen, stats = asyncio.run(go())
    assert error.param == "temperature"
    assert out[-1].finished and out[-1].token_ids == [7, 8, 9]
    assert [r.sampling.temperature for r in seen] == [0.0]  # the sampled segment never reached the engine
    assert stats["channels"] == 1


class InfoHandle:
    """A deployment's handle for ``info`` only: it answers once ``up`` is set (a deployment scaled
    to zero or starting never answers before)."""

    def __init__(self, traits: EngineTraits) -> None:
        self.traits, self.up, self.calls = traits, asyncio.Event(), 0

    @property
    def info(self):
        return self

    def remote(self):
        self.calls += 1

        async def answer():
            await self.up.wait()
            return {"traits": self.traits.model_dump()}

        return answer()


def test_a_deployment_that_does_not_answer_delays_only_the_first_request(monkeypatch):
    """The small deployment at zero replicas never answers ``info``: the first request waits the
    bound, later ones not at all (before, each waited the bound again once it expired); when the
    deployment answers, its traits are used."""
    import relay_serve.router.backend as backend_module

    monkeypatch.setattr(backend_module, "TRAITS_TIMEOUT_S", 0.2)

    async def go():
        small = InfoHandle(GREEDY_ONLY)
        backend = ServeBackend(FakeHandle(None), small, transport="handle")
        t0 = asyncio.get_running_loop().time()
        assert await backend.traits("small") == EngineTraits()  # unknown: no limits for now
        first_wait = asyncio.get_running_loop().time() - t0
        later = []
        for _ in range(2):
            await asyncio.sleep(0.25)  # past the provisional entry's expiry
            # the next requests do not wait at all: the call returns without suspending once
            call = backend.traits("small")
            try:
                call.send(None)
            except StopIteration as done:
                later.append(done.value)
            else:
                call.close()
                later.append("waited")
        small.up.set()
        await asyncio.sleep(0.01)
        answered = await backend.traits("small")
        return first_wait, later, answered, small.calls

    first_wait, later, answered, calls = asyncio.run(go())
    assert first_wait >= 0.2 and later == [EngineTraits(), EngineTraits()], (first_wait, later)
    assert answered == GREEDY_ONLY
    assert calls == 1  # one question in flight at a time, not one per request
