"""The relay core's Backend over the two model deployments' Ray Serve handles."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from relay_serve.relay.session import EngineError, SmallModelUnavailable
from relay_serve.relay.types import Backend, EngineChunk, SegmentRequest

log = logging.getLogger(__name__)


class ServeBackend(Backend):
    def __init__(self, large, small, affinity: bool = True) -> None:
        self.handles = {"large": large, "small": small}
        self.affinity = affinity

    def _handle(self, request: SegmentRequest, stream: bool):
        opts = {"method_name": "generate" if stream else "complete", "stream": stream}
        if self.affinity:
            opts["session_id"] = request.session_id
        return self.handles[request.model].options(**opts)

    async def generate(self, request: SegmentRequest, stream: bool = True) -> AsyncIterator[EngineChunk]:
        response = self._handle(request, stream).remote(request.model_dump())
        started = finished = False
        try:
            if stream:
                async for data in response:
                    chunk = EngineChunk.model_validate(data)
                    started = True
                    finished = chunk.finished
                    yield chunk
            else:
                chunk = EngineChunk.model_validate(await response)
                started = finished = True
                yield chunk
        except Exception as e:  # noqa: BLE001 - typed below by who can recover from it
            if request.model == "small" and not started:
                raise SmallModelUnavailable(f"small deployment: {type(e).__name__}: {e}") from e
            raise EngineError(f"{request.model} deployment: {type(e).__name__}: {e}") from e
        finally:
            if not finished:
                response.cancel()
