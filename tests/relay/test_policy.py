"""Every transition of the policies, driven through a scripted fake backend."""

from __future__ import annotations

import asyncio
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay_serve.protocol import EngineChunk, SamplingSettings
from relay_serve.relay.generation import EngineError, Generation
from relay_serve.relay.policy import (
    PolicySettings,
    RelayGen,
    SingleModel,
    SpeculativeThinking,
)
from relay_serve.relay.types import GenerationResult, TextDelta
from tests.fakes import FakeBackend, FakeCodec, follow

PROMPT = "Start at b3.\n"
REF = (
    "<think>\nFirst, b3 -> c12.\n\nThus, we are at c12.\n\nNext, c12 -> d4.\n\n"
    "Therefore, the answer is d4.\n</think>\n\nThe answer is \\boxed{d4}."
)
CUES = ["Thus,", "Therefore,"]


def make_session(scripts, max_tokens=500, stops=None, prompt=PROMPT, delay_s=0.0):
    codec = FakeCodec()
    backend = FakeBackend(codec, scripts, delay_s=delay_s)
    s = Generation(
        backend=backend,
        codec=codec,
        prompt_ids=codec.encode(prompt),
        max_tokens=max_tokens,
        sampling=SamplingSettings(temperature=0.0, seed=7),
        session_id="gen-1",
        user_stops=stops or [],
    )
    return s, backend


def run(session, policy) -> GenerationResult:
    return asyncio.run(session.run(policy))


def stream(session, policy) -> tuple[list[str], GenerationResult]:
    """The text deltas a streaming client gets, in order, and the generation's result."""

    async def collect():
        parts, result = [], None
        async for ev in session.stream(policy):
            if isinstance(ev, TextDelta):
                parts.append(ev.text)
            else:
                result = ev
        return parts, result

    return asyncio.run(collect())


def models_of(result: GenerationResult) -> list[tuple[str, str]]:
    return [(seg.model, result.text[seg.start : seg.end]) for seg in result.trace]


def check_invariants(result: GenerationResult) -> None:
    u = result.usage
    assert u.large_tokens + u.small_tokens == len(result.token_ids)
    assert result.trace[0].start == 0 and result.trace[-1].end == len(result.text)
    for a, b in pairwise(result.trace):
        assert a.end == b.start
    assert sum(seg.tokens for seg in result.trace) == len(result.token_ids)


def test_relay_hands_cued_sentences_and_the_answer_to_the_small_model():
    s, backend = make_session({"large": follow(REF), "small": follow(REF)})
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert r.text == REF
    assert r.finish_reason == "stop"
    check_invariants(r)
    assert models_of(r) == [
        ("large", "<think>\nFirst, b3 -> c12.\n\nThus,"),
        ("small", " we are at c12.\n\n"),  # ".\n" ends inside the "\n\n" token: the whole token goes
        ("large", "Next, c12 -> d4.\n\nTherefore,"),
        ("small", " the answer is d4.\n"),
        ("large", "</think>"),
        ("small", "\n\nThe answer is \\boxed{d4}."),
    ]
    assert [seg.cue for seg in r.trace] == [None, "Thus,", None, "Therefore,", None, "</think>"]
    assert r.usage.switches == 5 and r.usage.segments == 6
    # every request continues the whole context and carries the generation's id
    assert all(req.session_id == "gen-1" for req in backend.requests)
    assert backend.requests[1].model == "small" and "\n\n" in backend.requests[1].stop
    assert "Thus," in backend.requests[0].stop and "</think>" in backend.requests[0].stop


def test_segment_seeds_are_derived_and_distinct():
    s, backend = make_session({"large": follow(REF), "small": follow(REF)})
    run(s, RelayGen(PolicySettings(), CUES))
    seeds = [req.sampling.seed for req in backend.requests]
    assert len(set(seeds)) == len(seeds)
    s2, backend2 = make_session({"large": follow(REF), "small": follow(REF)})
    run(s2, RelayGen(PolicySettings(), CUES))
    assert seeds == [req.sampling.seed for req in backend2.requests]


