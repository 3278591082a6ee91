"""Builds the relay application: two ModelServer deployments and the RelayRouter ingress."""

from __future__ import annotations

from typing import Any

from relay_serve.config import AppConfig, ModelSettings


def _model_deployment(role: str, m: ModelSettings, affinity: bool, env_vars: dict[str, str]):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from relay_serve.replica.model_server import ModelServer

    opts: dict[str, Any] = {"name": role, **m.deployment.serve_options(env_vars)}
    if affinity:
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class="relay_serve.router.affinity.SessionAffinityRouter"
        )
    return serve.deployment(ModelServer).options(**opts).bind(role, m.model_dump(mode="json"))


def build_app(cfg: AppConfig):
    """The Ray Serve application for ``cfg``. Reads no model files (where it is built, on a
    KubeRay head, they are not mounted): the router checks the pair with what the model replicas
    report, and refuses a pair whose tokenizers differ (``router/startup.py``)."""
    from ray import serve

    from relay_serve.router.ingress import RelayRouter

    # The direct transport needs the router too (it follows which replicas Serve routes to); its
    # lease calls carry no session id, so it ranks the two least loaded replicas.
    affinity = cfg.router.session_affinity or cfg.router.transport == "direct"
    large = _model_deployment("large", cfg.large, affinity, cfg.env_vars)
    small = _model_deployment("small", cfg.small, affinity, cfg.env_vars)
    router_cls = serve.ingress()(RelayRouter)
    opts = {"name": "router", **cfg.router.deployment.serve_options(cfg.env_vars)}
    return serve.deployment(router_cls).options(**opts).bind(cfg.model_dump(mode="json"), large, small)


def app_builder(args: dict[str, Any]):
    """Entry point for a Ray Serve config file (``import_path: relay_serve.app:app_builder``):
    ``args`` is the AppConfig as a mapping."""
    return build_app(AppConfig.model_validate(args or {}))
