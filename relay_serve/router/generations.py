"""From an OpenAI request to a generation: the prompt's token ids, the checks against the
router's limits and the context, the relay core's generation and the policy with the cue set it starts with,
running it under the request's time limit, and the response. No HTTP, no Ray."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from relay_serve.config import AppConfig
from relay_serve.protocol import InvalidRequest, ModelRole, SamplingSettings
from relay_serve.relay.auto import AutoChooser, LoadClock, Mark
from relay_serve.relay.generation import (
    EngineError,
    Generation,
    ModelUnavailable,
    Policy,
)
from relay_serve.relay.policy import MODEL_IDS, make_policy
from relay_serve.relay.types import Backend, GenerationResult
from relay_serve.router.cue_provider import CueProvider
from relay_serve.router.metrics import RouterMetrics
from relay_serve.router.openai_api import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ClientError,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ServerError,
    Usage,
    new_id,
    now,
)
from relay_serve.router.shadow import ShadowScorer
from relay_serve.router.startup import PairRefused, PairStartup, ServedPair
from relay_serve.tokenizer import Codec

log = logging.getLogger(__name__)

AnyRequest = ChatCompletionRequest | CompletionRequest
OFF_LOOP_PROMPT_CHARS = 8192  # prompts at least this long are tokenized in a worker thread
CLIENT_GONE = 499  # the status a request is counted under when its client went away (nginx's)


@dataclass
class ServedGeneration:
    """One request's generation, ready to run: the request, the relay core's generation and the
    policy that drives it."""

    request: AnyRequest
    generation: Generation
    policy: Policy
    chat: bool
    name: str  # the model id's policy: relay, large, small, speculative-thinking, auto
    arrived: float  # time.perf_counter() when the request arrived
    explored: bool = False  # online calibration: the reasoning is the large model's alone
    path: str = ""  # the policy it runs as: ``name``, or for auto the one it chose
    mark: Mark | None = None  # the load clock when it started running (auto learns its mean load and purity)

    def age(self) -> float:
        return time.perf_counter() - self.arrived


class Generations:
    """Turns requests into generations and runs them over ``backend``; counts those in flight."""

    def __init__(
        self, cfg: AppConfig, startup: PairStartup, backend: Backend, cues: CueProvider, metrics: RouterMetrics
    ) -> None:
        self.cfg = cfg
        self.startup = startup  # the tokenizer and the context length, as the model replicas say
        self.backend = backend
        self.cues = cues
        self.metrics = metrics
        self.shadow: ShadowScorer | None = None  # online cue calibration, when enabled
        self.load = LoadClock()  # generations in flight on this router, over time
        self.auto = AutoChooser(cfg.policy.auto)

    @property
    def in_flight(self) -> int:
        return self.load.n

    # ---- request -> generation -----------------------------------------------------------------

    async def prepare(self, req: AnyRequest, arrived: float | None = None) -> ServedGeneration:
        """The generation ``req`` asks for; a ClientError naming the field when it cannot be."""
        arrived = time.perf_counter() if arrived is None else arrived
        chat = isinstance(req, ChatCompletionRequest)
        name = self.policy_name(req.model)
        await self._pair(arrived)
        prompt_ids = await self._tokenize(req)
        max_tokens = self._max_tokens(req, prompt_ids)
        await self.cues.maybe_refresh()
        self.metrics.cue_set_active(self.cues.active().created_at)
        cues, cue_version = self._cues(req, name)
        sampling = self._sampling(req)
        # auto: relay or large, whichever has been faster at this load; its engines are relay's
        await self._check_engines(
            ("large", "small") if name == "auto" else make_policy(name, self.cfg.policy, []).models, sampling, req
        )
        path = self.auto.choose(self.auto.load_ahead(self.load)) if name == "auto" else name
        explored = name == "relay" and req.relay_cues is None and self.shadow is not None and self.shadow.explore()
        if explored:
            cues = []  # no handoff during the reasoning: the large model writes the sentences after every cue
        policy = make_policy(path, self.cfg.policy, cues)
        generation = Generation(
            backend=self.backend,
            codec=self.codec,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=sampling,
            session_id=new_id("gen"),
            user_stops=req.stop_list(),
            cue_set_version=cue_version,
            retries=self.cfg.router.segment_retries,
            retry_backoff_s=self.cfg.router.retry_backoff_s,
            small_timeout_s=self.cfg.router.small_timeout_s,
        )
        generation.usage.explored = explored
        generation.usage.policy = path if name == "auto" else None
        return ServedGeneration(req, generation, policy, chat, name, arrived, explored, path=path)

    async def _pair(self, arrived: float) -> ServedPair:
        """The served pair; a request that comes while the model deployments start waits for them,
        up to its time limit."""
        if self.startup.ready:
            return self.startup.pair  # type: ignore[return-value]
        left = self.cfg.router.request_timeout_s - (time.perf_counter() - arrived)
        try:
            return await self.startup.wait(max(0.0, left))
        except PairRefused as e:
            raise ServerError(f"this pair cannot be served: {e}", status=503, code="pair_refused") from e
        except TimeoutError as e:
            status = self.startup.status()["large"]
            raise ServerError(
                f"the large model's deployment did not answer within the request's "
                f"{self.cfg.router.request_timeout_s:.0f} s "
                f"(last: {status.get('last_failure') or 'still starting'})",
                status=503,
                code="model_unavailable",
            ) from e

    def _served(self) -> ServedPair:
        pair = self.startup.pair
        if pair is None:
            raise RuntimeError("no request is prepared before the large deployment answered")
        return pair

    @property
    def codec(self) -> Codec:
        return self._served().codec

    @property
    def max_model_len(self) -> int:
        return self._served().max_model_len

    async def _check_engines(self, models: tuple[ModelRole, ...], sampling: SamplingSettings, req: AnyRequest) -> None:
        """Refuse sampling that an engine of ``models`` would run wrongly or crash on (a
        speculative vLLM-CPU engine samples only greedily): a 400 naming the parameter, before
        anything reaches an engine."""
        for model in models:
            try:
                (await self.backend.traits(model)).check(model, sampling)
            except InvalidRequest as e:
                default = (
                    " (the service's default sampling)" if e.param == "temperature" and req.temperature is None else ""
                )
                raise ClientError(e.message + default, param=e.param) from e

    def _cues(self, req: AnyRequest, policy: str) -> tuple[list[str], str | None]:
        """The cues of this generation and their version: the request's own ``relay_cues``
        (version ``request``; never written to the shared set) or the active set, which the
        generation keeps to its end."""
        if req.relay_cues is None:
            cue_set = self.cues.active()
            return list(cue_set.cues), cue_set.version
        r = self.cfg.router
        if policy != "relay":  # auto included: its generations may not relay
            raise ClientError("relay_cues applies to the relay model only", param="relay_cues")
        if len(req.relay_cues) > r.max_request_cues:
            raise ClientError(f"at most {r.max_request_cues} cues are allowed", param="relay_cues")
        for cue in req.relay_cues:
            if not cue.strip() or len(cue) > r.max_cue_length or any(c in cue for c in "\n\r\t"):
                raise ClientError(
                    f"each cue must be 1-{r.max_cue_length} characters on one line, not only white space: {cue[:40]!r}",
                    param="relay_cues",
                )
            if self.cfg.policy.think_close in cue:
                raise ClientError(f"a cue must not contain {self.cfg.policy.think_close!r}", param="relay_cues")
        return list(dict.fromkeys(req.relay_cues)), "request"

    def model_label(self, model: Any) -> str:
        """The policy ``model`` names, or ``unknown``: a metrics label of bounded cardinality."""
        try:
            return self.policy_name(model) if isinstance(model, str) else "unknown"
        except ClientError:
            return "unknown"

    def policy_name(self, model: str) -> str:
        prefix = self.cfg.router.model_name_prefix
        name = model[len(prefix) :] if prefix and model.startswith(prefix) else model
        if name not in MODEL_IDS:
            known = ", ".join(prefix + m for m in MODEL_IDS)
            raise ClientError(
                f"unknown model {model!r}; this service serves {known}", param="model", code="model_not_found"
            )
        return name

    async def _tokenize(self, req: AnyRequest) -> list[int]:
        """The prompt's token ids; a long prompt is tokenized off the event loop (a 32k-token prompt
        takes about 150 ms here, which would stall every stream of this router)."""
        if isinstance(req, ChatCompletionRequest):
            size = sum(len(m.text()) for m in req.messages)
        else:
            size = len(req.prompt)
        if size < OFF_LOOP_PROMPT_CHARS:
            return self._prompt_ids(req)
        return await asyncio.to_thread(self._prompt_ids, req)

    def _prompt_ids(self, req: AnyRequest) -> list[int]:
        if isinstance(req, ChatCompletionRequest):
            messages = [
                {"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in req.messages
            ]
            return self.codec.encode(self.codec.render_chat(messages))
        if isinstance(req.prompt, list):
            vocab = len(self.codec.tokenizer)
            if any(not 0 <= t < vocab for t in req.prompt):
                raise ClientError(f"prompt token ids must lie in [0, {vocab})", param="prompt")
            ids = list(req.prompt)
        else:
            ids = self.codec.encode(req.prompt)
        if not ids:  # an engine refuses an empty prompt: a 400 at once, not a failed engine
            raise ClientError("the prompt is empty: give at least one token of text", param="prompt")
        return ids

    def _max_tokens(self, req: AnyRequest, prompt_ids: list[int]) -> int:
        """The request's token budget, checked with its stop strings against the limits."""
        stops, r = req.stop_list(), self.cfg.router
        if len(stops) > r.max_stop_strings:
            raise ClientError(f"at most {r.max_stop_strings} stop strings are allowed", param="stop")
        if any(len(s) > r.max_stop_length for s in stops):
            raise ClientError(f"stop strings may be at most {r.max_stop_length} characters", param="stop")
        if any(s == "" for s in stops):
            raise ClientError("stop strings must not be empty", param="stop")
        room = self.max_model_len - len(prompt_ids)
        if room <= 0:
            param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            raise ClientError(
                f"the prompt is {len(prompt_ids)} tokens; this model's context is {self.max_model_len}",
                param=param,
                code="context_length_exceeded",
            )
        max_tokens, param = req.requested_max_tokens()
        if max_tokens is None:
            return room
        if max_tokens < 1:
            raise ClientError(f"{param} must be at least 1", param=param)
        if max_tokens > room:
            raise ClientError(
                f"{param}={max_tokens} does not fit: the prompt is {len(prompt_ids)} tokens of a "
                f"{self.max_model_len}-token context, leaving {room}",
                param=param,
                code="context_length_exceeded",
            )
        return max_tokens

    def _sampling(self, req: AnyRequest) -> SamplingSettings:
        d = self.cfg.sampling
        return SamplingSettings(
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_p=d.top_p if req.top_p is None else req.top_p,
            top_k=d.top_k if req.top_k is None else req.top_k,
            seed=req.seed,
        )

    # ---- running -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def running(self, g: ServedGeneration) -> Iterator[None]:
        """While ``g`` runs: counted in flight; after it, its leases go back to the backend."""
        g.mark = mark = self.load.enter(g.path)
        try:
            yield
        finally:
            self.load.leave(mark)
            self.backend.release(g.generation.session_id)

    async def run(self, g: ServedGeneration) -> dict[str, Any]:
        """The whole generation as a response body; a ServerError when it fails or takes longer
        than ``router.request_timeout_s``."""
        with self.running(g):
            try:
                result = await asyncio.wait_for(g.generation.run(g.policy), timeout=self.cfg.router.request_timeout_s)
            except TimeoutError as e:
                self.metrics.request(g.name, 504, g.age())
                raise ServerError(self.timeout_message(), status=504) from e
            except asyncio.CancelledError:
                self.metrics.request(g.name, CLIENT_GONE, g.age())
                raise
            except Exception as e:  # noqa: BLE001 - typed for the client by failure()
                err = failure(e, g.generation.session_id)
                self.metrics.request(g.name, err.status, g.age())
                raise err from e
        self.finished(g, result)
        return response(g, result)

    def finished(self, g: ServedGeneration, result: GenerationResult, ttft_s: float | None = None) -> None:
        """Count a generation that ran to its end (``ttft_s``: a streamed one's first text)."""
        e2e = g.age()
        self.metrics.request(g.name, 200, e2e)
        self.metrics.generation(g.name, result, ttft_s=ttft_s, e2e_s=e2e)
        if g.name == "auto":
            load = self.load.mean_since(g.mark) if g.mark is not None else float(self.in_flight)
            purity = self.load.share_since(g.mark) if g.mark is not None else 1.0
            self.auto.record(g.path, load, result.usage.wall_s, len(result.token_ids), purity)
            self.metrics.auto_choice(g.path)
        if self.shadow is not None and g.path == "relay" and g.request.relay_cues is None:
            self.shadow.offer(g.generation.prompt_ids, result.token_ids, g.generation.output.owners, g.explored)

    def timeout_message(self) -> str:
        return f"the generation took longer than {self.cfg.router.request_timeout_s} s"


