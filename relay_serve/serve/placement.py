"""Where a process runs in the Ray cluster (the node a replica landed on, the address other nodes
reach it by); the answers outside Ray, for tests and scripts."""

from __future__ import annotations


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
