"""The direct transport end to end without Ray: real ModelServers (over a fake engine) behind fake
Serve handles whose ``lease`` calls run the replicas' own ``lease`` method, and segments over the
replicas' real TCP channels. Leases: one per generation and model, reused, expired, dropped on a
failure, lost with their replica; the small deployment's timeout."""

from __future__ import annotations

import asyncio
import struct

import pytest

from relay_serve.engine.base import Engine, EngineInfo
from relay_serve.protocol import EngineChunk, SegmentRequest
from relay_serve.relay.generation import EngineError, ModelUnavailable
from relay_serve.replica.model_server import ModelServer
from relay_serve.router.backend import ServeBackend


class FakeEngine(Engine):
    """Writes ``max_tokens`` tokens (7, 8, 9, ...), ``delay_s`` apart; ``fail`` makes the next request fail."""

    def __init__(self, model, tokenizer=None, engine_args=None) -> None:
        self.requests: list[SegmentRequest] = []
        self.delay_s = 0.0
        self.first_delay_s: dict[str, float] = {}  # by session: a wait before the first token
        self.fail = False

    async def generate(self, request, request_id, stream=True):
        self.requests.append(request)
        if self.fail:
            self.fail = False
            raise RuntimeError("the engine core died")
        await asyncio.sleep(self.first_delay_s.get(request.session_id, 0.0))
        for i in range(request.max_tokens):
            await asyncio.sleep(self.delay_s)
            last = i == request.max_tokens - 1
            yield EngineChunk(token_ids=[7 + i], finished=last, finish_reason="length" if last else None)

    def info(self):
        return EngineInfo(model="fake", max_model_len=1024, tokenizer_fingerprint="x")

    async def check_health(self):
        pass


class LeaseCall:
    """What ``handle.options(method_name="lease", stream=True).remote(...)`` returns: iterates the
    replica's ``lease`` generator; ``cancel()`` ends it as Serve's cancellation would; ``die()``
    fails it as a dead replica's call would."""

    def __init__(self, gen) -> None:
        self.gen, self.cancelled = gen, False
        self._stop = asyncio.Event()
        self._error: Exception | None = None

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        try:
            while True:
                step = asyncio.ensure_future(self.gen.__anext__())
                stop = asyncio.ensure_future(self._stop.wait())
                done, _ = await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
                if step not in done:
                    step.cancel()
                    raise self._error or RuntimeError("RequestCancelledError")
                stop.cancel()
                try:
                    yield step.result()
                except StopAsyncIteration:
                    return
        finally:
            await self.gen.aclose()

    def cancel(self) -> None:
        self.cancelled = True
        self._stop.set()

    def die(self) -> None:
        from ray.exceptions import ActorDiedError

        self._error = ActorDiedError()  # what a lease call to a dead replica raises
        self._stop.set()


class FakeHandle:
    """A model deployment of one replica (``server``); ``silent`` grants no lease (no replica)."""

    def __init__(self, server: ModelServer | None) -> None:
        self.server, self.calls = server, []

    def options(self, method_name, stream=False, **kw):
        assert method_name == "lease" and stream
        return self

    def remote(self, lease_id, ttl_s):
        async def silent():
            await asyncio.sleep(3600)
            yield {}

        call = LeaseCall(self.server.lease(lease_id, ttl_s) if self.server is not None else silent())
        self.calls.append(call)
        return call


def replica(role: str) -> ModelServer:
    return ModelServer(role, {"model": f"toy:{role}"}, engine_cls=FakeEngine)


def req(model="large", session="gen-1", n=3):
    return SegmentRequest(model=model, prompt_token_ids=[1, 2], max_tokens=n, session_id=session)


async def run(
    backend: ServeBackend, request: SegmentRequest, stream: bool = False, timeout_s=None
) -> list[EngineChunk]:
    return [c async for c in backend.generate(request, stream=stream, timeout_s=timeout_s)]


def setup(**kw):
    large, small = replica("large"), replica("small")
    hl, hs = FakeHandle(large), FakeHandle(small)
    return ServeBackend(hl, hs, **kw), (large, hl), (small, hs)