def test_cue_at_the_start_of_a_large_turn_waits_for_min_large_tokens():
    ref = "<think>\nThus, a b c d e f.\n\nThus, g h.\n\nThus, x y.\n</think>\nok"
    s, backend = make_session({"large": follow(ref), "small": follow(ref)})
    r = run(s, RelayGen(PolicySettings(min_large_tokens=5), ["Thus,"]))
    check_invariants(r)
    # the first "Thus," comes after 4 large tokens ("<think>", "\n", "Thus", ","): no switch there
    assert models_of(r)[0] == ("large", "<think>\nThus, a b c d e f.\n\nThus,")
    assert models_of(r)[1] == ("small", " g h.\n\n")
    # right after the small sentence the large writes "Thus," (2 tokens): it keeps the sentence
    assert models_of(r)[2] == ("large", "Thus, x y.\n</think>")
    assert r.text == ref


def test_cue_stop_that_is_not_at_a_word_boundary_does_not_switch():
    ref = "<think>\nI know, also Some things.\n\nNow, so we go on.\n</think>\nend"
    s, backend = make_session({"large": follow(ref), "small": follow(ref)})
    r = run(s, RelayGen(PolicySettings(min_large_tokens=0), ["now,", "Now,", "So", "so"]))
    assert r.text == ref
    stops_hit = [req.model for req in backend.requests]
    # "know," and "also " stop the engine (raw substrings) but the large model goes on
    assert models_of(r)[0] == ("large", "<think>\nI know, also Some things.\n\nNow,")
    assert models_of(r)[1] == ("small", " so we go on.\n")
    assert [req.stop[:4] for req in backend.requests[:1]] == [["now,", "Now,", "So ", "So\n"]]
    assert stops_hit[:3] == ["large", "large", "large"]
    check_invariants(r)


def test_stop_string_split_across_tokens():
    # "Therefore," is two tokens; "c12" is three (" c", "1", "2")
    s, _ = make_session({"large": follow(REF), "small": follow(REF)}, stops=["c12."])
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert r.text == "<think>\nFirst, b3 -> "
    assert r.finish_reason == "stop"
    check_invariants(r)


def test_user_stop_spanning_a_handoff():
    # "c12.\n\nNext" starts in the small model's sentence and ends in the large model's turn
    s, _ = make_session({"large": follow(REF), "small": follow(REF)}, stops=["c12.\n\nNext"])
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert r.text == "<think>\nFirst, b3 -> c12.\n\nThus, we are at "
    assert r.finish_reason == "stop"
    check_invariants(r)


def test_think_close_inside_a_small_segment_goes_to_the_answer():
    ref = "<think>\nFirst, b3 -> c12.\n\nTherefore, it is c12</think>\n\nThe answer is c12."
    s, backend = make_session({"large": follow(ref), "small": follow(ref)})
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert r.text == ref
    assert [m for m, _ in models_of(r)] == ["large", "small", "small"]
    assert models_of(r)[2] == ("small", "\n\nThe answer is c12.")
    assert backend.requests[-1].model == "small" and backend.requests[-1].stop == []


def test_a_small_model_that_ends_its_turn_mid_reasoning_hands_back_to_the_large_model():
    # the small model ends its sentence at once (EOS): the large model goes on; the answer it leaves
    # empty too (EOS after </think> is the small model's answer ending)
    s, _ = make_session({"large": follow(REF), "small": lambda _: ""})
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert r.text == REF[: REF.index("</think>") + len("</think>")]
    assert r.finish_reason == "stop" and r.usage.small_tokens == 0
    assert [m for m, _ in models_of(r)] == ["large"]
    check_invariants(r)


def test_the_end_of_sequence_token_of_a_small_sentence_is_taken_back():
    """With an engine that reports EOS as a token (vLLM), that token is dropped from the output."""
    from tests.fakes import FakeBackend

    class EosBackend(FakeBackend):
        async def generate(self, request, stream=True, timeout_s=None):
            if request.model == "small" and "\n\n" in request.stop:  # a cued sentence: "we", then EOS
                self.requests.append(request)
                yield EngineChunk(token_ids=self.codec.encode(" we"))
                yield EngineChunk(token_ids=[self.eos], finished=True, finish_reason="stop")
                return
            async for chunk in super().generate(request, stream, timeout_s):
                yield chunk

    codec = FakeCodec()
    backend = EosBackend(codec, {"large": follow(REF), "small": follow(REF)})
    backend.eos = codec.encode("<think>")[0] + 10_000
    codec.pieces += [""] * (backend.eos - len(codec.pieces) + 1)  # the EOS token decodes to nothing
    s = Generation(
        backend=backend,
        codec=codec,
        prompt_ids=codec.encode(PROMPT),
        max_tokens=500,
        sampling=SamplingSettings(),
        session_id="gen-1",
    )
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert backend.eos not in r.token_ids and r.usage.discarded_tokens == 2
    assert models_of(r)[:3] == [
        ("large", "<think>\nFirst, b3 -> c12.\n\nThus,"),
        ("small", " we"),
        ("large", " are at c12.\n\nNext, c12 -> d4.\n\nTherefore,"),
    ]
    check_invariants(r)