def usage(generation: Generation, result: GenerationResult) -> Usage:
    n_prompt, n_out = len(generation.prompt_ids), len(result.token_ids)
    return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out, relay=result.usage)


def response(g: ServedGeneration, result: GenerationResult) -> dict[str, Any]:
    """The OpenAI response body of a finished generation (with the trace when asked for)."""
    req = g.request
    common = dict(
        id=new_id("chatcmpl" if g.chat else "cmpl"), created=now(), model=req.model, usage=usage(g.generation, result)
    )
    trace = result.trace if req.relay_trace else None
    if g.chat:
        choice = ChatChoice(message={"role": "assistant", "content": result.text}, finish_reason=result.finish_reason)
        resp = ChatCompletionResponse(choices=[choice], relay_trace=trace, **common)
    else:
        resp = CompletionResponse(
            choices=[CompletionChoice(text=result.text, finish_reason=result.finish_reason)],
            relay_trace=trace,
            **common,
        )
    body = resp.model_dump(exclude_none=True)
    if req.relay_trace:
        body["relay_engine_requests"] = [r.model_dump() for r in result.engine_requests]
    return body


def failure(e: Exception, session_id: str) -> ClientError | ServerError:
    """What a client is told when a generation fails (HTTP status and body; in a stream, the body)."""
    if isinstance(e, InvalidRequest):
        return ClientError(f"an engine refused the request: {e.message}", param=e.param)
    if isinstance(e, ModelUnavailable):
        return ServerError(f"the small model is unavailable: {e}", status=503, code="model_unavailable")
    if isinstance(e, EngineError):
        log.warning("generation %s failed: %s", session_id, e)
        return ServerError(f"an engine failed: {e}", status=502, code="engine_error")
    log.error("generation %s failed with an error of relay-serve's own", session_id, exc_info=e)
    return ServerError(
        f"the router failed (a bug in relay-serve): {type(e).__name__}: {e}", status=500, code="internal_error"
    )
