"""Who writes the next segment: RelayGen, the single-model baselines, and Speculative Thinking.

Each policy is a small state machine over a :class:`~relay_serve.relay.generation.Generation`; the generation
runs the engine requests and keeps the books. Knows nothing of Ray or vLLM.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from relay_serve.protocol import ModelRole
from relay_serve.relay.auto import AutoSettings
from relay_serve.relay.generation import (
    Generation,
    ModelUnavailable,
    Policy,
    SegmentOutcome,
)
from relay_serve.relay.text import (
    SENTENCE_STOPS,
    THINK_CLOSE,
    cue_stop_strings,
    find_cue,
)

PolicyName = Literal["relay", "large", "small", "speculative-thinking"]
POLICY_NAMES: tuple[PolicyName, ...] = ("relay", "large", "small", "speculative-thinking")
MODEL_IDS: tuple[str, ...] = (*POLICY_NAMES, "auto")  # auto: relay or large, per generation (auto.py)


class PolicySettings(BaseModel):
    """Settings of the policies (the ``policy`` section of the app config)."""

    model_config = ConfigDict(extra="forbid")

    max_small_segment_tokens: int = Field(64, ge=1, description="a small-model sentence is cut after this many tokens")
    min_large_tokens: int = Field(5, ge=0, description="tokens the large model writes before a cue may stop it again")
    think_close: str = Field(THINK_CLOSE, description="the string that ends the reasoning")
    answer_reserve_tokens: int = Field(
        0, ge=0, description="tokens of max_tokens kept for the answer when the reasoning runs long"
    )
    draft_tokens: int = Field(
        20, ge=1, description="speculative-thinking: tokens the small model drafts at a paragraph break"
    )
    large_stretch_tokens: int = Field(
        256, ge=1, description="speculative-thinking: at most this many tokens per large-model stretch"
    )
    reflection_words: list[str] = Field(
        default_factory=lambda: ["wait", "alternatively", "hold on", "check", "verify", "hmm"],
        description="speculative-thinking: a draft holding one of these hands the stretch to the large model",
    )
    auto: AutoSettings = Field(
        default_factory=AutoSettings, description="auto: how it learns which of relay and large is faster"
    )


class SingleModel:
    """One model writes everything: the ``large`` and ``small`` baselines."""

    def __init__(self, model: ModelRole) -> None:
        self.model = model
        self.prefetch: tuple[ModelRole, ...] = (model,)
        self.models: tuple[ModelRole, ...] = (model,)

    async def run(self, s: Generation) -> None:
        out = await s.write(self.model, s.left)
        s.finish(out.finish_reason)


class RelayGen:
    """RelayGen: the large model reasons and hands each sentence opened by a cue to the small model,
    which also writes the whole answer after the reasoning ends."""

    prefetch: tuple[ModelRole, ...] = ("large", "small")  # the small model writes the answer
    models: tuple[ModelRole, ...] = ("large", "small")

    def __init__(self, settings: PolicySettings, cues: list[str]) -> None:
        self.settings = settings
        self.cues = list(cues)
        self.cue_stops = cue_stop_strings(self.cues)
        self.small_stops = list(SENTENCE_STOPS) + [settings.think_close]

    async def run(self, s: Generation) -> None:
        s.usage.cues = list(self.cues)
        while not s.done and not self._closed(s):
            cue = await self.large_turn(s)
            if cue is None:
                break
            await self.small_sentence(s, cue)
        if s.done:
            return
        if self._closed(s):
            await self.answer(s, cue=self.settings.think_close)
        elif s.left <= 0:
            s.finish("length")
        else:  # the reasoning budget is spent: close it, and answer in the reserve
            answerer: ModelRole = "large" if s.backend.refusal("small") is not None else "small"
            s.force_text(self.settings.think_close, answerer, cue=self.settings.think_close)
            await self.answer(s, cue=None)  # the answer continues the segment the forced close opened

    def _closed(self, s: Generation) -> bool:
        return self.settings.think_close in s.output.text

    def _reasoning_budget(self, s: Generation) -> int:
        return s.left - self.settings.answer_reserve_tokens

    async def large_turn(self, s: Generation) -> str | None:
        """The large model writes until a real cue after ``min_large_tokens`` of its own tokens.

        Returns that cue; None when the reasoning closed, its budget ran out or the output ended.
        """
        stops = self.cue_stops + [self.settings.think_close]
        written = 0
        while (budget := self._reasoning_budget(s)) > 0:
            out = await s.write("large", budget, stops, word_stops=self.cue_stops)
            written += len(out.token_ids)
            if s.done or self._closed(s):
                return None
            if out.hit_eos:
                s.finish("stop")
                return None
            if not out.hit_stop_string:
                return None  # the reasoning budget is spent
            cue = self._cue_at_end(s, out)
            if cue is None:
                s.usage.false_stops += 1  # a raw substring that is no cue ("know," for "now,"): go on
            elif written >= self.settings.min_large_tokens:
                if not self._small_refused(s):
                    return cue
                written = 0  # the large model writes this sentence too; the next cue may hand off
        return None

    def _cue_at_end(self, s: Generation, out: SegmentOutcome) -> str | None:
        """The real cue that ends inside this segment's text (the one that stopped the engine)."""
        text = s.output.text
        pos = max(0, out.text_start - max((len(c) for c in self.cues), default=0))
        last = None
        while (match := find_cue(text, self.cues, pos)) is not None:
            last, pos = match, match.start + 1
        return None if last is None or last.end <= out.text_start else last.cue

    async def small_sentence(self, s: Generation, cue: str) -> None:
        """The small model finishes the sentence the cue opened; the large model takes over at its
        end, or when the small model fails (the text it streamed stays) or ends its turn (EOS, a
        mistake in the middle of the reasoning: the large model goes on)."""
        budget = min(self.settings.max_small_segment_tokens, self._reasoning_budget(s))
        if budget <= 0:
            return
        try:
            # No retry: the large model finishing the sentence is quicker than waiting for a replica.
            out = await s.sentence("small", budget, self.small_stops, cue)
        except ModelUnavailable as e:
            self._degrade(s, str(e))
            return
        if out.hit_eos and not s.done:
            s.take_back_silent_tokens()  # the end-of-sequence token is no part of the reasoning

    def _small_refused(self, s: Generation) -> bool:
        """Whether the backend refuses a small-model segment now (counted as a kept handoff)."""
        reason = s.backend.refusal("small")
        if reason is not None:
            self._degrade(s, reason)
        return reason is not None

    @staticmethod
    def _degrade(s: Generation, reason: str) -> None:
        s.usage.kept_on_large += 1
        s.usage.degraded = True
        s.usage.degraded_reason = s.usage.degraded_reason or reason

    async def answer(self, s: Generation, cue: str | None) -> None:
        """The small model writes the answer (the large one when the small one cannot)."""
        if s.left <= 0:
            s.finish("length")
            return
        if not self._small_refused(s):
            try:
                out = await s.answer("small", cue, optional=True)
                s.finish(out.finish_reason)
                return
            except ModelUnavailable as e:
                self._degrade(s, str(e))
            if s.done or s.left <= 0:
                s.finish("length")
                return
        out = await s.answer("large", cue)
        s.finish(out.finish_reason)


