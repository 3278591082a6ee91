"""The segment channel over real loopback TCP: chunks in order, requests multiplexed on one
connection, cancellation both ways, a wrong token refused, failures reported to the right request,
a dead peer noticed at once, hostile frames survived."""

from __future__ import annotations

import asyncio
import struct

import pytest

from relay_serve.protocol import FRAME, MAX_FRAME_BYTES, ChannelError, RemoteError, pack
from relay_serve.replica.channel import SegmentServer
from relay_serve.router.channel import Channel, ChannelPool


class Runner:
    """A fake model replica: ``n`` chunks of one token each (all at once when not streamed)."""

    def __init__(self, delay_s: float = 0.0, fail_at: int | None = None) -> None:
        self.delay_s, self.fail_at = delay_s, fail_at
        self.cancelled: list[int] = []
        self.started: list[dict] = []
        self.peers: list = []
        self.ended: list[str] = []
        self.end_peers: list = []
        self.closed_peers: list = []

    async def end_session(self, session_id: str, peer=None) -> None:
        self.ended.append(session_id)
        self.end_peers.append(peer)

    async def peer_closed(self, peer) -> None:
        self.closed_peers.append(peer)

    async def segment(self, request: dict, stream: bool, peer=None):
        self.started.append(request)
        self.peers.append(peer)
        n = request["n"]
        try:
            if not stream:
                await asyncio.sleep(self.delay_s)
                yield {"token_ids": list(range(n)), "finished": True, "finish_reason": "length"}
                return
            for i in range(n):
                if self.fail_at == i:
                    raise RuntimeError("engine died")
                await asyncio.sleep(self.delay_s)
                yield {"token_ids": [request.get("base", 0) + i], "finished": i == n - 1}
        except asyncio.CancelledError:
            self.cancelled.append(n)
            raise


async def serve(runner, **kw) -> SegmentServer:
    server = SegmentServer(runner, host="127.0.0.1", **kw)
    await server.start()
    server.token = server.issue_token()  # as a lease would get one
    return server


async def connect(server: SegmentServer) -> Channel:
    """A connection opened with the server's lease token; its requests carry that token."""
    channel = await Channel.connect(server.address, server.token)
    channel.test_token = server.token
    return channel


async def collect(channel: Channel, request: dict, stream: bool = True, token: str | None = None) -> list[dict]:
    return [c async for c in channel.request(request, stream, token or channel.test_token)]


async def cancelled_soon(runner: Runner, within_s: float = 1.0) -> list[int]:
    """What the replica cancelled, once it cancelled something (or ``within_s`` passed)."""
    for _ in range(int(within_s / 0.01)):
        if runner.cancelled:
            break
        await asyncio.sleep(0.01)
    return runner.cancelled


def test_chunks_arrive_in_order_streamed_or_whole():
    async def go():
        server = await serve(Runner())
        channel = await connect(server)
        streamed = await collect(channel, {"n": 4})
        whole = await collect(channel, {"n": 3}, stream=False)
        channel.close()
        await server.close()
        return streamed, whole

    streamed, whole = asyncio.run(go())
    assert [c["token_ids"] for c in streamed] == [[0], [1], [2], [3]] and streamed[-1]["finished"]
    assert whole == [{"token_ids": [0, 1, 2], "finished": True, "finish_reason": "length"}]


def test_concurrent_requests_share_one_connection_without_mixing():
    async def go():
        server = await serve(Runner(delay_s=0.001))
        channel = await connect(server)
        outs = await asyncio.gather(*(collect(channel, {"n": 5, "base": 100 * k}) for k in range(8)))
        connections = server.connections
        channel.close()
        await server.close()
        return outs, connections

    outs, connections = asyncio.run(go())
    assert connections == 1
    for k, out in enumerate(outs):
        assert [c["token_ids"][0] for c in out] == [100 * k + i for i in range(5)]


