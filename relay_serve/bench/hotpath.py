"""The router's and the model replica's own work per handoff, at the size of a real pair.

    python -m relay_serve.bench.hotpath [--contexts 1k,8k,32k] [--tokens 512] [--repeats 3] [--json]

The real router (HTTP API, generations, relay policy, session, transport over the replica's
channel) and the real model replica code (``ModelServer``: channel server, resumable engine
sessions, pause tokens, stop checks) serve relay requests over a vocabulary of Qwen3's size
(151,936 token texts, ``relay_serve/toy/vocab.py``, with a tokenizer made from them). The engine is
a stand-in that writes a fixed reasoning trace instantly, so what is measured is only what
relay-serve adds: the CPU time of the router's thread (its event loop, in this process) and of the
replicas' (both model replicas on the event loop of a process of their own, spawned, that answers
what the router calls on their deployment handles: as in production, router and replicas share no
interpreter), per switch between the models and per generated token, at contexts (prompt and what
came before) of 1k, 8k and 32k tokens. Each request generates ``--tokens`` tokens with a cue every
few sentences; a figure is the median of ``--repeats`` requests after one warm-up, the contexts
taking turns request by request (a slow spell of a shared machine hits them alike, so their ratios
hold). The replicas' CPU a segment is all their process's thread spent during the request over its
segments; it also times each segment's handling (``ModelServer.segment``) alone, the first of a
generation on a model (which carries the prompt: the context's one transfer) apart from those that
continue its session (which carry only what is new).

Also: how long the pause-token index of the vocabulary takes to build (once per replica), and
what the pause ids of a stop list never seen before cost (16 stops, as a client's ``stop`` and
``relay_cues`` can make), against the scan of every token text that the index replaced, and of a
list of 16 stops of 64 characters, and how many tokens pause for each. A replica finds a list it
has not seen in a worker thread, off its event loop (``PauseTokens.lookup``). Last, a full
collection of the replicas' process, with what their start-up built frozen (as ``ModelServer``
leaves it) and unfrozen.

The router tokenizes a request's prompt once; a long one (``OFF_LOOP_PROMPT_CHARS``) in a worker
thread, off its event loop and so outside the router thread's CPU measured here: what it costs is
reported apart (``prompt_tokenize_ms``, the prompt's ``encode`` timed alone).

With ``--json`` the last line is ``{"vocab_size", "index_build_s", "pause_ids_ms",
"pause_ids_scan_ms", "pause_ids_64_chars_ms", "router_cpu_ms_per_switch": {"1k", "8k", "32k"},
"replica_cpu_ms_per_segment": {...}, "replica_segment_handling_ms": {"1k": {"first", "continuing"}, ...},
"router_cpu_us_per_token": {...},
"replica_cpu_us_per_token": {...}, "switches_per_request": {...}, "prompt_tokenize_ms": {...},
"pause_ids_count", "pause_ids_64_chars_count", "full_collection_ms": {"frozen", "unfrozen"}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Collection, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from relay_serve.config import CueSettings
from relay_serve.engine.base import ChunkOutput, Engine, EngineInfo, ResumableRequest
from relay_serve.protocol import EngineChunk, SamplingSettings, SegmentRequest, pack, read_message
from relay_serve.relay.detok import TokenStream

CUES = tuple(
    CueSettings.model_fields["default_cues"].default_factory()
)  # the service's default cue set, which the bench serves with


class HotpathReport(BaseModel):
    vocab_size: int
    index_build_s: float
    pause_ids_ms: float
    pause_ids_scan_ms: float
    pause_ids_64_chars_ms: float
    tokens_per_request: int
    router_cpu_ms_per_switch: dict[str, float]
    replica_cpu_ms_per_segment: dict[str, float]
    replica_segment_handling_ms: dict[str, dict[str, float]]
    router_cpu_us_per_token: dict[str, float]
    replica_cpu_us_per_token: dict[str, float]
    switches_per_request: dict[str, float]
    prompt_tokenize_ms: dict[str, float]
    pause_ids_count: int
    pause_ids_64_chars_count: int
    full_collection_ms: dict[str, float]


# ---- the stand-in engine ---------------------------------------------------------------------

_TRACES: dict[tuple[int, ...], list[int]] = {}  # by their first tokens: traces (prompt included) the stand-in writes
_KEY = 16


class InstantEngine(Engine):
    """Writes the tokens of a fixed trace at once: the trace that starts as the request's context
    does (``_TRACES``, by the first tokens); at a context of ``n`` tokens, the next is the trace's
    ``n``-th. Resumable requests only (the default path)."""

    def __init__(self, model: str, tokenizer: str | None = None, engine_args: dict[str, Any] | None = None) -> None:
        from relay_serve.tokenizer import load_codec
        from relay_serve.toy.vocab import synthetic_vocab

        self.codec = load_codec(str(tokenizer))
        self.texts = list(synthetic_vocab())
        self.max_model_len = int((engine_args or {}).get("max_model_len", 40960))

    def can_resume(self) -> bool:
        return True

    def resumable(self, request_id: str) -> ResumableRequest:
        return _InstantRequest()

    def generate(self, request: SegmentRequest, request_id: str, stream: bool = True) -> AsyncIterator[EngineChunk]:
        raise NotImplementedError("the hot-path bench runs resumable segments only (router.resumable_requests)")

    def token_texts(self) -> list[str]:
        return self.texts

    def decode(self, token_ids: list[int]) -> str:
        return self.codec.decode(token_ids)

    def stream(self, context: Sequence[int] = ()) -> TokenStream:
        return self.codec.stream(context)

    def info(self) -> EngineInfo:
        return EngineInfo(
            model="instant", max_model_len=self.max_model_len, tokenizer_fingerprint=self.codec.fingerprint
        )

    async def check_health(self) -> None:
        pass


class _InstantRequest(ResumableRequest):
    def __init__(self) -> None:
        self.trace: list[int] = []
        self.held = 0

    async def chunk(
        self,
        token_ids: list[int],
        max_tokens: int,
        pause_ids: Collection[int],
        sampling: SamplingSettings,
        continued: bool = False,
    ) -> AsyncIterator[ChunkOutput]:
        if not self.held:
            self.trace = _TRACES[tuple(token_ids[:_KEY])]
        self.held += len(token_ids)
        for n in range(max_tokens):
            if self.held >= len(self.trace):
                yield ChunkOutput([], finish="stop", eos=True)
                return
            tid = self.trace[self.held]
            await asyncio.sleep(0)  # one engine output a token, as vLLM's output handler yields
            if tid in pause_ids or n == max_tokens - 1:
                yield ChunkOutput([tid], finish="stop" if tid in pause_ids else "length", decode_steps=n)
                return  # the last token sampled is not held (a next chunk feeds it)
            self.held += 1
            yield ChunkOutput([tid], decode_steps=1)

    async def close(self) -> None:
        pass


# ---- the replicas' process, and handles into it -------------------------------------------------


def _replicas_main(conn, models: dict[str, dict], traces: dict[tuple[int, ...], list[int]]) -> None:
    """The replicas' process: both model replicas (``ModelServer`` over the stand-in engine) on its
    event loop, and a loopback server (the segment channel's frames, ``protocol.pack``) for what
    the router calls on their deployment handles
    (``lease``, ``info``, ``tokenizer_files``) and for the bench (``cpu``: this loop's thread CPU;
    ``collection``: a full collection's cost here)."""
    _TRACES.update(traces)

    async def main() -> None:
        from relay_serve.replica.model_server import ModelServer

        servers = {role: ModelServer(role, models[role], engine_cls=InstantEngine) for role in models}
        clock = _SegmentClock()
        for server in servers.values():
            server.segment = clock.timed(server.segment)  # type: ignore[method-assign]
        stop = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            tasks: dict[int, asyncio.Task] = {}

            def send(message: dict[str, Any]) -> None:
                if not writer.is_closing():
                    writer.write(pack(message))

            async def run(rid: int, role: str, method: str, args: tuple) -> None:
                try:
                    if method == "cpu":
                        send({"id": rid, "result": time.thread_time()})
                    elif method == "segments":
                        send({"id": rid, "result": clock.take()})
                    elif method == "collection":
                        send({"id": rid, "result": full_collection_ms()})
                    elif method == "lease":
                        async with contextlib.aclosing(servers[role].lease(*args)) as items:
                            async for item in items:
                                send({"id": rid, "item": item})
                        send({"id": rid, "end": True})
                    else:
                        send({"id": rid, "result": await getattr(servers[role], method)(*args)})
                except Exception as e:  # noqa: BLE001 - the caller's error
                    send({"id": rid, "error": f"{type(e).__name__}: {e}"})
                finally:
                    tasks.pop(rid, None)

            try:
                while True:
                    message = await read_message(reader)
                    if message.get("stop"):
                        stop.set()
                        return
                    if message.get("cancel"):
                        if (task := tasks.get(message["id"])) is not None:
                            task.cancel()
                        continue
                    rid = message["id"]
                    tasks[rid] = asyncio.create_task(run(rid, message["role"], message["method"], message["args"]))
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                for task in list(tasks.values()):
                    task.cancel()
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        conn.send({"port": server.sockets[0].getsockname()[1]})
        await stop.wait()
        server.close()

    try:
        asyncio.run(main())
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
        raise


class _SegmentClock:
    """The thread CPU of each segment's handling on the replicas' loop (``ModelServer.segment``:
    the request's check, the engine session, the stop checks, the stand-in engine; not the
    channel's reading of its frame nor the writing of its chunks), the first segment of a
    generation on a model (``context_base`` 0: it carries the whole context) apart from those that
    continue its session. Time the loop spends elsewhere while a segment waits is counted too: the
    bench runs one request at a time, so there is little."""

    def __init__(self) -> None:
        self.first: list[float] = []
        self.continuing: list[float] = []

    def timed(self, segment):
        async def timed_segment(request: dict[str, Any], stream: Any, peer: Any = None) -> AsyncIterator[dict]:
            spent = 0.0
            chunks = segment(request, stream, peer)
            try:
                while True:
                    t0 = time.thread_time()
                    try:
                        chunk = await chunks.__anext__()
                    except StopAsyncIteration:
                        return
                    finally:
                        spent += time.thread_time() - t0
                    yield chunk
            finally:
                await chunks.aclose()
                (self.continuing if request.get("context_base") else self.first).append(spent)

        return timed_segment

    def take(self) -> dict[str, list[float]]:
        """The segments timed since the last call (s)."""
        out = {"first": self.first, "continuing": self.continuing}
        self.first, self.continuing = [], []
        return out


class _ReplicasProcess:
    """The model replicas in a process of their own, as in production (a replica is a process of
    its own; here both share one, on one event loop), and calls into it from the router's loop."""

    def __init__(self, models: dict[str, dict], traces: dict[tuple[int, ...], list[int]]) -> None:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self.process = context.Process(target=_replicas_main, args=(child, models, traces), daemon=True)
        self.process.start()
        if not parent.poll(600):
            self.process.kill()
            raise RuntimeError("the replicas' process did not start in 600 s")
        started = parent.recv()
        if "error" in started:
            raise RuntimeError(f"the replicas' process failed to start: {started['error']}")
        self.port: int = started["port"]
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Queue] = {}
        self._ids = itertools.count()

    async def _connect(self) -> None:
        if self._writer is None:
            reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)
            self._read_task = asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await read_message(reader)
                if (queue := self._pending.get(message["id"])) is not None:
                    queue.put_nowait(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            for queue in self._pending.values():
                queue.put_nowait({"error": "the replicas' process closed the connection"})

    async def open(self, role: str, method: str, args: tuple) -> tuple[int, asyncio.Queue]:
        await self._connect()
        rid, queue = next(self._ids), asyncio.Queue[dict[str, Any]]()
        self._pending[rid] = queue
        self.send({"id": rid, "role": role, "method": method, "args": args})
        return rid, queue

    def send(self, message: dict[str, Any]) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(pack(message))

    def done(self, rid: int) -> None:
        self._pending.pop(rid, None)

    async def call(self, role: str, method: str, args: tuple = ()) -> Any:
        rid, queue = await self.open(role, method, args)
        try:
            message = await queue.get()
        finally:
            self.done(rid)
        if "error" in message:
            raise RuntimeError(message["error"])
        return message["result"]

    async def stop(self) -> None:
        self.send({"stop": True})
        if self._writer is not None:
            self._writer.close()
        await asyncio.to_thread(self.process.join, 60)
        if self.process.is_alive():
            self.process.kill()


class _Stream:
    """A streaming handle call (``lease``) answered by the replicas' process."""

    def __init__(self, replicas: _ReplicasProcess, role: str, args: tuple) -> None:
        self.replicas, self.role, self.args = replicas, role, args
        self._rid: int | None = None
        self._queue: asyncio.Queue | None = None
        self._cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._cancelled:
            raise asyncio.CancelledError
        if self._queue is None:
            self._rid, self._queue = await self.replicas.open(self.role, "lease", self.args)
        message = await self._queue.get()
        if "item" in message:
            return message["item"]
        if self._rid is not None:
            self.replicas.done(self._rid)
        if message.get("cancelled"):
            raise asyncio.CancelledError
        if "error" in message:
            raise RuntimeError(message["error"])
        raise StopAsyncIteration

    def cancel(self) -> None:
        self._cancelled = True
        if self._queue is not None:
            self.replicas.send({"id": self._rid, "cancel": True})
            self._queue.put_nowait({"cancelled": True})


class _Handle:
    """What the router calls on a deployment handle (``lease``, ``info``, ``tokenizer_files``),
    answered by the replicas' process."""

    def __init__(self, replicas: _ReplicasProcess, role: str, method: str = "info") -> None:
        self.replicas, self.role, self._method = replicas, role, method

    def options(self, method_name: str, stream: bool = False, **_: Any) -> _Handle:
        return _Handle(self.replicas, self.role, method_name)

    @property
    def info(self) -> _Handle:
        return self.options("info")

    def remote(self, *args: Any):
        if self._method == "lease":
            return _Stream(self.replicas, self.role, args)
        return asyncio.ensure_future(self.replicas.call(self.role, self._method, args))


# ---- the trace -----------------------------------------------------------------------------------


def _sentence(rng: random.Random, words: list[str]) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(6, 14))) + rng.choice((".\n\n", ". "))


