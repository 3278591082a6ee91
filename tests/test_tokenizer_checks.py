"""The router's decoding keeps the reasoning markers even where a tokenizer makes them special
tokens, and a pair whose decoding loses the reasoning end marker is refused at start-up."""

from __future__ import annotations

import pytest

from relay_serve.toy.tokenizer import TOKENIZER_DIR


def special_think_tokenizer(tmp_path):
    """The toy tokenizer with </think> registered as a special token (as some chat models do)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    tok.add_special_tokens({"additional_special_tokens": ["</think>"]})
    assert "</think>" in tok.all_special_tokens
    assert "</think>" not in tok.decode(tok.encode("a</think>b", add_special_tokens=False), skip_special_tokens=True)
    tok.save_pretrained(str(tmp_path))
    return str(tmp_path)


def test_a_special_think_token_is_kept_and_end_of_turn_is_dropped(tmp_path):
    from relay_serve.tokenizer import Codec, check_marker

    codec = Codec.from_path(special_think_tokenizer(tmp_path))
    ids = codec.encode("so</think>\n\nok")
    assert codec.decode(ids + [codec.tokenizer.eos_token_id]) == "so</think>\n\nok"  # EOS dropped, the marker kept
    check_marker(codec, "</think>")


def test_a_marker_the_decoding_loses_is_refused_at_start_up():
    from relay_serve.config import AppConfig
    from relay_serve.tokenizer import MarkerLost, check_pair

    cfg = AppConfig.model_validate({"policy": {"think_close": "<|im_end|>"}})  # an end-of-turn token: dropped
    with pytest.raises(MarkerLost, match="does not survive the tokenizer"):
        check_pair(cfg)
    assert check_pair(AppConfig()).path.endswith("toy/models/large")