def test_closing_a_request_early_cancels_it_on_the_replica():
    async def go():
        runner = Runner(delay_s=0.01)
        server = await serve(runner)
        channel = await connect(server)
        stream = channel.request({"n": 100}, True, server.token)
        await stream.__anext__()
        await stream.aclose()
        cancelled = await cancelled_soon(runner)
        after = await collect(channel, {"n": 2})  # the connection still serves
        channel.close()
        await server.close()
        return cancelled, after

    cancelled, after = asyncio.run(go())
    assert cancelled == [100] and len(after) == 2


def test_a_connection_without_the_token_is_refused():
    async def go():
        runner = Runner()
        server = await serve(runner)
        channel = await Channel.connect(server.address, "not-the-token")
        with pytest.raises(ChannelError, match="closed by the replica"):
            await collect(channel, {"n": 2}, token="not-the-token")
        return server.refused, runner.started

    refused, started = asyncio.run(go())
    assert refused == 1 and started == []


def test_a_failed_request_is_reported_to_it_alone():
    async def go():
        server = await serve(Runner(fail_at=1))
        channel = await connect(server)
        got = []
        with pytest.raises(RemoteError, match="RuntimeError: engine died"):
            async for chunk in channel.request({"n": 3}, True, server.token):
                got.append(chunk)
        server.handler = Runner()  # the replica recovers; the connection was never in question
        after = await collect(channel, {"n": 2})
        channel.close()
        await server.close()
        return got, after

    got, after = asyncio.run(go())
    assert len(got) == 1 and len(after) == 2


def test_a_replica_that_goes_away_fails_its_open_requests_at_once():
    async def go():
        server = await serve(Runner(delay_s=10))
        channel = await connect(server)
        task = asyncio.create_task(collect(channel, {"n": 5}))
        await asyncio.sleep(0.05)
        await server.close()  # stops listening and drops the connection, as a dead process would
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(ChannelError, match="ended"):
            await task
        took = asyncio.get_running_loop().time() - t0
        with pytest.raises(ChannelError):
            await collect(channel, {"n": 1})
        return took

    assert asyncio.run(go()) < 1.0


def test_a_router_that_goes_away_has_its_requests_aborted():
    async def go():
        runner = Runner(delay_s=0.01)
        server = await serve(runner)
        channel = await connect(server)
        stream = channel.request({"n": 1000}, True, server.token)
        await stream.__anext__()
        channel.close()  # the router's end of the connection closes
        cancelled = await cancelled_soon(runner)
        await server.close()
        return cancelled

    assert asyncio.run(go()) == [1000]


@pytest.mark.parametrize(
    "garbage",
    [
        FRAME.pack(MAX_FRAME_BYTES + 1),  # a frame too large to read
        FRAME.pack(3) + b"\xc1\xc1\xc1",  # not msgpack
        pack(["not", "a", "mapping"]),  # type: ignore[arg-type]
        b"\x00\x00",  # a cut-off header, then the connection closes
    ],
)
def test_hostile_frames_close_that_connection_only(garbage):
    async def go():
        server = await serve(Runner())
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(pack({"op": "hello", "token": server.token}) + garbage)
        await writer.drain()
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the replica closed it, answering nothing
        channel = await connect(server)
        out = await collect(channel, {"n": 2})
        channel.close()
        await server.close()
        return out

    assert len(asyncio.run(go())) == 2


def test_a_request_that_is_not_a_mapping_is_an_error_for_that_request():
    async def go():
        server = await serve(Runner())
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            pack({"op": "hello", "token": server.token})
            + pack({"op": "generate", "id": 7, "token": server.token, "request": [1, 2]})
        )
        (size,) = struct.unpack("!I", await reader.readexactly(4))
        import msgspec

        reply = msgspec.msgpack.decode(await reader.readexactly(size))
        writer.close()
        await server.close()
        return reply

    reply = asyncio.run(go())
    assert reply["id"] == 7 and "not a mapping" in reply["error"]


