"""The HTTP surface of the router: routes, API keys, request bodies read under a size limit and
validated, OpenAI-style error bodies, and the OpenAPI document. What the routes do is the
router's (``router.py``)."""

from __future__ import annotations

import hmac
import json
import logging
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from relay_serve.router.openai_api import (
    ChatCompletionRequest,
    ClientError,
    CompletionRequest,
    ServerError,
    error_body,
)

if TYPE_CHECKING:
    from relay_serve.router.ingress import RelayRouter

log = logging.getLogger(__name__)

RequestModel = TypeVar("RequestModel", bound=BaseModel)


def build_api(router: RelayRouter) -> FastAPI:
    """The FastAPI app: ``/health`` open (probes carry no key), every other route behind the
    router's API keys."""
    api = FastAPI(title="relay-serve", version=_version())
    api.add_exception_handler(ClientError, _client_error)
    api.add_exception_handler(ServerError, _server_error)
    api.add_exception_handler(StarletteHTTPException, _http_error)
    api.add_exception_handler(Exception, _unexpected_error)
    api.add_api_route("/health", router.health, methods=["GET"])
    auth = [Depends(ApiKeys(router.cfg.router.api_keys()))]
    api.add_api_route("/v1/models", router.models, methods=["GET"], dependencies=auth)
    api.add_api_route("/v1/relay/cues", router.active_cues, methods=["GET"], dependencies=auth)
    api.add_api_route("/v1/relay/stats", router.stats, methods=["GET"], dependencies=auth)
    for path, endpoint, model in (
        ("/v1/chat/completions", router.chat_completions, ChatCompletionRequest),
        ("/v1/completions", router.completions, CompletionRequest),
    ):
        # The body is read and checked by hand (size limit first); the schema is documented.
        extra = {
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
            }
        }
        api.add_api_route(path, endpoint, methods=["POST"], dependencies=auth, openapi_extra=extra)
    api.openapi = lambda: _openapi_with_request_schemas(api)
    return api


class ApiKeys:
    """With API keys configured, a request needs ``Authorization: Bearer <key>``; keys are compared
    in constant time, each of them, whatever matched."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = [k.encode() for k in keys]

    async def __call__(self, request: Request) -> None:
        if not self.keys:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        token = given.strip().encode() if scheme.lower() == "bearer" else b""
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(token, key)
        if not matched:
            raise ClientError(
                "a valid API key is required: send it as 'Authorization: Bearer <key>'",
                status=401,
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )


async def read_request(request: Request, model_cls: type[RequestModel], limit: int) -> RequestModel:
    """The body of ``request`` as ``model_cls``: at most ``limit`` bytes, whether or not it says
    how long it is (413), valid UTF-8 JSON (400), valid fields (400 naming the field)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ClientError(f"the request body exceeds {limit} bytes", status=413, code="request_too_large")
    body = bytearray()
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
    return validate(data, model_cls)


def validate(data: Any, model_cls: type[RequestModel]) -> RequestModel:
    """``data`` (a parsed body, or a deployment-handle caller's dict) as ``model_cls``."""
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
