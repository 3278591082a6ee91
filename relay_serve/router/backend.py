"""The relay core's Backend over the two model deployments (segments go by ``transport.py``: over
a leased replica's direct channel, or as Ray Serve handle calls).

Besides passing segments through, it guards the small deployment for the relay policy: the number
of small-model segments this router replica has in flight (``max_small_in_flight``: past it, the
large model keeps its handoffs), and a deadline for the small model's first token (the session's
``timeout_s``). A segment that misses it goes to the large model; when no small-model segment of
this router got a token for that long either (a deployment scaled to zero or unreachable), the
small deployment is left alone for ``small_retry_after_s`` seconds instead of being waited for by
every request. One slow reply while others come through takes out only its own segment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from relay_serve.config import RouterSettings
from relay_serve.protocol import (
    ContextGap,
    EngineChunk,
    EngineTraits,
    InvalidRequest,
    ModelIdentity,
    ModelRole,
    RemoteError,
    SegmentRequest,
    Streaming,
)
from relay_serve.relay.generation import EngineError, ModelUnavailable
from relay_serve.relay.types import Backend
from relay_serve.router.calls import own_request
from relay_serve.router.transport import DirectTransport, HandleTransport

log = logging.getLogger(__name__)

TRAITS_TTL_S = 60.0  # a model's engine traits are asked again after this long (a rolling upgrade may change them)
TRAITS_TIMEOUT_S = 5.0  # the longest a request waits for traits never known (a deployment starting or scaled to zero)


def engine_failure(e: BaseException) -> bool:
    """A failure of a model replica, its engine or the way to it (the session asks again, maybe
    elsewhere), as opposed to a bug in the router: a connection or channel error, an error the
    replica reported (``RemoteError``), a Ray or Ray Serve error (a dead actor, a replica's
    exception through a handle call, no replica)."""
    from ray.exceptions import RayError
    from ray.serve.exceptions import RayServeException

    return isinstance(e, (OSError, EOFError, RemoteError, ContextGap, RayError, RayServeException))


class ServeBackend(Backend):
    def __init__(
        self,
        large,
        small,
        settings: RouterSettings | None = None,
        *,
        in_rotation: Callable[[ModelRole, str], bool] | None = None,
        **overrides: Any,
    ) -> None:
        """The backend over the two deployments' handles, as the router's ``settings`` say (their
        defaults when None; ``overrides`` replace fields of them, checked as the config is).
        ``in_rotation(model, replica_id)``: whether Serve still routes to that replica."""
        r = settings or RouterSettings()
        if overrides:
            r = RouterSettings.model_validate({**r.model_dump(), **overrides})
        handles = self.handles = {"large": large, "small": small}
        self._traits: dict[str, tuple[float, EngineTraits]] = {}
        self._traits_fetch: dict[str, asyncio.Future[EngineTraits]] = {}
        if r.transport == "direct":
            self.transport: DirectTransport | HandleTransport = DirectTransport(
                handles,
                affinity=r.session_affinity,
                ttl_s=r.lease_max_age_s + r.request_timeout_s + 60.0,  # outlives any use of the lease
                idle_s=r.lease_idle_s,
                max_age_s=r.lease_max_age_s,
                in_rotation=in_rotation,
                resumable=r.resumable_requests,
            )
        else:
            self.transport = HandleTransport(handles, affinity=r.session_affinity)
        self.max_small_in_flight = r.max_small_in_flight
        self.small_retry_after_s = r.small_retry_after_s
        self.in_flight = {"large": 0, "small": 0}
        self._down: dict[ModelRole, tuple[float, str]] = {}  # per model: refused until, and why
        self._last_reply: dict[ModelRole, float] = {}  # per model: when a segment of it last got a chunk

    def refusal(self, model: ModelRole) -> str | None:
        n, bound = self.in_flight[model], self.max_small_in_flight if model == "small" else None
        if bound is not None and n >= bound:
            return (
                f"the small deployment is past its queue bound ({n} segments in flight from this router, bound {bound})"
            )
        until, reason = self._down.get(model, (0.0, ""))
        return reason if time.monotonic() < until else None

    def has_replied(self, model: ModelRole) -> bool:
        return model in self._last_reply

    async def traits(self, model: ModelRole) -> EngineTraits:
        """What ``model``'s engine runs correctly, as one of its replicas says (``ModelServer.info``),
        kept for ``TRAITS_TTL_S`` and then refreshed in the background (the known traits serve
        meanwhile). Only a router's first request for a model waits, and for at most
        ``TRAITS_TIMEOUT_S``: a deployment that has not answered by then (starting, scaled to zero)
        gives no limits until it does; its replicas still refuse what their engine cannot run."""
        cached = self._traits.get(model)
        if cached is not None and time.monotonic() < cached[0]:
            return cached[1]
        fetch = self._traits_fetch.get(model)
        if fetch is None or fetch.done():
            fetch = self._traits_fetch[model] = asyncio.ensure_future(self._fetch_traits(model))
        if cached is not None:
            return cached[1]
        try:
            return await asyncio.wait_for(asyncio.shield(fetch), TRAITS_TIMEOUT_S)
        except TimeoutError:
            log.warning(
                "the %s deployment did not say within %.0f s what its engine runs; asking on in the background",
                model,
                TRAITS_TIMEOUT_S,
            )
            self._traits.setdefault(model, (time.monotonic() + TRAITS_TIMEOUT_S, EngineTraits()))
            return EngineTraits()

    async def identity(self, model: ModelRole, tokenizer: bool = True) -> ModelIdentity:
        handle = self.handles[model]
        info = await own_request(handle.info.remote)
        files = await own_request(handle.options(method_name="tokenizer_files").remote) if tokenizer else {}
        return ModelIdentity(
            tokenizer_files=files,
            **{k: info[k] for k in ("model_fingerprint", "tokenizer_fingerprint", "max_model_len")},
        )

    async def _fetch_traits(self, model: ModelRole) -> EngineTraits:
        try:
            info = await asyncio.wait_for(own_request(self.handles[model].info.remote), TRAITS_TTL_S)
        except Exception as e:  # noqa: BLE001 - unknown for now; the replicas keep their own guard
            log.warning("the %s deployment did not say what its engine runs (%s: %s)", model, type(e).__name__, e)
            cached = self._traits.get(model)
            traits = cached[1] if cached is not None else EngineTraits()
            self._traits[model] = (time.monotonic() + TRAITS_TIMEOUT_S, traits)
            return traits
        traits = EngineTraits.model_validate(info.get("traits") or {})
        self._traits[model] = (time.monotonic() + TRAITS_TTL_S, traits)
        return traits

    def prepare(self, session_id: str, models: Iterable[ModelRole]) -> None:
        self.transport.prepare(session_id, [m for m in models if self.refusal(m) is None])

    def release(self, session_id: str) -> None:
        self.transport.release(session_id)

    def stats(self) -> dict[str, int]:
        return self.transport.stats()

    def segments_in_flight(self) -> dict[ModelRole, int] | None:
        return dict(self.in_flight)

    def lease_counts(self) -> tuple[dict[str, int] | None, dict[str, int] | None]:
        """Leases held and idle per model (the direct transport); None, None with handles."""
        if isinstance(self.transport, DirectTransport):
            return self.transport.leases_held(), self.transport.leases_idle()
        return None, None

    def close(self) -> None:
        self.transport.close()

    def _timed_out(self, model: ModelRole, timeout_s: float) -> str:
        """Why a segment of ``model`` missed its first-token deadline; refuses the model's segments
        for ``small_retry_after_s`` when none of its segments got a token during that time."""
        if time.monotonic() - self._last_reply.get(model, float("-inf")) < timeout_s:
            return (
                f"the {model} model's first token took longer than {timeout_s} s "
                f"(other {model}-model segments were answered)"
            )
        reason = (
            f"the {model} deployment did not answer within {timeout_s} s (scaled to zero or "
            f"unreachable); its segments are refused for {self.small_retry_after_s} s"
        )
        self._down[model] = (time.monotonic() + self.small_retry_after_s, reason)
        log.warning("%s", reason)
        return reason

    async def generate(
        self, request: SegmentRequest, stream: Streaming = True, timeout_s: float | None = None
    ) -> AsyncIterator[EngineChunk]:
        model = request.model
        deadline = timeout_s  # for the first reply only
        chunks = self.transport.segment(request, stream)
        self.in_flight[model] += 1
        try:
            while True:
                try:
                    async with asyncio.timeout(deadline):
                        chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                deadline = None
                self._last_reply[model] = time.monotonic()
                yield chunk
        except TimeoutError as e:
            self.transport.drop(request.session_id, model)  # a lease still queued in Serve goes too
            raise ModelUnavailable(self._timed_out(model, timeout_s)) from e
        except InvalidRequest:
            raise  # the request's fault: a 400, not an engine failure
        except Exception as e:
            if not engine_failure(e):  # a bug here: not retried, not blamed on an engine
                log.error("a %s segment of %s failed in the router", model, request.session_id, exc_info=e)
                raise
            raise EngineError(f"{model} deployment: {type(e).__name__}: {e}") from e
        finally:
            self.in_flight[model] -= 1
            await chunks.aclose()
