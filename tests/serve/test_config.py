import pytest
import yaml
from pydantic import ValidationError

from relay_serve.config import AppConfig, resolve_model
from relay_serve.deploy.serve_config import serve_config, serve_config_yaml


def test_the_embedded_default_is_the_toy_pair():
    cfg = AppConfig()
    assert cfg.large.model == "toy:large" and cfg.small.model == "toy:small"
    assert resolve_model("toy:large").endswith("toy/models/large")
    assert cfg.large.engine_args["max_model_len"] == cfg.small.engine_args["max_model_len"] == 1024
    assert cfg.cues.store_uri.startswith("file://")


def test_yaml_round_trip_and_unknown_keys_are_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(AppConfig().to_yaml())
    assert AppConfig.from_yaml(path) == AppConfig()
    path.write_text("large:\n  model: toy:large\n  enginee_args: {}\n")
    with pytest.raises(ValidationError, match="enginee_args"):
        AppConfig.from_yaml(path)
    path.write_text("policy:\n  min_large_tokens: -1\n")
    with pytest.raises(ValidationError, match="min_large_tokens"):
        AppConfig.from_yaml(path)


def test_unknown_toy_model_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown toy model"):
        resolve_model("toy:medium")


def test_serve_config_validates_against_ray_serve_schema():
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load(serve_config_yaml(AppConfig()))
    schema = (
        ServeDeploySchema.model_validate(doc)
        if hasattr(ServeDeploySchema, "model_validate")
        else ServeDeploySchema.parse_obj(doc)
    )
    app = schema.applications[0]
    assert app.import_path == "relay_serve.app:app_builder"
    assert AppConfig.model_validate(app.args) == AppConfig()
    assert serve_config(AppConfig(), port=9000)["http_options"]["port"] == 9000


def test_deployment_options_pass_through():
    cfg = AppConfig.model_validate(
        {"small": {"model": "toy:small", "deployment": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}}}
    )
    opts = cfg.small.deployment.serve_options()
    engine_load = {
        "policy_function": "relay_serve.app.autoscaling:EngineLoadPolicy",
        "policy_kwargs": {"target_per_replica": 16.0},
    }
    assert (
        opts["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "policy": engine_load}
        and "num_replicas" not in opts
    )
    assert cfg.large.deployment.serve_options()["num_replicas"] == 1


def test_model_deployments_scale_on_engine_load_unless_told_otherwise():
    own = {"policy_function": "my.module:policy"}
    cfg = AppConfig.model_validate(
        {
            "large": {
                "model": "toy:large",
                "deployment": {"autoscaling_config": {"max_replicas": 2}, "target_engine_load": 3},
            },
            "small": {"model": "toy:small", "deployment": {"autoscaling_config": {"max_replicas": 2, "policy": own}}},
            "router": {"deployment": {"autoscaling_config": {"max_replicas": 2}}},
        }
    )
    assert cfg.large.deployment.serve_options()["autoscaling_config"]["policy"]["policy_kwargs"] == {
        "target_per_replica": 3.0
    }
    assert cfg.small.deployment.serve_options()["autoscaling_config"]["policy"] == own
    assert "policy" not in cfg.router.deployment.serve_options()["autoscaling_config"]  # the router: Serve's own
    none = AppConfig.model_validate(
        {"large": {"model": "toy:large", "deployment": {"autoscaling_config": {}, "target_engine_load": None}}}
    )
    assert "policy" not in none.large.deployment.serve_options()["autoscaling_config"]
    with pytest.raises(ValueError, match="target_engine_load"):
        AppConfig.model_validate({"large": {"model": "toy:large", "deployment": {"target_engine_load": 0}}})
    with pytest.raises(ValueError, match="target_engine_load"):
        AppConfig.model_validate({"router": {"deployment": {"target_engine_load": 4}}})  # not a model deployment
