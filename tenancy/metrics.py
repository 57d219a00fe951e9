"""Prometheus metrics of the tenancy package (module-level: registered once per process).

Names use the project's ``loom:`` prefix (vLLM style, see DESIGN.md).
"""

from __future__ import annotations

import functools
from typing import Any

from prometheus_client import Counter, Gauge

QUOTA_MODE = Gauge(
    "loom:tenancy_quota_mode",
    "1 for the admission mode in force: redis, fail_static, fail_closed or local (embedded store).",
    ["mode"],
)
ADMISSIONS = Counter(
    "loom:tenancy_admissions",
    "Admission decisions, by result (granted/refused), the limit that refused, and the backend.",
    ["result", "limit", "backend"],
)
AUTH_FAILURES = Counter(
    "loom:tenancy_auth_failures",
    "Refused API keys by server-side reason (the client always sees the same answer).",
    ["reason"],
)
REDIS_ERRORS = Counter(
    "loom:tenancy_redis_errors",
    "Redis calls that failed or timed out, by operation.",
    ["op"],
)
CONFIG_RELOADS = Counter(
    "loom:tenancy_config_reloads",
    "Tenant config refreshes applied to the local cache, by source and trigger.",
    ["source", "trigger"],
)
TENANTS_CACHED = Gauge("loom:tenancy_tenants_cached", "Tenants in this process's cache.")
PENDING_FINISHES = Gauge(
    "loom:tenancy_pending_finishes",
    "Request finishes (usage, refunds) buffered while Redis was unreachable, awaiting replay.",
)
DROPPED_FINISHES = Counter(
    "loom:tenancy_dropped_finishes",
    "Buffered finishes dropped because the buffer was full (usage lost).",
)


@functools.cache
def admission_counter(result: str, limit: str, backend: str) -> Any:
    """The labelled admissions counter, resolved once per label set (``labels()`` costs microseconds)."""
    return ADMISSIONS.labels(result=result, limit=limit, backend=backend)


STATE_FILE_ERRORS = Counter(
    "loom:tenancy_state_file_errors",
    "Embedded store: quota state file failures, by op (load: unreadable at start, started from zero; "
    "save: could not be written).",
    ["op"],
)
