"""A speed-only pair for CPU benchmarks: random weights (seeded), the toy tokenizer, a large model
that costs about ten times the small one per token. Written to the state folder on first use
(about 0.5 GB), never committed. Its text is noise: it runs recorded schedules (replay mode)."""

from __future__ import annotations

import shutil
from pathlib import Path

from relay_serve import envs
from relay_serve.toy.train import ModelSpec, make_model

# Architectures only (steps=0: the weights stay random). 4 layers: about 20 ms a token here
# against the small one's 2 (10x; measured in `relay-serve bench`).
SPEED_LARGE = ModelSpec(name="speed-large", hidden_size=1024, intermediate_size=4096, num_layers=4, num_heads=16, steps=0, max_position_embeddings=2048)
SPEED_SMALL = ModelSpec(name="speed-small", hidden_size=64, intermediate_size=8, num_layers=2, num_heads=2, steps=0, max_position_embeddings=2048)
SPEC_FILE = "speed_spec.txt"  # a pair written from another spec or seed is rewritten


def ensure_speed_pair(root: Path | None = None, seed: int = 0) -> tuple[Path, Path]:
    root = root or envs.state_dir() / "speed-pair"
    return _ensure(SPEED_LARGE, root, seed), _ensure(SPEED_SMALL, root, seed)


def _ensure(spec: ModelSpec, root: Path, seed: int) -> Path:
    out = root / spec.name
    stamp = spec.model_dump_json() + f" seed={seed}"
    if (out / "model.safetensors").exists() and (out / SPEC_FILE).exists() and (out / SPEC_FILE).read_text() == stamp:
        return out
    import torch

    from relay_serve.toy.tokenizer import load_tokenizer

    tok = load_tokenizer()
    torch.manual_seed(seed)
    model = make_model(spec, tok)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a run that died half-way
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / SPEC_FILE).write_text(stamp)
    tmp.rename(out)
    return out
