"""How a router replica sends a segment request to a model deployment.

``DirectTransport`` (the default, ``router.transport: direct``): a generation takes a *lease* on one
replica of each model it uses, a streamed Ray Serve call (``ModelServer.lease``) that the replica
answers with the address and token of its segment channel and then holds open until the router
releases it, its channel connection closes, or ``ttl_s`` passes. Ray Serve therefore still chooses
the replica (least loaded), admits the generation (``max_ongoing_requests`` counts leases) and
reports a dead replica (the lease call fails); autoscaling is on the engines' own load instead
(``app/autoscaling.py``), since a held lease is not work. Every segment of
the generation then goes over the channel to the leased replica: session affinity by construction,
and a handoff costs a TCP round trip instead of a Serve call. With ``resumable`` (and an engine that
has them), the segments of a generation on one replica continue one resumable engine request
there, which the router ends with the generation. A failed segment drops its lease, so the retry
takes a new one (Serve routes it to a live replica).

``HandleTransport`` (``router.transport: handle``): every segment is a Ray Serve handle call,
carrying the generation's id as its session id for ``SessionAffinityRouter``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from relay_serve.protocol import (
    ChannelError,
    ContextGap,
    EngineChunk,
    InvalidRequest,
    ModelRole,
    RemoteError,
    SegmentRequest,
    Streaming,
    pack_token_ids,
)
from relay_serve.router.calls import own_request
from relay_serve.router.channel import ChannelPool

log = logging.getLogger(__name__)


class HandleTransport:
    """A Ray Serve handle call per segment."""

    def __init__(self, handles: dict[str, Any], affinity: bool = True) -> None:
        self.handles = handles
        self.affinity = affinity

    def prepare(self, session_id: str, models: Iterable[ModelRole]) -> None:
        pass

    def drop(self, session_id: str, model: ModelRole) -> None:
        pass

    def release(self, session_id: str) -> None:
        if self.affinity:
            from relay_serve.router.affinity import release_session

            release_session(session_id)

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        from relay_serve.router.affinity import affinity_map_size

        return {"pinned_generations": affinity_map_size()}

    async def segment(self, request: SegmentRequest, stream: Streaming) -> AsyncIterator[EngineChunk]:
        opts: dict[str, Any] = {"method_name": "generate" if stream else "complete", "stream": bool(stream)}
        if self.affinity:
            opts["session_id"] = request.session_id
        response = own_request(
            lambda: self.handles[request.model].options(**opts).remote(request.model_dump(exclude={"unchanged"}))
        )
        finished = False
        try:
            if stream:
                async for data in response:
                    chunk = EngineChunk.model_validate(data)
                    finished = chunk.finished
                    yield chunk
            else:
                chunk = EngineChunk.model_validate(await response)
                finished = True
                yield chunk
        finally:
            if not finished:
                response.cancel()


@dataclass(frozen=True)
class LeaseInfo:
    address: str
    token: str
    replica_id: str
    resumable: bool = False  # the replica's engine offers resumable requests


class Lease:
    """A hold on one model replica (a streamed ``ModelServer.lease`` call), used by one
    generation at a time."""

    def __init__(self, handle, model: ModelRole, ttl_s: float, on_lost, on_granted=None) -> None:
        self.model = model
        self.created = time.monotonic()
        self.idle_since: float | None = None
        self.released = False
        self.ended = False
        self._on_lost = on_lost
        self._on_granted = on_granted or (lambda info: None)
        self.info: asyncio.Future[LeaseInfo] = asyncio.get_running_loop().create_future()
        self.info.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "never retrieved"
        lease_id = f"lease-{uuid.uuid4().hex[:12]}"
        self._response = own_request(lambda: handle.options(method_name="lease", stream=True).remote(lease_id, ttl_s))
        self._task = asyncio.create_task(self._keep())

    @property
    def usable(self) -> bool:
        """Not given back and not ended (it may still be waiting for its replica)."""
        return not (self.released or self.ended)

    @property
    def granted(self) -> bool:
        return self.usable and self.info.done() and not self.info.cancelled() and self.info.exception() is None

    async def _keep(self) -> None:
        error: BaseException | None = None
        try:
            async for message in self._response:
                if not self.info.done():
                    info = LeaseInfo(
                        message["address"], message["token"], message["replica_id"], bool(message.get("resumable"))
                    )
                    self.info.set_result(info)
                    self._on_granted(info)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - the replica died, or the lease was cancelled
            error = e
        finally:
            self.ended = True
            if not self.info.done():
                reason = f"{type(error).__name__}: {error}" if error is not None else "it ended before answering"
                self.info.set_exception(ConnectionError(f"no lease on the {self.model} deployment: {reason}"))
            elif error is not None and not self.released:
                self._on_lost(self, error)

    def release(self) -> None:
        """Give the replica back (idempotent; a lease still being acquired is cancelled in Serve)."""
        if not self.released:
            self.released = True
            if not self.ended:
                self._response.cancel()


class DirectTransport:
    """Leases through Ray Serve, segments over each replica's channel.

    A lease whose replica Serve took out of rotation (``in_rotation``: draining for a downscale,
    or dead) is given back at the generation's next segment, which takes a new one: a downscale
    moves generations at segment boundaries instead of failing them when the replica stops.

    A generation that ends gives its leases back to this router replica's idle pool rather than
    to Serve: the next generation takes the most recently used one at once (no Serve call on its
    first segment, and the warmest prefix cache). An idle lease goes back to Serve after
    ``idle_s``; none is reused once ``max_age_s`` old, so that Serve places new generations afresh
    and a replica added by autoscaling gets its share within that time.
    """

    def __init__(
        self,
        handles: dict[str, Any],
        *,
        affinity: bool,
        ttl_s: float,
        idle_s: float,
        max_age_s: float,
        resumable: bool,
        in_rotation: Callable[[ModelRole, str], bool] | None = None,
    ) -> None:
        self.handles = handles
        self.resumable = resumable
        self.in_rotation = in_rotation or (lambda model, replica_id: True)
        self.affinity = affinity  # False: a lease per segment (Serve picks the replica every time)
        self.ttl_s = ttl_s
        self.idle_s = idle_s if affinity else 0.0
        self.max_age_s = max_age_s
        self.pool = ChannelPool()
        self.leases: dict[str, dict[str, Lease]] = {}
        self.idle: dict[str, list[Lease]] = {"large": [], "small": []}
        # per generation and model: the lease whose replica's engine session holds its context after
        # its last segment (the next one sends only what is new)
        self.continued: dict[tuple[str, ModelRole], Lease] = {}
        self._attaching: set[asyncio.Task] = set()

    def _lease(self, session_id: str, model: ModelRole) -> Lease:
        held = self.leases.setdefault(session_id, {})
        lease = held.get(model)
        if lease is not None and lease.granted and not self._in_rotation(lease):
            self._end_session(
                lease, session_id
            )  # its replica is draining (a downscale): move on at this segment boundary
            lease.release()
        if lease is None or not lease.usable:
            lease = held[model] = self._reuse(model) or Lease(
                self.handles[model], model, self.ttl_s, self._lost, self._attach
            )
        return lease

    def _in_rotation(self, lease: Lease) -> bool:
        return self.in_rotation(lease.model, lease.info.result().replica_id)

    def _reusable(self, lease: Lease) -> bool:
        return lease.granted and time.monotonic() - lease.created < self.max_age_s and self._in_rotation(lease)

    def _reuse(self, model: ModelRole) -> Lease | None:
        idle = self.idle[model]
        while idle:
            lease = idle.pop()  # the most recently used
            lease.idle_since = None  # no longer idle: its expiry timer does nothing
            if self._reusable(lease):
                return lease
            lease.release()
        return None

    def _give_back(self, lease: Lease) -> None:
        if self.idle_s > 0 and self._reusable(lease):
            lease.idle_since = since = time.monotonic()
            self.idle[lease.model].append(lease)
            asyncio.get_running_loop().call_later(self.idle_s, self._expire, lease, since)
        else:
            lease.release()

    def _expire(self, lease: Lease, since: float) -> None:
        if lease.idle_since == since:  # still idle since then (not taken and given back again)
            self.idle[lease.model].remove(lease)
            lease.release()

    def _attach(self, info: LeaseInfo) -> None:
        """A granted lease is bound to this router's connection to its replica at once (the
        replica ends it when the connection closes), not only at its first segment."""

        async def attach() -> None:
            try:
                (await self.pool.get(info.address, info.token)).attach(info.token)
            except Exception as e:  # noqa: BLE001 - the lease's first segment finds out and retries
                log.info("could not attach a lease on replica %s: %s", info.replica_id, e)

        task = asyncio.get_running_loop().create_task(attach())
        self._attaching.add(task)
        task.add_done_callback(self._attaching.discard)

    def _lost(self, lease: Lease, error: BaseException) -> None:
        """A lease failed under way (its replica died): fail the segments open there now."""
        info = lease.info.result()
        log.warning("lease on %s replica %s lost: %s", lease.model, info.replica_id, error)
        self.pool.drop(info.address, f"its replica's lease failed: {type(error).__name__}")

    def prepare(self, session_id: str, models: Iterable[ModelRole]) -> None:
        """Start taking leases on ``models`` now (the generation will use them), so that a later
        handoff does not wait for one."""
        if self.affinity:
            for model in models:
                self._lease(session_id, model)

    def drop(self, session_id: str, model: ModelRole) -> None:
        """Give a generation's lease on ``model`` back to Serve (it failed or timed out: not
        for reuse)."""
        lease = self.leases.get(session_id, {}).pop(model, None)
        self.continued.pop((session_id, model), None)
        if lease is not None:
            self._end_session(lease, session_id)
            lease.release()

    def release(self, session_id: str) -> None:
        for model in ("large", "small"):
            self.continued.pop((session_id, model), None)
        for lease in self.leases.pop(session_id, {}).values():
            self._end_session(lease, session_id)
            self._give_back(lease)

    def _end_session(self, lease: Lease, session_id: str) -> None:
        """The generation is done with this replica: its resumable engine request there goes."""
        if self.resumable and lease.granted and lease.info.result().resumable:
            channel = self.pool.existing(lease.info.result().address)
            if channel is not None:
                channel.end_session(session_id)

    def close(self) -> None:
        """Give every lease back (held or idle: their replicas then have no ongoing request of this
        router, and stop at once when Serve stops them) and close the connections."""
        for held in self.leases.values():
            for lease in held.values():
                lease.release()
        for idle in self.idle.values():
            for lease in idle:
                lease.idle_since = None  # out of the pool: its expiry timer does nothing
                lease.release()
        self.leases.clear()
        self.idle = {"large": [], "small": []}
        self.pool.close()

    def stats(self) -> dict[str, int]:
        held = self.leases_held()
        return {
            "pinned_generations": len(self.leases),
            "leases": sum(held.values()),
            "idle_leases": sum(len(idle) for idle in self.idle.values()),
            "channels": len(self.pool),
        }

    def leases_held(self) -> dict[str, int]:
        """Leases held by generations, per model."""
        n = dict.fromkeys(self.idle, 0)
        for held in self.leases.values():
            for model in held:
                n[model] += 1
        return n

    def leases_idle(self) -> dict[str, int]:
        return {model: len(idle) for model, idle in self.idle.items()}

    async def segment(self, request: SegmentRequest, stream: Streaming) -> AsyncIterator[EngineChunk]:
        lease = self._lease(request.session_id, request.model)
        key = (request.session_id, request.model)
        holder = self.continued.pop(key, None)
        info: LeaseInfo | None = None
        try:
            info = await asyncio.shield(lease.info)
            channel = await self.pool.get(info.address, info.token)
            resume = self.resumable and info.resumable and self.affinity
            base = request.unchanged if resume and holder is lease else 0
            while True:
                try:
                    async for data in channel.request(wire_body(request, resume, base), stream, info.token):
                        yield EngineChunk.model_validate(data)
                    break
                except ContextGap:
                    if base == 0:
                        raise
                    base = 0  # the replica's session does not hold it (ended, restarted): the whole context
            self.continued[key] = lease
        except InvalidRequest:
            raise  # the request's fault: the lease and its replica are fine
        except Exception as e:
            self.drop(request.session_id, request.model)  # the retry takes a new lease (a live replica)
            if info is not None and isinstance(e, (ChannelError, RemoteError)):
                raise type(e)(f"replica {info.replica_id}: {e}") from e
            raise
        finally:
            if not self.affinity:
                self.drop(request.session_id, request.model)


def wire_body(request: SegmentRequest, resume: bool, base: int) -> dict[str, Any]:
    """A segment request as it crosses the channel: with ``base`` > 0 the context's first ``base``
    tokens are left out (the replica's engine session holds them), so the work per segment is in
    the new tokens, not the context; the tokens sent go packed (``pack_token_ids``), so a 32k-token
    prompt costs the replica one list of ints, not a msgpack list and its validation."""
    body = request.model_dump(exclude={"prompt_token_ids", "unchanged"})
    body.update(prompt_token_ids=pack_token_ids(request.prompt_token_ids[base:]), context_base=base, resume=resume)
    return body
