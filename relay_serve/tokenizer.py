"""The shared tokenizer as the router and the engines see it (a transformers fast tokenizer), and
the start-up checks of a pair: one tokenizer for both models, and a reasoning end marker that
survives the router's decoding. No Ray, no vLLM, no HTTP."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from relay_serve.relay.text import THINK_CLOSE, THINK_OPEN

if TYPE_CHECKING:
    from relay_serve.config import AppConfig


class TokenizerMismatch(RuntimeError):
    pass


class MarkerLost(RuntimeError):
    """The reasoning end marker does not come back from the router's decoding."""


class Codec:
    """encode/decode for the relay core, plus the chat template. Special tokens (end of turn) are
    left out of decoded text; added tokens such as ``<think>`` are kept, and so are the reasoning
    markers where a tokenizer makes them special tokens (the policies look for them in the text)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.path = path
        vocab = self.tokenizer.get_vocab()
        kept = {vocab[m] for m in (THINK_OPEN, THINK_CLOSE) if m in vocab}
        self._dropped = frozenset(self.tokenizer.all_special_ids) - kept

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        ids = [i for i in token_ids if i not in self._dropped]
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    @property
    def fingerprint(self) -> str:
        return tokenizer_fingerprint(self.tokenizer)


def tokenizer_fingerprint(tokenizer) -> str:
    """Identical for tokenizers that map every string to the same ids."""
    vocab = sorted(tokenizer.get_vocab().items())
    added = sorted((t.content, t.special) for t in tokenizer.added_tokens_decoder.values())
    blob = json.dumps([vocab, added, tokenizer.eos_token], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@lru_cache(maxsize=8)
def load_codec(path: str) -> Codec:
    return Codec(path)


def check_marker(codec: Codec, marker: str) -> None:
    """Refuse a pair whose decoding loses the reasoning end marker: the relay would never see the
    reasoning end, and the small model would never write the answer."""
    ids = codec.encode(marker)
    if codec.decode(ids) != marker or codec.decode(codec.encode("x" + marker + "y")) != "x" + marker + "y":
        raise MarkerLost(
            f"the reasoning end marker {marker!r} does not survive the tokenizer at {codec.path} (tokens {ids} decode to "
            f"{codec.decode(ids)!r}); set policy.think_close to the marker this model writes"
        )


def check_pair(cfg: AppConfig) -> Codec:
    """The pair must share a tokenizer (handoffs pass token ids) whose decoding keeps the reasoning
    end marker; refuse other pairs at start-up. Returns the shared codec."""
    large, small = load_codec(cfg.large.tokenizer_path), load_codec(cfg.small.tokenizer_path)
    if large.fingerprint != small.fingerprint:
        raise TokenizerMismatch(
            f"the large model's tokenizer ({cfg.large.tokenizer_path}, {large.fingerprint}) differs from the "
            f"small model's ({cfg.small.tokenizer_path}, {small.fingerprint}); relay-serve hands token ids "
            "between the two models and needs a pair that shares one tokenizer"
        )
    check_marker(large, cfg.policy.think_close)
    return large