def test_a_duplicate_request_id_is_an_error_for_that_id_and_the_connection_serves_on():
    async def go():
        runner = Runner(delay_s=0.05)
        server = await serve(runner)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        generate = {"op": "generate", "id": 3, "token": server.token, "request": {"n": 4}, "stream": True}
        writer.write(pack({"op": "hello", "token": server.token}) + pack(generate) + pack(generate))
        import msgspec

        replies = []
        while not any(r.get("chunk", {}).get("finished") for r in replies):
            (size,) = struct.unpack("!I", await reader.readexactly(4))
            replies.append(msgspec.msgpack.decode(await reader.readexactly(size)))
        writer.write(pack({**generate, "id": 4, "request": {"n": 1}}))  # the same connection serves on
        (size,) = struct.unpack("!I", await reader.readexactly(4))
        after = msgspec.msgpack.decode(await reader.readexactly(size))
        writer.close()
        await server.close()
        return replies, after

    replies, after = asyncio.run(go())
    errors = [r for r in replies if "error" in r]
    assert len(errors) == 1 and "already running" in errors[0]["error"]
    assert [r["chunk"]["token_ids"] for r in replies if "chunk" in r] == [
        [0],
        [1],
        [2],
        [3],
    ]  # the first ran to its end
    assert after["id"] == 4 and after["chunk"]["finished"]


def test_a_connection_ends_only_its_own_sessions():
    from relay_serve.replica.model_server import ModelServer
    from tests.serve.test_transport import FakeEngine

    async def go():
        server = ModelServer("large", {"model": "toy:large"}, engine_cls=FakeEngine)
        server.sessions["gen-1"] = session = type("S", (), {"closed": False})()

        async def close():
            session.closed = True

        session.close = close
        server._session_peers["gen-1"] = "conn-a"
        await server.end_session("gen-1", "conn-b")  # another router's connection
        kept = "gen-1" in server.sessions and not session.closed
        await server.end_session("gen-1", "conn-a")
        return kept, "gen-1" in server.sessions, session.closed

    assert asyncio.run(go()) == (True, False, True)


def test_the_pool_opens_one_connection_per_replica_and_reopens_a_dropped_one():
    async def go():
        server = await serve(Runner())
        pool = ChannelPool()
        a, b = await asyncio.gather(pool.get(server.address, server.token), pool.get(server.address, server.token))
        same = a is b and len(pool) == 1
        pool.drop(server.address, "a test")
        assert a.closed is not None
        c = await pool.get(server.address, server.token)
        out = await collect(c, {"n": 1}, token=server.token)
        pool.close()
        await server.close()
        return same, c is not a, out, server.connections

    same, fresh, out, connections = asyncio.run(go())
    assert same and fresh and len(out) == 1 and connections == 2


def test_connecting_to_nobody_is_a_channel_error():
    async def go():
        server = await serve(Runner())
        address = server.address
        await server.close()
        with pytest.raises(ChannelError, match="cannot connect"):
            await ChannelPool().get(address, "x")

    asyncio.run(go())


def test_a_generation_end_reaches_the_replica_and_a_closed_connection_ends_its_peer():
    async def go():
        runner = Runner()
        server = await serve(runner)
        channel = await connect(server)
        await collect(channel, {"n": 2})
        channel.end_session("gen-7")
        await collect(channel, {"n": 1})  # the end was read before this request
        assert runner.ended == ["gen-7"] and runner.peers[0] == runner.peers[1] == runner.end_peers[0] is not None
        channel.close()
        for _ in range(100):
            if runner.closed_peers:
                break
            await asyncio.sleep(0.01)
        assert runner.closed_peers == [runner.peers[0]]
        await server.close()

    asyncio.run(go())


