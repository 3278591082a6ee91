"""Incremental detokenization: a token at a time, the text a whole decode gives.

Oracles written apart from the code: the toy tokenizer's own whole decode, Python's UTF-8 decoder,
and the synthetic vocabulary's contract (token ``i`` decodes alone to ``synthetic_vocab()[i]`` and a
sequence to their concatenation)."""

from __future__ import annotations

import tempfile
from functools import cache
from itertools import pairwise
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay_serve.relay.detok import MAX_PENDING, WindowStream
from relay_serve.relay.output import Output
from relay_serve.tokenizer import Codec, FastStream, load_codec
from relay_serve.toy.tokenizer import TOKENIZER_DIR
from relay_serve.toy.vocab import synthetic_vocab, write_tokenizer

TEXT = st.lists(st.sampled_from(list("ab Thus,.\n42éÜ中文→🙂") + ["</think>", "<think>", "  "]), max_size=40).map(
    "".join
)
LIVE = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@cache
def toy() -> Codec:
    return load_codec(str(TOKENIZER_DIR))


@cache
def synthetic() -> Codec:
    return load_codec(str(write_tokenizer(Path(tempfile.mkdtemp()) / "tok")))


def pieces(stream, ids):
    """What the stream gives for each token, and the text so far after each."""
    out, text = [], ""
    for i in ids:
        piece = stream.step(i)
        out.append(piece)
        text += piece or ""
    return out, text


@LIVE
@given(text=TEXT, cut=st.integers(0, 80))
def test_both_streams_give_the_whole_decode_a_token_at_a_time_and_never_take_text_back(text, cut):
    codec = toy()
    ids = codec.encode(text)
    whole = codec.decode(ids)
    assert whole == text  # the oracle: the toy's byte-level BPE decodes what it encoded
    for stream in (codec.stream(), WindowStream(codec.decode)):
        assert isinstance(codec.stream(), FastStream)
        got, so_far = "", []
        for piece in pieces(stream, ids)[0]:
            got += piece or ""
            so_far.append(got)
        assert got == whole
        assert all(whole.startswith(p) for p in so_far)
    # after a context: the text the rest adds, where the context ends between characters
    k = min(cut, len(ids))
    head = codec.decode(ids[:k])
    if whole.startswith(head):
        for stream in (codec.stream(ids[:k]), WindowStream(codec.decode, ids[:k])):
            assert pieces(stream, ids[k:])[1] == whole[len(head) :]


@LIVE
@given(
    text=st.text(
        alphabet=st.characters(
            min_codepoint=0x80, max_codepoint=0x10FFFF, exclude_categories=("Cs",), exclude_characters="\ufffd"
        ),
        min_size=1,
        max_size=8,
    )
)
def test_a_multi_byte_character_written_byte_by_byte_waits_for_its_last_byte(text):
    """Byte tokens (ids 0-255 of the synthetic vocabulary) write characters of 2 to 4 bytes: no text
    until the character is whole, then exactly it. (U+FFFD itself is left out: written, it looks
    like a character still being decoded, here as in vLLM's detokenizer, and waits for the next.)"""
    codec = synthetic()
    data = text.encode()
    got, text_so_far = pieces(codec.stream(), list(data))
    assert text_so_far == text
    ends = set()  # the byte offsets where a character is whole
    for i in range(1, len(data) + 1):
        try:
            data[:i].decode()
            ends.add(i)
        except UnicodeDecodeError:
            pass
    assert {i + 1 for i, p in enumerate(got) if p is not None} == ends


@LIVE
@given(data=st.data())
def test_a_real_size_vocabulary_streams_its_token_texts(data):
    """151,936 tokens: words, punctuation, digits, white space; each writes its own text."""
    codec, texts = synthetic(), synthetic_vocab()
    whole = [i for i in range(256, len(texts) - 30) if "\ufffd" not in texts[i]]
    ids = data.draw(st.lists(st.sampled_from(whole), max_size=40))
    assert pieces(codec.stream(), ids)[1] == "".join(texts[i] for i in ids)


def test_broken_bytes_become_replacement_characters_after_a_characters_worth_of_tokens():
    codec = synthetic()
    broken = [0xE4, 0xB8, 0xE4, 0xB8, 0xE4]  # starts of 3-byte characters that never end
    for stream in (codec.stream(), WindowStream(codec.decode)):
        got, text = pieces(stream, broken + [ord("a")])
        assert got[: MAX_PENDING - 1] == [None] * (MAX_PENDING - 1)  # might still be one character
        assert got[MAX_PENDING - 1] is not None and "\ufffd" in got[MAX_PENDING - 1]
        assert text.endswith("a") and stream.pending == 0


def test_special_tokens_the_codec_drops_write_nothing_even_between_the_bytes_of_a_character():
    codec = toy()
    dropped = min(codec._dropped)
    ids = codec.encode("é中")
    mixed = ids[:1] + [dropped] + ids[1:] + [dropped]
    assert pieces(codec.stream(), mixed)[1] == codec.decode(mixed) == "é中"


@LIVE
@given(
    text=TEXT,
    sizes=st.lists(st.integers(1, 7), min_size=1, max_size=30),
    stop=st.sampled_from(["", "Thus", "\n", "中"]),
)
def test_output_text_is_the_decoding_of_its_ids_however_the_tokens_come(text, sizes, stop):
    """The router's Output, fed the tokens in chunks of any size: its text is the whole decode of
    its ids; a user stop cuts both, and what comes after the cut decodes on from there."""
    codec = toy()
    ids = codec.encode(text)
    out = Output(codec, user_stops=[stop] if stop else None)
    at = 0
    for n in sizes:
        out.append(ids[at : at + n], "large")
        at += n
    out.append(ids[at:], "small")
    if out.stopped:
        assert stop in text and out.text == text[: text.index(stop)]
        assert codec.decode(out.ids).startswith(out.text)
    else:
        assert out.text == codec.decode(out.ids) == text
    assert all(a <= b for a, b in pairwise(out.starts))


@LIVE
@given(text=TEXT, more=TEXT, keep=st.integers(0, 60))
def test_output_decodes_on_after_tokens_are_taken_back(text, more, keep):
    """The session takes tokens back (a sentence end, a cue the large model must rewrite) and
    appends others: the text stays the decoding of the ids that stand."""
    codec = toy()
    ids = codec.encode(text)
    out = Output(codec)
    out.append(ids, "large")
    k = min(keep, len(ids))
    out.truncate(out.starts[k] if k < len(ids) else len(out.text))
    out.append(codec.encode(more), "small")
    assert out.text == codec.decode(out.ids)


def test_a_character_cut_in_half_by_a_take_back_leaves_nothing_behind():
    codec = toy()
    half = codec.encode("中")
    assert len(half) > 1  # a byte-level BPE writes it in pieces
    out = Output(codec)
    out.append(codec.encode("ab") + half[:1], "large")
    assert out.text == "ab"  # the first piece waits for the rest
    out.truncate(len(out.text))  # the waiting piece goes
    out.append(codec.encode(" c"), "small")
    assert out.text == codec.decode(out.ids) == "ab c"
