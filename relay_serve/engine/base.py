"""The engine interface a ModelServer wraps. Implemented by VLLMEngine (vllm_engine.py, the only
module that imports vLLM) and by fakes in the tests."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from pydantic import BaseModel, Field

from relay_serve.relay.types import EngineChunk, SegmentRequest


class EngineInfo(BaseModel):
    model: str
    max_model_len: int
    tokenizer_fingerprint: str = Field(description="sha256 of the tokenizer's vocabulary and added tokens")


class Engine(ABC):
    """One inference engine for one model."""

    @abstractmethod
    def generate(self, request: SegmentRequest, request_id: str, stream: bool = True) -> AsyncIterator[EngineChunk]:
        """Stream the output of one request; closing the iterator aborts it. Without ``stream``
        the engine may deliver the whole output as one final chunk."""

    @abstractmethod
    async def score(self, token_ids: list[int], start: int, top_k: int = 2) -> list[list[float]]:
        """Teacher-forced scoring: for each position ``i >= start`` of ``token_ids``, the ``top_k``
        largest log-probabilities of the model's distribution for token ``i`` given ``token_ids[:i]``."""

    @abstractmethod
    def info(self) -> EngineInfo: ...

    @abstractmethod
    async def check_health(self) -> None:
        """Raise when the engine cannot serve."""

    def shutdown(self) -> None:  # noqa: B027 - optional
        pass