class SpeculativeThinking:
    """The Speculative Thinking baseline: the small model leads; at each paragraph break it drafts a
    few tokens, and a draft that holds a reflection word is thrown away and the large model writes
    that stretch (to the next paragraph break) instead."""

    BREAK = "\n\n"
    prefetch: tuple[ModelRole, ...] = ("small",)  # the large model only writes reflective stretches
    models: tuple[ModelRole, ...] = ("small", "large")

    def __init__(self, settings: PolicySettings) -> None:
        self.settings = settings
        words = "|".join(re.escape(w) for w in settings.reflection_words)
        self.reflection = re.compile(rf"(?<![\w])(?:{words})(?![\w])", re.IGNORECASE)
        self.stops = [self.BREAK, settings.think_close]

    async def run(self, s: Generation) -> None:
        close = self.settings.think_close
        out = await s.write("small", s.left, self.stops)
        while not s.done and close not in s.output.text:
            if out.hit_eos:
                s.finish("stop")
                return
            if s.left <= 0:
                s.finish("length")
                return
            if out.hit_stop_string:  # at a paragraph break
                out = await self.next_stretch(s)
            else:  # a stretch cut short of a break: the small model goes on to one
                out = await s.write("small", s.left, self.stops)
        if s.done:
            return
        out = await s.answer("small", cue=close)
        s.finish(out.finish_reason)

    async def next_stretch(self, s: Generation) -> SegmentOutcome:
        draft = await s.draft("small", self.settings.draft_tokens, self.stops)
        if self.reflection.search(draft.text):
            s.discard(draft)
            return await s.write("large", self.settings.large_stretch_tokens, self.stops)
        s.commit(draft)
        return draft


def make_policy(name: PolicyName, settings: PolicySettings, cues: list[str]) -> Policy:
    if name == "relay":
        return RelayGen(settings, cues)
    if name == "speculative-thinking":
        return SpeculativeThinking(settings)
    if name in ("large", "small"):
        return SingleModel(name)
    raise ValueError(f"unknown policy {name!r}")