def test_empty_generation():
    s, _ = make_session({"large": lambda _: "", "small": lambda _: ""})
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert r.text == "" and r.token_ids == [] and r.trace == [] and r.finish_reason == "stop"


def test_budget_exhausted_while_the_large_model_reasons():
    s, _ = make_session({"large": follow(REF), "small": follow(REF)}, max_tokens=6)
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert r.finish_reason == "length" and len(r.token_ids) == 6
    assert "</think>" not in r.text
    check_invariants(r)


def test_budget_exhausted_in_reasoning_closes_it_and_the_small_model_answers_in_the_reserve():
    long_ref = "<think>\nFirst, b3 -> c12.\n\nNext, c12 -> d4.\n\nNext, d4 -> f1.\n</think>\n\nd4"

    def small(written: str) -> str:
        return "\n\nThe answer is c12." if written.endswith("</think>") else ""

    s, _ = make_session({"large": follow(long_ref), "small": small}, max_tokens=30)
    r = run(s, RelayGen(PolicySettings(answer_reserve_tokens=10), CUES))
    check_invariants(r)
    segs = models_of(r)
    assert segs[0][0] == "large" and len(r.token_ids) <= 30
    assert segs[1] == ("small", "</think>\n\nThe answer is c12.")
    assert r.trace[1].forced and r.trace[1].cue == "</think>"
    assert r.finish_reason == "stop"


def test_budget_exhausted_in_a_small_sentence():
    n = len(FakeCodec().encode("<think>\nFirst, b3 -> c12.\n\nThus,"))
    s, _ = make_session({"large": follow(REF), "small": follow(REF)}, max_tokens=n + 3)
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert r.finish_reason == "length" and len(r.token_ids) == n + 3
    assert models_of(r)[-1] == ("small", " we are at")
    check_invariants(r)


def test_budget_exhausted_in_the_answer():
    n = len(FakeCodec().encode(REF))
    s, _ = make_session({"large": follow(REF), "small": follow(REF)}, max_tokens=n - 2)
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert r.finish_reason == "length" and r.text == REF[: len(r.text)] and len(r.token_ids) == n - 2
    assert models_of(r)[-1][0] == "small"


def test_small_segment_is_cut_at_max_small_segment_tokens():
    ref = "<think>\nThus, one two three four five six seven\n\nmore.\n</think>\nok"
    s, _ = make_session({"large": follow(ref), "small": follow(ref)})
    r = run(s, RelayGen(PolicySettings(max_small_segment_tokens=3, min_large_tokens=0), ["Thus,"]))
    assert models_of(r)[1] == ("small", " one two three")
    assert models_of(r)[2][0] == "large" and r.text == ref


def test_sentence_end_rule_keeps_decimal_points():
    ref = "<think>\nThus, it is 3.5 units. Then more.\n</think>\nok"
    s, _ = make_session({"large": follow(ref), "small": follow(ref)})
    r = run(s, RelayGen(PolicySettings(min_large_tokens=0), ["Thus,"]))
    # ". " completes only with " Then": that token starts the next sentence and is taken back
    assert models_of(r)[1] == ("small", " it is 3.5 units.")
    assert models_of(r)[2] == ("large", " Then more.\n</think>")
    assert r.usage.discarded_tokens == 1 and r.text == ref


def test_large_and_small_baselines_use_one_model():
    for model in ("large", "small"):
        s, backend = make_session({"large": follow(REF), "small": follow(REF)})
        r = run(s, SingleModel(model))
        assert r.text == REF and [m for m, _ in models_of(r)] == [model]
        assert len(backend.requests) == 1 and r.usage.switches == 0
        check_invariants(r)


def test_degrades_to_the_large_model_when_the_small_one_is_unavailable():
    s, backend = make_session({"large": follow(REF), "small": follow(REF)})
    backend.unavailable.add("small")
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert r.text == REF and r.usage.small_tokens == 0
    assert r.usage.degraded and "no replica" in r.usage.degraded_reason
    check_invariants(r)


