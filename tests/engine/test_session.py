"""A generation's segments on one model in one resumable request (``engine/session.py``): stops
found exactly where vLLM's stop strings find them (pause tokens, one token of look-ahead), only new
tokens fed, a context that does not continue the request restarts it, cancellation closes it."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay_serve.engine.session import EngineSession
from relay_serve.engine.stops import PauseTokens, first_stop, lookahead_stops
from relay_serve.protocol import SegmentRequest
from tests.fakes import FakeCodec, FakeResumableEngine

PROMPT = "<think>\n"
REF = (
    "First, b3 -> c12.\n\nThus, we are at c12.\n\nNext, c12 -> v13.\n\nWait, c12 -> v13.\n"
    "</think>\n\nThe answer is v13."
)


def full_script(full: str):
    """A model that writes ``full`` (prompt included) from wherever its text stands; off it, nothing."""
    return lambda text: full[len(text) :] if full.startswith(text) else ""


def setup(ref: str = REF, extra: str = "", swaps: bool = False):
    """With ``swaps``, the vocabulary has 64 tokens the model never writes, and stops are looked
    ahead inside the engine where their completing tokens fit (``PauseIds.swaps``)."""
    codec = FakeCodec()
    codec.encode(PROMPT + ref)  # fixes the vocabulary: the reference's own pieces, then any others
    codec.encode(extra)
    engine = FakeResumableEngine(codec, full_script(PROMPT + ref))
    if swaps:
        engine.spare = codec.encode("".join(f" Qz{chr(97 + i // 26)}{chr(97 + i % 26)}" for i in range(64)))
    return codec, engine, EngineSession(engine, "gen-1", PauseTokens(engine.token_texts(), spare_ids=engine.spare))


def request(
    codec, context: str, stop: list[str], max_tokens: int = 200, word_stops: list[str] | None = None
) -> SegmentRequest:
    return SegmentRequest(
        model="large",
        prompt_token_ids=codec.encode(context),
        max_tokens=max_tokens,
        stop=stop,
        word_stops=word_stops or [],
        session_id="gen-1",
        resume=True,
    )


async def collect(session, req, stream: bool = False):
    return [c async for c in session.segment(req, stream=stream)]


def test_pause_tokens_cover_every_way_to_complete_a_stop():
    texts = ["Th", "us", ",", "Thus", "x,", "Thus,", "The", "h", "us,", ", we", "so", ".", " the", "\n", " a", " b"]
    pauses = PauseTokens(texts)

    def paused(stops, word_stops=frozenset()):
        found = pauses.ids(stops, word_stops)
        return {texts[i] for i in found}, dict(found.ahead)

    # "Thus,": tokens that start with the rest of a split (",", "us,", ", we") or hold it all
    assert paused(("Thus,",)) == ({",", "Thus,", "us,", ", we"}, {})
    # ". " ends in white space (completed by most tokens): the token that ends the prefix, and a look-ahead
    assert paused((". ",)) == ({"."}, {". ": (1,)})
    # "so ": "o " starts no token (completion at j = 1: no pause); at j = 2 the tokens ending "so"
    assert paused(("so ",)) == ({"so"}, {"so ": (2,)})
    # a cue (word stop) pauses where its word ends, not on every comma; its piece "us" too; the
    # rests "hus,", "us," and "s," start fewer tokens than the prefixes end: completed
    assert paused(("Thus,",), frozenset({"Thus,"})) == ({"Thus", "us", "Thus,", "us,"}, {"Thus,": (4,)})
    assert first_stop("a Thus, b. c", ["b.", "Thus,"]) == (10, "b.")  # list order, as vLLM
    assert lookahead_stops("so b.", {". ": (1,)}) and not lookahead_stops("so Th", {"Thus,": (1,)})
    assert not lookahead_stops("so b.", {". ": ()}) and not lookahead_stops("so Th", {})
    assert lookahead_stops("so Th", {"Thus,": (2,)}, ["Thus,"])
    assert not lookahead_stops("so xTh", {"Thus,": (2,)}, ["Thus,"])  # a word stop's prefix starts a word


def test_a_word_stop_counts_only_at_a_word_start():
    assert first_stop("we also see", ["so "], word_stops=["so "]) is None
    assert first_stop("we also so see", ["so "], word_stops=["so "]) == (11, "so ")
    assert first_stop("so see", ["so "], word_stops=["so "], before="al") is None
    assert first_stop("so see", ["so "], word_stops=["so "], before="al ") == (3, "so ")
    assert first_stop("we also see", ["so "]) == (8, "so ")  # not a word stop: any match


def test_a_cue_stops_the_segment_where_a_stop_string_would():
    codec, engine, session = setup()
    out = asyncio.run(collect(session, request(codec, PROMPT, ["Thus,", "Wait,"])))
    (last,) = out
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == "Thus,"
    assert codec.decode(last.token_ids) == "First, b3 -> c12.\n\nThus,"
    assert last.pauses == 1  # at the "," of "First," (no cue); then the "," of "Thus," completed one
    assert engine.requests[0].feeds == [codec.encode(PROMPT), codec.encode(",")]  # the paused-on token fed again


def test_a_stop_ending_in_white_space_looks_one_token_ahead():
    """ "Thus, " as a word stop: most tokens start with its last character, none ends "Thus,", and
    the "," is a piece of it: the request pauses on every ",", and looks one token ahead where the
    text ends with "Thus," at a word start."""
    codec, engine, session = setup()
    out = asyncio.run(collect(session, request(codec, PROMPT, ["Thus, "], word_stops=["Thus, "])))
    (last,) = out
    assert last.stop_reason == "Thus, " and codec.decode(last.token_ids) == "First, b3 -> c12.\n\nThus, we"
    assert last.pauses == 2  # at the "," of "First," (no look-ahead) and of "Thus," (then one token ahead)
    assert engine.requests[0].feeds == [codec.encode(PROMPT), codec.encode(","), codec.encode(",")]
    assert session.pauses.ids(("Thus, ",), frozenset({"Thus, "})).ahead == {"Thus, ": (5,)}


def test_the_next_segment_feeds_only_what_is_new():
    codec, engine, session = setup()
    asyncio.run(collect(session, request(codec, PROMPT, ["Thus,"])))
    # another model wrote " we are at c12.\n\n"; this one continues from there
    context = PROMPT + "First, b3 -> c12.\n\nThus, we are at c12.\n\n"
    (last,) = asyncio.run(collect(session, request(codec, context, ["Wait,"])))
    assert codec.decode(last.token_ids) == "Next, c12 -> v13.\n\nWait,"
    (resumable,) = engine.requests
    assert resumable.feeds[2] == codec.encode(", we are at c12.\n\n")  # the pending "," and the other model's tokens
    assert last.cached_tokens == len(codec.encode(context)) - len(resumable.feeds[2])


def test_a_context_that_does_not_continue_the_request_restarts_it():
    codec, engine, session = setup()
    asyncio.run(collect(session, request(codec, PROMPT, ["Thus,"])))
    restarts = []
    session.on_restart = lambda: restarts.append(1)
    # the router took tokens back: the context no longer holds what the request holds
    (last,) = asyncio.run(collect(session, request(codec, PROMPT + "First,", ["."])))
    assert codec.decode(last.token_ids) == " b3 -> c12." and restarts == [1]
    assert len(engine.requests) == 2 and engine.requests[0].closed


def test_eos_and_length_end_a_segment():
    codec, engine, session = setup()
    (last,) = asyncio.run(collect(session, request(codec, PROMPT + REF[:-5], [])))
    assert last.finish_reason == "stop" and last.stop_reason is None and codec.decode(last.token_ids) == " v13."
    codec, engine, session = setup()
    (last,) = asyncio.run(collect(session, request(codec, PROMPT, ["Wait,"], max_tokens=3)))
    assert last.finish_reason == "length" and len(last.token_ids) == 3


def test_streamed_chunks_add_up_to_the_segment():
    codec, engine, session = setup()
    out = asyncio.run(collect(session, request(codec, PROMPT, ["Thus,"]), stream=True))
    assert out[-1].finished and out[-1].token_ids == [] and not any(c.finished for c in out[:-1])
    assert codec.decode([t for c in out for t in c.token_ids]) == "First, b3 -> c12.\n\nThus,"


def test_a_cancelled_segment_closes_the_request():
    codec, engine, session = setup()
    engine.delay_s = 0.05

    async def go():
        task = asyncio.ensure_future(collect(session, request(codec, PROMPT, ["Wait,"])))
        await asyncio.sleep(0.12)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    assert engine.requests[0].closed and session.request is None and not session.busy


PIECES = ["a", " b", ".", " ", "\n", "\n\n", "Thus", ",", " so", "so", " T", "h", "us", "!", "also", " Thus"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=30),
    st.lists(st.sampled_from(["Thus,", ". ", ".\n", "\n\n", "so ", "a b", "!"]), max_size=3, unique=True),
    st.integers(min_value=1, max_value=40),
    st.data(),
)
def test_stops_agree_with_vllm_stop_strings(pieces, stops, max_tokens, data):
    """For any text, stop strings and word stops among them, looked ahead by pausing or inside the
    engine: the same tokens, finish reason and stop string as one plain request with vLLM's
    stop-string semantics (word stops at word starts)."""
    text = "".join(pieces)
    word_stops = data.draw(st.lists(st.sampled_from(stops), unique=True)) if stops else []
    swaps = data.draw(st.booleans())
    codec, engine, session = setup(text, extra="".join(PIECES) + "".join(stops), swaps=swaps)
    req = request(codec, PROMPT, stops, max_tokens=max_tokens, word_stops=word_stops)
    (plain,) = asyncio.run(_plain(engine, req))
    (ours,) = asyncio.run(collect(session, req))
    assert (ours.token_ids, ours.finish_reason, ours.stop_reason) == (
        plain.token_ids,
        plain.finish_reason,
        plain.stop_reason,
    ), (pieces, stops, max_tokens)


async def _plain(engine, req):
    return [c async for c in engine.generate(req, "plain")][-1:]


@pytest.mark.parametrize("stream", [False, True])
def test_a_busy_session_refuses_a_second_segment(stream):
    codec, engine, session = setup()
    session.busy = True
    with pytest.raises(RuntimeError, match="already runs a segment"):
        asyncio.run(collect(session, request(codec, PROMPT, []), stream=stream))


def test_a_chunk_that_yields_nothing_is_an_error_that_says_so():
    """An engine request whose chunk ends with no output at all (not even EOS) fails the segment
    with a message naming it, not with an unbound name."""
    codec, engine, session = setup()

    async def silent(token_ids, max_tokens, pause_ids, sampling, continued=False):
        return
        yield  # an async generator that yields nothing

    async def go():
        async for _ in session.segment(request(codec, PROMPT, ["Thus,"]), stream=False):
            pass

    original = engine.resumable

    def resumable(request_id):
        r = original(request_id)
        r.chunk = silent
        return r

    engine.resumable = resumable
    with pytest.raises(RuntimeError, match="ended a chunk without a token"):
        asyncio.run(go())


def delta(codec, context: str, base: int, stop: list[str]) -> SegmentRequest:
    """The segment for ``context`` as a router that knows the session holds ``base`` tokens sends it."""
    ids = codec.encode(context)
    return request(codec, context, stop).model_copy(update={"prompt_token_ids": ids[base:], "context_base": base})


def test_a_segment_that_sends_only_what_is_new_gets_what_the_whole_context_gets():
    codec, engine, session = setup()
    first = asyncio.run(collect(session, request(codec, PROMPT, ["Thus,"])))[-1]
    context = PROMPT + "First, b3 -> c12.\n\nThus, we are at c12.\n\n"
    held = len(codec.encode(PROMPT)) + len(first.token_ids)  # the context and what the session wrote
    (last,) = asyncio.run(collect(session, delta(codec, context, held, ["Wait,"])))
    assert codec.decode(last.token_ids) == "Next, c12 -> v13.\n\nWait,"
    (resumable,) = engine.requests  # continued, not restarted
    assert resumable.feeds[2] == codec.encode(", we are at c12.\n\n")
    assert session.seen == codec.encode(context) + last.token_ids


def test_a_segment_that_continues_more_than_the_session_holds_is_a_context_gap():
    from relay_serve.protocol import ContextGap

    codec, engine, session = setup()
    first = asyncio.run(collect(session, request(codec, PROMPT, ["Thus,"])))[-1]
    held = len(codec.encode(PROMPT)) + len(first.token_ids)
    context = PROMPT + "First, b3 -> c12.\n\nThus, we"
    with pytest.raises(ContextGap):
        asyncio.run(collect(session, delta(codec, context, held + 1, ["."])))
    asyncio.run(session.close())  # the session ended (reaped, or the router ended it): it holds nothing
    with pytest.raises(ContextGap):
        asyncio.run(collect(session, delta(codec, context, 1, ["."])))
    (last,) = asyncio.run(collect(session, delta(codec, context, 0, ["."])))  # the whole context: served
    assert codec.decode(last.token_ids) == " are at c12."


def test_tokens_sent_again_keep_the_request_when_they_are_the_same_and_restart_it_when_not():
    codec, engine, session = setup()
    asyncio.run(collect(session, request(codec, PROMPT, ["Thus,"])))
    n_prompt = len(codec.encode(PROMPT))
    context = PROMPT + "First, b3 -> c12.\n\nThus, we are at c12.\n\n"
    restarts = []
    session.on_restart = lambda: restarts.append(1)
    asyncio.run(collect(session, delta(codec, context, n_prompt, ["Wait,"])))  # resends the same tokens
    assert restarts == [] and len(engine.requests) == 1
    other = PROMPT + "First, b3 -> c12.\n\nSo, we are at c12.\n\n"  # tokens the KV holds, replaced
    asyncio.run(collect(session, delta(codec, other, n_prompt, ["."])))
    assert restarts == [1] and len(engine.requests) == 2
    assert engine.requests[1].feeds[0] == codec.encode(other)  # the new request gets the whole context


@pytest.mark.parametrize("swaps", [False, True], ids=["pauses", "swaps"])
def test_stops_looked_ahead_inside_the_engine_cost_no_pause(swaps):
    """The reference's segments, cue by cue and sentence by sentence: the same tokens and stops
    either way; looked ahead by pausing, each stop found costs a pause on the token before its
    last (``" Thus"`` before ``","``); inside the engine, none."""
    codec, engine, session = setup(swaps=swaps)
    cues = ["Thus,", "Wait,", "Next,"]
    context, found, pauses = PROMPT, [], 0
    for stop in (cues, [". ", ".\n", "\n\n"], cues, [". ", ".\n", "\n\n"], cues):
        req = request(codec, context, stop, word_stops=cues if stop is cues else [])
        (plain,) = asyncio.run(_plain(engine, req))
        (ours,) = asyncio.run(collect(session, req))
        assert (ours.token_ids, ours.stop_reason) == (plain.token_ids, plain.stop_reason)
        found.append(ours.stop_reason)
        pauses += ours.pauses
        context += codec.decode(ours.token_ids)
    assert found == ["Thus,", ".\n", "Next,", ".\n", "Wait,"]
    assert pauses == (0 if swaps else len(found))
