"""What one call costs on each path a segment could take from a router to a model replica.

    python -m relay_serve.bench.calls [--n 300] [--json]

On a local Ray (Serve started in it), each path is timed on a trivial method, ``--n`` calls one
after another after a warm-up, idle and then with one core kept busy by another process:

- ``serve handle``: a Ray Serve deployment handle call (``await handle.ping.remote()``): Serve's
  request router, the replica's request wrapper and metrics, then Ray's actor call;
- ``ray actor``: a call to an async Ray actor (``await actor.ping.remote()``);
- ``tcp``: a round trip of a 64-byte frame to an echo server in an actor, over loopback TCP (what
  the segment channel, ``relay_serve/protocol.py``, pays per message besides its own work).

The figures behind the segment channel's design (docs/architecture.md, "The segment path").
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
from collections.abc import Awaitable, Callable

from pydantic import BaseModel

PATHS = ("serve handle", "ray actor", "tcp")


class CallCost(BaseModel):
    path: str
    idle_ms_median: float
    idle_ms_p90: float
    busy_ms_median: float
    busy_ms_p90: float


class CallsReport(BaseModel):
    n: int
    paths: list[CallCost]

    def table(self) -> str:
        lines = [
            f"{self.n} calls a path, one at a time; busy: another process keeps one core busy",
            "",
            "| path | idle, median (ms) | idle, p90 (ms) | one core busy, median (ms) | p90 (ms) |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {c.path} | {c.idle_ms_median} | {c.idle_ms_p90} | {c.busy_ms_median} | {c.busy_ms_p90} |"
            for c in self.paths
        ]
        return "\n".join(lines)


def _spin(stop) -> None:  # a process that keeps one core busy until told to stop
    while not stop.is_set():
        pass


async def _times(call: Callable[[], Awaitable[object]], n: int) -> list[float]:
    for _ in range(max(5, n // 10)):  # warm-up
        await call()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append(1000 * (time.perf_counter() - t0))
    return out


def _summary(times: list[float]) -> tuple[float, float]:
    return round(statistics.median(times), 3), round(statistics.quantiles(times, n=10)[-1], 3)


def run(n: int = 300) -> CallsReport:
    import ray
    from ray import serve

    from relay_serve.cluster import init_ray

    @serve.deployment(max_ongoing_requests=8)
    class Pinged:
        async def ping(self) -> int:
            return 0

    @ray.remote(num_cpus=0)
    class Echo:
        async def ping(self) -> int:
            return 0

        async def serve_tcp(self) -> int:
            async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                try:
                    while data := await reader.readexactly(64):
                        writer.write(data)
                        await writer.drain()
                except (asyncio.IncompleteReadError, ConnectionError):
                    writer.close()

            self._server = await asyncio.start_server(echo, "127.0.0.1", 0)
            return self._server.sockets[0].getsockname()[1]

    init_ray()
    handle = serve.run(Pinged.bind(), name="calls-bench", route_prefix=None)
    actor = Echo.remote()
    port = ray.get(actor.serve_tcp.remote())

    async def measure() -> dict[str, list[float]]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        frame = bytes(64)

        async def tcp() -> bytes:
            writer.write(frame)
            await writer.drain()
            return await reader.readexactly(64)

        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "serve handle": lambda: handle.ping.remote(),
            "ray actor": lambda: actor.ping.remote(),
            "tcp": tcp,
        }
        try:
            return {path: await _times(calls[path], n) for path in PATHS}
        finally:
            writer.close()

    try:
        idle = asyncio.run(measure())
        spawn = multiprocessing.get_context("spawn")  # no fork of a process with Ray's threads
        stop = spawn.Event()
        spinner = spawn.Process(target=_spin, args=(stop,), daemon=True)
        spinner.start()
        try:
            busy = asyncio.run(measure())
        finally:
            stop.set()
            spinner.join(timeout=10)
    finally:
        serve.delete("calls-bench")
        ray.kill(actor)
    paths = []
    for path in PATHS:
        (im, ip), (bm, bp) = _summary(idle[path]), _summary(busy[path])
        paths.append(CallCost(path=path, idle_ms_median=im, idle_ms_p90=ip, busy_ms_median=bm, busy_ms_p90=bp))
    return CallsReport(n=n, paths=paths)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m relay_serve.bench.calls", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300, help="calls a path (default 300)")
    parser.add_argument("--json", action="store_true", help="also print the report as one JSON line, last")
    args = parser.parse_args(argv)
    if args.n < 20:
        parser.error("--n: at least 20 calls a path")
    report = run(args.n)
    print(report.table())
    if args.json:
        print(report.model_dump_json())


if __name__ == "__main__":
    main()
