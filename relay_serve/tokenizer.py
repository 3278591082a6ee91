"""The shared tokenizer as the router and the engines see it (a transformers fast tokenizer)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from functools import lru_cache


class Codec:
    """encode/decode for the relay core, plus the chat template. Special tokens (end of turn) are
    left out of decoded text; added tokens such as ``<think>`` are kept."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.path = path

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

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
