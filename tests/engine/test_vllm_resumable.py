"""``VLLMResumable``'s own bookkeeping over a stand-in for vLLM's engine (no vLLM engine runs)."""

from __future__ import annotations

import asyncio

import pytest

from relay_serve.engine.vllm_engine import VLLMResumable


class _DeadEngine:
    """An engine whose request never ends and whose abort fails (its core died)."""

    async def generate(self, inputs, params, request_id):
        await asyncio.Event().wait()
        yield  # never reached

    async def abort(self, request_id):
        raise RuntimeError("EngineCore is dead")


def test_closing_a_request_whose_abort_fails_still_ends_its_task():
    async def go():
        request = VLLMResumable(_DeadEngine(), "r-1")
        request._task = asyncio.create_task(request._pump(None))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="EngineCore is dead"):
            await request.close()
        assert request._task.done()  # ended here, not left reading a dead engine's request

    asyncio.run(go())
