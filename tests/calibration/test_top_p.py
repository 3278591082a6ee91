"""The calibration job samples its traces with the configured top_p (it used to drop it)."""

from __future__ import annotations

import pytest

from calibration_jobs.calibrate import CalibrationConfig, _EngineWorker
from relay_serve.engine.vllm_engine import OfflineEngine


@pytest.mark.vllm  # builds vLLM's SamplingParams (imports vLLM), no engine
def test_top_p_reaches_the_engines_sampling_parameters():
    seen = {}

    class LLM:
        def generate(self, prompts, params, use_tqdm=False):
            seen["top_p"] = [p.top_p for p in params]
            return []

    engine = OfflineEngine.__new__(OfflineEngine)
    engine.llm = LLM()
    worker = _EngineWorker.__new__(_EngineWorker)
    worker.engine = engine
    cfg = CalibrationConfig(top_p=0.9)
    worker.traces([[1, 2], [3]], 2, cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.seed)
    assert seen["top_p"] == [0.9] * 4