def test_a_generation_leases_each_model_once_and_sends_every_segment_to_that_replica():
    async def go():
        b, (large, hl), (small, hs) = setup()
        b.prepare("gen-1", ["large", "small"])
        outs = []
        for model in ("large", "small", "large", "small", "large"):
            outs.append(await run(b, req(model), stream=model == "small"))
        held = (large.leases_held, small.leases_held, b.stats())
        b.release("gen-1")
        return outs, held, len(hl.calls), len(hs.calls), len(large.engine.requests), len(small.engine.requests)

    outs, held, lease_calls_l, lease_calls_s, reqs_l, reqs_s = asyncio.run(go())
    assert [o[-1].token_ids for o in outs] == [[7, 8, 9], [9], [7, 8, 9], [9], [7, 8, 9]]  # whole, or streamed
    assert all(o[-1].finished and o[-1].replica_id == "local" for o in outs)
    assert (lease_calls_l, lease_calls_s, reqs_l, reqs_s) == (1, 1, 3, 2)
    assert held[:2] == (1, 1) and held[2]["leases"] == 2 and held[2]["channels"] == 2


def test_released_leases_serve_the_next_generation_then_go_back_to_serve_when_idle():
    async def go():
        b, (large, hl), _ = setup(lease_idle_s=0.05)
        await run(b, req(session="gen-1"))
        b.release("gen-1")
        idle = b.stats()["idle_leases"]
        await run(b, req(session="gen-2"))  # takes the idle lease: no Serve call
        calls_after_reuse = len(hl.calls)
        b.release("gen-2")
        await asyncio.sleep(0.15)
        await asyncio.sleep(0)
        return idle, calls_after_reuse, hl.calls[0].cancelled, b.stats(), large.leases_held

    idle, calls, cancelled, stats, held = asyncio.run(go())
    assert idle == 1 and calls == 1
    assert cancelled and stats["idle_leases"] == 0 and stats["leases"] == 0 and held == 0


def test_a_lease_past_its_max_age_is_given_back_not_reused():
    async def go():
        b, (_, hl), _ = setup(lease_max_age_s=0.02)
        await run(b, req(session="gen-1"))
        await asyncio.sleep(0.05)
        b.release("gen-1")
        await run(b, req(session="gen-2"))
        return len(hl.calls), hl.calls[0].cancelled

    assert asyncio.run(go()) == (2, True)


def test_a_failed_segment_gives_its_lease_back_and_the_retry_takes_a_new_one():
    async def go():
        b, (large, hl), _ = setup()
        await run(b, req())
        large.engine.fail = True
        with pytest.raises(EngineError, match="RemoteError: replica local: RuntimeError: the engine core died"):
            await run(b, req())
        first_cancelled = hl.calls[0].cancelled
        out = await run(b, req())
        return first_cancelled, len(hl.calls), out, b.in_flight

    first_cancelled, calls, out, in_flight = asyncio.run(go())
    assert first_cancelled and calls == 2 and out[-1].finished and in_flight == {"large": 0, "small": 0}


def test_a_lost_lease_fails_the_segments_under_way_on_its_replica_at_once():
    async def go():
        b, (large, hl), _ = setup()
        large.engine.delay_s = 30.0  # a token every 30 s: only the lost lease can end the segment soon
        task = asyncio.create_task(run(b, req(n=100), stream=True))
        await asyncio.sleep(0.1)
        t0 = asyncio.get_running_loop().time()
        hl.calls[0].die()  # Serve reports the replica dead; its connection may linger (a lost node)
        with pytest.raises(EngineError, match="ended"):
            await task
        return asyncio.get_running_loop().time() - t0

    assert asyncio.run(go()) < 10.0  # not the engine's next token


def test_without_affinity_every_segment_takes_a_lease_of_its_own():
    async def go():
        b, (_, hl), _ = setup(session_affinity=False)
        b.prepare("gen-1", ["large"])  # no prefetch either
        before = len(hl.calls)
        for _ in range(3):
            await run(b, req())
        await asyncio.sleep(0)
        return before, len(hl.calls), all(c.cancelled for c in hl.calls), b.stats()

    before, calls, all_given_back, stats = asyncio.run(go())
    assert before == 0 and calls == 3 and all_given_back and stats["leases"] == 0 and stats["idle_leases"] == 0


