"""vLLM's AsyncLLM behind the Engine interface. The only module of relay-serve that imports vLLM."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from relay_serve.engine.base import Engine, EngineInfo
from relay_serve.relay.types import EngineChunk, SegmentRequest
from relay_serve.tokenizer import tokenizer_fingerprint

log = logging.getLogger(__name__)


class VLLMEngine(Engine):
    def __init__(self, model: str, tokenizer: str | None = None, engine_args: dict[str, Any] | None = None) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = {"enable_prefix_caching": True, **(engine_args or {})}
        self.model = model
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, tokenizer=tokenizer or model, **args))
        self._max_model_len = int(self.engine.model_config.max_model_len)
        self._fingerprint = tokenizer_fingerprint(_hf_tokenizer(self.engine))

    def info(self) -> EngineInfo:
        return EngineInfo(model=self.model, max_model_len=self._max_model_len, tokenizer_fingerprint=self._fingerprint)

    async def generate(self, request: SegmentRequest, request_id: str, stream: bool = True) -> AsyncIterator[EngineChunk]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            seed=s.seed,
            stop=request.stop or None,
            include_stop_str_in_output=True,
            skip_special_tokens=True,
            # FINAL_ONLY spares the replica's event loop one output object per token.
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )
        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids)
        async for out in self.engine.generate(prompt, params, request_id):
            comp = out.outputs[0]
            chunk = EngineChunk(token_ids=list(comp.token_ids), text=comp.text)
            if out.finished:
                chunk.finished = True
                chunk.finish_reason = "length" if comp.finish_reason == "length" else (
                    "abort" if comp.finish_reason == "abort" else "stop"
                )
                chunk.stop_reason = comp.stop_reason
                chunk.cached_tokens = int(out.num_cached_tokens or 0)
                chunk.ttft_s, chunk.decode_s = _timing(out)
            yield chunk

    async def score(self, token_ids: list[int], start: int, top_k: int = 2) -> list[list[float]]:
        import uuid

        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k, output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=token_ids), params, f"score-{uuid.uuid4().hex}"):
            final = out
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError("the engine returned no prompt logprobs")
        rows = []
        for i in range(max(1, start), len(token_ids)):
            entry = final.prompt_logprobs[i] or {}
            rows.append(sorted((lp.logprob for lp in entry.values()), reverse=True)[:top_k])
        return rows

    async def check_health(self) -> None:
        await self.engine.check_health()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _timing(out) -> tuple[float | None, float | None]:
    """Time to first token (from the request's arrival at the engine) and decode time (first token
    to last) from vLLM's request statistics; None when the engine keeps none (disable_log_stats)."""
    stats = getattr(out, "metrics", None)
    if stats is None or not getattr(stats, "first_token_ts", 0.0):
        return None, None
    return float(stats.first_token_latency), float(stats.last_token_ts - stats.first_token_ts)


def _hf_tokenizer(engine):
    tok = engine.tokenizer
    return getattr(tok, "tokenizer", tok)


class OfflineEngine:
    """vLLM's offline ``LLM`` for batch jobs (toy evaluation, calibration scoring, speed probes)."""

    def __init__(self, model: str, engine_args: dict[str, Any] | None = None) -> None:
        from vllm import LLM

        self.llm = LLM(model=model, **{"enable_prefix_caching": True, **(engine_args or {})})

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        temperature: float = 0.0,
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
                seed=None if seed is None else seed + i,
                ignore_eos=ignore_eos,
                skip_special_tokens=False,
            )
            for i in range(len(prompts))
        ]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=progress)
        return [list(o.outputs[0].token_ids) for o in outs]

    def score(self, sequences: list[list[int]], starts: list[int], top_k: int = 2, progress: bool = False) -> list[list[list[float]]]:
        """For each sequence, the ``top_k`` largest log-probabilities at every position from its start."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=progress)
        rows = []
        for out, seq, start in zip(outs, sequences, starts):
            lps = out.prompt_logprobs
            rows.append(
                [sorted((lp.logprob for lp in (lps[i] or {}).values()), reverse=True)[:top_k] for i in range(max(1, start), len(seq))]
            )
        return rows
