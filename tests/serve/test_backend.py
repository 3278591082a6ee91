"""ServeBackend with the handle transport over fake handles: chunks pass through, an early close cancels the Ray
response,
failures are typed by who can recover."""

import asyncio

import pytest

from relay_serve.protocol import EngineChunk, SegmentRequest
from relay_serve.relay.generation import EngineError, ModelUnavailable
from relay_serve.router.backend import ServeBackend


class FakeResponse:
    def __init__(self, chunks, fail_after=None):
        self.chunks, self.fail_after, self.cancelled = chunks, fail_after, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for i, c in enumerate(self.chunks):
            if self.fail_after is not None and i == self.fail_after:
                from ray.exceptions import ActorDiedError

                raise ActorDiedError()  # what a handle call to a dead replica raises
            yield c.model_dump()

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    def __init__(self, response):
        self.response, self.options_seen = response, []

    def options(self, **kw):
        self.options_seen.append(kw)
        return self

    def remote(self, request):
        self.request = request
        return self.response


def req(model="large"):
    return SegmentRequest(model=model, prompt_token_ids=[1, 2], max_tokens=4, session_id="gen-9")


CHUNKS = [
    EngineChunk(token_ids=[5]),
    EngineChunk(token_ids=[6]),
    EngineChunk(token_ids=[7], finished=True, finish_reason="length"),
]


def test_chunks_pass_through_with_the_session_id():
    h = FakeHandle(FakeResponse(CHUNKS))
    b = ServeBackend(h, None, transport="handle")

    async def go():
        return [c async for c in b.generate(req())]

    out = asyncio.run(go())
    assert [c.token_ids for c in out] == [[5], [6], [7]] and out[-1].finished
    assert h.options_seen == [{"method_name": "generate", "stream": True, "session_id": "gen-9"}]


def test_unstreamed_segments_take_one_call():
    class Unary:
        cancelled = False

        def __await__(self):
            async def done():
                return EngineChunk(token_ids=[5, 6], finished=True, finish_reason="stop", stop_reason="x").model_dump()

            return done().__await__()

        def cancel(self):
            self.cancelled = True

    h = FakeHandle(Unary())

    async def go():
        return [c async for c in ServeBackend(h, None, transport="handle").generate(req(), stream=False)]

    out = asyncio.run(go())
    assert [c.token_ids for c in out] == [[5, 6]] and out[0].stop_reason == "x"
    assert h.options_seen[-1]["method_name"] == "complete" and h.options_seen[-1]["stream"] is False
    assert not h.response.cancelled


def test_closing_early_cancels_the_ray_response():
    h = FakeHandle(FakeResponse(CHUNKS))
    b = ServeBackend(h, None, transport="handle")

    async def go():
        gen = b.generate(req())
        await gen.__anext__()
        await gen.aclose()

    asyncio.run(go())
    assert h.response.cancelled


def test_a_failed_call_is_an_engine_error_for_the_session_to_retry():
    async def drain(b, model):
        return [c async for c in b.generate(req(model))]

    for model, after in (("small", 0), ("small", 1), ("large", 0)):
        h = FakeHandle(FakeResponse(CHUNKS, fail_after=after))
        b = ServeBackend(h, h, transport="handle")
        with pytest.raises(EngineError, match="ActorDiedError"):
            asyncio.run(drain(b, model))
        assert b.in_flight == {"large": 0, "small": 0} and b.refusal("small") is None


class Silent:
    """A response that never answers (a deployment scaled to zero: the call waits for a replica)."""

    cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(3600)

    def __await__(self):
        return asyncio.sleep(3600).__await__()

    def cancel(self):
        self.cancelled = True


@pytest.mark.parametrize("stream", [True, False])
def test_a_silent_small_deployment_times_out_and_is_left_alone_for_a_while(stream):
    h = FakeHandle(Silent())
    b = ServeBackend(None, h, small_retry_after_s=60, transport="handle")

    async def drain():
        return [c async for c in b.generate(req("small"), stream=stream, timeout_s=0.05)]

    with pytest.raises(ModelUnavailable, match="did not answer within 0.05 s"):
        asyncio.run(drain())
    assert h.response.cancelled and b.in_flight["small"] == 0
    assert "did not answer" in b.refusal("small")
    b._down.clear()  # the retry-after window has passed
    assert b.refusal("small") is None


def test_past_the_queue_bound_small_segments_are_refused():
    class Slow(FakeResponse):
        async def _gen(self):
            await asyncio.sleep(0.05)
            for c in self.chunks:
                yield c.model_dump()

    b = ServeBackend(None, FakeHandle(Slow(CHUNKS)), max_small_in_flight=2, transport="handle")

    async def go():
        async def drain():
            return [c async for c in b.generate(req("small"))]

        tasks = [asyncio.create_task(drain()) for _ in range(2)]
        await asyncio.sleep(0.01)
        during = b.refusal("small")
        await asyncio.gather(*tasks)
        return during, b.refusal("small")

    during, after = asyncio.run(go())
    assert "past its queue bound (2 segments in flight" in during and after is None


def test_a_bug_under_a_segment_is_raised_as_itself_not_as_an_engine_error():
    """A TypeError in the router's own code is not an engine failure: the session must not retry
    it and the client must not be told an engine failed."""

    class Buggy(FakeResponse):
        async def _gen(self):
            yield CHUNKS[0].model_dump()
            raise TypeError("a bug")

    async def drain(b):
        return [c async for c in b.generate(req("large"))]

    h = FakeHandle(Buggy(CHUNKS))
    b = ServeBackend(h, h, transport="handle")
    with pytest.raises(TypeError, match="a bug"):
        asyncio.run(drain(b))
