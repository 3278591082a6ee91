"""``relay-serve batch``: batch inference on Ray Data through the router's deployment handle.

Ray Data streams the input (JSONL or Parquet, local or object storage) in file order; the driver
keeps ``concurrency`` requests in flight through the ``router`` deployment's handle (the same
validation, limits and policies as the HTTP API) and writes results in parts: each part is
written under a temporary name and moved into place whole, so a part is either there or not.
A rerun with the same ``--output`` skips every id already written, so a stopped run resumes with
nothing duplicated. Malformed input lines and failed requests go to ``errors.jsonl`` with their
line number (or row number for Parquet) and the reason; they are never dropped silently.

Input rows: ``id`` (optional; default ``line-N``/``row-N``), then ``prompt`` (a user message's
content) or ``messages`` (chat messages), and optionally ``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``seed``, ``stop`` overriding the run's defaults.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from relay_serve.client import SAMPLING_FIELDS, chat_body

if TYPE_CHECKING:
    from relay_serve.config import AppConfig

log = logging.getLogger(__name__)

RESULT_PREFIX = "part-"
ERRORS_FILE = "errors.jsonl"
SUMMARY_FILE = "_summary.json"


class BatchSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str = Field(description="a .jsonl or .parquet file: a local path or an fsspec/Ray Data URI")
    output: str = Field(description="the results folder (local path or object-store URI)")
    mode: str = Field("relay", description="the model id to request: relay, large, small, speculative-thinking")
    concurrency: int = Field(32, ge=1, le=4096, description="requests in flight")
    format: Literal["parquet", "jsonl"] = "parquet"
    max_tokens: int | None = Field(None, ge=1, description="default for rows that do not set it")
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    part_rows: int = Field(256, ge=1, description="results per written part")
    part_interval_s: float = Field(30.0, gt=0, description="write a part at least this often while results arrive")
    retries: int = Field(2, ge=0, description="retries of a request that failed on the server side (5xx)")


class BatchRow(BaseModel):
    """One input row, as validated before anything is sent."""

    model_config = ConfigDict(extra="ignore")

    id: str | int | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> BatchRow:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a row needs exactly one of 'prompt' and 'messages'")
        return self


class BatchSummary(BaseModel):
    input: str
    output: str
    mode: str
    rows_read: int
    skipped_done: int = Field(description="ids already in the output (a resumed run)")
    written: int
    malformed: int
    failed: int
    elapsed_s: float
    completion_tokens: int
    small_token_share: float | None
    errors_file: str


# ---- reading -------------------------------------------------------------------------------------


def _input_kind(path: str) -> str:
    lower = path.lower()
    if lower.endswith(".jsonl") or lower.endswith(".jsonl.gz") or lower.endswith(".ndjson"):
        return "jsonl"
    if lower.endswith(".parquet"):
        return "parquet"
    raise ValueError(f"--input must be a .jsonl or .parquet file, got {path!r}")


def read_rows(path: str) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """``(line or row number, raw row, parse error)`` in file order, streamed by Ray Data."""
    import ray

    kind = _input_kind(path)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # line numbers must be the file's
    ctx.enable_progress_bars = False
    if kind == "parquet":
        ds = ray.data.read_parquet(path)
        for n, row in enumerate(ds.iter_rows(), start=1):
            yield n, dict(row), None
        return
    ds = ray.data.read_text(path, drop_empty_lines=False)
    for n, row in enumerate(ds.iter_rows(), start=1):
        line = row["text"].strip()
        if not line:
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            yield n, None, f"not valid JSON: {e}"
            continue
        if not isinstance(data, dict):
            yield n, None, "not a JSON object"
            continue
        yield n, data, None


def count_rows(path: str) -> int | None:
    """The number of input rows when it is cheap to know (Parquet metadata, local JSONL), else None."""
    import fsspec

    try:
        fs, p = fsspec.core.url_to_fs(path)
        if _input_kind(path) == "parquet":
            import pyarrow.parquet as pq

            with fs.open(p, "rb") as f:
                return pq.ParquetFile(f).metadata.num_rows
        if fs.protocol not in ("file", ("file", "local")) or path.endswith(".gz"):
            return None
        with fs.open(p, "rb") as f:
            return sum(1 for line in f if line.strip())
    except Exception:  # noqa: BLE001 - only a progress bar's total
        return None


def request_body(row: BatchRow, s: BatchSettings) -> dict[str, Any]:
    fields = {name: getattr(row, name) if getattr(row, name) is not None else getattr(s, name, None) for name in SAMPLING_FIELDS}
    if row.messages is not None:
        return chat_body(s.mode, messages=row.messages, **fields)
    return chat_body(s.mode, row.prompt, **fields)


# ---- writing -------------------------------------------------------------------------------------


class Output:
    """The results folder: parts written whole, ids already done, and the errors file."""

    def __init__(self, uri: str, fmt: str) -> None:
        import fsspec

        self.uri = uri.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.uri)
        self.fmt = fmt
        self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def parts(self) -> list[str]:
        names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        return sorted(self._path(n) for n in names if n.startswith(RESULT_PREFIX) and not n.endswith(".tmp"))

    def done_ids(self) -> set[str]:
        import pyarrow.json as pj
        import pyarrow.parquet as pq

        ids: set[str] = set()
        for p in self.parts():
            with self.fs.open(p, "rb") as f:
                table = pq.read_table(f, columns=["id"]) if p.endswith(".parquet") else pj.read_json(f)
            ids.update(str(i) for i in table.column("id").to_pylist())
        return ids

    def write_part(self, records: list[dict[str, Any]]) -> str:
        import pyarrow as pa
        import pyarrow.parquet as pq

        name = f"{RESULT_PREFIX}{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}.{self.fmt}"
        final, tmp = self._path(name), self._path(name + ".tmp")
        with self.fs.open(tmp, "wb") as f:
            if self.fmt == "parquet":
                pq.write_table(pa.Table.from_pylist(records), f)
            else:
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())
        self.fs.mv(tmp, final)
        return final

    def append_errors(self, errors: list[dict[str, Any]]) -> None:
        if not errors:
            return
        path = self._path(ERRORS_FILE)
        old = self.fs.cat_file(path) if self.fs.exists(path) else b""
        new = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in errors).encode()
        with self.fs.open(path + ".tmp", "wb") as f:
            f.write(old + new)
        self.fs.mv(path + ".tmp", path)

    def write_summary(self, summary: BatchSummary) -> None:
        with self.fs.open(self._path(SUMMARY_FILE), "w") as f:
            f.write(summary.model_dump_json(indent=2) + "\n")


def result_record(row_id: str, line: int, mode: str, response: dict[str, Any], latency_s: float) -> dict[str, Any]:
    usage = response["usage"]
    relay = usage.get("relay") or {}
    choice = response["choices"][0]
    return {
        "id": row_id,
        "line": line,
        "mode": mode,
        "text": choice["message"]["content"],
        "finish_reason": choice["finish_reason"],
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "large_tokens": relay.get("large_tokens", 0),
        "small_tokens": relay.get("small_tokens", 0),
        "switches": relay.get("switches", 0),
        "segments": relay.get("segments", 0),
        "cached_prompt_tokens": relay.get("cached_prompt_tokens", 0),
        "cue_set_version": relay.get("cue_set_version"),
        "degraded": bool(relay.get("degraded", False)),
        "latency_s": round(latency_s, 4),
    }


# ---- the run -------------------------------------------------------------------------------------

Call = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


async def run_batch_async(s: BatchSettings, call: Call, progress: bool = True) -> BatchSummary:
    """Drive every input row through ``call`` (the router's ``handle_request``), ``concurrency``
    at a time, writing parts as results arrive. Interrupted, it writes what it has first."""
    from tqdm import tqdm

    out = Output(s.output, s.format)
    done = out.done_ids()
    started = time.perf_counter()
    counts = {"rows": 0, "skipped": 0, "written": 0, "malformed": 0, "failed": 0, "tokens": 0, "small": 0}
    pending: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    last_flush = time.monotonic()
    seen: set[str] = set()
    total = count_rows(s.input)
    bar = tqdm(total=total, desc=f"batch {s.mode}", unit="row", disable=not progress)

    def flush(force: bool = False) -> None:
        nonlocal last_flush, pending, errors
        due = len(pending) >= s.part_rows or time.monotonic() - last_flush >= s.part_interval_s
        if pending and (force or due):
            out.write_part(pending)
            counts["written"] += len(pending)
            pending = []
            last_flush = time.monotonic()
        if errors and (force or due):
            out.append_errors(errors)
            errors = []

    def error(line: int, row_id: str | None, kind: str, message: str) -> None:
        counts[kind] += 1
        errors.append({"line": line, "id": row_id, "kind": kind, "error": message, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
        log.warning("input line %d%s: %s", line, f" (id {row_id})" if row_id else "", message)

    async def one(line: int, row_id: str, body: dict[str, Any]) -> None:
        for attempt in range(s.retries + 1):
            t0 = time.perf_counter()
            try:
                result = await call(body)
            except Exception as e:  # noqa: BLE001 - the handle itself failed (replica died, ...)
                result = {"error": {"message": f"{type(e).__name__}: {e}"}, "status": 503}
            if "response" in result:
                rec = result_record(row_id, line, s.mode, result["response"], time.perf_counter() - t0)
                pending.append(rec)
                counts["tokens"] += rec["completion_tokens"]
                counts["small"] += rec["small_tokens"]
                break
            status = int(result.get("status", 500))
            if status < 500 or attempt == s.retries:
                error(line, row_id, "failed", f"HTTP {status}: {result['error'].get('message')}")
                break
            await asyncio.sleep(0.5 * 2**attempt)
        bar.update(1)
        flush()

    sem = asyncio.Semaphore(s.concurrency)
    tasks: set[asyncio.Task] = set()

    async def guarded(line: int, row_id: str, body: dict[str, Any]) -> None:
        try:
            await one(line, row_id, body)
        finally:
            sem.release()

    rows = read_rows(s.input)
    prefix = "row" if _input_kind(s.input) == "parquet" else "line"
    try:
        while True:
            item = await asyncio.to_thread(next, rows, None)
            if item is None:
                break
            line, raw, problem = item
            counts["rows"] += 1
            if problem is not None:
                error(line, None, "malformed", problem)
                bar.update(1)
                continue
            try:
                row = BatchRow.model_validate(raw)
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                error(line, None, "malformed", f"{where + ': ' if where else ''}{err['msg']}")
                bar.update(1)
                continue
            row_id = str(row.id) if row.id is not None else f"{prefix}-{line}"
            if row_id in seen:
                error(line, row_id, "malformed", f"duplicate id {row_id!r} (an earlier line has it)")
                bar.update(1)
                continue
            seen.add(row_id)
            if row_id in done:
                counts["skipped"] += 1
                bar.update(1)
                continue
            await sem.acquire()
            task = asyncio.create_task(guarded(line, row_id, request_body(row, s)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            flush()
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        flush(force=True)
        bar.close()
    summary = BatchSummary(
        input=s.input,
        output=s.output,
        mode=s.mode,
        rows_read=counts["rows"],
        skipped_done=counts["skipped"],
        written=counts["written"],
        malformed=counts["malformed"],
        failed=counts["failed"],
        elapsed_s=round(time.perf_counter() - started, 3),
        completion_tokens=counts["tokens"],
        small_token_share=round(counts["small"] / counts["tokens"], 4) if counts["tokens"] else None,
        errors_file=f"{out.uri}/{ERRORS_FILE}",
    )
    out.write_summary(summary)
    return summary


def router_handle(cfg: AppConfig | None = None):
    """The router handle of the running app named ``cfg.name``, or of ``cfg`` (default: the
    embedded toy app) started here when no such app runs."""
    from ray import serve

    from relay_serve.config import AppConfig
    from relay_serve.serve.local import init_ray, start

    cfg = cfg or AppConfig()
    init_ray(cfg.env_vars)
    try:
        serve.get_app_handle(cfg.name)
    except Exception:  # noqa: BLE001 - no Serve or no such app on this cluster: start it
        log.info("no app %r is running: starting it", cfg.name)
        start(cfg)
    return serve.get_deployment_handle("router", app_name=cfg.name)


def run_batch(s: BatchSettings, progress: bool = True, cfg: AppConfig | None = None) -> BatchSummary:
    _input_kind(s.input)  # refuse a bad input before starting anything
    handle = router_handle(cfg)

    async def call(body: dict[str, Any]) -> dict[str, Any]:
        return await handle.handle_request.remote(body)

    return asyncio.run(run_batch_async(s, call, progress))
