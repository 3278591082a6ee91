"""A relay generation's segments on one model, continued in one resumable engine request.

Without it every segment is a new engine request over the whole context: the prefix cache serves
the full KV blocks of what the replica saw before, and the rest (the other model's tokens and the
tail of the last block) is computed again, as a new request that waits to be scheduled. A
:class:`EngineSession` keeps one resumable request per generation instead and feeds it only what is
new since its last segment, so a handoff costs the prefill of the other model's tokens.

Each segment still carries the whole context (``SegmentRequest.prompt_token_ids``). The session
knows which tokens its request holds (``known``); a context that continues them is fed its new
tokens, one that does not (the router took back tokens, a draft was rejected) restarts the request.
Stop strings become pause tokens (``stops.py``): at every pause the session checks the segment's
text as vLLM's stop-string check would and either ends the segment or resumes the request with the
token it paused on. Knows nothing of vLLM.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from relay_serve.engine.base import Engine, ResumableRequest
from relay_serve.engine.stops import PauseTokens, first_stop, lookahead_stops
from relay_serve.relay.types import EngineChunk, SegmentRequest

_CONTEXT = 8  # tokens of left context when decoding a segment's text (byte-level merges)


class EngineSession:
    def __init__(self, engine: Engine, session_id: str, pauses: PauseTokens, on_restart: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.session_id = session_id
        self.pauses = pauses
        self.on_restart = on_restart or (lambda: None)
        self.request: ResumableRequest | None = None
        self.known: list[int] = []  # the tokens whose KV the request holds
        self.busy = False
        self.last_used = time.monotonic()
        self._starts = 0

    def _continues(self, context: list[int]) -> bool:
        n = len(self.known)
        return self.request is not None and len(context) > n and context[:n] == self.known

    async def _restart(self) -> None:
        if self.request is not None:
            self.on_restart()
            await self.close()
        self._starts += 1
        self.request = self.engine.resumable(f"{self.session_id}-r{self._starts}")
        self.known = []

    async def segment(self, request: SegmentRequest, stream: bool = True) -> AsyncIterator[EngineChunk]:
        """The output of one segment request, as ``Engine.generate`` gives it: streamed chunks, or
        (without ``stream``) all of it in the last one."""
        if self.busy:
            raise RuntimeError(f"session {self.session_id} already runs a segment")
        self.busy = True
        try:
            async for chunk in self._segment(request, stream):
                yield chunk
        except BaseException:
            await self.close()  # cancelled or failed mid-chunk: the request's state is unknown
            raise
        finally:
            self.busy = False
            self.last_used = time.monotonic()

    async def _segment(self, request: SegmentRequest, stream: bool) -> AsyncIterator[EngineChunk]:
        context = request.prompt_token_ids
        fresh = not self._continues(context)
        if fresh:
            await self._restart()
        feed = context[len(self.known) :]
        stops = tuple(request.stop)
        pause_ids = self.pauses.ids(stops, frozenset(request.word_stops)) if stops else frozenset()
        left, generated = request.max_tokens, []
        last = EngineChunk(finished=True, finish_reason="length")
        cached = len(self.known)
        ttft_s: float | None = None
        decode_s, steps, pauses, lookahead = 0.0, 0, 0, False
        while True:
            new: list[int] = []
            out = None
            async for out in self.request.chunk(feed, 1 if lookahead else left, pause_ids, request.sampling):
                new += out.token_ids
                if stream and out.token_ids:
                    yield EngineChunk(token_ids=out.token_ids)
                if out.finish is not None:
                    break
            if out is None or (not new and not out.eos):
                raise RuntimeError("the resumable request ended a chunk without a token")
            if ttft_s is None:
                ttft_s = out.ttft_s
                cached += out.cached_tokens if fresh else 0
            decode_s += out.decode_s or 0.0
            steps += out.decode_steps
            self.known += feed + new[:-1] if new else feed  # the last token sampled is not in the request's cache yet
            generated += new
            left -= len(new)
            if out.eos:
                last = EngineChunk(finished=True, finish_reason="stop")
                break
            before, text = self._text(context, generated)
            hit = first_stop(text, stops, request.word_stops, before)
            if hit is not None:
                last = EngineChunk(finished=True, finish_reason="stop", stop_reason=hit[1])
                break
            if left <= 0:
                break
            pauses += 1  # a pause that stopped nothing: resume with the token it paused on
            lookahead = lookahead_stops(text, stops, request.word_stops, before)
            feed = new[-1:]
        timing = {"cached_tokens": cached, "ttft_s": ttft_s, "decode_s": decode_s, "decode_steps": steps, "pauses": pauses}
        yield last.model_copy(update={"token_ids": [] if stream else generated, **timing})

    def _text(self, context: list[int], generated: list[int]) -> tuple[str, str]:
        """The end of the context's text and the segment's, as vLLM's detokenizer gives it (decoded
        with a little left context)."""
        left = context[-_CONTEXT:]
        before = self.engine.decode(left)
        full = self.engine.decode(left + generated)
        return (before, full[len(before) :]) if full.startswith(before) else (before, self.engine.decode(generated))

    async def close(self) -> None:
        request, self.request = self.request, None
        self.known = []
        if request is not None:
            await request.close()
