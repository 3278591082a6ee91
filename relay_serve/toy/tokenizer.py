"""The toy pair's shared tokenizer: byte-level BPE whose merges make every word of the toy world one
token, so any text still encodes (as bytes) while toy traces stay short.

``<think>`` and ``</think>`` are atomic added tokens that are kept in decoded text (as in Qwen3's
tokenizer); ``<|im_start|>``, ``<|im_end|>`` and ``<|endoftext|>`` are special tokens.
"""

from __future__ import annotations

from pathlib import Path

from relay_serve.toy.world import THINK_CLOSE, THINK_OPEN, ToyWorld

TOKENIZER_DIR = Path(__file__).parent / "tokenizer"
PAD, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]
THINK_TOKENS = [THINK_OPEN, THINK_CLOSE]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def build_tokenizer(world: ToyWorld, out_dir: Path = TOKENIZER_DIR) -> Path:
    """Train the BPE on the world's corpus and save a transformers fast tokenizer in ``out_dir``."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    chat_words = ["user\nassistant\nsystem\n", "The answer is"]
    corpus = [c.replace(THINK_OPEN, "").replace(THINK_CLOSE, "") for c in world.corpus()]
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
    )
    tok.train_from_iterator(corpus + chat_words, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=None,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


def load_tokenizer(path: Path = TOKENIZER_DIR):  # -> PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def spare_token_ids(path: str, world: ToyWorld | None = None) -> list[int]:
    """The toy tokenizer's ids the toy models never write: every token (not a special one) whose
    text holds a character that no text of the toy world has (``$``, ``A``, ``é``, ...). The
    engine uses them as stand-ins (``engine/vllm_swaps.py``) and masks them in relay segments."""
    from relay_serve.tokenizer import load_codec

    alphabet = set("".join((world or ToyWorld()).corpus()))
    tokenizer = load_codec(path).tokenizer
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return [
        i
        for i in range(len(tokenizer))
        if i not in special and not set(tokenizer.decode([i], clean_up_tokenization_spaces=False)) <= alphabet
    ]
