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
``top_p``, ``top_k``, ``seed``, ``stop`` overriding the run's defaults, and ``answer``: a gold
answer the result is graded against (math-verify, as ``relay-serve eval`` grades), so that a
batch over a labelled set reports its pass@1 beside its throughput.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
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
    mode: str = Field("relay", description="the model id to request: relay, large, small, speculative-thinking, auto")
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
    answer: str | int | float | None = Field(None, description="a gold answer: the result is graded against it")

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
    output_tokens_per_s: float | None = Field(None, description="completion tokens of this run over its elapsed time")
    small_token_share: float | None
    graded: int = Field(0, description="results of rows with a gold answer")
    pass_at_1: float | None = Field(None, description="of the rows with a gold answer (a failed row counts as wrong)")
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
    fields = {
        name: getattr(row, name) if getattr(row, name) is not None else getattr(s, name, None)
        for name in SAMPLING_FIELDS
    }
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


def result_record(
    row_id: str, line: int, mode: str, response: dict[str, Any], latency_s: float, answer: str | None = None
) -> dict[str, Any]:
    usage = response["usage"]
    relay = usage.get("relay") or {}
    choice = response["choices"][0]
    graded: dict[str, Any] = {}
    if answer is not None:
        from relay_serve.eval.grading import is_correct

        graded = {"answer": answer, "correct": bool(is_correct(choice["message"]["content"], answer))}
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
        "policy": relay.get("policy"),
        "latency_s": round(latency_s, 4),
        **graded,
    }


# ---- the run -------------------------------------------------------------------------------------

Call = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass
class _Counts:
    rows: int = 0
    skipped: int = 0
    written: int = 0
    malformed: int = 0
    failed: int = 0
    tokens: int = 0
    small: int = 0
    graded: int = 0
    correct: int = 0


