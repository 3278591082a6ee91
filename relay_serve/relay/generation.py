"""Drives one generation through segments. Knows nothing of Ray or vLLM.

A :class:`Generation` owns the growing output (:class:`~relay_serve.relay.output.Output`) and runs
engine requests for a policy through the abstract :class:`~relay_serve.relay.types.Backend`: each
request continues the full context (prompt + everything written so far), so the engines' prefix
caches make a handoff cheap. The policy decides who writes next; the generation does the bookkeeping
(budget, usage, trace, streaming, cancellation).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from relay_serve.protocol import (
    EngineChunk,
    FinishReason,
    InvalidRequest,
    ModelRole,
    SamplingSettings,
    SegmentRequest,
    Streaming,
)
from relay_serve.relay.detok import window_text
from relay_serve.relay.output import Output
from relay_serve.relay.text import sentence_end
from relay_serve.relay.types import (
    Backend,
    EngineRequestRecord,
    GenerationResult,
    Handoff,
    RelayUsage,
    TextCodec,
    TextDelta,
)

log = logging.getLogger(__name__)


class ModelUnavailable(Exception):
    """A model could not serve a segment now (no first reply within the segment's deadline, or the
    small model's retries are spent): the policy decides who writes it instead (relay: the large
    model)."""


class EngineError(Exception):
    """An engine request failed or ended without finishing."""


@dataclass
class SegmentOutcome:
    """What one engine request produced."""

    model: ModelRole
    token_ids: list[int]
    text: str  # the decoding of token_ids in context (for committed segments: the committed text)
    finish_reason: FinishReason
    stop_reason: str | int | None
    text_start: int = 0  # where this segment's text begins in the output (committed segments)

    @property
    def hit_stop_string(self) -> bool:
        return self.finish_reason == "stop" and isinstance(self.stop_reason, str)

    @property
    def hit_eos(self) -> bool:
        return self.finish_reason == "stop" and not isinstance(self.stop_reason, str)


class Policy(Protocol):
    """Who writes the next segment (``policy.py``)."""

    prefetch: tuple[ModelRole, ...]  # the models every generation will use: the backend may get them ready
    models: tuple[ModelRole, ...]  # the models it may use at all (their engines must accept its sampling)

    async def run(self, generation: Generation) -> None:
        """Write the whole generation through ``generation``'s steps."""


@dataclass(frozen=True)
class _Plan:
    """How one segment runs (what the named steps of :class:`Generation` set)."""

    model: ModelRole
    stop: list[str]
    word_stops: list[str]
    max_tokens: int
    cue: str | None  # the cue (or </think>) that opened the segment, for the trace
    commit: bool = True  # False: a draft, returned and not added to the output
    sentence: bool = False  # end at the sentence end (take back a token that starts the next)
    optional: bool = False  # the small model's relay work: a deadline for its first reply
    retries: int | None = None  # default: the generation's


