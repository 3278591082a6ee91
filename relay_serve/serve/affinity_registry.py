"""The affinity routers alive in this process. Kept apart from affinity.py because Ray Serve
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