class _BatchRun:
    """One batch run: the rows in, the calls out (``concurrency`` at a time), and the results and
    errors not yet written, flushed as whole parts."""

    def __init__(self, s: BatchSettings, call: Call, progress: bool) -> None:
        from tqdm import tqdm

        self.s, self.call = s, call
        self.out = Output(s.output, s.format)
        self.done = self.out.done_ids()
        self.counts = _Counts()
        self.results: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.seen: set[str] = set()
        self.answers: dict[str, str] = {}  # gold answers of the rows that have one
        self.last_flush = time.monotonic()
        self.prefix = "row" if _input_kind(s.input) == "parquet" else "line"
        self.bar = tqdm(total=count_rows(s.input), desc=f"batch {s.mode}", unit="row", disable=not progress)

    async def run(self) -> BatchSummary:
        """Every input row through ``call``; interrupted, it writes what it has first."""
        started = time.perf_counter()
        sem = asyncio.Semaphore(self.s.concurrency)
        tasks: set[asyncio.Task] = set()

        async def send(line: int, row_id: str, body: dict[str, Any]) -> None:
            try:
                await self._send(line, row_id, body)
            finally:
                sem.release()

        rows = read_rows(self.s.input)
        try:
            while (item := await asyncio.to_thread(next, rows, None)) is not None:
                admitted = self._admit(*item)
                if admitted is None:
                    self.bar.update(1)
                    continue
                await sem.acquire()
                task = asyncio.create_task(send(*admitted))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                self._flush()
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            self._flush(force=True)
            self.bar.close()
        return self._summary(time.perf_counter() - started)

    def _admit(self, line: int, raw: Any, problem: str | None) -> tuple[int, str, dict[str, Any]] | None:
        """A row to send (its line, id and request body), or None: malformed, seen before, or
        already written by an earlier run."""
        self.counts.rows += 1
        if problem is not None:
            self._error(line, None, "malformed", problem)
            return None
        try:
            row = BatchRow.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            self._error(line, None, "malformed", f"{where + ': ' if where else ''}{err['msg']}")
            return None
        row_id = str(row.id) if row.id is not None else f"{self.prefix}-{line}"
        if row_id in self.seen:
            self._error(line, row_id, "malformed", f"duplicate id {row_id!r} (an earlier line has it)")
            return None
        self.seen.add(row_id)
        if row_id in self.done:
            self.counts.skipped += 1
            return None
        if row.answer is not None:
            self.answers[row_id] = str(row.answer)
        return line, row_id, request_body(row, self.s)

    async def _send(self, line: int, row_id: str, body: dict[str, Any]) -> None:
        """One row's request: a 4xx is final at once, a 5xx after ``retries`` retries."""
        for attempt in range(self.s.retries + 1):
            t0 = time.perf_counter()
            try:
                result = await self.call(body)
            except Exception as e:  # noqa: BLE001 - the handle itself failed (replica died, ...)
                result = {"error": {"message": f"{type(e).__name__}: {e}"}, "status": 503}
            if "response" in result:
                answer = self.answers.get(row_id)
                rec = result_record(row_id, line, self.s.mode, result["response"], time.perf_counter() - t0, answer)
                self.results.append(rec)
                self.counts.tokens += rec["completion_tokens"]
                self.counts.small += rec["small_tokens"]
                self.counts.graded += answer is not None
                self.counts.correct += bool(rec.get("correct"))
                break
            status = int(result.get("status", 500))
            if status < 500 or attempt == self.s.retries:
                self._error(line, row_id, "failed", f"HTTP {status}: {result['error'].get('message')}")
                self.counts.graded += row_id in self.answers  # a failed row counts as wrong
                break
            await asyncio.sleep(0.5 * 2**attempt)
        self.bar.update(1)
        self._flush()

    def _error(self, line: int, row_id: str | None, kind: Literal["malformed", "failed"], message: str) -> None:
        setattr(self.counts, kind, getattr(self.counts, kind) + 1)
        self.errors.append(
            {"line": line, "id": row_id, "kind": kind, "error": message, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        )
        log.warning("input line %d%s: %s", line, f" (id {row_id})" if row_id else "", message)

    def _flush(self, force: bool = False) -> None:
        """Write the results as a part (and the errors) once there are ``part_rows`` of them or
        ``part_interval_s`` passed; all of them with ``force``."""
        due = len(self.results) >= self.s.part_rows or time.monotonic() - self.last_flush >= self.s.part_interval_s
        if self.results and (force or due):
            self.out.write_part(self.results)
            self.counts.written += len(self.results)
            self.results = []
            self.last_flush = time.monotonic()
        if self.errors and (force or due):
            self.out.append_errors(self.errors)
            self.errors = []

    def _summary(self, elapsed_s: float) -> BatchSummary:
        c = self.counts
        summary = BatchSummary(
            input=self.s.input,
            output=self.s.output,
            mode=self.s.mode,
            rows_read=c.rows,
            skipped_done=c.skipped,
            written=c.written,
            malformed=c.malformed,
            failed=c.failed,
            elapsed_s=round(elapsed_s, 3),
            completion_tokens=c.tokens,
            output_tokens_per_s=round(c.tokens / elapsed_s, 1) if elapsed_s > 0 else None,
            small_token_share=round(c.small / c.tokens, 4) if c.tokens else None,
            graded=c.graded,
            pass_at_1=round(c.correct / c.graded, 4) if c.graded else None,
            errors_file=f"{self.out.uri}/{ERRORS_FILE}",
        )
        self.out.write_summary(summary)
        return summary


async def run_batch_async(s: BatchSettings, call: Call, progress: bool = True) -> BatchSummary:
    """Drive every input row through ``call`` (the router's ``handle_request``), ``concurrency``
    at a time, writing parts as results arrive. Interrupted, it writes what it has first."""
    return await _BatchRun(s, call, progress).run()


def router_handle(cfg: AppConfig | None = None):
    """The router handle of the running app named ``cfg.name``, or of ``cfg`` (default: the
    embedded toy app) started here when no such app runs."""
    from ray import serve

    from relay_serve.app.local import start
    from relay_serve.cluster import init_ray
    from relay_serve.config import AppConfig

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
