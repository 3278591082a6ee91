"""A router replica's calls to the model deployments are Serve requests of their own.

Made while the router serves a client's request, a handle call would inherit that request's
internal id; Ray Serve 2.60's request router then loses one of two calls pending on a deployment
with the same id and spins the router's event loop (router/calls.py). The oracle is Ray Serve's own
request context as each fake handle sees it at ``.remote()``: no parent id, whatever the caller's.
The last test runs the case that hung on a real Serve app (without ``own_request`` the waiting
call is never placed and the caller's event loop spins: not asserted here, it wedges the replica)."""

from __future__ import annotations

import asyncio

import pytest
from ray.serve import context as serve_context

from relay_serve.protocol import EngineChunk, EngineTraits, SegmentRequest
from relay_serve.replica.model_server import ModelServer
from relay_serve.router.backend import ServeBackend
from relay_serve.router.calls import own_request
from tests.serve.test_transport import FakeEngine, LeaseCall

PARENT = "the-clients-request"


def parent_seen() -> str:
    """The internal request id a handle call made here would carry as its parent's."""
    return serve_context._get_serve_request_context()._internal_request_id


def in_a_request(coro_fn):
    """Run ``coro_fn()`` as the router does while it serves a client's request."""

    async def go():
        serve_context._set_request_context(request_id="client-1", _internal_request_id=PARENT)
        assert parent_seen() == PARENT  # the test's premise: a call made here would inherit it
        return await coro_fn()

    return asyncio.run(go())


class RecordingHandle:
    """One model deployment: ``lease``, ``generate``/``complete`` and ``info`` calls, each
    recording the parent request id it was made under."""

    def __init__(self, role: str) -> None:
        self.server = ModelServer(role, {"model": f"toy:{role}"}, engine_cls=FakeEngine)
        self.parents: list[str] = []
        self.method = ""

    def options(self, method_name, stream=False, **kw):
        self.method = method_name
        return self

    @property
    def info(self):
        self.method = "info"
        return self

    def remote(self, *args):
        self.parents.append(parent_seen())
        if self.method == "lease":
            return LeaseCall(self.server.lease(*args))
        if self.method == "info":

            async def answer():
                return {"traits": EngineTraits().model_dump()}

            return answer()
        return Chunks()


class Chunks:
    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        yield EngineChunk(token_ids=[5], finished=True, finish_reason="length").model_dump()

    def __await__(self):
        async def one():
            return EngineChunk(token_ids=[5], finished=True, finish_reason="length").model_dump()

        return one().__await__()

    def cancel(self):
        pass


def req(model: str) -> SegmentRequest:
    return SegmentRequest(model=model, prompt_token_ids=[1, 2], max_tokens=1, session_id="gen-1")


@pytest.mark.parametrize("transport", ["direct", "handle"])
def test_segments_and_leases_carry_no_parent_request(transport):
    large, small = RecordingHandle("large"), RecordingHandle("small")
    backend = ServeBackend(large, small, transport=transport)

    async def go():
        backend.prepare("gen-1", ["large", "small"])
        for model in ("large", "small", "large"):
            assert [c async for c in backend.generate(req(model), stream=model == "small")][-1].finished
        backend.release("gen-1")
        backend.close()

    in_a_request(go)
    assert large.parents and small.parents  # calls were made ...
    assert set(large.parents + small.parents) == {""}  # ... none as a child of the client's request


def test_the_engine_traits_question_carries_no_parent_request():
    large, small = RecordingHandle("large"), RecordingHandle("small")
    backend = ServeBackend(large, small, transport="handle")

    async def go():
        return await backend.traits("large")

    assert in_a_request(go) == EngineTraits()
    assert large.parents == [""]


def test_own_request_leaves_the_callers_context_alone():
    seen = {}

    async def go():
        seen["inside"] = own_request(parent_seen)
        seen["after"] = parent_seen()

    in_a_request(go)
    assert seen == {"inside": "", "after": PARENT}


CALLER_SRC = """
import asyncio, contextvars, time
from ray import serve
from ray.serve.config import RequestRouterConfig
from relay_serve.router.affinity import SessionAffinityRouter
from relay_serve.router.calls import own_request


@serve.deployment(
    max_ongoing_requests=1, request_router_config=RequestRouterConfig(request_router_class=SessionAffinityRouter)
)
class Worker:
    async def hold(self, s: float) -> str:
        await asyncio.sleep(s)
        return "done"


@serve.deployment
class Caller:
    def __init__(self, worker) -> None:
        self.worker = worker

    async def __call__(self, fresh: bool) -> bool:
        def call(s):
            make = lambda: self.worker.hold.remote(s)
            return own_request(make) if fresh else make()

        first = call(1.0)  # takes the worker's only slot
        await asyncio.sleep(0.3)
        second, third = call(0.1), call(0.1)  # both wait, with the same id unless fresh
        await asyncio.sleep(0.3)
        second.cancel()
        await first
        try:
            await asyncio.wait_for(third, 5.0)
            return True
        except (asyncio.TimeoutError, TimeoutError):
            third.cancel()
            return False
"""


@pytest.mark.serve
def test_on_real_serve_a_waiting_call_is_placed_after_a_sibling_is_cancelled(serve_port, tmp_path, monkeypatch):
    """Two calls made while serving one request wait for the busy replica of a deployment routed
    by SessionAffinityRouter; the first is cancelled; the second is placed once the replica frees."""
    import importlib
    import sys

    from ray import serve

    (tmp_path / "stranded_caller.py").write_text(CALLER_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("stranded_caller")
    try:
        handle = serve.run(mod.Caller.bind(mod.Worker.bind()), name="stranded", route_prefix=None)
        placed = handle.remote(True).result(timeout_s=60)
    finally:
        serve.delete("stranded")
        sys.modules.pop("stranded_caller", None)
    assert placed is True