def test_engine_that_ends_a_stream_without_finishing_is_an_error():
    s, backend = make_session({"large": follow(REF), "small": follow(REF)})
    backend.generate = lambda request, stream=True, timeout_s=None: _empty()
    with pytest.raises(EngineError):
        run(s, RelayGen(PolicySettings(), CUES))


async def _empty():
    if False:
        yield


def test_streamed_text_equals_the_result_and_holds_back_user_stops():
    s, _ = make_session({"large": follow(REF), "small": follow(REF)}, stops=["d4."])
    parts, result = stream(s, RelayGen(PolicySettings(), CUES))
    assert all("d4." not in "".join(parts[: i + 1]) for i in range(len(parts)))  # never streamed, even for a moment
    assert "".join(parts) == result.text == "<think>\nFirst, b3 -> c12.\n\nThus, we are at c12.\n\nNext, c12 -> "


def test_closing_the_stream_cancels_the_engine_request():
    s, backend = make_session({"large": follow(REF), "small": follow(REF)}, delay_s=0.01)

    async def first_then_close():
        agen = s.stream(RelayGen(PolicySettings(), CUES))
        await agen.__anext__()
        await agen.aclose()

    asyncio.run(first_then_close())
    assert backend.cancelled == 1


SPEC_REF = "<think>\nStep one.\n\nWait, check it.\n\nStep two.\n</think>\n\nDone."


def test_speculative_thinking_hands_reflective_stretches_to_the_large_model():
    s, backend = make_session({"large": follow(SPEC_REF), "small": follow(SPEC_REF)})
    r = run(s, SpeculativeThinking(PolicySettings(draft_tokens=4)))
    assert r.text == SPEC_REF
    check_invariants(r)
    assert models_of(r) == [
        ("small", "<think>\nStep one.\n\n"),
        ("large", "Wait, check it.\n\n"),
        ("small", "Step two.\n</think>"),
        ("small", "\n\nDone."),
    ]
    assert r.usage.discarded_tokens == 4  # the rejected draft "Wait", ",", " check", " it"


def test_speculative_thinking_keeps_drafts_without_reflection():
    ref = "<think>\nStep one.\n\nStep two is long enough.\n\nStep three.\n</think>\n\nDone."
    s, _ = make_session({"large": follow(ref), "small": follow(ref)})
    r = run(s, SpeculativeThinking(PolicySettings(draft_tokens=3)))
    assert r.text == ref and r.usage.large_tokens == 0 and r.usage.discarded_tokens == 0
    check_invariants(r)


# ---- faults: a replica dies mid-segment, the small deployment refuses --------------------------


def test_a_large_segment_whose_replica_died_continues_from_the_context_without_loss():
    s, backend = make_session({"large": follow(REF), "small": follow(REF)})
    backend.faults = [("large", 3), ("large", 2)]  # two deaths in a row, both mid-segment
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert r.text == REF and r.usage.retries == 2 and not r.usage.degraded
    check_invariants(r)
    # each retry continued the context as it stood: nothing written twice
    first, second, third = backend.requests[:3]
    assert len(second.prompt_token_ids) == len(first.prompt_token_ids) + 3
    assert len(third.prompt_token_ids) == len(second.prompt_token_ids) + 2
    assert second.max_tokens == first.max_tokens - 3


def test_a_large_model_that_keeps_failing_ends_in_an_engine_error_after_its_retries():
    s, backend = make_session({"large": follow(REF), "small": follow(REF)})
    s.retries = 2
    backend.faults = [("large", 1)] * 3
    with pytest.raises(EngineError, match="failed 3 times"):
        run(s, RelayGen(PolicySettings(), CUES))
    assert len(backend.requests) == 3


def test_streamed_text_has_no_gap_or_repeat_across_a_retry():
    s, backend = make_session({"large": follow(REF), "small": follow(REF)})
    backend.faults = [("large", 4), ("small", 2)]
    parts, result = stream(s, RelayGen(PolicySettings(), CUES))
    assert "".join(parts) == result.text == REF


def test_a_small_sentence_whose_replica_died_is_finished_by_the_large_model():
    s, backend = make_session({"large": follow(REF), "small": follow(REF)})
    backend.faults = [("small", 2)]  # "Thus," then " we" " are", then the replica dies
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert r.text == REF and r.usage.degraded and r.usage.kept_on_large == 1
    assert "died" in r.usage.degraded_reason and r.usage.retries == 0
    check_invariants(r)
    owners = models_of(r)
    # the small model's two tokens stay; the large model writes the rest of that sentence
    assert ("small", " we are") in owners and owners[owners.index(("small", " we are")) + 1][0] == "large"
    assert r.usage.small_tokens > 2  # later handoffs and the answer still go to the small model


