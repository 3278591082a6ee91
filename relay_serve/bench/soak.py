"""A bounded soak: C clients send back-to-back requests for D seconds (mostly streamed relay
requests, some of every other mode), then the router's state is compared with its state before.

Pass: no request failed, and once the clients stop, the router has nothing in flight and its
count of generations pinned to replicas (generations holding leases, or the affinity map of the handle
transport) is back to where it was before the run. "Before" follows a warm-up at full load
(a quarter of the duration, at most 20 s). The router's resident memory before, at its peak, at
the end and after is reported, with the number of memory blocks Python has allocated (which a
leak of Python objects grows); Python rarely hands freed memory back to the OS, so RSS is a
figure to watch rather than a pass condition.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from pydantic import BaseModel, Field

from relay_serve.bench.report import pct
from relay_serve.client import api_headers, chat_body, http_client
from relay_serve.config import PaperSampling


class SoakSettings(BaseModel):
    clients: int = Field(64, ge=1, le=4096)
    duration_s: float = Field(120.0, gt=0.0)
    max_tokens: int = Field(256, ge=1)
    settle_s: float = Field(15.0, ge=0.0, description="wait after the clients stop before the last look at the router")
    seed: int = 0


def _body(rng: random.Random, prompt: str, s: SoakSettings) -> dict[str, Any]:
    mode = rng.choices(["relay", "large", "small", "speculative-thinking"], weights=[7, 1, 1, 1])[0]
    paper = PaperSampling()
    return chat_body(
        mode,
        prompt,
        max_tokens=s.max_tokens,
        temperature=paper.temperature,
        top_p=paper.top_p,
        top_k=paper.top_k,
        seed=rng.randrange(2**31),
        stream=True if rng.random() < 0.7 else None,
    )


async def _one(client, base: str, body: dict) -> tuple[bool, str | None, int]:
    """(ok, error, completion characters) of one request; a streamed one must end in [DONE]."""
    url = base + "/v1/chat/completions"
    if not body.get("stream"):
        r = await client.post(url, json=body)
        if r.status_code != 200:
            return False, f"HTTP {r.status_code}: {r.text[:200]}", 0
        return True, None, len(r.json()["choices"][0]["message"]["content"])
    chars, done = 0, False
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return False, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}", 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                return False, f"stream error: {event['error'].get('message')}", chars
            for choice in event.get("choices", []):
                chars += len(choice["delta"].get("content") or "")
    return done, None if done else "stream ended without [DONE]", chars


async def _soak(base: str, s: SoakSettings, prompts: list[str], progress: bool) -> dict[str, Any]:
    from tqdm import tqdm

    stop_at = time.monotonic() + s.duration_s
    latencies: list[float] = []
    errors: list[str] = []
    bar = tqdm(total=int(s.duration_s), desc=f"soak, {s.clients} clients", unit="s", disable=not progress)

    async def client_loop(k: int) -> None:
        rng = random.Random(s.seed * 100_003 + k)
        while time.monotonic() < stop_at:
            body = _body(rng, rng.choice(prompts), s)
            t0 = time.perf_counter()
            try:
                ok, err, _ = await _one(client, base, body)
            except Exception as e:  # noqa: BLE001 - a transport failure is a failed request
                ok, err = False, f"{type(e).__name__}: {e}"
            latencies.append(time.perf_counter() - t0)
            if not ok:
                errors.append(f"{body['model']}{' stream' if body.get('stream') else ''}: {err}")

    peak = {"pinned_generations": 0, "in_flight": 0, "rss_bytes": 0, "python_blocks": 0}

    async def ticker() -> None:
        ticks = 0
        while time.monotonic() < stop_at:
            await asyncio.sleep(1)
            ticks += 1
            bar.update(1)
            bar.set_postfix(requests=len(latencies), errors=len(errors))
            if ticks % 5 == 0:  # the router's state, every 5 s
                now = (await client.get(base + "/v1/relay/stats")).json()
                for k in peak:
                    peak[k] = max(peak[k], now[k])

    async with http_client(600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(ticker(), *(client_loop(k) for k in range(s.clients)))
        wall = time.perf_counter() - t0
    bar.close()
    return {
        "requests": len(latencies),
        "errors": len(errors),
        "first_errors": errors[:5],
        "requests_per_s": round(len(latencies) / wall, 2),
        "latency_p50_s": round(pct(latencies, 0.5), 3),
        "latency_p99_s": round(pct(latencies, 0.99), 3),
        "wall_s": round(wall, 1),
        "router_peak": peak,
    }


def stats(base: str) -> dict[str, Any]:
    """The router's /v1/relay/stats (of the one replica that answers)."""
    import httpx

    return httpx.get(base + "/v1/relay/stats", headers=api_headers(), timeout=30).json()


def run_soak(base: str, s: SoakSettings, progress: bool = True) -> dict[str, Any]:
    from relay_serve.toy.world import ToyWorld

    prompts = [p.prompt for p in ToyWorld().sample_heldout(256, seed=s.seed)]
    # Warm up at full load, so that "before" is a router whose caches and allocator pools are full
    warm = SoakSettings(**{**s.model_dump(), "duration_s": min(20.0, s.duration_s / 4)})
    asyncio.run(_soak(base, warm, prompts, False))
    time.sleep(s.settle_s)
    before = stats(base)
    load = asyncio.run(_soak(base, s, prompts, progress))
    at_end = stats(base)
    time.sleep(s.settle_s)
    after = stats(base)
    phases = {"before": before, "peak": load["router_peak"], "end": at_end, "after": after}
    report = {
        "settings": s.model_dump(),
        **load,
        "router_before": before,
        "router_after": after,
        "router_rss_mib": {k: round(v["rss_bytes"] / (1 << 20), 1) for k, v in phases.items()},
        "router_python_blocks": {k: v["python_blocks"] for k, v in phases.items()},
        "pinned_generations": {k: v["pinned_generations"] for k, v in phases.items()},
    }
    report["failed_checks"] = failed_checks(load["errors"], after)
    report["passed"] = not report["failed_checks"]
    return report


def failed_checks(errors: int, after: dict[str, Any]) -> list[str]:
    """What the soak requires of the router once the load is gone and ``settle_s`` passed: no
    failed request, and nothing left: no generation or segment in flight, no session pinned to a
    replica, no idle lease (they expire after ``router.lease_idle_s``)."""
    checks = {
        f"{errors} requests failed": errors == 0,
        f"{after.get('in_flight')} generations still in flight": after.get("in_flight") == 0,
        f"{after.get('pinned_generations')} generations still pinned to replicas": after.get("pinned_generations") == 0,
        f"segments still in flight: {after.get('segments_in_flight')}": not any(
            (after.get("segments_in_flight") or {}).values()
        ),
        f"{after.get('idle_leases')} idle leases did not expire": not after.get("idle_leases"),
    }
    return [what for what, ok in checks.items() if not ok]