def make_trace(codec, context_tokens: int, tokens: int, seed: int = 0) -> tuple[str, list[int]]:
    """A prompt of about ``context_tokens`` tokens (drawn by ``seed``), and the prompt's ids
    followed by a reasoning trace of at least ``tokens`` tokens whose every third sentence opens
    with a cue: the same trace after every prompt, so that contexts differ in their length only
    (the pauses and switches a trace makes are its own)."""
    from relay_serve.toy.vocab import synthetic_vocab

    rng = random.Random(seed)
    words = [t.strip() for t in synthetic_vocab()[1000:30000] if t.strip().isalpha() and t.isascii()]
    prompt = ""
    while len(codec.encode(prompt)) < context_tokens - 40:
        prompt += "".join(_sentence(rng, words) for _ in range(50))
    ids = codec.encode(prompt)[: context_tokens - 40]
    prompt = codec.decode(ids) + "\n\n<think>\n"
    trace, k, rng = "", 0, random.Random(tokens)
    while len(codec.encode(trace)) < tokens + 64:
        trace += (rng.choice(CUES) + " " if k % 3 == 2 else "") + _sentence(rng, words)
        k += 1
    return prompt, codec.encode(prompt + trace + "</think>\n\nThe answer is 42.")


# ---- the measurement -----------------------------------------------------------------------------


