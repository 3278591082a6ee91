"""Fakes that implement the real interfaces: a word-piece codec and scripted models behind a Backend.

A scripted model is a function from the text written so far to the text it would write from there;
the fake engine emits that text token by token and applies stop strings, ``max_tokens`` and EOS with
vLLM's semantics (the stop string is included in the output; the token that completes it is the
last one).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Sequence

from relay_serve.engine.base import Engine, EngineInfo
from relay_serve.protocol import EngineChunk, ModelIdentity, SegmentRequest
from relay_serve.relay.detok import WindowStream
from relay_serve.relay.generation import EngineError, ModelUnavailable
from relay_serve.relay.types import Backend

_PIECE = re.compile(r"</?think>|\n\n|\n| ?[A-Za-z]+| ?\d| ?[^\sA-Za-z\d]|\s")


class FakeCodec:
    """Splits text into small pieces (words, single digits, punctuation) and numbers them."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.pieces: list[str] = []

    def encode(self, text: str) -> list[int]:
        out = []
        pos = 0
        for m in _PIECE.finditer(text):
            if m.start() != pos:
                raise ValueError(f"cannot encode {text[pos : m.start()]!r}")
            pos = m.end()
            if m.group() not in self.vocab:
                self.vocab[m.group()] = len(self.pieces)
                self.pieces.append(m.group())
            out.append(self.vocab[m.group()])
        return out

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(self.pieces[i] for i in token_ids)

    def stream(self, context: Sequence[int] = ()) -> WindowStream:
        return WindowStream(self.decode, context)


Script = Callable[[str], str]  # text written so far -> what the model writes from there


def follow(reference: str, fallback: str = "") -> Script:
    """A model that writes ``reference``; off its path it writes ``fallback`` (then stops)."""

    def script(written: str) -> str:
        return reference[len(written) :] if reference.startswith(written) else fallback

    return script


class FakeBackend(Backend):
    """Scripted models over any codec. A session's first request is its bare prompt (every policy
    starts that way), so what the session wrote is what later requests hold beyond it."""

    def __init__(
        self,
        codec,
        scripts: dict[str, Script],
        delay_s: float = 0.0,
        tokenizers: dict | None = None,
        max_model_len: int = 1024,
    ) -> None:
        self.codec = codec
        self.tokenizers = tokenizers or {}  # a model's own tokenizer (a Codec), where it is not ``codec``
        self.max_model_len = max_model_len
        self.starting: dict[str, asyncio.Event] = {}  # a model whose event is unset has not started: identity() waits
        self.identity_calls = 0
        # what an engine session of (generation, model) saw: its last request's context and every
        # token it wrote; a request's ``unchanged`` must not claim more of its context than that
        self.seen: dict[tuple[str, str], list[int]] = {}
        self.unchanged_violations: list[str] = []
        self.unchanged_tokens = 0
        self.prompts: dict[str, int] = {}
        self.scripts = scripts
        self.delay_s = delay_s
        self.requests: list[SegmentRequest] = []
        self.unavailable: set[str] = set()
        self.faults: list[tuple[str, int]] = []  # (model, n): that model's next request dies after n tokens
        self.small_refused: str | None = None  # what refusal("small") says
        self.cancelled = 0

    def refusal(self, model: str) -> str | None:
        return self.small_refused if model == "small" else None

    async def identity(self, model: str, tokenizer: bool = True) -> ModelIdentity:
        from relay_serve.tokenizer import tokenizer_files

        self.identity_calls += 1
        started = self.starting.get(model)
        if started is not None:
            await started.wait()
        codec = self.tokenizers.get(model, self.codec)
        files = tokenizer_files(codec.tokenizer) if tokenizer else {}
        return ModelIdentity(
            model_fingerprint=f"fake-{model}",
            tokenizer_fingerprint=codec.fingerprint,
            max_model_len=self.max_model_len,
            tokenizer_files=files,
        )

    def _check_unchanged(self, request: SegmentRequest) -> list[int]:
        key, n, context = (request.session_id, request.model), request.unchanged, request.prompt_token_ids
        before = self.seen.get(key, [])
        if n > len(before) or context[:n] != before[:n]:
            self.unchanged_violations.append(f"{request.model}: unchanged={n} but only {len(before)} seen / differs")
        self.unchanged_tokens += n
        seen = self.seen[key] = list(context)
        return seen

    async def generate(
        self, request: SegmentRequest, stream: bool = True, timeout_s: float | None = None
    ) -> AsyncIterator[EngineChunk]:
        self.requests.append(request)
        seen = self._check_unchanged(request)
        if request.model in self.unavailable:
            raise ModelUnavailable(f"{request.model} deployment has no replica")
        n_prompt = self.prompts.setdefault(request.session_id, len(request.prompt_token_ids))
        written_ids = request.prompt_token_ids[n_prompt:]
        pieces = self.codec.encode(self.scripts[request.model](self.codec.decode(written_ids)))
        fault = next((f for f in self.faults if f[0] == request.model), None)
        if fault is not None:
            self.faults.remove(fault)
        text = ""
        try:
            for n, tid in enumerate(pieces, start=1):
                if fault is not None and n > fault[1]:
                    raise EngineError(f"{request.model} replica died")
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                text = self.codec.decode(pieces[:n])
                hit = next((s for s in request.stop if s in text), None)
                seen.append(tid)
                if hit is not None:
                    yield EngineChunk(token_ids=[tid], finished=True, finish_reason="stop", stop_reason=hit)
                    return
                if n == request.max_tokens:
                    yield EngineChunk(token_ids=[tid], finished=True, finish_reason="length")
                    return
                yield EngineChunk(token_ids=[tid])
            yield EngineChunk(finished=True, finish_reason="stop", stop_reason=None)  # EOS
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1
            raise


