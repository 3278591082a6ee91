"""A vocabulary of real size, made here (no download): 151,936 token texts shaped like a byte-level
BPE's (Qwen3's size), to test and measure what grows with the vocabulary (pause tokens, the hot
path) without the real tokenizer.

What a byte-level BPE's tokens decode to, alone: the 256 single bytes (printable ASCII as itself,
the rest as ``"\\ufffd"``: a piece of a multi-byte character decodes to the replacement character),
words with and without a leading space and capitalised, word pieces, punctuation alone and glued to
words and to newlines, single digits (Qwen splits numbers into digits), runs of spaces and
newlines, multi-byte characters (accented letters, CJK, symbols) and words holding them, and the
pair's special tokens at the end. Deterministic: the same list on every machine.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

QWEN3_VOCAB_SIZE = 151_936
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
_ONSETS = (
    "",
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "qu",
    "r",
    "s",
    "t",
    "v",
    "w",
    "x",
    "y",
    "z",
    "bl",
    "br",
    "ch",
    "cl",
    "cr",
    "dr",
    "fl",
    "fr",
    "gl",
    "gr",
    "ph",
    "pl",
    "pr",
    "sc",
    "sh",
    "sl",
    "sp",
    "st",
    "str",
    "th",
    "tr",
    "wh",
)
_NUCLEI = ("a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "ie", "io", "oo", "ou", "ue")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "d", "ng", "nd", "st", "ck", "nt", "rs", "sh", "th", "x")
_PUNCT = (
    ",",
    ".",
    ":",
    ";",
    "!",
    "?",
    ")",
    "(",
    "]",
    "[",
    "}",
    "{",
    '"',
    "'",
    "-",
    "--",
    "...",
    "/",
    "\\",
    "*",
    "+",
    "=",
    "<",
    ">",
    "_",
    "|",
    "^",
    "$",
    "%",
    "&",
    "#",
    "@",
    "~",
    "`",
)
_MULTIBYTE = "éèêëàâäçñöüßøåæœíóúÁÉÖÜαβγδεζηθλμπσφωΔΣΩ→←⇒≤≥≠∑∫√∞×÷·°•–—“”‘’…中文的是一不了人我在有他这为之大来以个国到说们和地也子时道出而要于就下得可你年生自会那后能对着事其里所去行过家十用发天如然作方成者多日都三小军二无同么经法当起与好看学进种将还分此心前面又定见只主没公从"  # noqa: E501


def _words(rng: random.Random, n: int) -> list[str]:
    out: dict[str, None] = {}
    while len(out) < n:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) for _ in range(rng.choice((1, 1, 2, 2, 2, 3))))
        out[word + rng.choice(_CODAS)] = None
    return list(out)


@cache
def synthetic_vocab(size: int = QWEN3_VOCAB_SIZE, seed: int = 0) -> tuple[str, ...]:
    """``size`` token texts (``texts[i]`` is token ``i`` decoded alone), the special tokens last.
    Texts repeat only where a real vocabulary's do (pieces of multi-byte characters)."""
    rng = random.Random(seed)
    texts: list[str] = [chr(b) if 32 <= b < 127 or b in (9, 10, 13) else "\ufffd" for b in range(256)]
    seen = set(texts)

    def add(text: str) -> None:
        if text and text not in seen:
            seen.add(text)
            texts.append(text)

    for n in range(2, 9):  # runs of spaces and newlines, and both
        add(" " * n)
        add("\n" * n)
        add(" " * (n - 1) + "\n")
        add("\n" + " " * (n - 1))
    for p in _PUNCT:
        for tail in ("", " ", "\n", "\n\n", ".\n", ",\n"):
            add(p + tail)
            add(" " + p + tail)
    for c in _MULTIBYTE:
        add(c)
        add(" " + c)
    budget = size - len(SPECIAL_TOKENS)
    words = _words(rng, budget)  # more than enough; forms are taken until the budget is met
    forms = (
        lambda w: " " + w,
        lambda w: w,
        lambda w: " " + w.capitalize(),
        lambda w: w.capitalize(),
        lambda w: w + rng.choice(",.:;)"),
        lambda w: " " + w + rng.choice((",", ".", ".\n", ".\n\n", ":", "'s")),
        lambda w: w[: max(1, len(w) // 2)],  # a word piece
        lambda w: " " + w + rng.choice(_MULTIBYTE),
        lambda w: rng.choice(_MULTIBYTE) + w,
        lambda w: " " + w.upper(),
    )
    weights = (30, 20, 12, 6, 6, 8, 10, 3, 2, 3)
    i = 0
    while len(texts) < budget:
        add(rng.choices(forms, weights)[0](words[i % len(words)]))
        i += 1
    texts.extend(SPECIAL_TOKENS)
    return tuple(texts)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(path: Path, size: int = QWEN3_VOCAB_SIZE) -> Path:
    """A transformers fast tokenizer over :func:`synthetic_vocab` in ``path`` (``AutoTokenizer``
    loads it): a unigram model whose pieces are the token texts (a piece of a multi-byte character
    is a byte token, as in a byte-level BPE), decoding by concatenation, the special tokens as
    special tokens, a ChatML template. Each id decodes alone to ``synthetic_vocab()[id]``."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    texts = synthetic_vocab(size)
    pieces = [
        (f"<0x{i:02X}>" if t == "\ufffd" else t, -20.0 if i < 256 else -(len(t) ** 0.5)) for i, t in enumerate(texts)
    ]
    tok = Tokenizer(models.Unigram(pieces, unk_id=None, byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path
