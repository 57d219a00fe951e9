"""Limits hold globally: real OS processes hammering one tenant through Redis are admitted exactly up
to the limit. Token buckets refill continuously (limit/60 per second), so the bound allows for the
refill during the burst: ``limit <= admitted <= limit + refill(burst span)``; with a burst far shorter
than one refill interval (the usual case here) that is exactly the limit.
"""

from __future__ import annotations

import math
import multiprocessing as mp
from typing import Any

import pytest
from tenancy_testlib import hammer_process, make_tenant

PROCESSES = 4
ATTEMPTS = 100

# name -> (tenant, prompt_tokens, max_tokens, capacity in requests, refill in requests per second)
SCENARIOS = {
    "rpm": (make_tenant("g-rpm", requests_per_minute=50), 10, 10, 50, 50 / 60),
    "tpm": (make_tenant("g-tpm", tokens_per_minute=6000), 20, 40, 100, 6000 / 60 / 60),
    "concurrency": (make_tenant("g-conc", max_concurrent=7), 10, 10, 7, 0.0),
}


@pytest.fixture(scope="module")
def hammered(redis_url: str) -> dict[str, Any]:
    import uuid

    import redis

    prefix = f"loomtest-{uuid.uuid4().hex[:12]}"
    values = {
        "store": "redis",
        "redis_url": redis_url,
        "key_prefix": prefix,
        "secret": "x" * 32,
        "redis_timeout_s": 2.0,  # a loaded 2-core machine must not flip a child into fail-static
    }
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES)
    queue = ctx.Queue()
    plan = [(t.model_dump_json(), ATTEMPTS, p, m) for t, p, m, _, _ in SCENARIOS.values()]
    procs = [
        ctx.Process(target=hammer_process, args=(values, plan, barrier, queue)) for _ in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    try:
        reports = [queue.get(timeout=120) for _ in range(PROCESSES * len(SCENARIOS))]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{prefix}:*"):
            client.delete(key)
        client.close()
    by_tenant: dict[str, list] = {}
    for tenant_id, start, end, outcome in reports:
        by_tenant.setdefault(tenant_id, []).append((start, end, outcome))
    return by_tenant


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_admitted_exactly_up_to_the_limit(hammered, name):
    tenant, _, _, capacity, refill_per_s = SCENARIOS[name]
    runs = hammered[tenant.id]
    assert len(runs) == PROCESSES
    outcomes = [o for _, _, per_process in runs for o in per_process]
    span = max(e for _, e, _ in runs) - min(s for s, _, _ in runs)
    granted = sum(1 for o in outcomes if o[0])
    refused = [o for o in outcomes if not o[0]]
    extra = math.floor(span * refill_per_s)
    assert len(outcomes) == PROCESSES * ATTEMPTS
    print(f"{name}: granted {granted}/{len(outcomes)}, burst span {span:.3f} s")
    assert capacity <= granted <= capacity + extra, (granted, span)
    assert len(refused) == PROCESSES * ATTEMPTS - granted
    expected_limit = {"rpm": "requests_per_minute", "tpm": "tokens_per_minute"}.get(name, "max_concurrent")
    assert {o[1] for o in refused} == {expected_limit}
    assert all(o[2] is not None and o[2] > 0 for o in refused)  # every refusal says when to retry
    assert {o[3] for o in outcomes} == {"redis"}
