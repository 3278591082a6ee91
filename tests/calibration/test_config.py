"""The calibration job's config: the app config shared by path, workers placed like the model's
replicas, datasets from the eval loaders."""

from __future__ import annotations

from pathlib import Path

import pytest

from calibration_jobs.calibrate import CalibrationConfig, calibration_prompts
from relay_serve.config import AppConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_gpu_calibration_config_shares_the_service_config():
    cfg = CalibrationConfig.load(str(CONFIGS / "calibration-qwen3-32b-1.7b.yaml"))
    assert cfg.app == AppConfig.from_yaml(CONFIGS / "qwen3-32b-1.7b.yaml")
    large, small = cfg.actor_options(cfg.app.large), cfg.actor_options(cfg.app.small)
    assert (large["num_gpus"], large["resources"]) == (2, {"relay_large": 1})
    assert (small["num_gpus"], small["resources"]) == (1, {"relay_small": 1})
    assert len(calibration_prompts(cfg)) == cfg.num_prompts == 200  # GSM8K from the wheel


def test_worker_overrides_and_toy_defaults():
    cfg = CalibrationConfig(worker_num_cpus=0.5, worker_num_gpus=0)
    opts = cfg.actor_options(cfg.app.large)
    assert (opts["num_cpus"], opts["num_gpus"]) == (0.5, 0)
    assert opts["runtime_env"]["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert CalibrationConfig().actor_options(cfg.app.small)["num_cpus"] == 1


def test_bad_configs_are_named(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        CalibrationConfig.load(str(bad))
    with pytest.raises(ValueError, match="calibration dataset: unknown dataset"):
        calibration_prompts(CalibrationConfig(dataset="aime"))
