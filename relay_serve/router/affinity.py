"""Session-affine request routing for the model deployments.

Every segment of one generation carries the generation's id as its Ray Serve session id. This
request router sends a segment to the replica that served the previous segment of its session
while that replica lives (its prefix cache holds the context), otherwise to the less loaded of two
replicas. Sessions are forgotten when the generation ends (:func:`release_session`), when their
replica dies, or after ``idle_ttl_s`` without a segment; the map is bounded by ``max_sessions``.

The router lives in the caller's process (the RelayRouter replica), one instance per handle.
Ray Serve pickles this module by value, so process-wide state lives in ``affinity_registry``.
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from relay_serve.router import affinity_registry as registry


class SessionAffinityRouter(RequestRouter):
    def initialize_state(self, idle_ttl_s: float = 120.0, max_sessions: int = 100_000, **kwargs) -> None:
        self.idle_ttl_s = idle_ttl_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, tuple[ReplicaID, float]] = OrderedDict()
        self._lock = threading.Lock()
        registry.register(self)

    # ---- the routing decision ------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Serve sleeps between routing attempts only when the router says so (its own routers
            # do once they rank every replica, as this one always does). Without it a request that
            # finds every replica at max_ongoing_requests is retried in a busy loop: a core of the
            # caller's CPU until a slot frees.
            pending_request.routing_context.should_backoff = True
        sid = pending_request.metadata.session_id if pending_request is not None else ""
        pinned = self._pinned(sid, candidate_replicas)
        rest = [r for r in candidate_replicas if r is not pinned]
        ranks = [[pinned]] if pinned is not None else []
        if rest:
            ranks.append(self._two_least_loaded(rest))
        return ranks

    def _pinned(self, sid: str, candidates: list[RunningReplica]) -> RunningReplica | None:
        if not sid:
            return None
        with self._lock:
            entry = self._sessions.get(sid)
        if entry is None:
            return None
        return next((r for r in candidates if r.replica_id == entry[0]), None)

    def _two_least_loaded(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        def load(r: RunningReplica) -> tuple[int, float]:
            q = self.replica_queue_len_cache.get(r.replica_id)
            return (0 if q is None else q, random.random())

        return sorted(replicas, key=load)[:2]

    # ---- bookkeeping ---------------------------------------------------------------------------

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        sid = pending_request.metadata.session_id
        if not sid:
            return
        now = time.monotonic()
        with self._lock:
            self._sessions[sid] = (replica_id, now)
            self._sessions.move_to_end(sid)
            self._prune(now)

    def _prune(self, now: float) -> None:
        while self._sessions:
            sid, (_, seen) = next(iter(self._sessions.items()))
            if len(self._sessions) > self.max_sessions or now - seen > self.idle_ttl_s:
                self._sessions.popitem(last=False)
            else:
                break

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        with self._lock:
            for sid in [s for s, (rid, _) in self._sessions.items() if rid == replica_id]:
                del self._sessions[sid]

    def release(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def size(self) -> int:
        with self._lock:
            self._prune(time.monotonic())
            return len(self._sessions)


def release_session(session_id: str) -> None:
    """Forget a finished generation in every affinity router of this process."""
    for router in registry.routers():
        router.release(session_id)


def affinity_map_size() -> int:
    """Sessions remembered by the affinity routers of this process (for /v1/relay/stats)."""
    return sum(r.size() for r in registry.routers())
