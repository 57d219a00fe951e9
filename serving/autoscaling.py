"""The engine deployment's autoscaling policy: replicas for the requests the replicas run.

Serve's default policy divides its count of ongoing calls by ``target_ongoing_requests``. A gateway
sends a burst of requests in one call (serving/dispatch.py), so that count would read a burst of 64
as one: each replica reports the requests it runs instead (``record_autoscaling_stats``), and this
policy reads them. Serve applies the configured bounds, delays and scaling factors around it.
"""

from __future__ import annotations

from typing import Any

ENGINE_REQUESTS_METRIC = "engine_requests"
POLICY = "serving.autoscaling:engine_requests_policy"


def engine_requests_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """(replicas wanted, policy state) from an ``AutoscalingContext``: the replicas' own request
    counts over the target per replica; Serve's count of calls until a replica has reported."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    by_replica = (ctx.aggregated_metrics or {}).get(ENGINE_REQUESTS_METRIC)
    requests = sum(by_replica.values()) if by_replica else ctx.total_num_requests
    return requests / ctx.config.get_target_ongoing_requests(), {}
