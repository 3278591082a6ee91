"""The Ray cluster as every process of relay-serve sees it: joining or starting Ray (the CLI, the
driver, the calibration and batch jobs), where this process runs (the node a replica landed on,
the address other nodes reach it by; the answers outside Ray, for tests and scripts) and the
node's metrics endpoint."""

from __future__ import annotations

import logging
import socket
from typing import Any

from relay_serve import envs
from relay_serve.config import AppConfig

log = logging.getLogger(__name__)


def node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - outside Ray (tests, scripts)
        return None


def node_ip() -> str:
    """The address other nodes reach this one by (inside Ray), else the loopback address."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (tests, scripts)
        pass
    return "127.0.0.1"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (for apps started by eval, bench and the tests)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_ray(
    env_vars: dict[str, str] | None = None, num_cpus: int | None = None, metrics_port: int | None = None, **kwargs: Any
) -> None:
    """Connect to RELAY_RAY_ADDRESS, or start a local Ray; ``env_vars`` reach every worker (the
    Serve controller and proxies too). ``metrics_port``: where a local Ray's metrics agent serves
    Prometheus (a cluster's nodes have theirs from ``ray start --metrics-export-port``)."""
    import ray

    if ray.is_initialized():
        return
    runtime_env = {"env_vars": dict(env_vars if env_vars is not None else AppConfig().env_vars)}
    address = envs.ray_address()
    if address:
        ray.init(address=address, runtime_env=runtime_env, **kwargs)
        if metrics_port is not None and metrics_port != node_metrics_port():
            log.warning(
                "--metrics-port %d is ignored: this Ray cluster's node exports on %s", metrics_port, node_metrics_port()
            )
    else:
        if metrics_port is not None:
            kwargs["_metrics_export_port"] = metrics_port
        envs.run_local_ray_workers_at_normal_priority()
        # Serve's direct ingress holds a stopping ingress replica open 30 s for external load
        # balancers to deregister it; a local Ray has none (in-flight requests are still awaited).
        runtime_env["env_vars"].setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")
        ray.init(
            address="local",
            num_cpus=num_cpus or envs.num_cpus(),
            include_dashboard=False,
            runtime_env=runtime_env,
            **kwargs,
        )


def _this_node() -> dict[str, Any]:
    import ray

    here = node_id()
    return next(n for n in ray.nodes() if n["NodeID"] == here)


def node_metrics_port() -> int:
    return int(_this_node()["MetricsExportPort"])


def metrics_url() -> str:
    """Where this node's Ray metrics agent serves Prometheus (the relay metrics among them)."""
    node = _this_node()
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