@dataclass
class Generation:
    """One generation: ``prompt_ids`` continued for at most ``max_tokens`` tokens."""

    backend: Backend
    codec: TextCodec
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingSettings
    session_id: str
    user_stops: list[str] = field(default_factory=list)
    cue_set_version: str | None = None
    retries: int = 2
    retry_backoff_s: float = 0.2
    small_timeout_s: float | None = None  # the deadline for the first reply of optional small-model work
    output: Output = field(init=False)
    usage: RelayUsage = field(init=False)
    finish_reason: FinishReason | None = None
    engine_log: list[EngineRequestRecord] = field(default_factory=list, init=False)
    handoffs: list[Handoff] = field(default_factory=list, init=False)
    _last_commit: tuple[ModelRole, float] | None = field(
        default=None, init=False
    )  # model and time of the last committed chunk
    _events: asyncio.Queue | None = field(default=None, init=False)
    # per model: the context tokens its engine session holds after its last request (SegmentRequest.unchanged)
    _seen: dict[ModelRole, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.output = Output(self.codec, self.user_stops)
        self.usage = RelayUsage(cue_set_version=self.cue_set_version)

    # ---- used by policies ----------------------------------------------------------------------

    @property
    def generated(self) -> int:
        return len(self.output.ids)

    @property
    def left(self) -> int:
        return self.max_tokens - self.generated

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.output.stopped

    def finish(self, reason: FinishReason) -> None:
        if self.finish_reason is None:
            self.finish_reason = "stop" if self.output.stopped else reason

    # The steps a policy takes. Each runs one segment over the whole context (the prompt and all
    # that was written), so that a model's prefix cache, or its resumable request, makes it cheap.

    async def write(
        self,
        model: ModelRole,
        max_tokens: int,
        stop: Sequence[str] = (),
        cue: str | None = None,
        word_stops: Sequence[str] = (),
    ) -> SegmentOutcome:
        """``model`` writes, committed as it comes, until a stop string (a ``word_stops`` one only
        at a word start, where the engine can tell), EOS or ``max_tokens``."""
        return await self._segment(_Plan(model, list(stop), list(word_stops), max_tokens, cue))

    async def sentence(self, model: ModelRole, max_tokens: int, stop: Sequence[str], cue: str) -> SegmentOutcome:
        """``model`` (the small one) finishes the sentence ``cue`` opened: a token that begins the
        next sentence is taken back (:meth:`end_at_sentence`). Optional work: no retry, and no
        first reply within ``small_timeout_s`` raises :class:`ModelUnavailable`."""
        return await self._segment(
            _Plan(model, list(stop), [], max_tokens, cue, sentence=True, optional=True, retries=0)
        )

    async def answer(self, model: ModelRole, cue: str | None, optional: bool = False) -> SegmentOutcome:
        """``model`` writes the rest (the answer after the reasoning): no stop string but the
        user's, the whole budget. ``optional``: the small model's relay work, under the deadline."""
        return await self._segment(_Plan(model, [], [], self.left, cue, optional=optional))

    async def draft(self, model: ModelRole, max_tokens: int, stop: Sequence[str] = ()) -> SegmentOutcome:
        """``model`` writes a draft: returned, not committed (:meth:`commit` or :meth:`discard` it)."""
        return await self._segment(_Plan(model, list(stop), [], max_tokens, None, commit=False))

    async def _segment(self, plan: _Plan) -> SegmentOutcome:
        """Run one segment. An engine request that fails (its replica died, its stream ended
        unfinished) is sent again over the context as it now stands, for the tokens it still owes:
        the text already written stays and nothing is written twice. After ``plan.retries`` (default:
        the generation's) further failures the segment raises :class:`ModelUnavailable` for the
        small model (policies can hand its work to the large one) or :class:`EngineError`."""
        max_tokens = min(plan.max_tokens, self.left)
        if max_tokens <= 0:
            return SegmentOutcome(plan.model, [], "", "length", None, len(self.output.text))
        if plan.commit:
            self.output.start_run(plan.model, cue=plan.cue)
        start_text, start_tokens = len(self.output.text), len(self.output.ids)
        tokens: list[int] = []
        last = await self._with_retries(plan, max_tokens, tokens)
        if plan.commit and plan.sentence and last.finish_reason == "stop" and isinstance(last.stop_reason, str):
            self.end_at_sentence(start_text)
        if plan.commit:
            self._emit(plan.model)
            text = self.output.text[start_text:]
            tokens = self.output.ids[start_tokens:]
        else:
            text = window_text(self.codec.decode, self.output.ids, tokens)  # once a segment: no stream to keep
        reason: FinishReason = last.finish_reason or ("stop" if self.output.stopped else "abort")
        return SegmentOutcome(plan.model, tokens, text, reason, last.stop_reason, start_text)

    async def _with_retries(self, plan: _Plan, max_tokens: int, tokens: list[int]) -> EngineChunk:
        allowed = self.retries if plan.retries is None else plan.retries
        failures = 0
        while True:
            try:
                last = await self._engine_request(plan, max_tokens - len(tokens), tokens)
            except (ModelUnavailable, InvalidRequest):
                raise  # the deployment cannot answer now, or the request is at fault: no point asking again
            except EngineError as e:  # an engine, a replica or the way to it failed: asked again (a bug is not)
                failures += 1
                log.warning(
                    "generation %s: %s engine request failed (failure %d, %d retries allowed): %s",
                    self.session_id,
                    plan.model,
                    failures,
                    allowed,
                    e,
                )
                if failures > allowed:
                    failed = f"the {plan.model} model failed {failures} time{'s' if failures > 1 else ''}; last: {e}"
                    raise (ModelUnavailable if plan.model == "small" else EngineError)(failed) from e
                self.usage.retries += 1
                await asyncio.sleep(self.retry_backoff_s * failures)
                if not (self.output.stopped or len(tokens) >= max_tokens):
                    continue
                last = EngineChunk(finished=True, finish_reason="stop" if self.output.stopped else "length")
            return last

    async def _engine_request(self, plan: _Plan, max_tokens: int, tokens: list[int]) -> EngineChunk:
        """One engine request continuing the context (and ``tokens``, a draft's so far); appends
        what arrives to ``tokens`` (and the output, when the plan commits). Returns the last chunk."""
        written = len(self.output.ids)
        context = self.prompt_ids + self.output.ids + ([] if plan.commit else tokens)
        # What of the context this model's previous request had (and got back) still stands: a
        # transport that reaches the same engine session sends only the rest.
        seen = self._seen.pop(plan.model, None)
        unchanged = 0 if seen is None else min(seen, len(self.prompt_ids) + self.output.floor(plan.model), len(context))
        self.output.watch(plan.model)
        request = SegmentRequest.model_construct(  # built here, from checked parts: not validated again
            model=plan.model,
            prompt_token_ids=context,
            max_tokens=max_tokens,
            stop=list(dict.fromkeys(plan.stop + self.user_stops)),
            word_stops=plan.word_stops,
            sampling=self.sampling.for_segment(self.usage.engine_requests),
            resume=False,
            session_id=self.session_id,
            unchanged=unchanged,
            context_base=0,
        )
        self.usage.engine_requests += 1
        got: list[int] = []
        last = EngineChunk()
        t0 = time.perf_counter()
        # Optional work sends its first token at once even to a client that does not stream: the
        # deadline bounds that first reply, not the whole segment.
        stream: Streaming = (self._events is not None and plan.commit) or ("first" if plan.optional else False)
        deadline = self.small_timeout_s if plan.optional else None
        chunks = self.backend.generate(request, stream=stream, timeout_s=deadline)
        try:
            async for chunk in chunks:
                last = chunk
                if plan.commit and chunk.token_ids and not got:
                    self._handed_off(plan.model)
                got += chunk.token_ids
                tokens += chunk.token_ids
                if plan.commit and chunk.token_ids:
                    self._last_commit = (plan.model, time.perf_counter())
                    self.output.append(chunk.token_ids, plan.model)
                    self._emit(plan.model, hold_last_token=True)
                    if self.output.stopped:
                        break
        finally:
            await _aclose(chunks)  # closing early aborts the engine request
        if not self.output.stopped and (not last.finished or last.finish_reason == "abort"):
            raise EngineError(f"the {plan.model} model's request ended without finishing")
        # the engine session now holds the context and what came back (a draft's tokens are not
        # the output's: only the context before it is known to stand)
        self._seen[plan.model] = len(context) + len(got) if plan.commit else len(self.prompt_ids) + written
        self.usage.cached_prompt_tokens += last.cached_tokens
        self.engine_log.append(
            EngineRequestRecord(
                model=plan.model,
                replica_id=last.replica_id,
                prompt_tokens=len(context),
                cached_tokens=last.cached_tokens,
                output_tokens=len(got),
                committed=plan.commit,
                engine_s=last.engine_s,
                ttft_s=last.ttft_s,
                decode_s=last.decode_s,
                decode_steps=last.decode_steps,
                pauses=last.pauses,
                wall_s=time.perf_counter() - t0,
            )
        )
        return last

    def _handed_off(self, model: ModelRole) -> None:
        """``model`` wrote its first token of a segment: a handoff when the last committed token
        was the other model's."""
        if self._last_commit is not None and self._last_commit[0] != model:
            self.handoffs.append(Handoff(to=model, latency_s=time.perf_counter() - self._last_commit[1]))

    def commit(self, outcome: SegmentOutcome, cue: str | None = None) -> None:
        """Add a draft's tokens to the output."""
        if outcome.token_ids:  # a draft was written earlier: no handoff latency to measure here
            self._last_commit = (outcome.model, time.perf_counter())
        self.output.start_run(outcome.model, cue=cue)
        self.output.append(outcome.token_ids, outcome.model)
        self._emit(outcome.model)

    def end_at_sentence(self, text_start: int) -> None:
        """Drop trailing tokens of a segment that begin the next sentence.

        A stop string such as ". " completes only with the token after the punctuation; when that
        token also starts the next sentence (" Then"), it is taken back, and the next segment writes
        it. Whitespace-only tokens after the sentence end stay.
        """
        out = self.output
        end = sentence_end(out.text, text_start)
        if end is None:
            return
        for i in range(len(out.ids)):
            if out.starts[i] < end:
                continue
            stop = out.starts[i + 1] if i + 1 < len(out.ids) else len(out.text)
            if out.text[out.starts[i] : stop].strip():
                self.usage.discarded_tokens += len(out.ids) - i
                out.truncate(out.starts[i])
                return

    def take_back_silent_tokens(self) -> None:
        """Drop trailing tokens that wrote no text (an end-of-sequence token), counted as discarded."""
        n = self.output.drop_silent_tail()
        self.usage.discarded_tokens += n

    def discard(self, outcome: SegmentOutcome) -> None:
        self.usage.discarded_tokens += len(outcome.token_ids)

    def force_text(self, text: str, model: ModelRole, cue: str | None = None) -> None:
        """Insert text no engine wrote (closing ``</think>`` at the budget's end), counted for ``model``."""
        self.output.start_run(model, cue=cue, forced=True)
        self.output.append(self.codec.encode(text), model)
        self._emit(model)

    # ---- driving -------------------------------------------------------------------------------

    def _emit(self, model: ModelRole, hold_last_token: bool = False) -> None:
        if self._events is not None:
            delta = self.output.take_stream_delta(hold_last_token=hold_last_token)
            if delta:
                self._events.put_nowait(TextDelta(text=delta, model=model))

    def result(self) -> GenerationResult:
        trace = self.output.trace()
        self.usage.large_tokens = self.output.count("large")
        self.usage.small_tokens = self.output.count("small")
        self.usage.segments = len(trace)
        self.usage.switches = sum(1 for a, b in itertools.pairwise(trace) if a.model != b.model)
        self.usage.engine_s = sum(r.engine_s or 0.0 for r in self.engine_log)
        return GenerationResult(
            text=self.output.text,
            token_ids=list(self.output.ids),
            finish_reason=self.finish_reason or "stop",
            usage=self.usage,
            trace=trace,
            engine_requests=list(self.engine_log),
            handoffs=list(self.handoffs),
        )

    async def run(self, policy: Policy) -> GenerationResult:
        """Run ``policy`` to the end and return the whole generation."""
        t0 = time.perf_counter()
        self.backend.prepare(self.session_id, policy.prefetch)
        await policy.run(self)
        self.finish("stop")
        self.usage.wall_s = time.perf_counter() - t0
        return self.result()

    async def stream(
        self, policy: Policy, timeout_s: float | None = None
    ) -> AsyncIterator[TextDelta | GenerationResult]:
        """Run ``policy``, yielding text deltas as they become final, then the result. With
        ``timeout_s`` the run is cancelled that long after it started, whoever reads the deltas
        and however slowly: the iterator then yields what was final before and raises
        ``TimeoutError``.

        Closing this iterator (a client that went away) cancels the policy and its engine request.
        """
        events: asyncio.Queue[TextDelta | None] = asyncio.Queue()
        self._events = events
        run = self.run(policy) if timeout_s is None else asyncio.wait_for(self.run(policy), timeout_s)
        task = asyncio.ensure_future(run)
        task.add_done_callback(lambda _: events.put_nowait(None))
        try:
            while True:
                event = await events.get()
                if event is None:
                    break
                yield event
            result = task.result()  # raises the policy's error, if any
            tail = self.output.take_stream_delta(final=True)
            if tail:
                yield TextDelta(text=tail, model=self.output.owners[-1] if self.output.owners else "large")
            yield result
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


async def _aclose(stream) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:  # noqa: BLE001 - closing a dead stream must not mask the real outcome
            log.debug("closing an engine stream failed", exc_info=True)
