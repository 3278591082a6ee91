"""Autoscaling a model deployment on its own work: the segments running or queued in its engines.

Each ModelServer replica reports ``engine_load`` through Ray Serve's custom autoscaling metrics
(``record_autoscaling_stats``); the controller averages it over ``look_back_period_s`` per
replica and calls :class:`EngineLoadPolicy` each control-loop tick. The policy asks for enough
replicas to bring the load per replica to ``target_per_replica``; Serve's own wrapper then
applies ``min_replicas``/``max_replicas``, the up/downscaling factors and ``upscale_delay_s``/
``downscale_delay_s`` of the deployment's autoscaling_config, as for its default policy.

Why not Serve's default (ongoing requests per replica): with the direct transport a replica's
ongoing requests are the leases routers hold on it, one a generation that may use it, whether or
not the model writes. Under relay traffic the small deployment would scale with the number of
generations (the large model's load), not with the sentences it writes.
"""

from __future__ import annotations

import math
from typing import Any

from relay_serve.replica.load import ENGINE_LOAD


class EngineLoadPolicy:
    """Replicas for a deployment's engine load: ``ceil(total load / target_per_replica)``.

    Before any replica has reported (cold start, or a replica just started) it keeps the current
    target; with no load at all it asks for zero (the wrapper holds ``min_replicas`` and the
    downscale delay)."""

    def __init__(self, target_per_replica: float = 8.0) -> None:
        if not target_per_replica > 0:
            raise ValueError(f"target_per_replica must be positive, not {target_per_replica}")
        self.target_per_replica = float(target_per_replica)

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        loads = (ctx.aggregated_metrics or {}).get(ENGINE_LOAD) or {}
        if not loads:
            return ctx.target_num_replicas, {}
        total = float(sum(loads.values()))
        desired = math.ceil(total / self.target_per_replica - 1e-9)
        return desired, {"engine_load": total}