def pause_ids_cost(texts: list[str], lists: int = 9) -> tuple[float, float, float, float, int, int]:
    """Index build time (s); the pause ids of a never-seen list of 16 stops by the index (ms, the
    median of ``lists`` such lists) and by a scan of every text (ms, the first list, whose ids
    must be the index's); those of a never-seen list of 16 stops of 64 characters (ms, the median
    of ``lists``); how many tokens pause for each kind of list (the median)."""
    from relay_serve.engine.stops import PauseTokens, scan_pause_ids

    t0 = time.perf_counter()
    pauses = PauseTokens(texts)
    build_s = time.perf_counter() - t0
    rng = random.Random(1)
    word_stops = frozenset(CUES)
    index_ms, long_ms, counts, long_counts = [], [], [], []
    for k in range(lists):
        stops = tuple(rng.choice(texts[1000:-100]).strip() + ", " for _ in range(12)) + CUES
        t0 = time.perf_counter()
        found = pauses.ids(stops, word_stops)
        index_ms.append((time.perf_counter() - t0) * 1e3)
        counts.append(len(found))
        if k == 0:
            t0 = time.perf_counter()
            scanned = scan_pause_ids(texts, stops, word_stops, found.ahead)
            scan_ms = (time.perf_counter() - t0) * 1e3
            if scanned != found:
                raise AssertionError(f"the index found {len(found)} pause ids and the scan {len(scanned)}")
    for _ in range(lists):  # sentences of vocabulary words cut at 64 characters; a quarter end in ", " (looked ahead)
        words = [t.strip() for t in rng.sample(texts[1000:-100], 16 * 16)]
        long = tuple(
            (" ".join(words[16 * k : 16 * k + 16])[:62] + ", ")
            if k % 4 == 0
            else " ".join(words[16 * k : 16 * k + 16])[:64]
            for k in range(16)
        )
        t0 = time.perf_counter()
        long_counts.append(len(pauses.ids(long)))
        long_ms.append((time.perf_counter() - t0) * 1e3)
    return (
        build_s,
        statistics.median(index_ms),
        scan_ms,
        statistics.median(long_ms),
        int(statistics.median(counts)),
        int(statistics.median(long_counts)),
    )


