"""API keys: optional, read from a file or a named environment variable, Bearer auth on every
route but /health; a named source that is missing is a start-up error, never an open API."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from relay_serve.config import RouterSettings
from tests.serve.test_router import chat, make_router


def request(router, method, path, key=None, body=None, scheme="Bearer"):
    async def go():
        headers = {"authorization": f"{scheme} {key}"} if key is not None else {}
        transport = httpx.ASGITransport(app=router.api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.request(method, path, json=body, headers=headers)

    return asyncio.run(go())


@pytest.fixture
def keyed(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# one key a line\nkey-from-file\n\n  second-key  \n")
    monkeypatch.setenv("TEST_RELAY_KEY", "key-from-env")
    router, backend = make_router(api_key_file=str(keys), api_key_env="TEST_RELAY_KEY")
    return router, backend


@pytest.mark.parametrize("key", ["key-from-file", "second-key", "key-from-env"])
def test_every_configured_key_is_accepted(keyed, key):
    router, _ = keyed
    assert request(router, "POST", "/v1/chat/completions", key, chat(max_tokens=20)).status_code == 200
    assert request(router, "GET", "/v1/models", key).status_code == 200


@pytest.mark.parametrize(
    "key, scheme",
    [(None, "Bearer"), ("wrong", "Bearer"), ("key-from-fil", "Bearer"), ("key-from-file", "Basic"), ("", "Bearer")],
)
@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/v1/relay/cues"),
        ("GET", "/v1/relay/stats"),
    ],
)
def test_a_missing_or_wrong_key_is_a_401_before_any_work(keyed, key, scheme, method, path):
    router, backend = keyed
    body = (
        chat() if path == "/v1/chat/completions" else ({"model": "relay", "prompt": "x"} if method == "POST" else None)
    )
    r = request(router, method, path, key, body, scheme=scheme)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key" and "Bearer" in r.json()["error"]["message"]
    assert backend.requests == []


def test_health_stays_open(keyed):
    router, _ = keyed
    assert request(router, "GET", "/health").status_code == 200


def test_without_keys_the_api_is_open():
    router, _ = make_router()
    assert request(router, "GET", "/v1/models").status_code == 200


def test_a_named_key_source_that_is_missing_stops_the_start(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_RELAY_KEY", raising=False)
    with pytest.raises(ValueError, match="NO_SUCH_RELAY_KEY is not set"):
        RouterSettings(api_key_env="NO_SUCH_RELAY_KEY").api_keys()
    with pytest.raises(ValueError, match="cannot read"):
        RouterSettings(api_key_file=str(tmp_path / "absent")).api_keys()
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        RouterSettings(api_key_file=str(tmp_path / "empty")).api_keys()
