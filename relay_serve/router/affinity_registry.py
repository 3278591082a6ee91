"""The request routers alive in this process. Kept apart from affinity.py because Ray Serve
pickles a request router's module by value: module-level state there would be copied, not shared."""

from __future__ import annotations

import threading
import weakref

_routers: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()


def register(router) -> None:
    with _lock:
        _routers.add(router)


def routers() -> list:
    with _lock:
        return list(_routers)


def replica_running(app: str, deployment: str, replica_id: str) -> bool:
    """Whether Ray Serve still routes to ``replica_id`` of ``deployment``, as far as this process's
    routers know: False once Serve took it out of rotation (it is draining for a downscale, or
    died); True when no router here follows that deployment (nothing to say otherwise)."""
    followed = False
    for router in routers():
        for rid in list(router.curr_replicas):
            dep = rid.deployment_id
            if dep.app_name == app and dep.name == deployment:
                followed = True
                if rid.unique_id == replica_id:
                    return True
    return not followed