def test_a_small_deployment_without_a_replica_times_out_and_is_left_alone():
    async def go():
        large = replica("large")
        hs = FakeHandle(None)
        b = ServeBackend(FakeHandle(large), hs, small_retry_after_s=60)
        b.prepare("gen-1", ["large", "small"])
        with pytest.raises(ModelUnavailable, match="did not answer within 0.05 s"):
            await run(b, req("small"), timeout_s=0.05)
        cancelled = hs.calls[0].cancelled
        refusal = b.refusal("small")
        b.prepare("gen-2", ["large", "small"])  # while the small deployment is down: no lease asked
        return cancelled, refusal, len(hs.calls), b.in_flight

    cancelled, refusal, calls, in_flight = asyncio.run(go())
    assert cancelled and "did not answer" in refusal and calls == 1 and in_flight["small"] == 0


def test_the_replica_counts_its_leases_and_reports_its_channel():
    async def go():
        b, (large, _), _ = setup()
        await run(b, req())
        info, routing = await large.info(), await large.record_routing_stats()
        b.release("gen-1")
        b.transport.idle["large"][0].release()
        await asyncio.sleep(0.01)
        return info, routing, large.leases_held

    from relay_serve.cluster import node_ip

    info, routing, held_after = asyncio.run(go())
    host, _, port = info["channel"].rpartition(":")
    assert info["leases_held"] == 1 and held_after == 0
    assert (
        routing["leases_held"] == 1 and routing["sessions"] == info["sessions"]
    )  # the same figures, asked of this replica
    assert host == node_ip() and int(port) > 0  # the node's address inside Ray (other tests start one), else loopback


def test_unknown_transports_are_refused():
    with pytest.raises(ValueError, match="transport"):
        ServeBackend(None, None, transport="grpc")


def test_a_lease_on_a_replica_taken_out_of_rotation_moves_at_the_next_segment():
    async def go():
        rotation = {"local": True}
        b, (_, hl), _ = setup(in_rotation=lambda model, rid: rotation[rid])
        await run(b, req(session="gen-1"))
        rotation["local"] = False  # Serve stops routing to the replica (it drains for a downscale)
        out = await run(b, req(session="gen-1"))  # the generation goes on, on a new lease
        moved = (len(hl.calls), hl.calls[0].cancelled, out[-1].finished)
        b.release("gen-1")
        return moved, b.stats()["idle_leases"]

    (calls, first_given_back, finished), idle = asyncio.run(go())
    assert calls == 2 and first_given_back and finished
    assert idle == 0  # a lease out of rotation is not kept for reuse either


def test_rotation_follows_the_routers_of_this_process():
    from ray.serve._private.common import DeploymentID, ReplicaID

    from relay_serve.router import affinity_registry

    class Router:
        def __init__(self, app, name, ids):
            self.curr_replicas = {
                ReplicaID(unique_id=i, deployment_id=DeploymentID(name=name, app_name=app)): None for i in ids
            }

    routers = [Router("relay", "large", ["a", "b"]), Router("relay", "small", ["c"]), Router("other", "large", ["z"])]
    for r in routers:
        affinity_registry.register(r)
    running = affinity_registry.replica_running
    assert running("relay", "large", "a") and running("relay", "small", "c")
    assert not running("relay", "large", "c") and not running(
        "relay", "large", "z"
    )  # not in that deployment's rotation
    assert running("unfollowed", "large", "q")  # no router here follows it: nothing to say otherwise


def test_an_idle_lease_that_cannot_be_reused_is_given_back_once(caplog):
    async def go():
        rotation = {"local": True}
        b, (_, hl), _ = setup(lease_idle_s=0.05, in_rotation=lambda model, rid: rotation[rid])
        await run(b, req(session="gen-1"))
        b.release("gen-1")
        rotation["local"] = False  # while idle, its replica leaves rotation
        await run(b, req(session="gen-2"))  # passes over it, takes a new one
        await asyncio.sleep(0.1)  # the old lease's expiry timer fires: nothing left to do
        return len(hl.calls), hl.calls[0].cancelled

    assert asyncio.run(go()) == (2, True)
    assert "ValueError" not in caplog.text  # the expiry timer of a lease taken out of the pool


