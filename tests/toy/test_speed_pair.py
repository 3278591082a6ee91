"""The speed pair: written once per spec and seed, rewritten when either changes."""

from __future__ import annotations

from relay_serve.toy import speed_pair
from relay_serve.toy.train import ModelSpec


def test_written_once_and_rewritten_on_a_new_spec(tmp_path, monkeypatch):
    tiny = ModelSpec(name="speed-large", hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2, steps=0)
    monkeypatch.setattr(speed_pair, "SPEED_LARGE", tiny)
    large, small = speed_pair.ensure_speed_pair(tmp_path)
    assert (large / "config.json").exists() and (small / "tokenizer.json").exists()
    mtime = (large / "model.safetensors").stat().st_mtime_ns
    assert speed_pair.ensure_speed_pair(tmp_path)[0] == large
    assert (large / "model.safetensors").stat().st_mtime_ns == mtime  # reused
    monkeypatch.setattr(speed_pair, "SPEED_LARGE", tiny.model_copy(update={"num_layers": 2}))
    speed_pair.ensure_speed_pair(tmp_path)
    import json

    assert json.loads((large / "config.json").read_text())["num_hidden_layers"] == 2
    assert not list(tmp_path.glob("*.tmp"))
