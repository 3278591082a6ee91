"""The app's settings: one strict pydantic document, read from YAML (unknown keys are errors).

``AppConfig()`` is the embedded default: local Ray, the toy pair from this package, a local cue
store under the project's state folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from relay_serve import envs
from relay_serve.relay.policy import PolicySettings

TOY_PREFIX = "toy:"
TOY_MODELS_DIR = Path(__file__).parent / "toy" / "models"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeploymentSettings(Strict):
    """Ray Serve options of one deployment, passed to ``serve.deployment(...).options``."""

    num_replicas: int | Literal["auto"] | None = Field(None, description="fixed replica count (no autoscaling)")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve autoscaling: min_replicas, max_replicas, target_ongoing_requests, ..."
    )
    max_ongoing_requests: int = Field(64, ge=1)
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})
    graceful_shutdown_wait_loop_s: float = Field(
        0.5,
        gt=0.0,
        description="a stopping replica looks this often whether its requests (and leases) are done (Serve's default: "
        "2)",
    )

    @property
    def may_scale_to_zero(self) -> bool:
        """Autoscaling whose minimum is zero replicas (Serve's default minimum is one)."""
        scaling = self.autoscaling_config
        return scaling is not None and int(scaling.get("min_replicas", 1)) == 0

    def serve_options(self, env_vars: dict[str, str] | None = None) -> dict[str, Any]:
        actor = {**self.ray_actor_options}
        if env_vars:
            runtime_env = dict(actor.get("runtime_env") or {})
            runtime_env["env_vars"] = {**env_vars, **(runtime_env.get("env_vars") or {})}
            actor["runtime_env"] = runtime_env
        opts: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": actor,
            "graceful_shutdown_wait_loop_s": self.graceful_shutdown_wait_loop_s,
        }
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = dict(self.autoscaling_config)
        else:
            opts["num_replicas"] = 1 if self.num_replicas is None else self.num_replicas
        return opts


def default_engine_args() -> dict[str, Any]:
    """vLLM engine arguments that suit the toy pair on a CPU."""
    return {"max_model_len": 1024, "enforce_eager": True, "dtype": "float32", "max_num_seqs": 64, "block_size": 32}


def default_cpu_engine_env() -> dict[str, str]:
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps vLLM-CPU's model runner inside its engine-core
    # process: no worker process, whose shared-memory queue spins (sched_yield) for a second after
    # every step. On 2 cores that spinning took the router's overhead per switch from 9.0 to 11.3 ms.
    # One OpenMP thread an engine, as vLLM's own thread binding gives a replica of one CPU.
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}


ENGINE_LOAD_POLICY = "relay_serve.app.autoscaling:EngineLoadPolicy"


class ModelDeploymentSettings(DeploymentSettings):
    """A model deployment's Serve options. With an ``autoscaling_config`` it scales on its
    engines' load (``app/autoscaling.py``), not on Serve's ongoing requests (leases)."""

    target_engine_load: float | None = Field(
        16.0,
        gt=0.0,
        description="with autoscaling_config: segments running or queued per replica's engine to aim at (averaged over "
        "look_back_period_s); null: Serve's default policy (ongoing requests, i.e. leases, per replica). An "
        "autoscaling_config with its own policy keeps it",
    )

    def serve_options(self, env_vars: dict[str, str] | None = None) -> dict[str, Any]:
        opts = super().serve_options(env_vars)
        scaling = opts.get("autoscaling_config")
        if scaling is not None and "policy" not in scaling and self.target_engine_load is not None:
            scaling["policy"] = {
                "policy_function": ENGINE_LOAD_POLICY,
                "policy_kwargs": {"target_per_replica": self.target_engine_load},
            }
        return opts


def default_model_deployment() -> ModelDeploymentSettings:
    """One replica with one CPU and a 1 GiB KV cache (vLLM-CPU's VLLM_CPU_KVCACHE_SPACE)."""
    return ModelDeploymentSettings(
        max_ongoing_requests=64,
        ray_actor_options={"num_cpus": 1, "runtime_env": {"env_vars": default_cpu_engine_env()}},
    )


