"""Calls from a router replica to the model deployments, each a Serve request of its own.

A handle call made while a replica serves a request inherits that request's internal request id
(Ray Serve's request context is a context variable). Ray Serve 2.60's request router indexes its
pending requests by that id and assigns a chosen replica to the pending request with the calling
task's id: two calls pending on one deployment with the same id (a generation's lease and a
background traits refresh, or a lease and its replacement while the first is being cancelled)
leave one of them out of the index. Its routing task then finds a replica with room, assigns it to
nobody and tries again without ever awaiting: the router replica's event loop spins and serves no
one (seen in the benchmark and in CI: every request of the app hung).

``own_request`` runs the call in an empty context, so Serve gives it a fresh id. Cancelling the
caller does not cancel such a call by itself: every caller here cancels its call itself
(``Lease.release``, ``HandleTransport.segment``'s ``finally``, ``asyncio.wait_for``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def own_request(call: Callable[[], T]) -> T:
    """``call()`` (a ``handle....remote(...)``) as a Serve request of its own, not a child of the
    request being served."""
    return contextvars.Context().run(call)