def full_collection_ms() -> dict[str, float]:
    """A full collection of this process (the replicas': it holds the modules a replica imports
    and two pause indexes) with what the replicas' start-up built frozen, as a ``ModelServer``
    leaves it, and unfrozen (ms); the run's garbage is collected first."""
    import gc

    gc.collect()
    t0 = time.perf_counter()
    gc.collect()
    frozen = (time.perf_counter() - t0) * 1e3
    gc.unfreeze()
    t0 = time.perf_counter()
    gc.collect()
    unfrozen = (time.perf_counter() - t0) * 1e3
    return {"frozen": round(frozen, 1), "unfrozen": round(unfrozen, 1)}


def measure(contexts: dict[str, int], tokens: int, repeats: int, progress=print) -> HotpathReport:
    import httpx

    from relay_serve.router.backend import ServeBackend
    from relay_serve.router.ingress import RelayRouter
    from relay_serve.tokenizer import load_codec
    from relay_serve.toy.vocab import synthetic_vocab, write_tokenizer

    texts = list(synthetic_vocab())
    build_s, index_ms, scan_ms, long_ms, count, long_count = pause_ids_cost(texts)
    progress(
        f"pause-token index: built in {build_s:.2f} s; a new list of 16 stops {index_ms:.2f} ms (a scan: {scan_ms:.0f} "
        f"ms), {count} tokens pause; of 16 stops of 64 characters {long_ms:.2f} ms, {long_count} tokens pause"
    )
    work = Path(tempfile.mkdtemp(prefix="relay-hotpath-"))
    tok_dir = write_tokenizer(work / "tokenizer")
    codec = load_codec(str(tok_dir))
    longest = max(contexts.values()) + tokens + 512
    engine_args = {"max_model_len": longest}
    models = {
        role: {"model": f"hotpath/{role}", "tokenizer": str(tok_dir), "engine_args": engine_args}
        for role in ("large", "small")
    }
    cfg = {
        "name": "hotpath",
        **models,
        "router": {"session_affinity": True},
        "cues": {"store_uri": (work / "cues").as_uri(), "online": {"enabled": False}},
    }
    prompts = {}
    for label, context in contexts.items():
        prompt, trace = make_trace(codec, context, tokens, seed=context)
        _TRACES[tuple(trace[:_KEY])] = trace
        prompts[label] = prompt
    replicas = _ReplicasProcess(models, dict(_TRACES))
    backend = ServeBackend(_Handle(replicas, "large"), _Handle(replicas, "small"))
    router = RelayRouter(cfg, backend=backend)

    async def one(client, prompt: str) -> tuple[float, float, dict]:
        body = {"model": "relay", "prompt": prompt, "max_tokens": tokens, "temperature": 0.0}
        await replicas.call("", "segments")  # what came before this request is not its own
        p0 = await replicas.call("", "cpu")
        r0 = time.thread_time()
        resp = await client.post("/v1/completions", json=body)
        r1 = time.thread_time()
        p1 = await replicas.call("", "cpu")
        if resp.status_code != 200:
            raise RuntimeError(f"the router answered {resp.status_code}: {resp.text}")
        segments = await replicas.call("", "segments")
        return r1 - r0, p1 - p0, {**resp.json()["usage"], "segment_cpu": segments}

    per: dict[str, dict[str, float]] = {
        k: {} for k in ("switch", "segment", "router_tok", "replica_tok", "switches", "tokenize", "first", "continuing")
    }
    for label, prompt in prompts.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            codec.encode(prompt)
            times.append((time.perf_counter() - t0) * 1e3)
        per["tokenize"][label] = round(statistics.median(times), 2)

    async def run_all() -> None:
        transport = httpx.ASGITransport(app=router.api)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://hotpath", timeout=600) as client:
                measured: dict[str, list[tuple[float, float, dict]]] = {label: [] for label in contexts}
                for i in range(repeats + 1):  # the contexts take turns, so a slow spell of the machine hits them alike
                    for label in contexts:
                        run = await one(client, prompts[label])
                        if i > 0:  # the first round warms caches (the pause ids of the request's stops among them)
                            measured[label].append(run)
                for label, runs in measured.items():
                    per["switches"][label] = statistics.median(u["relay"]["switches"] for _, _, u in runs)
                    per["switch"][label] = (
                        statistics.median(r / max(1, u["relay"]["switches"]) for r, _, u in runs) * 1e3
                    )
                    per["segment"][label] = (
                        statistics.median(p / max(1, u["relay"]["segments"]) for _, p, u in runs) * 1e3
                    )
                    per["first"][label] = (
                        statistics.median(t for *_, u in runs for t in u["segment_cpu"]["first"]) * 1e3
                    )
                    per["continuing"][label] = (
                        statistics.median(t for *_, u in runs for t in u["segment_cpu"]["continuing"]) * 1e3
                    )
                    per["router_tok"][label] = statistics.median(r / u["completion_tokens"] for r, _, u in runs) * 1e6
                    per["replica_tok"][label] = statistics.median(p / u["completion_tokens"] for _, p, u in runs) * 1e6
                    progress(
                        f"context {label}: {per['switches'][label]:.0f} switches a request; router "
                        f"{per['switch'][label]:.2f} ms "
                        f"CPU a switch, replicas {per['segment'][label]:.2f} ms CPU a segment (handling a generation's "
                        f"first on a model {per['first'][label]:.2f} ms, one that continues it "
                        f"{per['continuing'][label]:.2f} ms); per token "
                        f"{per['router_tok'][label]:.0f} and {per['replica_tok'][label]:.0f} us; the prompt's "
                        "tokenization "
                        f"{per['tokenize'][label]:.1f} ms a request"
                    )
        finally:
            backend.close()  # the leases go back; their calls end in the replicas' process
            await asyncio.sleep(0.2)
            try:
                collection.update(await replicas.call("", "collection"))
            finally:
                await replicas.stop()

    collection: dict[str, float] = {}
    asyncio.run(run_all())
    progress(
        f"a full collection of the replicas' process: {collection['frozen']} ms as the replicas leave it, "
        f"{collection['unfrozen']} ms unfrozen"
    )
    return HotpathReport(
        vocab_size=len(texts),
        index_build_s=round(build_s, 3),
        pause_ids_ms=round(index_ms, 3),
        pause_ids_scan_ms=round(scan_ms, 1),
        pause_ids_64_chars_ms=round(long_ms, 3),
        tokens_per_request=tokens,
        router_cpu_ms_per_switch={k: round(v, 3) for k, v in per["switch"].items()},
        replica_cpu_ms_per_segment={k: round(v, 3) for k, v in per["segment"].items()},
        replica_segment_handling_ms={
            k: {"first": round(per["first"][k], 3), "continuing": round(per["continuing"][k], 3)} for k in per["first"]
        },
        router_cpu_us_per_token={k: round(v, 1) for k, v in per["router_tok"].items()},
        replica_cpu_us_per_token={k: round(v, 1) for k, v in per["replica_tok"].items()},
        switches_per_request=per["switches"],
        prompt_tokenize_ms=per["tokenize"],
        pause_ids_count=count,
        pause_ids_64_chars_count=long_count,
        full_collection_ms=collection,
    )


def parse_contexts(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        n = int(float(part[:-1]) * 1024) if part.endswith("k") else int(part)
        if n < 256:
            raise argparse.ArgumentTypeError(f"--contexts: {part!r} is under 256 tokens")
        out[part] = n
    if not out:
        raise argparse.ArgumentTypeError("--contexts: no context given")
    return out


def main(argv: list[str] | None = None) -> None:
    import logging

    parser = argparse.ArgumentParser(prog="python -m relay_serve.bench.hotpath", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--contexts", type=parse_contexts, default=parse_contexts("1k,8k,32k"), help="prompt sizes, e.g. 1k,8k,32k"
    )
    parser.add_argument("--tokens", type=int, default=512, help="tokens generated a request")
    parser.add_argument("--repeats", type=int, default=3, help="requests measured at each context (after one warm-up)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on the last line")
    args = parser.parse_args(argv)
    if args.tokens < 64 or args.repeats < 1:
        parser.error("--tokens must be at least 64 and --repeats at least 1")
    logging.basicConfig(level=logging.WARNING)
    report = measure(args.contexts, args.tokens, args.repeats, progress=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(report.model_dump()))
    else:
        print(report.model_dump_json(indent=2))


if __name__ == "__main__":
    main()