class ModelSettings(Strict):
    """One model of the pair and how its deployment runs."""

    model: str = Field(description="a local path, a hub id, or toy:large / toy:small")
    tokenizer: str | None = Field(None, description="defaults to the model's own")
    engine_args: dict[str, Any] = Field(
        default_factory=default_engine_args,
        description="passed through to vLLM's AsyncEngineArgs (dtype, max_model_len, speculative_config, ...)",
    )
    deployment: ModelDeploymentSettings = Field(default_factory=default_model_deployment)
    spare_token_ids: list[int] | None = Field(
        None,
        description="token ids the model never writes: a resumable engine request stops on them as stand-ins for the "
        "tokens that complete a cue or a sentence end (the look-ahead inside the engine, engine/vllm_swaps.py) and "
        "masks them otherwise; None: the ids of the model's output layer past its tokenizer's vocabulary (a toy model: "
        "the tokens holding a character the toy world never writes); []: none (every look-ahead pauses)",
    )

    @property
    def resolved_spare_token_ids(self) -> list[int] | None:
        """``spare_token_ids``, a toy model's found from its tokenizer (None: the engine's own)."""
        if self.spare_token_ids is None and (self.tokenizer or self.model).startswith(TOY_PREFIX):
            from relay_serve.toy.tokenizer import spare_token_ids

            return spare_token_ids(self.tokenizer_path)
        return self.spare_token_ids

    @property
    def model_path(self) -> str:
        return resolve_model(self.model)

    @property
    def tokenizer_path(self) -> str:
        return resolve_model(self.tokenizer or self.model)

    @property
    def resolved_engine_args(self) -> dict[str, Any]:
        """The engine arguments as vLLM takes them: a draft model named ``toy:small`` in
        ``speculative_config`` becomes its path (the engine arguments are otherwise passed as they are)."""
        spec = self.engine_args.get("speculative_config")
        if isinstance(spec, dict) and isinstance(spec.get("model"), str):
            return {**self.engine_args, "speculative_config": {**spec, "model": resolve_model(spec["model"])}}
        return dict(self.engine_args)


def resolve_model(ref: str) -> str:
    """A model reference as a path or hub id: ``toy:large`` and ``toy:small`` are folders of this
    package; ``toy:large-wide`` is generated from ``toy:large`` on first use (``toy/wide.py``)."""
    if ref.startswith(TOY_PREFIX):
        name = ref[len(TOY_PREFIX) :]
        if name == "large-wide":
            from relay_serve.toy.wide import ensure_wide_large

            return str(ensure_wide_large())
        path = TOY_MODELS_DIR / name
        if not path.is_dir():
            raise ValueError(f"unknown toy model {ref!r}: no folder {path}")
        return str(path)
    return ref


class SamplingDefaults(Strict):
    """Sampling used where a request leaves a setting out."""

    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)