def test_closing_the_backend_with_an_idle_lease_leaves_no_expiry_timer_to_fail(caplog):
    async def go():
        b, (_, hl), _ = setup(lease_idle_s=0.05)
        await run(b, req(session="gen-1"))
        b.release("gen-1")  # its lease goes idle, with an expiry timer
        b.close()  # the router stops: every lease goes back at once
        await asyncio.sleep(0.1)  # the timer fires after the close
        return hl.calls[0].cancelled, b.stats()["idle_leases"]

    assert asyncio.run(go()) == (True, 0)
    assert "ValueError" not in caplog.text and "Traceback" not in caplog.text


def scripted(prompt: str, ref: str):
    """A codec and an engine class (resumable requests) whose model writes ``prompt + ref`` from
    wherever its text stands, for real ModelServers behind the direct transport."""
    from tests.fakes import FakeCodec, FakeResumableEngine

    codec = FakeCodec()
    codec.encode(prompt + ref)

    class Scripted(FakeResumableEngine):
        def __init__(self, model, tokenizer=None, engine_args=None) -> None:
            super().__init__(codec, lambda text: (prompt + ref)[len(text) :] if (prompt + ref).startswith(text) else "")

    return codec, Scripted


async def relay_over(backend: ServeBackend, codec, prompt: str):
    """One RelayGen generation (cue ``Thus,``) over ``backend``."""
    from relay_serve.protocol import SamplingSettings
    from relay_serve.relay.generation import Generation
    from relay_serve.relay.policy import PolicySettings, RelayGen

    s = Generation(
        backend=backend,
        codec=codec,
        prompt_ids=codec.encode(prompt),
        max_tokens=200,
        sampling=SamplingSettings(),
        session_id="gen-1",
    )
    return await s.run(RelayGen(PolicySettings(min_large_tokens=0), ["Thus,"]))


def test_a_relay_generation_continues_one_resumable_request_per_model():
    """RelayGen over the direct transport, with replicas whose engine has resumable requests:
    one request per model for the whole generation, fed only what is new, ended with it."""
    prompt = "<think>\n"
    ref = "First, b3 -> c12.\n\nThus, we are at c12.\n\nNext, c12 -> v13.\n</think>\n\nThe answer is v13."
    codec, Scripted = scripted(prompt, ref)

    async def go(resumable: bool):
        large = ModelServer("large", {"model": "toy:large"}, engine_cls=Scripted)
        small = ModelServer("small", {"model": "toy:small"}, engine_cls=Scripted)
        b = ServeBackend(FakeHandle(large), FakeHandle(small), resumable_requests=resumable)
        result = await relay_over(b, codec, prompt)
        open_sessions = (len(large.sessions), len(small.sessions))
        b.release("gen-1")
        await asyncio.sleep(0.05)
        return result, open_sessions, large, small

    result, open_sessions, large, small = asyncio.run(go(True))
    assert result.text == ref and result.usage.small_tokens > 0 and result.usage.switches >= 2
    assert open_sessions == (1, 1)
    (large_req,), (small_req,) = large.engine.requests, small.engine.requests
    # after its first chunk the large request is fed the pending token and the small model's sentence only
    assert codec.decode(large_req.feeds[0]) == prompt and all(len(f) < 12 for f in large_req.feeds[1:])
    assert (
        large_req.closed and small_req.closed and not large.sessions and not small.sessions
    )  # ended with the generation
    result, _, large, small = asyncio.run(go(False))
    assert result.text == ref and large.engine.requests == [] and small.engine.requests == []