def test_a_token_dies_with_its_lease():
    """A lease's token opens connections and admits segments only while the lease lives: one seen
    once cannot get past Serve's admission later."""

    async def go():
        server = await serve(Runner())
        other = server.issue_token()  # another lease, still live
        channel = await connect(server)
        assert len(await collect(channel, {"n": 2}, token=server.token)) == 2
        server.revoke_token(server.token)  # its lease ended
        with pytest.raises(RemoteError, match="LeaseExpired"):
            await collect(channel, {"n": 2}, token=server.token)
        assert len(await collect(channel, {"n": 1}, token=other)) == 1  # the connection serves live leases
        stale = await connect(server)
        with pytest.raises(ChannelError):
            await collect(stale, {"n": 1}, token=other)
        channel.close()
        await server.close()
        return server.refused

    assert asyncio.run(go()) == 1


def test_a_connection_may_not_send_a_big_frame_before_its_hello_is_checked():
    async def go():
        server = await serve(Runner())
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(struct.pack("!I", 1 << 20))  # announces a 1 MiB first frame
        closed = await asyncio.wait_for(reader.read(), 2)  # the replica closes without reading it
        writer.close()
        await server.close()
        return closed, server.refused, server.connections

    assert asyncio.run(go()) == (b"", 1, 0)


def test_a_cancelled_connect_does_not_fail_the_others_waiting_on_it():
    async def go():
        server = await serve(Runner())
        pool = ChannelPool()
        first = asyncio.create_task(pool.get(server.address, server.token))
        second = asyncio.create_task(pool.get(server.address, server.token))
        await asyncio.sleep(0)
        first.cancel()  # the generation that started the connect went away
        channel = await second
        out = await collect(channel, {"n": 2}, token=server.token)
        pool.close()
        await server.close()
        return first.cancelled(), len(out)

    assert asyncio.run(go()) == (True, 2)


def test_a_request_nobody_reads_fails_instead_of_growing_without_end(monkeypatch):
    from relay_serve.router import channel as channel_module

    monkeypatch.setattr(channel_module, "MAX_PENDING_CHUNKS", 5)

    async def go():
        runner = Runner()
        server = await serve(runner)
        channel = await connect(server)
        unread = channel.request({"n": 50}, True, server.token)
        await unread.__anext__()  # sent; then nobody reads
        for _ in range(100):
            if runner.cancelled:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(ChannelError, match="were not read"):
            async for _ in unread:
                pass
        other = await collect(channel, {"n": 3}, token=server.token)  # the connection goes on
        channel.close()
        await server.close()
        return runner.cancelled, len(other)

    cancelled, other = asyncio.run(go())
    assert cancelled == [50] and other == 3


def test_leases_end_when_a_connection_they_were_used_on_closes():
    """A router that dies closes its connections: the leases it used on them (by its hello, an
    attach, or a segment) end there, while a lease used elsewhere or never lives on."""

    async def ended(server, token, within_s=1.0) -> bool:
        try:
            await asyncio.wait_for(server.lease_ended(token), within_s)
            return True
        except TimeoutError:
            return False

    async def go():
        server = await serve(Runner())
        attached, used, elsewhere, unused = (server.issue_token() for _ in range(4))
        channel = await connect(server)  # hello with server.token
        channel.attach(attached)
        await collect(channel, {"n": 1}, token=used)
        other = await Channel.connect(server.address, elsewhere)
        await collect(other, {"n": 1}, token=elsewhere)
        assert not await ended(server, server.token, within_s=0.1)  # the connection is open: the lease lives
        channel.close()
        results = [await ended(server, t) for t in (server.token, attached, used)]
        lives_on = [await ended(server, t, within_s=0.2) for t in (elsewhere, unused)]
        assert len(await collect(other, {"n": 1}, token=elsewhere)) == 1
        other.close()
        await server.close()
        return results, lives_on

    results, lives_on = asyncio.run(go())
    assert results == [True, True, True] and lives_on == [False, False]
