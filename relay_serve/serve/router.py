"""RelayRouter: the OpenAI-compatible ingress. Renders the prompt, runs a policy per request over
the model deployments, streams deltas, and reports who wrote what. Never imports vLLM, so it runs
on CPU-only nodes; the class is undecorated (``app.build_app`` binds it) and tests drive its
FastAPI app directly with a fake backend.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from relay_serve.config import AppConfig
from relay_serve.serve.cue_provider import CueProvider
from relay_serve.relay.policy import POLICY_NAMES, make_policy
from relay_serve.relay.session import EngineError, Session, SmallModelUnavailable
from relay_serve.relay.types import Backend, GenerationResult, SamplingSettings, TextDelta
from relay_serve.serve.openai_api import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ClientError,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ServerError,
    Usage,
    error_body,
    new_id,
    now,
)
from relay_serve.tokenizer import check_pair

log = logging.getLogger(__name__)

MODEL_DESCRIPTIONS = {
    "relay": "RelayGen: the large model reasons, the small one writes cued sentences and the answer",
    "large": "the large model alone",
    "small": "the small model alone",
    "speculative-thinking": "Speculative Thinking: the small model leads, the large one takes reflective stretches",
}


class RelayRouter:
    def __init__(self, config: dict[str, Any], large=None, small=None, backend: Backend | None = None) -> None:
        self.cfg = AppConfig.model_validate(config)
        self.codec = check_pair(self.cfg)
        if backend is None:
            from relay_serve.serve import affinity_registry
            from relay_serve.serve.backend import ServeBackend

            r = self.cfg.router
            app = self.cfg.name
            backend = ServeBackend(
                large,
                small,
                affinity=r.session_affinity,
                max_small_in_flight=r.max_small_in_flight,
                small_retry_after_s=r.small_retry_after_s,
                transport=r.transport,
                lease_ttl_s=r.lease_max_age_s + r.request_timeout_s + 60.0,  # outlives any use of it
                lease_idle_s=r.lease_idle_s,
                lease_max_age_s=r.lease_max_age_s,
                resumable=r.resumable_requests,
                in_rotation=lambda model, replica_id: affinity_registry.replica_running(app, model, replica_id),
            )
        self.backend = backend
        self.api_keys = [k.encode() for k in self.cfg.router.api_keys()]
        self.cues = CueProvider(self.cfg, pair_fingerprint=self.pair_fingerprint())
        self.max_model_len = self.cfg.max_model_len or 4096
        self.in_flight = 0
        self.api = self._build_api()

    def __serve_build_asgi_app__(self):  # noqa: N802 - Ray Serve's hook name
        return self.api

    def __del__(self) -> None:
        """Ray Serve calls it when the replica stops: the leases go back, so the model replicas
        are not held waiting for this router's generations until their shutdown timeout."""
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()

    def pair_fingerprint(self) -> str:
        from relay_serve.cues import pair_fingerprint

        return pair_fingerprint(self.cfg)

    # ---- the HTTP API --------------------------------------------------------------------------

    def _build_api(self) -> FastAPI:
        api = FastAPI(title="relay-serve", version=_version())
        api.add_exception_handler(ClientError, _client_error)
        api.add_exception_handler(ServerError, _server_error)
        api.add_exception_handler(StarletteHTTPException, _http_error)
        api.add_exception_handler(Exception, _unexpected_error)
        api.add_api_route("/health", self.health, methods=["GET"])  # open: probes carry no key
        auth = [Depends(self._authorize)]
        api.add_api_route("/v1/models", self.models, methods=["GET"], dependencies=auth)
        api.add_api_route("/v1/relay/cues", self.active_cues, methods=["GET"], dependencies=auth)
        api.add_api_route("/v1/relay/stats", self.stats, methods=["GET"], dependencies=auth)
        for path, endpoint, model in (
            ("/v1/chat/completions", self.chat_completions, ChatCompletionRequest),
            ("/v1/completions", self.completions, CompletionRequest),
        ):
            # The body is read and checked by hand (size limit first); the schema is documented.
            extra = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}
            api.add_api_route(path, endpoint, methods=["POST"], dependencies=auth, openapi_extra=extra)
        api.openapi = lambda: _openapi_with_request_schemas(api)
        return api

    async def _authorize(self, request: Request) -> None:
        """With API keys configured, every route but /health needs ``Authorization: Bearer <key>``;
        keys are compared in constant time, each of them, whatever matched."""
        if not self.api_keys:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        token = given.strip().encode() if scheme.lower() == "bearer" else b""
        matched = False
        for key in self.api_keys:
            matched |= hmac.compare_digest(token, key)
        if not matched:
            raise ClientError(
                "a valid API key is required: send it as 'Authorization: Bearer <key>'",
                status=401,
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def health(self) -> JSONResponse:
        await self.cues.maybe_refresh()
        status = self.cues.status()
        body = {"status": "ok" if status["ok"] else "degraded", "cue_set": status}
        return JSONResponse(body)

    async def models(self) -> dict[str, Any]:
        prefix = self.cfg.router.model_name_prefix
        cards = [ModelCard(id=prefix + m, created=now(), description=MODEL_DESCRIPTIONS[m]) for m in POLICY_NAMES]
        return {"object": "list", "data": [c.model_dump() for c in cards]}

    async def active_cues(self) -> dict[str, Any]:
        await self.cues.maybe_refresh()
        return self.cues.describe()

    async def stats(self) -> dict[str, Any]:
        """This router replica's state: generations in flight, sessions pinned to replicas
        (leases held, or remembered by the affinity routers), segments in flight per model, open
        segment channels, its resident memory and the number of memory blocks Python has
        allocated (what a leak of Python objects would grow)."""
        import sys

        import psutil

        segments = getattr(self.backend, "in_flight", None)
        held = self.backend.stats()
        return {
            "in_flight": self.in_flight,
            "affinity_sessions": held.get("affinity_sessions", 0),
            "leases": held.get("leases"),
            "idle_leases": held.get("idle_leases"),
            "channels": held.get("channels"),
            "segments_in_flight": dict(segments) if isinstance(segments, dict) else None,
            "rss_bytes": psutil.Process().memory_info().rss,
            "python_blocks": sys.getallocatedblocks(),
        }

    async def chat_completions(self, request: Request):
        return await self._chat(await self._parse(request, ChatCompletionRequest))

    async def completions(self, request: Request):
        return await self._completion(await self._parse(request, CompletionRequest))

    async def _chat(self, req: ChatCompletionRequest):
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in req.messages]
        prompt_ids = self.codec.encode(self.codec.render_chat(messages))
        return await self._serve(req, prompt_ids, chat=True)

    async def _completion(self, req: CompletionRequest):
        if isinstance(req.prompt, list):
            vocab = len(self.codec.tokenizer)
            if any(not 0 <= t < vocab for t in req.prompt):
                raise ClientError(f"prompt token ids must lie in [0, {vocab})", param="prompt")
            prompt_ids = list(req.prompt)
        else:
            prompt_ids = self.codec.encode(req.prompt)
        return await self._serve(req, prompt_ids, chat=False)

    async def handle_request(self, body: dict[str, Any], chat: bool = True) -> dict[str, Any]:
        """For deployment-handle callers (batch jobs): one chat (or completion) request body in,
        ``{"response": ...}`` or ``{"error": {...OpenAI error...}, "status": <HTTP status>}`` out.
        Same validation, limits and policies as the HTTP API; no streaming."""
        try:
            req = self._validate(body, ChatCompletionRequest if chat else CompletionRequest)
            if req.stream:
                raise ClientError("stream is not supported through the deployment handle", param="stream")
            if chat:
                return {"response": await self._chat(req)}
            return {"response": await self._completion(req)}
        except (ClientError, ServerError) as e:
            return {**e.body(), "status": e.status}

    # ---- request handling ----------------------------------------------------------------------

    async def _parse(self, request: Request, model_cls):
        limit = self.cfg.router.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ClientError(f"the request body exceeds {limit} bytes", status=413, code="request_too_large")
        body = b""
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise ClientError(f"the request body exceeds {limit} bytes", status=413, code="request_too_large")
        try:
            data = json.loads(body)
        except UnicodeDecodeError as e:
            raise ClientError("the request body is not valid UTF-8", code="invalid_json") from e
        except (json.JSONDecodeError, RecursionError) as e:
            raise ClientError(f"the request body is not valid JSON: {e}", code="invalid_json") from e
        return self._validate(data, model_cls)

    def _validate(self, data: Any, model_cls):
        if not isinstance(data, dict):
            raise ClientError("the request body must be a JSON object", code="invalid_json")
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise ClientError(f"{param}: {err['msg']}", param=param) from None
        except RecursionError as e:
            raise ClientError("the request body is nested too deeply", code="invalid_json") from e
        if req.ignored_fields():
            log.info("ignoring unsupported request fields: %s", ", ".join(req.ignored_fields()))
        return req

    def _policy_name(self, model: str) -> str:
        prefix = self.cfg.router.model_name_prefix
        name = model[len(prefix) :] if prefix and model.startswith(prefix) else model
        if name not in POLICY_NAMES:
            known = ", ".join(prefix + m for m in POLICY_NAMES)
            raise ClientError(f"unknown model {model!r}; this service serves {known}", param="model", code="model_not_found")
        return name

    def _check(self, req, prompt_ids: list[int]) -> int:
        stops = req.stop_list()
        r = self.cfg.router
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

    def _session(self, req, prompt_ids: list[int], max_tokens: int, cue_set) -> Session:
        d = self.cfg.sampling
        sampling = SamplingSettings(
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_p=d.top_p if req.top_p is None else req.top_p,
            top_k=d.top_k if req.top_k is None else req.top_k,
            seed=req.seed,
        )
        return Session(
            backend=self.backend,
            codec=self.codec,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=sampling,
            session_id=new_id("gen"),
            user_stops=req.stop_list(),
            cue_set_version=cue_set.version,
            retries=self.cfg.router.segment_retries,
            retry_backoff_s=self.cfg.router.retry_backoff_s,
            small_timeout_s=self.cfg.router.small_timeout_s,
        )

    async def _serve(self, req, prompt_ids: list[int], chat: bool):
        name = self._policy_name(req.model)
        max_tokens = self._check(req, prompt_ids)
        await self.cues.maybe_refresh()
        cue_set = self.cues.active()  # the set this request starts with is the set it ends with
        session = self._session(req, prompt_ids, max_tokens, cue_set)
        policy = make_policy(name, self.cfg.policy, cue_set.cues)
        if req.stream:
            return StreamingResponse(self._stream(req, session, policy, chat), media_type="text/event-stream")
        self.in_flight += 1
        try:
            result = await asyncio.wait_for(session.run(policy), timeout=self.cfg.router.request_timeout_s)
        except asyncio.TimeoutError as e:
            raise ServerError(f"the generation took longer than {self.cfg.router.request_timeout_s} s", status=504) from e
        except Exception as e:  # noqa: BLE001 - typed for the client by _generation_failure
            raise _generation_failure(e, session.session_id) from e
        finally:
            self.in_flight -= 1
            self._release(session)
        return self._response(req, session, result, chat)

    def _release(self, session: Session) -> None:
        self.backend.release(session.session_id)

    def _usage(self, session: Session, result: GenerationResult) -> Usage:
        n_prompt, n_out = len(session.prompt_ids), len(result.token_ids)
        return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out, relay=result.usage)

    def _response(self, req, session: Session, result: GenerationResult, chat: bool) -> dict[str, Any]:
        common = dict(id=new_id("chatcmpl" if chat else "cmpl"), created=now(), model=req.model, usage=self._usage(session, result))
        trace = result.trace if req.relay_trace else None
        if chat:
            choice = ChatChoice(message={"role": "assistant", "content": result.text}, finish_reason=result.finish_reason)
            resp = ChatCompletionResponse(choices=[choice], relay_trace=trace, **common)
        else:
            resp = CompletionResponse(choices=[CompletionChoice(text=result.text, finish_reason=result.finish_reason)], relay_trace=trace, **common)
        body = resp.model_dump(exclude_none=True)
        if req.relay_trace:
            body["relay_engine_requests"] = [r.model_dump() for r in result.engine_requests]
        return body

    async def _stream(self, req, session: Session, policy, chat: bool) -> AsyncIterator[str]:
        rid = new_id("chatcmpl" if chat else "cmpl")
        created = now()
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None = None, first: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta else {})
                choice = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            return _sse({"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice]})

        self.in_flight += 1
        events = session.stream(policy)
        try:
            if chat:
                yield chunk(None, first=True)
            async with asyncio.timeout(self.cfg.router.request_timeout_s):
                async for ev in events:
                    if isinstance(ev, TextDelta):
                        yield chunk(ev.text)
                    else:
                        yield chunk(None, finish=ev.finish_reason)
                        if req.stream_options is not None and req.stream_options.include_usage:
                            tail = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": []}
                            tail["usage"] = self._usage(session, ev).model_dump()
                            if req.relay_trace:
                                tail["relay_trace"] = [s.model_dump() for s in ev.trace]
                                tail["relay_engine_requests"] = [r.model_dump() for r in ev.engine_requests]
                            yield _sse(tail)
        except TimeoutError:
            yield _sse(error_body(f"the generation took longer than {self.cfg.router.request_timeout_s} s", "server_error", code="timeout"))
        except Exception as e:  # noqa: BLE001 - reported to the client in the stream
            yield _sse(_generation_failure(e, session.session_id).body())
        finally:
            await events.aclose()
            self.in_flight -= 1
            self._release(session)
        yield "data: [DONE]\n\n"


def _generation_failure(e: Exception, session_id: str) -> ServerError:
    """What a client is told when a generation fails (HTTP status and body; in a stream, the body)."""
    if isinstance(e, SmallModelUnavailable):
        return ServerError(f"the small model is unavailable: {e}", status=503, code="model_unavailable")
    if isinstance(e, EngineError):
        log.warning("generation %s failed: %s", session_id, e)
        return ServerError(f"an engine failed: {e}", status=502, code="engine_error")
    log.error("generation %s failed", session_id, exc_info=e)
    return ServerError(f"the generation failed: {type(e).__name__}: {e}", status=502, code="engine_error")


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _client_error(request: Request, exc: ClientError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _server_error(request: Request, exc: ServerError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected error on %s", request.url.path, exc_info=exc)
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)


def _openapi_with_request_schemas(api: FastAPI) -> dict[str, Any]:
    """FastAPI's OpenAPI document plus the request bodies' JSON schemas (the routes read their
    bodies themselves, so FastAPI does not know them)."""
    if api.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=api.title, version=api.version, routes=api.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (ChatCompletionRequest, CompletionRequest):
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        api.openapi_schema = doc
    return api.openapi_schema


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("relay-serve")
    except PackageNotFoundError:
        return "0"
