"""The shared tokenizer as the router and the engines see it (a transformers fast tokenizer), and
the start-up checks of a pair: one tokenizer for both models, and a reasoning end marker that
survives the router's decoding. No Ray, no vLLM, no HTTP."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from relay_serve.relay.detok import Decode, TokenStream, WindowStream
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

    def __init__(self, tokenizer, source: str) -> None:
        self.tokenizer = tokenizer
        self.path = source  # where it was loaded from, for messages
        vocab = self.tokenizer.get_vocab()
        kept = {vocab[m] for m in (THINK_OPEN, THINK_CLOSE) if m in vocab}
        self._dropped = frozenset(self.tokenizer.all_special_ids) - kept

    @classmethod
    def from_path(cls, path: str) -> Codec:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), path)

    @classmethod
    def from_files(cls, files: dict[str, bytes], source: str) -> Codec:
        """The tokenizer saved as ``files`` (``tokenizer_files``) where the model files are not:
        the router gets them from a model replica."""
        import tempfile

        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory(prefix="relay-tokenizer-") as folder:
            for name, data in files.items():
                if Path(name).name != name:
                    raise ValueError(f"a tokenizer file name must be a bare name, not {name!r}")
                (Path(folder) / name).write_bytes(data)
            return cls(AutoTokenizer.from_pretrained(folder), source)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        ids = [i for i in token_ids if i not in self._dropped]
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def stream(self, context: Sequence[int] = ()) -> TokenStream:
        """Incremental decoding of the tokens that follow ``context``: the text ``decode`` gives, a token at a time."""
        return token_stream(self.tokenizer, self.decode, context, skip=self._dropped, skip_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    @property
    def fingerprint(self) -> str:
        return tokenizer_fingerprint(self.tokenizer)


class FastStream(TokenStream):
    """A fast tokenizer's own incremental decoder (tokenizers' ``DecodeStream``, as vLLM's
    detokenizer uses it): O(1) a token, where a window decodes twice a token."""

    def __init__(
        self, backend, decode: Decode, context: Sequence[int], skip: frozenset[int], skip_special_tokens: bool
    ) -> None:
        self.backend, self.skip, self.skip_special_tokens = backend, skip, skip_special_tokens
        super().__init__(decode, context)
        self._resync()

    def _resync(self) -> None:
        from tokenizers.decoders import DecodeStream

        ids = [i for i in self.ids if i not in self.skip]
        self._decoder = DecodeStream(ids=ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, token_id: int) -> str | None:
        if token_id in self.skip:  # writes no text: nothing to give unless other tokens wait for theirs
            return "" if self.pending == 1 else None
        return self._decoder.step(self.backend, token_id)


def token_stream(
    tokenizer,
    decode: Decode,
    context: Sequence[int] = (),
    skip: frozenset[int] = frozenset(),
    skip_special_tokens: bool = False,
) -> TokenStream:
    """The incremental decoder of a transformers tokenizer: its fast backend's where it has one, a
    window over ``decode`` where not."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return WindowStream(decode, context)
    return FastStream(backend, decode, context, skip, skip_special_tokens)


def tokenizer_fingerprint(tokenizer) -> str:
    """Identical for tokenizers that map every string to the same ids."""
    vocab = sorted(tokenizer.get_vocab().items())
    added = sorted((t.content, t.special) for t in tokenizer.added_tokens_decoder.values())
    blob = json.dumps([vocab, added, tokenizer.eos_token], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """``tokenizer`` as the files ``save_pretrained`` writes (vocabulary, merges, added tokens,
    chat template), to rebuild it where its model's folder cannot be read."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="relay-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        return {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}


@lru_cache(maxsize=8)
def load_codec(path: str) -> Codec:
    return Codec.from_path(path)


def check_marker(codec: Codec, marker: str) -> None:
    """Refuse a pair whose decoding loses the reasoning end marker: the relay would never see the
    reasoning end, and the small model would never write the answer."""
    ids = codec.encode(marker)
    if codec.decode(ids) != marker or codec.decode(codec.encode("x" + marker + "y")) != "x" + marker + "y":
        raise MarkerLost(
            f"the reasoning end marker {marker!r} does not survive the tokenizer at {codec.path} (tokens {ids} decode "
            "to "
            f"{codec.decode(ids)!r}); set policy.think_close to the marker this model writes"
        )


def check_shared(large: str, small: str, large_from: str, small_from: str) -> None:
    """The pair must share a tokenizer (handoffs pass token ids): refuse two fingerprints that differ."""
    if large != small:
        raise TokenizerMismatch(
            f"the large model's tokenizer ({large_from}, {large}) differs from the small model's ({small_from}, "
            f"{small}); "
            "relay-serve hands token ids between the two models and needs a pair that shares one tokenizer"
        )


def check_pair(cfg: AppConfig) -> Codec:
    """From the model files where this runs (the calibration job, the CLI): the pair shares a
    tokenizer whose decoding keeps the reasoning end marker. Returns the shared codec. The router
    makes the same checks with what the model replicas report (``router/startup.py``)."""
    large, small = load_codec(cfg.large.tokenizer_path), load_codec(cfg.small.tokenizer_path)
    check_shared(large.fingerprint, small.fingerprint, cfg.large.tokenizer_path, cfg.small.tokenizer_path)
    check_marker(large, cfg.policy.think_close)
    return large
