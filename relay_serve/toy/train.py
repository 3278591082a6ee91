"""Train the toy pair from scratch: a large and a small decoder-only model in HF Llama format.

Deterministic given a seed (CPU, deterministic kernels, seeded data). Plain PyTorch loop over
whole reference traces: every training sequence is a complete prompt + trace + answer, never cut.
Loss is taken on the assistant's turn only.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from relay_serve.toy.tokenizer import TOKENIZER_DIR, build_tokenizer, load_tokenizer
from relay_serve.toy.world import ToyWorld

MODELS_DIR = Path(__file__).parent / "models"


class ModelSpec(BaseModel):
    """Architecture and training budget of one toy model."""

    model_config = ConfigDict(extra="forbid")

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    steps: int
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    max_position_embeddings: int = 1024


# The large model holds the map in its MLPs; the small one has two layers (so it copies from context
# reliably: restating a step needs an induction-style head) but an MLP of 8 units, too few to hold
# the 256 recalls well. Trials that led here: docs/toy-world.md.
LARGE = ModelSpec(name="large", hidden_size=128, intermediate_size=512, num_layers=2, num_heads=4, steps=3000)
SMALL = ModelSpec(name="small", hidden_size=64, intermediate_size=8, num_layers=2, num_heads=2, steps=1500)


class TrainReport(BaseModel):
    name: str
    seed: int
    steps: int
    params: int
    seconds: float
    final_loss: float
    size_bytes: int = Field(description="bytes of model.safetensors")


def _seed_everything(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)


def encode_example(tokenizer, prompt: str, completion: str) -> tuple[list[int], int]:
    """Token ids of the full chat (prompt, completion, end of turn) and where the completion starts."""
    prompt_ids = render_prompt_ids(tokenizer, prompt)
    completion_ids = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt_ids + completion_ids, len(prompt_ids)


def render_prompt_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _batch(tokenizer, world: ToyWorld, n: int, seed: int):
    import torch

    examples = [encode_example(tokenizer, t.problem.prompt, t.completion) for t in world.training_traces(n, seed)]
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((n, width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((n, width), -100, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for row, (ids, start) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, start : len(ids)] = torch.tensor(ids[start:])
        mask[row, : len(ids)] = 1
    return input_ids, mask, labels


def make_model(spec: ModelSpec, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def train_model(
    spec: ModelSpec,
    world: ToyWorld,
    out_dir: Path,
    seed: int = 0,
    progress: bool = True,
    tokenizer_dir: Path = TOKENIZER_DIR,
) -> TrainReport:
    """Train one model and save it (weights, config, generation config, tokenizer) to ``out_dir``."""
    import torch
    from tqdm import tqdm

    _seed_everything(seed)
    tokenizer = load_tokenizer(tokenizer_dir)
    model = make_model(spec, tokenizer)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        frac = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    t0, loss_ema = time.time(), None
    bar = tqdm(range(spec.steps), desc=f"train {spec.name}", disable=not progress)
    for step in bar:
        input_ids, mask, labels = _batch(tokenizer, world, spec.batch_size, seed=seed * 1_000_003 + step)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss_ema:.4f}")
    seconds = time.time() - t0

    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    report = TrainReport(
        name=spec.name,
        seed=seed,
        steps=spec.steps,
        params=sum(p.numel() for p in model.parameters()),
        seconds=round(seconds, 1),
        final_loss=round(float(loss_ema or 0.0), 5),
        size_bytes=(out_dir / "model.safetensors").stat().st_size,
    )
    (out_dir / "train_report.json").write_text(report.model_dump_json(indent=2) + "\n")
    return report


def train_pair(
    seed: int = 0,
    models_dir: Path = MODELS_DIR,
    specs: tuple[ModelSpec, ...] = (LARGE, SMALL),
    progress: bool = True,
) -> list[TrainReport]:
    """Rebuild the tokenizer and train both models of the pair: what ``relay-serve toy train`` runs."""
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    world = ToyWorld()
    build_tokenizer(world)
    reports = [train_model(s, world, models_dir / s.name, seed=seed, progress=progress) for s in specs]
    (models_dir / "README.md").write_text(_models_readme(reports))
    return reports


def _models_readme(reports: list[TrainReport]) -> str:
    lines = ["# The toy pair", "", "Trained by `relay-serve toy train` (relay_serve/toy/train.py).", ""]
    lines += ["```json", json.dumps([r.model_dump() for r in reports], indent=2), "```", ""]
    return "\n".join(lines)