def test_a_refused_small_deployment_leaves_every_handoff_to_the_large_model():
    s, backend = make_session({"large": follow(REF), "small": follow(REF)})
    backend.small_refused = "the small deployment is past its queue bound"
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert r.text == REF and r.usage.small_tokens == 0
    assert r.usage.kept_on_large == 3  # two cues and the answer
    assert r.usage.degraded_reason == "the small deployment is past its queue bound"
    assert not any(req.model == "small" for req in backend.requests)
    check_invariants(r)


# Any text, any spacing: what a client is streamed is the final text. The pieces include the white
# space where the sentence rule and stop strings could disagree (tab, carriage return, no-break
# space), cues and cue look-alikes, and tokens that hold a sentence end in their middle.
_PIECES = [
    "Thus,",
    " Thus,",
    "Therefore,",
    " so",
    " also",
    " b3",
    " x",
    "Wait,",
    ".",
    "!",
    "?",
    ",",
    " ",
    "\n",
    "\n\n",
    "\t",
    "\r",
    "\xa0",
    "3",
    ".5",
    "</think>",
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    large=st.lists(st.sampled_from(_PIECES), min_size=1, max_size=40).map("".join),
    small=st.lists(st.sampled_from(_PIECES), min_size=1, max_size=20).map("".join),
)
def test_streamed_deltas_add_up_to_the_final_text_for_any_text(large, small):
    # Each model writes its text whatever the context, so relay interleaves them however cues and
    # sentence ends fall; a small model that ends no sentence hands back at its token budget.
    scripts = {"large": lambda written: "<think>\n" + large if not written else large, "small": lambda written: small}
    s, _ = make_session(scripts, max_tokens=120)
    parts, result = stream(s, RelayGen(PolicySettings(max_small_segment_tokens=8), CUES + ["Wait,"]))
    assert "".join(parts) == result.text
    check_invariants(result)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    large=st.lists(st.sampled_from(_PIECES), min_size=1, max_size=40).map("".join),
    small=st.lists(st.sampled_from(_PIECES), min_size=1, max_size=20).map("".join),
    stops=st.lists(st.sampled_from(["c12", ". ", "we", "Wait"]), max_size=2),
    speculative=st.booleans(),
)
def test_what_a_request_says_is_unchanged_of_its_context_is_what_its_engine_session_saw(
    large, small, stops, speculative
):
    """``SegmentRequest.unchanged`` (what a transport may leave out when it reaches the same
    engine session) never claims a token of the context that differs from what that model's
    previous request had and wrote, whatever the policy took back (sentence ends, EOS, drafts,
    user stops)."""
    scripts = {"large": lambda written: "<think>\n" + large if not written else large, "small": lambda written: small}
    s, backend = make_session(scripts, max_tokens=120, stops=stops)
    policy = (
        SpeculativeThinking(PolicySettings(draft_tokens=4))
        if speculative
        else RelayGen(PolicySettings(max_small_segment_tokens=8), CUES + ["Wait,"])
    )
    run(s, policy)
    assert backend.unchanged_violations == []


def test_a_relay_generation_says_all_of_each_context_but_the_other_models_tokens_is_unchanged():
    """Without take-backs, a model's request leaves out (for a transport that can) everything but
    what the other model wrote since: its previous request's context and output, which is the
    context of the request that followed it."""
    s, backend = make_session({"large": follow(REF), "small": follow(REF)})
    r = run(s, RelayGen(PolicySettings(), CUES))
    assert r.text == REF and backend.unchanged_violations == []
    reqs = backend.requests
    assert [q.model for q in reqs[:2]] == ["large", "small"] and reqs[0].unchanged == reqs[1].unchanged == 0
    for i in range(2, len(reqs)):
        j = max(k for k in range(i) if reqs[k].model == reqs[i].model)  # that model's previous request
        assert reqs[i].unchanged == len(reqs[j + 1].prompt_token_ids), (i, reqs[i].model)
        assert len(reqs[i].prompt_token_ids) - reqs[i].unchanged < len(reqs[i].prompt_token_ids) // 2
