"""A relay generation's segments on one model, continued in one resumable engine request.

Without it every segment is a new engine request over the whole context: the prefix cache serves
the full KV blocks of what the replica saw before, and the rest (the other model's tokens and the
tail of the last block) is computed again, as a new request that waits to be scheduled. A
:class:`EngineSession` keeps one resumable request per generation instead and feeds it only what is
new since its last segment, so a handoff costs the prefill of the other model's tokens.

A segment carries what is new: the session keeps the generation's tokens as the router last saw
them from here (``seen``: the last segment's context and what it generated), and a segment says
how many of them still stand (``context_base``) and sends the rest; one that continues from more
than the session holds raises ``ContextGap`` (the router sends the whole context). The request's
KV cache holds the first ``n_known`` of ``seen``: a context that keeps them is fed its new tokens,
one that does not (the router took back tokens, a draft was rejected) restarts the request. Per
segment the work is in the new tokens, not the context.
Stop strings become pause tokens (``stops.py``): at every pause the session checks the segment's
text as vLLM's stop-string check would and either ends the segment or resumes the request with the
token it paused on. Knows nothing of vLLM.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from relay_serve.engine.base import Engine, ResumableRequest
from relay_serve.engine.stops import PauseTokens, first_stop, lookahead_stops
from relay_serve.protocol import ContextGap, EngineChunk, SegmentRequest
from relay_serve.relay.detok import WINDOW


class EngineSession:
    def __init__(
        self, engine: Engine, session_id: str, pauses: PauseTokens, on_restart: Callable[[], None] | None = None
    ) -> None:
        self.engine = engine
        self.session_id = session_id
        self.pauses = pauses
        self.on_restart = on_restart or (lambda: None)
        self.request: ResumableRequest | None = None
        self.seen: list[int] = []  # the context of the last segment and what it generated
        self.n_known = 0  # the first n_known of seen are the tokens whose KV the request holds
        self.busy = False
        self.last_used = time.monotonic()
        self._starts = 0

    def _take_context(self, request: SegmentRequest) -> bool:
        """Make ``seen`` the segment's context; whether the request's KV still holds its first
        ``n_known`` tokens (so the request continues) or must restart."""
        base, tail = request.context_base, request.prompt_token_ids
        if base > len(self.seen):
            raise ContextGap(
                f"session {self.session_id} holds {len(self.seen)} tokens of the context; the segment continues from "
                f"{base}"
            )
        kept = self.request is not None
        if kept and base < self.n_known:  # tokens the KV holds are sent again: kept only if they are the same
            end = min(self.n_known, base + len(tail))
            kept = end == self.n_known and self.seen[base:end] == tail[: end - base]
        del self.seen[base:]
        self.seen += tail
        return kept and len(self.seen) > self.n_known

    async def _restart(self) -> None:
        if self.request is not None:
            self.on_restart()
            await self._close_request()
        self._starts += 1
        self.request = self.engine.resumable(f"{self.session_id}-r{self._starts}")
        self.n_known = 0

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
        fresh = not self._take_context(request)
        if fresh:
            await self._restart()
        resumable = self.request
        if resumable is None:  # _take_context kept one, or _restart made one
            raise RuntimeError(f"session {self.session_id} has no resumable request")
        n_context = len(self.seen)
        feed = self.seen[self.n_known :]
        stops = tuple(request.stop)
        longest = max(map(len, stops), default=1)
        pause_ids = await self.pauses.lookup(stops, frozenset(request.word_stops))  # a new list: off this loop
        left, generated = request.max_tokens, []
        last = EngineChunk(finished=True, finish_reason="length")
        cached = self.n_known
        ttft_s: float | None = None
        decode_s, steps, pauses, lookahead, continued = 0.0, 0, 0, False, False
        # the segment's text as vLLM's detokenizer gives it: decoded a token at a time after a little left context
        left_context = self.seen[max(0, n_context - WINDOW) : n_context]
        before, text, detok = self.engine.decode(left_context), "", self.engine.stream(left_context)
        while True:
            new: list[int] = []
            out = None
            async for out in resumable.chunk(
                feed, 1 if lookahead else left, pause_ids, request.sampling, continued=continued
            ):
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
            self.n_known += len(feed) + max(0, len(new) - 1)  # the last token sampled is not in the request's cache yet
            self.seen += new
            generated += new
            left -= len(new)
            if out.eos:
                last = EngineChunk(finished=True, finish_reason="stop")
                break
            # only text that can hold a stop completed by this chunk is searched: O(new), not O(segment)
            lo = max(0, len(text) - longest + 1)
            text += "".join(piece for t in new if (piece := detok.step(t)) is not None)
            hit = first_stop(text[lo:], stops, request.word_stops, text[lo - 1] if lo else before)
            if hit is not None:
                last = EngineChunk(finished=True, finish_reason="stop", stop_reason=hit[1])
                break
            if left <= 0:
                break
            pauses += 1  # a pause that stopped nothing: resume with the token it paused on
            tail = (before[-longest - 1 :] + text[-longest - 1 :])[
                -longest - 1 :
            ]  # all a stop's prefix and the character before it
            lookahead = lookahead_stops(tail, pause_ids.ahead, request.word_stops)
            feed, continued = new[-1:], True
        timing = {
            "cached_tokens": cached,
            "ttft_s": ttft_s,
            "decode_s": decode_s,
            "decode_steps": steps,
            "pauses": pauses,
        }
        yield last.model_copy(update={"token_ids": [] if stream else generated, **timing})

    async def _close_request(self) -> None:
        request, self.request = self.request, None
        self.n_known = 0
        if request is not None:
            await request.close()

    async def close(self) -> None:
        """The request goes, and what the session knew of the context (a later segment that
        continues it gets ``ContextGap``)."""
        self.seen = []
        await self._close_request()
