"""The client side of a relay-serve API (or of any OpenAI-compatible server): the one way eval,
bench, soak and batch build a chat request body, and the HTTP client they send it with. Knows
nothing of Ray or of the server's internals."""

from __future__ import annotations

from typing import Any

from relay_serve import envs

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")


class RequestFailed(RuntimeError):
    """A request that did not answer 200."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:500]}")
        self.status = status


def api_headers() -> dict[str, str]:
    """What a client of a relay-serve API sends: RELAY_API_KEY as a Bearer key, when it is set."""
    key = envs.api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def http_client(timeout: float = 600.0):
    """An async HTTP client for a relay-serve API (eval, bench, soak)."""
    import httpx

    return httpx.AsyncClient(timeout=timeout, headers=api_headers())


def chat_body(
    model: str, prompt: str | None = None, messages: list[dict[str, Any]] | None = None, **fields: Any
) -> dict[str, Any]:
    """An OpenAI chat completion body: one user ``prompt`` (or ``messages``) and the other
    ``fields`` (sampling settings, ``stream``, ``relay_trace``, ...); fields set to None are left out."""
    if (prompt is None) == (messages is None):
        raise ValueError("give a prompt or messages")
    body: dict[str, Any] = {
        "model": model,
        "messages": messages if messages is not None else [{"role": "user", "content": prompt}],
    }
    body.update({k: v for k, v in fields.items() if v is not None})
    return body


async def post_chat(client, base: str, body: dict[str, Any]) -> dict[str, Any]:
    """The response of one non-streamed chat request; RequestFailed unless it answered 200."""
    r = await client.post(base + "/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise RequestFailed(r.status_code, r.text)
    return r.json()
