"""A generation as OpenAI server-sent events: a chunk per text delta, the finish reason, usage
(and the trace) when asked for, an error event if it fails, and always ``data: [DONE]``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from relay_serve.relay.types import GenerationResult, TextDelta
from relay_serve.router.generations import (
    CLIENT_GONE,
    Generations,
    ServedGeneration,
    failure,
    usage,
)
from relay_serve.router.openai_api import error_body, new_id, now


class EventFormat:
    """The SSE lines of one response: chat chunks or completion chunks."""

    def __init__(self, g: ServedGeneration) -> None:
        self.g = g
        self.head = {
            "id": new_id("chatcmpl" if g.chat else "cmpl"),
            "object": "chat.completion.chunk" if g.chat else "text_completion",
            "created": now(),
            "model": g.request.model,
        }

    def start(self) -> str | None:
        """Chat streams open with the assistant's role."""
        return self._choice({"role": "assistant", "content": ""}, None) if self.g.chat else None

    def delta(self, text: str) -> str:
        return self._choice({"content": text}, None)

    def finish(self, reason: str) -> str:
        return self._choice({}, reason)

    def usage(self, result: GenerationResult) -> str | None:
        """The usage chunk, when the request asked for it (``stream_options.include_usage``)."""
        req = self.g.request
        if req.stream_options is None or not req.stream_options.include_usage:
            return None
        tail: dict[str, Any] = {**self.head, "choices": [], "usage": usage(self.g.generation, result).model_dump()}
        if req.relay_trace:
            tail["relay_trace"] = [s.model_dump() for s in result.trace]
            tail["relay_engine_requests"] = [r.model_dump() for r in result.engine_requests]
        return sse(tail)

    def _choice(self, delta: dict[str, Any], finish: str | None) -> str:
        if self.g.chat:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta.get("content", ""), "finish_reason": finish, "logprobs": None}
        return sse({**self.head, "choices": [choice]})


async def events(generations: Generations, g: ServedGeneration) -> AsyncIterator[str]:
    """The response's SSE lines as the generation runs; closing it (the client went away)
    cancels the generation and its engine requests."""
    fmt = EventFormat(g)
    metrics = generations.metrics
    status: int | None = CLIENT_GONE  # until the stream ends otherwise
    with generations.running(g):
        # The deadline bounds the generation where it runs (the generation's task), not this
        # generator: a timeout across a ``yield`` would land in the writer of a slow client, which
        # would get neither the error event nor [DONE].
        stream = g.generation.stream(g.policy, timeout_s=generations.cfg.router.request_timeout_s)
        try:
            if (line := fmt.start()) is not None:
                yield line
            ttft_s: float | None = None
            async for ev in stream:
                if isinstance(ev, TextDelta):
                    ttft_s = g.age() if ttft_s is None else ttft_s
                    yield fmt.delta(ev.text)
                    continue
                status = None  # counted with the whole generation
                generations.finished(g, ev, ttft_s=g.age() if ttft_s is None else ttft_s)
                yield fmt.finish(ev.finish_reason)
                if (line := fmt.usage(ev)) is not None:
                    yield line
        except TimeoutError:
            status = 504
            yield sse(error_body(generations.timeout_message(), "server_error", code="timeout"))
        except Exception as e:  # noqa: BLE001 - reported to the client in the stream
            err = failure(e, g.generation.session_id)
            status = err.status
            yield sse(err.body())
        finally:
            if status is not None:
                metrics.request(g.name, status, g.age())
            await stream.aclose()
    yield "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