def test_segments_on_a_held_session_carry_only_what_is_new_and_a_lost_session_gets_the_whole_context():
    """Over the channel, a model's later segments send the tokens its engine session does not
    hold (the other model's sentence), not the context; when the replica lost the session (reaped,
    restarted) the segment is sent whole again and the generation is unchanged."""
    prompt = "<think>\n"
    ref = (
        "First, b3 -> c12.\n\nThus, we are at c12.\n\nNext, c12 -> v13.\n\nThus, v13 it is.\n"
        "</think>\n\nThe answer is v13."
    )
    codec, Scripted = scripted(prompt, ref)

    async def go(lose_after: int | None):
        large = ModelServer("large", {"model": "toy:large"}, engine_cls=Scripted)
        small = ModelServer("small", {"model": "toy:small"}, engine_cls=Scripted)
        wire: list[tuple[str, int, int]] = []  # model, context_base, tokens sent
        for server in (large, small):
            segment = server.segment

            def recording(request, stream, peer=None, segment=segment, server=server):
                sent = request["prompt_token_ids"]  # packed: 4 little-endian bytes a token id
                assert isinstance(sent, bytes) and len(sent) % 4 == 0
                wire.append((server.role, request["context_base"], len(struct.unpack(f"<{len(sent) // 4}I", sent))))
                if lose_after is not None and len(wire) == lose_after:
                    server.sessions.clear()  # the replica forgot the generation's sessions
                return segment(request, stream, peer)

            server.segment = recording
        b = ServeBackend(FakeHandle(large), FakeHandle(small), resumable_requests=True)
        result = await relay_over(b, codec, prompt)
        b.release("gen-1")
        await asyncio.sleep(0.05)
        return result, wire

    result, wire = asyncio.run(go(None))
    assert result.text == ref
    firsts = {m: next(w for w in wire if w[0] == m) for m in ("large", "small")}
    assert all(w[1] == 0 for w in firsts.values())  # nothing held yet: the whole context
    later = [w for w in wire if w not in firsts.values()]
    assert later and all(0 < sent < base for _, base, sent in later), wire  # the other model's tokens, not the context
    # the replica loses its sessions while the third segment arrives: it is refused and sent whole
    lost, wire = asyncio.run(go(3))
    assert lost.text == ref
    third = wire[2]
    assert third[1] > 0 and wire[3][:1] == third[:1] and wire[3][1] == 0 and wire[3][2] > third[2], wire


def test_a_long_unstreamed_small_answer_is_bounded_by_its_first_token_only():
    """A batch (unstreamed) relay answer that takes 1 s on the small model, with a 0.3 s deadline:
    the deadline bounds its first token, so the small model writes all of it and the deployment
    stays in service."""
    from relay_serve.protocol import SamplingSettings
    from relay_serve.relay.detok import WindowStream
    from relay_serve.relay.generation import Generation

    class Numbers:  # decodes the fake engine's token ids (7, 8, 9, ...)
        def encode(self, text):
            return [int(t) for t in text.split()]

        def decode(self, ids):
            return "".join(f" {i}" for i in ids)

        def stream(self, context=()):
            return WindowStream(self.decode, context)

    async def go():
        b, (large, _), (small, _) = setup()
        small.engine.delay_s = 0.02  # 50 tokens: 1 s
        s = Generation(
            backend=b,
            codec=Numbers(),
            prompt_ids=[1, 2],
            max_tokens=50,
            sampling=SamplingSettings(),
            session_id="g",
            small_timeout_s=0.3,
        )
        out = await s.answer("small", cue=None, optional=True)
        return out, b.refusal("small")

    out, refusal = asyncio.run(go())
    assert len(out.token_ids) == 50 and out.finish_reason == "length" and refusal is None


def test_one_slow_first_token_takes_out_its_own_segment_only():
    """While other small-model segments are answered, one whose first token is late goes to the
    large model alone; the small deployment stays in service."""
    from relay_serve.relay.generation import ModelUnavailable

    async def go():
        b, _, (small, _) = setup()
        small.engine.delay_s = 0.01
        small.engine.first_delay_s["slow"] = 0.5  # this segment's first token comes late
        busy = asyncio.create_task(run(b, req("small", session="other", n=60), stream=True))  # answered all along
        await asyncio.sleep(0.05)
        with pytest.raises(ModelUnavailable, match="first token took longer than 0.2 s"):
            await run(b, req("small", session="slow", n=3), stream="first", timeout_s=0.2)
        refusal = b.refusal("small")
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
        return refusal

    assert asyncio.run(go()) is None


