import random

from relay_serve.toy.tokenizer import TOKENIZER_DIR, build_tokenizer, load_tokenizer
from relay_serve.toy.world import ToyWorld


def test_round_trip_and_special_tokens_survive():
    tok = load_tokenizer()
    w = ToyWorld()
    t = w.trace(w.heldout_problems[0], random.Random(0))
    ids = tok.encode(t.completion, add_special_tokens=False)
    assert tok.decode(ids) == t.completion
    think, close = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert ids[0] == think and close in ids  # atomic, never split
    assert tok.decode(ids, skip_special_tokens=True) == t.completion  # kept in text, like Qwen3
    # any text still encodes (byte-level), and round-trips
    odd = "Ünïcödé, 3.5 € and tabs\tand\n\nnew lines"
    assert tok.decode(tok.encode(odd, add_special_tokens=False)) == odd


def test_toy_words_are_single_tokens():
    tok = load_tokenizer()
    for piece in [" b3", "Thus", ",", " ->", "\n", " we", "Therefore"]:
        n = len(tok.encode(piece, add_special_tokens=False))
        assert n <= 2, (piece, n)  # an entity is a letter and a number
    assert len(tok.encode("Thus", add_special_tokens=False)) == 1


def test_chat_template():
    tok = load_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"


def test_the_committed_tokenizer_is_what_the_build_makes(tmp_path):
    build_tokenizer(ToyWorld(), tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == (TOKENIZER_DIR / "tokenizer.json").read_text()


def test_the_spare_ids_are_tokens_no_toy_text_holds():
    """The stand-ins of the look-ahead inside the engine: no token of any trace of the toy world,
    no special token; a config's own list (``[]``: none) is taken as it is."""
    from relay_serve.config import ModelSettings, resolve_model
    from relay_serve.tokenizer import load_codec
    from relay_serve.toy.tokenizer import spare_token_ids
    from relay_serve.toy.world import ToyWorld

    path = resolve_model("toy:large")
    codec = load_codec(path)
    spare = set(spare_token_ids(path))
    written = {t for text in ToyWorld().corpus() for t in codec.encode(text)}
    assert len(spare) > 100 and not spare & written
    assert not spare & set(codec.tokenizer.all_special_ids) and codec.encode("</think>")[0] not in spare
    assert ModelSettings(model="toy:large").resolved_spare_token_ids == sorted(spare)
    assert ModelSettings(model="toy:large", spare_token_ids=[]).resolved_spare_token_ids == []
    assert ModelSettings(model="Qwen/Qwen3-32B").resolved_spare_token_ids is None  # the engine's own
