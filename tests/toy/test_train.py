"""Training is deterministic given a seed (a few steps of both architectures, twice)."""

from safetensors.torch import load_file

from relay_serve.toy.train import LARGE, SMALL, train_model
from relay_serve.toy.world import ToyWorld


def test_training_is_deterministic(tmp_path):
    world = ToyWorld()
    for spec in (SMALL, LARGE):
        short = spec.model_copy(update={"steps": 3, "batch_size": 8, "warmup_steps": 1})
        a = train_model(short, world, tmp_path / "a" / spec.name, seed=5, progress=False)
        b = train_model(short, world, tmp_path / "b" / spec.name, seed=5, progress=False)
        train_model(short, world, tmp_path / "c" / spec.name, seed=6, progress=False)
        wa = load_file(tmp_path / "a" / spec.name / "model.safetensors")
        wb = load_file(tmp_path / "b" / spec.name / "model.safetensors")
        wc = load_file(tmp_path / "c" / spec.name / "model.safetensors")
        assert all((wa[k] == wb[k]).all() for k in wa)
        assert any((wa[k] != wc[k]).any() for k in wa)
        assert a.final_loss == b.final_loss


def test_the_committed_pair_fits_the_limits():
    from pathlib import Path

    from transformers import AutoConfig

    root = Path(__file__).parents[2] / "relay_serve" / "toy" / "models"
    for name in ("large", "small"):
        cfg = AutoConfig.from_pretrained(root / name)
        assert cfg.model_type == "llama"
        assert cfg.hidden_size // cfg.num_attention_heads in (32, 64, 128)  # vLLM-CPU attention
        assert (root / name / "model.safetensors").stat().st_size <= 25 * 2**20
