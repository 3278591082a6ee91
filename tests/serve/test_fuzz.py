"""Hostile input against the router's HTTP API (scripted backend, no Ray): whatever arrives, the
answer is a success or a 4xx with an OpenAI error body, never a 5xx or a stack trace.

Schemathesis generates requests from the app's own OpenAPI document (positive and negative
cases); hypothesis replaces fields of a valid request with arbitrary JSON and sends raw bytes.
"""

from __future__ import annotations

import json

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.test_router import call, chat, make_router

ROUTER, BACKEND = make_router()
schema = schemathesis.openapi.from_asgi("/openapi.json", ROUTER.api)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def check_answer(status: int, body: bytes, content_type: str) -> None:
    assert status < 500, (status, body[:400])
    assert b"Traceback" not in body and b'File "' not in body
    if status >= 400:
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert err["type"] == "invalid_request_error"
    elif "text/event-stream" in content_type:
        assert body.rstrip().endswith(b"data: [DONE]")


def test_the_openapi_document_describes_the_request_bodies():
    doc = ROUTER.api.openapi()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]


@schema.parametrize()
@FUZZ
def test_schema_driven_requests_never_cause_a_server_error(case):
    r = case.call()
    check_answer(r.status_code, r.content, r.headers.get("content-type", ""))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "relay_trace",
    "user",
]


@given(field=st.sampled_from(FIELDS), value=JSON, stream=st.booleans())
@FUZZ
def test_any_json_in_any_field_is_answered_cleanly(field, value, stream):
    body = {**chat(max_tokens=40, stream=stream), field: value}
    r = call(ROUTER, "POST", "/v1/chat/completions", body)
    check_answer(r.status_code, r.content, r.headers.get("content-type", ""))


@given(content=st.binary(max_size=300))
@FUZZ
def test_any_bytes_are_answered_cleanly(content):
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = call(ROUTER, "POST", path, content=content)
        check_answer(r.status_code, r.content, r.headers.get("content-type", ""))
        assert r.status_code == 400


def test_deep_nesting_and_invalid_utf8_inside_a_valid_shape_are_400s():
    deep = b'{"model": "relay", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    bad_utf8 = b'{"model": "relay", "messages": [{"role": "user", "content": "\xc3\x28"}]}'
    for content in (deep, bad_utf8):
        r = call(ROUTER, "POST", "/v1/chat/completions", content=content)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


def test_a_model_name_never_reaches_a_path():
    for model in ("../../etc/passwd", "/etc/passwd", "toy:large", "file:///etc/passwd"):
        r = call(ROUTER, "POST", "/v1/chat/completions", chat(model=model))
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
