"""A speed-only pair for CPU benchmarks: random weights (seeded), the toy tokenizer, a large model
that costs about ten times the small one per token. Written to the state folder on first use
(about 0.5 GB), never committed. Its text is noise: it runs recorded schedules (replay mode)."""

from __future__ import annotations

import shutil
from pathlib import Path

from pydantic import BaseModel

from relay_serve import envs


class SpeedModel(BaseModel):
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int


# 4 layers: about 20 ms a token here against the small one's 2 (10x; measured in `relay-serve bench`)
SPEED_LARGE = SpeedModel(name="speed-large", hidden_size=1024, intermediate_size=4096, num_layers=4, num_heads=16)
SPEC_FILE = "speed_spec.txt"  # a pair written from another spec or seed is rewritten
SPEED_SMALL = SpeedModel(name="speed-small", hidden_size=64, intermediate_size=8, num_layers=2, num_heads=2)


def ensure_speed_pair(root: Path | None = None, seed: int = 0) -> tuple[Path, Path]:
    root = root or envs.state_dir() / "speed-pair"
    return _ensure(SPEED_LARGE, root, seed), _ensure(SPEED_SMALL, root, seed)


def _ensure(spec: SpeedModel, root: Path, seed: int) -> Path:
    out = root / spec.name
    stamp = spec.model_dump_json() + f" seed={seed}"
    if (out / "model.safetensors").exists() and (out / SPEC_FILE).exists() and (out / SPEC_FILE).read_text() == stamp:
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from relay_serve.toy.tokenizer import load_tokenizer

    tok = load_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a run that died half-way
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / SPEC_FILE).write_text(stamp)
    tmp.rename(out)
    return out