def test_idle_sessions_are_closed_on_a_timer_without_waiting_for_a_new_one(monkeypatch):
    """A session whose router went quiet is closed after SESSION_IDLE_S even if no other session
    is ever opened on that replica (its KV cache and engine slot come back)."""
    from relay_serve.replica import model_server
    from tests.fakes import FakeCodec, FakeResumableEngine

    monkeypatch.setattr(model_server, "SESSION_IDLE_S", 0.2)
    codec = FakeCodec()
    codec.encode("a b")

    class Resumable(FakeResumableEngine):
        def __init__(self, model, tokenizer=None, engine_args=None) -> None:
            super().__init__(codec, lambda text: "")

    async def go():
        server = ModelServer("large", {"model": "toy:large"}, engine_cls=Resumable)
        server._session("gen-quiet", "conn-1")
        opened = list(server.sessions)
        await asyncio.sleep(0.5)
        return opened, list(server.sessions)

    assert asyncio.run(go()) == (["gen-quiet"], [])


def resumable_setup(**kw):
    """Replicas whose engine has resumable requests (a segment opens an engine session there)."""
    codec, Scripted = scripted("a", " b c d e f")
    large = ModelServer("large", {"model": "toy:large"}, engine_cls=Scripted)
    small = ModelServer("small", {"model": "toy:small"}, engine_cls=Scripted)
    hl, hs = FakeHandle(large), FakeHandle(small)
    return ServeBackend(hl, hs, **kw), codec, (large, hl), (small, hs)


def test_a_router_that_dies_frees_its_leases_and_sessions_on_the_replicas_at_once():
    """A router's process dies: Serve does not cancel its lease calls, but its connections close.
    The leases it held end on the replicas (the small one too, taken ahead of any segment: it was
    attached when granted), and so do the engine sessions of its generations."""

    async def go():
        b, codec, (large, hl), (small, hs) = resumable_setup()
        b.prepare("gen-1", ["large", "small"])
        await run(
            b, SegmentRequest(model="large", prompt_token_ids=codec.encode("a"), max_tokens=2, session_id="gen-1")
        )
        b.prepare("gen-2", ["large", "small"])
        await asyncio.sleep(0.05)  # the leases are granted and attached
        before = (large.leases_held, small.leases_held, len(large.sessions))
        b.transport.pool.close()  # the process is gone: its sockets close; nobody cancels or releases
        for _ in range(100):
            if large.leases_held == small.leases_held == len(large.sessions) == 0:
                break
            await asyncio.sleep(0.01)
        after = (large.leases_held, small.leases_held, len(large.sessions))
        cancelled = [c.cancelled for c in hl.calls + hs.calls]
        return before, after, cancelled

    before, after, cancelled = asyncio.run(go())
    assert before == (2, 2, 1) and after == (0, 0, 0)
    assert not any(cancelled)  # the replicas ended the leases themselves


def test_a_lease_on_a_replica_out_of_rotation_ends_its_engine_session_there_when_replaced():
    async def go():
        rotation = {"in": True}
        b, codec, (large, hl), _ = resumable_setup()
        b.transport.in_rotation = lambda model, replica_id: rotation["in"]
        segment = SegmentRequest(model="large", prompt_token_ids=codec.encode("a"), max_tokens=2, session_id="gen-1")
        await run(b, segment)
        first = large.sessions.get("gen-1")
        rotation["in"] = False  # Serve drains the replica: the next segment takes a new lease
        await run(b, segment)
        await asyncio.sleep(0.05)
        return first, large.sessions.get("gen-1"), len(hl.calls), hl.calls[0].cancelled

    first, now, calls, cancelled = asyncio.run(go())
    # the one replica here is also where the new lease lands: the old session ended, a new one runs
    assert first is not None and now is not None and now is not first and calls == 2 and cancelled


def test_a_replica_with_a_pause_index_keeps_what_start_up_built_out_of_the_collectors_sight():
    """The pause index and what the engine built live as long as the replica: frozen after start-up,
    a full collection on the replica's loop does not walk them again. A replica without resumable
    requests (no index) leaves the collector alone."""
    import gc

    built_before = [object() for _ in range(3)]  # a container the collector tracks, made before start-up
    tracked = {id(o) for o in gc.get_objects()}
    assert id(built_before) in tracked
    try:
        resumable_setup()
        assert id(built_before) not in {id(o) for o in gc.get_objects()} and gc.get_freeze_count() > 0
        gc.unfreeze()
        replica("large")  # FakeEngine: no resumable requests
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
