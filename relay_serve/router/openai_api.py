"""OpenAI-compatible request and response types, and the errors typed by who is at fault.

Requests are lenient: unknown OpenAI fields are accepted and ignored (the router logs them).
Settings are strict elsewhere. No Ray, no vLLM.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
)

from relay_serve.relay.types import RelayUsage, TraceSegment


class ClientError(Exception):
    """The request is at fault: HTTP 4xx with the parameter named."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.headers = message, param, status, code, headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, "invalid_request_error", self.param, self.code)


class ServerError(Exception):
    """The service is at fault: HTTP 5xx."""

    def __init__(self, message: str, status: int = 500, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.code = message, status, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, "server_error", None, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class _SamplingRequest(_Lenient):
    model: str
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    relay_trace: StrictBool = False
    relay_cues: list[str] | None = Field(
        None, description="relay only: the cues of this request instead of the active cue set (never written to it)"
    )
    user: str | None = None

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _no_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("must be a number")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and v < 1:
            raise ValueError("top_k must be -1 (off) or at least 1")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[StrictInt] | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        return v


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    relay: RelayUsage


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ChatChoice(BaseModel):
    index: int = 0
    message: dict[str, Any]
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    relay_trace: list[TraceSegment] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    relay_trace: list[TraceSegment] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "relay-serve"
    description: str = ""
