"""The output of one generation as it grows: token ids, who wrote each, the decoded text, the runs
of text each model wrote, user stop strings, and what is safe to stream.

Text is always the decoding of the committed token ids (never an engine's own, stop-truncated
text), so the context handed to the next segment and the text the client sees cannot drift apart.
Knows nothing of Ray or vLLM.
"""

from __future__ import annotations

import bisect
import sys
from dataclasses import dataclass

from relay_serve.protocol import ModelRole
from relay_serve.relay.types import TextCodec, TraceSegment


@dataclass
class _Run:
    model: ModelRole
    start: int
    cue: str | None
    forced: bool


class Output:
    def __init__(self, codec: TextCodec, user_stops: list[str] | None = None) -> None:
        self.codec = codec
        self.user_stops = [s for s in (user_stops or []) if s]
        self.holdback = max((len(s) for s in self.user_stops), default=1) - 1
        self.ids: list[int] = []
        self.owners: list[ModelRole] = []
        self.starts: list[int] = []  # character offset where each token's text begins
        self.text = ""
        self._stream = codec.stream()  # the text of each token as it comes (incremental detokenization)
        self._pending = 0  # trailing tokens whose text is not decodable yet (a split UTF-8 char)
        self._stop_checked = 0  # no user stop starts before this offset
        self._emitted = 0
        self.stopped = False  # a user stop string ended the output
        self._runs: list[_Run] = []
        self._floors: dict[str, int] = {}  # per watcher: the shortest ``ids`` was cut to since it watched

    # ---- what stands -----------------------------------------------------------------------------

    def watch(self, key: str) -> None:
        """From now on, remember for ``key`` the shortest length ``ids`` is cut to."""
        self._floors[key] = sys.maxsize

    def floor(self, key: str) -> int:
        """How many leading ``ids`` have stood since ``key`` watched (every one, if none was taken
        back: ``sys.maxsize``); 0 for a key that never watched."""
        return self._floors.get(key, 0)

    def _cut(self) -> None:
        n = len(self.ids)
        for key, floor in self._floors.items():
            if n < floor:
                self._floors[key] = n

    # ---- growing -------------------------------------------------------------------------------

    def start_run(self, model: ModelRole, cue: str | None = None, forced: bool = False) -> None:
        """Begin a new trace segment unless ``model`` already writes the current one."""
        if self._runs and self._runs[-1].model == model and cue is None and not forced:
            return
        if self._runs and self._runs[-1].start == len(self.text):
            self._runs.pop()  # the previous run never wrote anything
        self._runs.append(_Run(model, len(self.text), cue, forced))

    def append(self, token_ids: list[int], model: ModelRole) -> None:
        """Commit tokens written by ``model``; applies user stop strings."""
        if self.stopped or not token_ids:
            return
        if not self._runs or self._runs[-1].model != model:
            self.start_run(model)
        for tid in token_ids:
            self.ids.append(tid)
            self.owners.append(model)
            self.starts.append(len(self.text))  # tokens waiting for their text start where it will
            piece = self._stream.step(tid)
            if piece is None:
                self._pending += 1
            else:
                self.text += piece
                self._pending = 0
        self._apply_user_stops()

    def _restream(self) -> None:
        """The tokens were cut: decode what comes next after those that stand."""
        self._stream = self.codec.stream(self.ids)
        self._pending = 0

    def _apply_user_stops(self) -> None:
        if not self.user_stops:
            return
        hits = [p for s in self.user_stops if (p := self.text.find(s, self._stop_checked)) != -1]
        if hits:
            self.truncate(min(hits))
            self.stopped = True
        else:
            self._stop_checked = max(0, len(self.text) - self.holdback)

    def truncate(self, cut: int) -> None:
        """Drop the text from ``cut`` on and every token that starts there or later."""
        keep = bisect.bisect_left(self.starts, cut)  # starts never decrease: the tokens that start before the cut
        del self.ids[keep:], self.owners[keep:], self.starts[keep:]
        self._cut()
        self.text = self.text[:cut]
        self._restream()
        while len(self._runs) > 1 and self._runs[-1].start >= cut:
            self._runs.pop()

    def drop_silent_tail(self) -> int:
        """Drop trailing tokens that wrote no text (a special token such as EOS; not the pieces of a
        character still being decoded); how many."""
        n = 0
        while (
            self.ids
            and self._pending == 0
            and self.starts[-1] == len(self.text)
            and not self.codec.decode(self.ids[-1:])
        ):
            del self.ids[-1], self.owners[-1], self.starts[-1]
            n += 1
        self._cut()
        if n:
            self._restream()
        return n

    # ---- reading -------------------------------------------------------------------------------

    def count(self, model: ModelRole) -> int:
        return sum(1 for m in self.owners if m == model)

    def take_stream_delta(self, final: bool = False, hold_last_token: bool = False) -> str:
        """Text not yet streamed that no later user stop (nor, with ``hold_last_token``, the
        take-back of the last token) can take back."""
        if final or self.stopped:
            safe = len(self.text)
        else:
            safe = len(self.text) - self.holdback
            if hold_last_token and self.starts:
                safe = min(safe, self.starts[-1])
            safe = max(self._emitted, safe)
        delta = self.text[self._emitted : safe]
        self._emitted = safe
        return delta

    def trace(self) -> list[TraceSegment]:
        """The runs, tiling the text: each starts where the previous one ends."""
        out: list[TraceSegment] = []
        for i, run in enumerate(self._runs):
            end = self._runs[i + 1].start if i + 1 < len(self._runs) else len(self.text)
            tokens = sum(1 for s in self.starts if run.start <= s < end) if end > run.start else 0
            if i + 1 == len(self._runs):
                tokens = sum(1 for s in self.starts if s >= run.start)
            if tokens == 0 and end == run.start:
                continue
            if out and out[-1].model == run.model and run.cue is None and not run.forced:
                out[-1].end, out[-1].tokens = end, out[-1].tokens + tokens
                continue
            out.append(
                TraceSegment(model=run.model, start=run.start, end=end, tokens=tokens, cue=run.cue, forced=run.forced)
            )
        return out