class PaperSampling(BaseModel):
    """The RelayGen paper's sampling (temperature 0.6, top_p 0.95, top_k 20): what eval and bench
    default to."""

    temperature: float = Field(0.6, ge=0.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    top_k: int = Field(20, ge=-1)


class SelectionRule(BaseModel):
    """How cues are selected from their margins (the calibration job's rule, and online calibration's)."""

    model_config = ConfigDict(extra="forbid")

    rule: Literal["ci-above-overall", "mean-above-overall"] = Field(
        "ci-above-overall",
        description="ci-above-overall: the lower end of the cue's interval is above the overall mean "
        "(ours); mean-above-overall: the cue's mean is (the paper's)",
    )
    min_occurrences: int = Field(5, ge=1)
    confidence: float = Field(0.95, gt=0.0, lt=1.0)


class OnlineCalibration(Strict):
    """Cue sets recalibrated from served traffic (``router/shadow.py``, ``online/cue_stats.py``)."""

    enabled: bool = Field(False, description="score served relay generations and publish re-selected cue sets")
    sample_rate: float = Field(
        0.1, ge=0.0, le=1.0, description="the share of finished relay generations a router scores"
    )
    explore_rate: float = Field(
        0.02,
        ge=0.0,
        le=1.0,
        description="the share of relay generations whose reasoning the large model writes alone (evidence on the "
        "selected cues)",
    )
    min_occurrences: int = Field(20, ge=1, description="a cue needs this many scored occurrences to be selected")
    confidence: float = Field(0.95, gt=0.0, lt=1.0)
    rule: Literal["ci-above-overall", "mean-above-overall"] = "ci-above-overall"
    publish_interval_s: float = Field(300.0, gt=0.0, description="how often the shared statistics re-select")
    max_queue: int = Field(8, ge=1, description="generations waiting to be scored per router; more are dropped")
    candidates: list[str] | None = Field(
        None, description="the cues to keep statistics of (default: the calibration job's)"
    )
    window_generations: int = Field(
        2000,
        ge=1,
        description="the statistics cover the newest this many scored generations: every cue's occurrences and the "
        "baseline alike",
    )
    confirm_rounds: int = Field(
        2,
        ge=1,
        description="a different selection is published only after this many re-selections in a row gave it (no "
        "flip-flopping)",
    )
    score_timeout_s: float = Field(
        60.0, gt=0.0, description="a scoring call that takes longer is given up (one sample lost)"
    )

    def selection_rule(self) -> SelectionRule:
        return SelectionRule(rule=self.rule, min_occurrences=self.min_occurrences, confidence=self.confidence)


class CueSettings(Strict):
    store_uri: str = Field(default_factory=lambda: envs.cue_store_uri(), description="where calibrated cue sets live")
    poll_interval_s: float = Field(5.0, gt=0.0)
    default_cues: list[str] = Field(
        default_factory=lambda: ["Therefore,", "Thus,", "So,", "Hence,"],
        description="used until a calibrated set for this pair exists in the store",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options for the store (endpoint_url, key, secret, ...)"
    )
    online: OnlineCalibration = Field(default_factory=OnlineCalibration)


class RouterSettings(Strict):
    deployment: DeploymentSettings = Field(
        default_factory=lambda: DeploymentSettings(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 1})
    )
    transport: Literal["direct", "handle"] = Field(
        "direct",
        description="direct: a generation leases a replica of each model through Ray Serve and sends its segments over "
        "that replica's TCP channel; handle: every segment is a Ray Serve handle call",
    )
    session_affinity: bool = Field(
        True,
        description="keep each generation's segments on the replica holding its prefix (direct: one lease a "
        "generation, "
        "not one a segment; handle: the SessionAffinityRouter)",
    )
    resumable_requests: bool = Field(
        True,
        description="direct transport: a generation's segments on one model continue one resumable engine request "
        "(vLLM "
        "streaming input; its KV cache kept between segments) instead of a new request each; engines with a "
        "speculative_config always take a new request per segment",
    )
    lease_idle_s: float = Field(
        2.0, ge=0.0, description="direct: a lease a generation gave back waits this long for the next one (0: no reuse)"
    )
    lease_max_age_s: float = Field(
        30.0, gt=0.0, description="direct: a lease this old is not reused; Serve places the next generation afresh"
    )
    max_request_bytes: int = Field(1_000_000, ge=1024)
    max_stop_strings: int = Field(16, ge=0)
    max_stop_length: int = Field(64, ge=1)
    max_request_cues: int = Field(16, ge=0, description="at most this many cues in a request's relay_cues")
    max_cue_length: int = Field(32, ge=1, description="characters of a cue in a request's relay_cues")
    request_timeout_s: float = Field(600.0, gt=0.0, description="a generation that takes longer fails with 504")
    model_name_prefix: str = Field("", description="prefix of the model ids in /v1/models (e.g. 'qwen3-')")
    segment_retries: int = Field(
        2,
        ge=0,
        le=10,
        description="an engine request whose replica failed is sent again this many times, from the context so far",
    )
    retry_backoff_s: float = Field(0.2, ge=0.0, le=10.0, description="wait before retry n: n times this")
    max_small_in_flight: int | None = Field(
        None,
        ge=1,
        description="relay: past this many small-model segments in flight (per router replica) the large model keeps "
        "its handoffs",
    )
    small_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="relay: a small-model segment whose first token does not come by then (streamed or not: it "
        "bounds the first token only) goes to the large model",
    )
    small_retry_after_s: float = Field(
        10.0, ge=0.0, description="after such a timeout, the large model writes small-model segments for this long"
    )
    api_key_file: str | None = Field(
        None, description="a file of accepted API keys, one a line (Authorization: Bearer)"
    )
    api_key_env: str | None = Field(None, description="an environment variable holding an accepted API key")

    def api_keys(self) -> list[str]:
        """The accepted API keys (empty: the API is open). Read at start-up; a named source that
        is missing or empty is an error, never an open API."""
        keys: list[str] = []
        if self.api_key_file is not None:
            try:
                lines = Path(self.api_key_file).read_text().splitlines()
            except OSError as e:
                raise ValueError(f"router.api_key_file: cannot read {self.api_key_file}: {e.strerror}") from e
            found = [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]
            if not found:
                raise ValueError(f"router.api_key_file: {self.api_key_file} holds no key")
            keys += found
        if self.api_key_env is not None:
            value = (envs.get(self.api_key_env) or "").strip()
            if not value:
                raise ValueError(f"router.api_key_env: the environment variable {self.api_key_env} is not set")
            keys.append(value)
        return keys


def default_env_vars() -> dict[str, str]:
    # Ray Serve runs user code and handle routing on the replica's own event loop: a handle call
    # here took 1.4 ms instead of 3.3 (5.4 -> 2.1 ms streamed), which is most of a handoff's cost.
    return {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}


class AppConfig(Strict):
    name: str = "relay"
    route_prefix: str = "/"
    env_vars: dict[str, str] = Field(
        default_factory=default_env_vars, description="set in every deployment's processes (and a local Ray's)"
    )
    large: ModelSettings = Field(default_factory=lambda: ModelSettings(model="toy:large"))
    small: ModelSettings = Field(default_factory=lambda: ModelSettings(model="toy:small"))
    router: RouterSettings = Field(default_factory=RouterSettings)
    policy: PolicySettings = Field(default_factory=PolicySettings)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    cues: CueSettings = Field(default_factory=CueSettings)

    @field_validator("route_prefix")
    @classmethod
    def _slash(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("route_prefix must start with '/'")
        return v

    @classmethod
    def from_yaml(cls, path: str | Path) -> AppConfig:
        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the config must be a mapping")
        return cls.model_validate(data)

    @classmethod
    def load(cls, path: str | Path | None) -> AppConfig:
        return cls() if path is None else cls.from_yaml(path)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