class FakeResumableEngine(Engine):
    """An engine with resumable requests over a fixed vocabulary: the model is a script from the
    text its request holds to what it writes next. Like vLLM, a chunk ends after a pause token, at
    EOS (the script has nothing more) or at ``max_tokens``, and the last token a chunk sampled is
    not part of the request until a later chunk feeds it again. ``generate`` is the plain request
    with vLLM's stop-string semantics, to compare with."""

    def __init__(self, codec: FakeCodec, script: Script) -> None:
        self.codec = codec
        self.script = script
        self.requests: list[FakeResumable] = []
        self.delay_s = 0.0  # between the tokens of a chunk
        self.spare: list[int] = []  # ids the script never writes: with some, stops are looked ahead as vLLM's swaps do

    def can_resume(self) -> bool:
        return True

    def resumable(self, request_id: str) -> FakeResumable:
        self.requests.append(FakeResumable(self, request_id))
        return self.requests[-1]

    def token_texts(self) -> list[str]:
        return list(self.codec.pieces)

    def spare_ids(self) -> list[int]:
        return list(self.spare)

    def decode(self, token_ids) -> str:
        return self.codec.decode(token_ids)

    def info(self) -> EngineInfo:
        return EngineInfo(model="fake-resumable", max_model_len=4096, tokenizer_fingerprint="fake")

    async def check_health(self) -> None:
        pass

    def next_pieces(self, held: list[int]) -> list[int]:
        return self.codec.encode(self.script(self.codec.decode(held)))

    async def generate(
        self, request: SegmentRequest, request_id: str, stream: bool = True
    ) -> AsyncIterator[EngineChunk]:
        """vLLM's stop strings, a word stop counting only at a word start (as an engine that can tell)."""
        pieces = self.next_pieces(request.prompt_token_ids)
        before = self.codec.decode(request.prompt_token_ids)
        for n in range(1, len(pieces) + 1):
            text = self.codec.decode(pieces[:n])
            hit = next((s for s in request.stop if _occurs(s, text, before, s in request.word_stops)), None)
            if hit is not None or n == request.max_tokens:
                yield EngineChunk(
                    token_ids=pieces[:n], finished=True, finish_reason="stop" if hit else "length", stop_reason=hit
                )
                return
        yield EngineChunk(token_ids=pieces, finished=True, finish_reason="stop")


def _occurs(stop: str, text: str, before: str, word: bool) -> bool:
    pos = text.find(stop)
    while pos != -1 and word and stop[0].isalnum() and ((before + text[:pos])[-1:] or " ").isalnum():
        pos = text.find(stop, pos + 1)
    return pos != -1


class FakeResumable:
    def __init__(self, engine: FakeResumableEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.held: list[int] = []  # tokens in the request's cache
        self.feeds: list[list[int]] = []
        self.closed = False

    async def chunk(self, token_ids, max_tokens, pause_ids, sampling, continued=False):
        from relay_serve.engine.base import ChunkOutput

        assert not self.closed and token_ids, "a chunk must feed tokens to an open request"
        self.feeds.append(list(token_ids))
        self.held += token_ids
        swaps = getattr(pause_ids, "swaps", {}) if self.engine.spare else {}
        for n in range(max_tokens):
            pieces = self.engine.next_pieces(self.held)
            if not pieces:
                yield ChunkOutput([], finish="stop", eos=True)
                return
            await asyncio.sleep(self.engine.delay_s)
            tid = pieces[0]
            # vllm_swaps.py: after a trigger (the last token written, or fed after a pause) a completing
            # token is drawn as its stand-in, which the chunk stops on; the engine gives back the token
            last = self.held[-1] if n > 0 or continued else None
            swapped = any(c == tid for c, _ in swaps.get(last, ()))
            if tid in pause_ids or swapped or n == max_tokens - 1:
                stop = tid in pause_ids or swapped
                yield ChunkOutput([tid], finish="stop" if stop else "length", decode_steps=n)  # not held
                return
            self.held.append(tid)
            yield ChunkOutput([tid])

    async def close(self) -> None:
        self.closed = True
