"""The relay core's Backend over the two model deployments' Ray Serve handles.

Besides passing segments through, it guards the small deployment for the relay policy: the number
of small-model segments this router replica has in flight (``max_small_in_flight``: past it, the
large model keeps its handoffs), and a deadline for the small model's first reply
(the session's ``timeout_s``: a deployment scaled to zero or unreachable is then left alone for
``small_retry_after_s`` seconds instead of being waited for by every request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from relay_serve.relay.session import EngineError, SmallModelUnavailable
from relay_serve.relay.types import Backend, EngineChunk, SegmentRequest

log = logging.getLogger(__name__)


class ServeBackend(Backend):
    def __init__(
        self,
        large,
        small,
        affinity: bool = True,
        max_small_in_flight: int | None = None,
        small_retry_after_s: float = 10.0,
    ) -> None:
        self.handles = {"large": large, "small": small}
        self.affinity = affinity
        self.max_small_in_flight = max_small_in_flight
        self.small_retry_after_s = small_retry_after_s
        self.in_flight = {"large": 0, "small": 0}
        self._small_down_until = 0.0
        self._small_down_reason = ""

    def small_refusal(self) -> str | None:
        n, bound = self.in_flight["small"], self.max_small_in_flight
        if bound is not None and n >= bound:
            return f"the small deployment is past its queue bound ({n} segments in flight from this router, bound {bound})"
        if time.monotonic() < self._small_down_until:
            return self._small_down_reason
        return None

    def _handle(self, request: SegmentRequest, stream: bool):
        opts = {"method_name": "generate" if stream else "complete", "stream": stream}
        if self.affinity:
            opts["session_id"] = request.session_id
        return self.handles[request.model].options(**opts)

    async def generate(
        self, request: SegmentRequest, stream: bool = True, timeout_s: float | None = None
    ) -> AsyncIterator[EngineChunk]:
        model = request.model
        deadline = timeout_s  # for the first reply only
        response = self._handle(request, stream).remote(request.model_dump())
        self.in_flight[model] += 1
        finished = False
        try:
            if stream:
                chunks = response.__aiter__()
                while True:
                    try:
                        async with asyncio.timeout(deadline):
                            data = await chunks.__anext__()
                    except StopAsyncIteration:
                        break
                    deadline = None
                    chunk = EngineChunk.model_validate(data)
                    finished = chunk.finished
                    yield chunk
            else:
                async with asyncio.timeout(deadline):
                    data = await response
                chunk = EngineChunk.model_validate(data)
                finished = True
                yield chunk
        except TimeoutError as e:
            if model != "small":
                raise EngineError(f"{model} deployment: no reply within {timeout_s} s") from e
            self._small_down_until = time.monotonic() + self.small_retry_after_s
            self._small_down_reason = (
                f"the small deployment did not answer within {timeout_s} s (scaled to zero or "
                f"unreachable); the large model writes its segments for {self.small_retry_after_s} s"
            )
            log.warning("%s", self._small_down_reason)
            raise SmallModelUnavailable(self._small_down_reason) from e
        except Exception as e:  # noqa: BLE001 - the session decides whether to retry
            raise EngineError(f"{model} deployment: {type(e).__name__}: {e}") from e
        finally:
            self.in_flight[model] -= 1
            if not finished:
                response.cancel()
