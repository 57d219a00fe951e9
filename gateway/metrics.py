"""Gateway metrics (Prometheus): requests, latency, tokens and refusals by tenant, plus the engine
gauges of every replica behind this gateway re-exported under vLLM's names.

Module-level metric objects (registered once per process on the default registry, beside the
tenancy package's); the engine collector is registered per running gateway.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.stats import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter(
    "loom:gateway_requests",
    "Completion calls by tenant, priority and final code (gRPC's code names, whatever the front).",
    ["tenant", "priority", "code"],
)
TTFT = Histogram(
    "loom:time_to_first_token_seconds",
    "Arrival to first streamed token.",
    ["priority"],
    buckets=_LATENCY_BUCKETS,
)
TPOT = Histogram(
    "loom:time_per_output_token_seconds",
    "Mean gap between streamed tokens after the first, per request.",
    ["priority"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
E2E = Histogram(
    "loom:e2e_request_latency_seconds", "Arrival to last byte.", ["priority"], buckets=_LATENCY_BUCKETS
)
PROMPT_TOKENS = Counter("loom:prompt_tokens", "Prompt tokens of admitted requests, by tenant.", ["tenant"])
GENERATION_TOKENS = Counter("loom:generation_tokens", "Tokens streamed to clients, by tenant.", ["tenant"])
REFUSALS = Counter(
    "loom:gateway_admission_refusals",
    "Requests refused before dispatch, by tenant and reason.",
    ["tenant", "reason"],
)
AUTH_REFUSALS = Counter("loom:gateway_unauthenticated", "Calls refused for a missing or bad API key.")


ReplicaRow = tuple[str, str, str, EngineStats]  # (pool, model, replica id, published stats)


class EngineCollector(Collector):
    """Per-replica engine gauges from the stats each replica publishes to the request router.

    One collector per process; every running gateway adds a source (its catalog's pools) and removes
    it when it stops. A replica seen by two gateways in one process is reported once.
    """

    def __init__(self) -> None:
        self._sources: dict[int, Callable[[], list[ReplicaRow]]] = {}

    def add_source(self, key: int, source: Callable[[], list[ReplicaRow]]) -> None:
        self._sources[key] = source

    def remove_source(self, key: int) -> None:
        self._sources.pop(key, None)

    def collect(self) -> Iterator[Metric]:
        labels = ["pool", "model", "replica"]
        families = {
            name: (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, help_text, labels=labels
            )
            for name, kind, help_text, _ in _PER_REPLICA
        }
        waiting = GaugeMetricFamily(
            "loom:num_requests_waiting", "Requests queued in the engine.", labels=[*labels, "priority"]
        )
        # vLLM's shape, so inference-aware routers can read it: the value is a timestamp, the news is
        # in the labels (comma-separated adapter ids).
        lora = GaugeMetricFamily(
            "loom:lora_requests_info",
            "LoRA adapters running and waiting on each replica.",
            labels=[*labels, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        tenant_kv = GaugeMetricFamily(
            "loom:kv_cache_blocks_held",
            "KV blocks a tenant holds on a replica (in use or caching its prefixes); kind: held, "
            "floor or cap.",
            labels=[*labels, "tenant", "kind"],
        )
        # vLLM's spec-decode counters, per tenant: the acceptance rate is accepted over draft tokens.
        spec = {
            name: CounterMetricFamily(name, help_text, labels=[*labels, "tenant"])
            for name, help_text in (
                ("loom:spec_decode_num_drafts", "Verifications of a request's proposed tokens."),
                ("loom:spec_decode_num_draft_tokens", "Tokens proposed for verification."),
                ("loom:spec_decode_num_accepted_tokens", "Proposed tokens that the model accepted."),
            )
        }
        now = time.time()
        seen: set[tuple[str, str, str]] = set()
        for source in list(self._sources.values()):
            for pool, model, replica, s in source():
                if (pool, model, replica) in seen:
                    continue
                seen.add((pool, model, replica))
                key = [pool, model, replica]
                for name, _, _, value in _PER_REPLICA:
                    families[name].add_metric(key, float(value(s)))
                for prio, n in s.waiting.items():
                    waiting.add_metric([*key, prio.value], float(n))
                for tenant, kv in s.kv_by_tenant.items():
                    for kind, blocks in (("held", kv.held), ("floor", kv.floor), ("cap", kv.cap)):
                        tenant_kv.add_metric([*key, tenant, kind], float(blocks))
                for tenant, c in s.speculation.items():
                    for name, count in (
                        ("loom:spec_decode_num_drafts", c.drafts),
                        ("loom:spec_decode_num_draft_tokens", c.draft_tokens),
                        ("loom:spec_decode_num_accepted_tokens", c.accepted_tokens),
                    ):
                        spec[name].add_metric([*key, tenant], float(count))
                if s.max_loras:
                    adapters = [str(s.max_loras), ",".join(s.running_adapters), ",".join(s.waiting_adapters)]
                    lora.add_metric([*key, *adapters], now)
        yield from (*families.values(), waiting, tenant_kv, *spec.values(), lora)


# (name, kind, help, value): the per-replica engine series, under vLLM's names where they mean the
# same. The counters and step gauges are what utilization is computed from (docs/utilization.md).
_PER_REPLICA: tuple[tuple[str, str, str, Callable[[EngineStats], float]], ...] = (
    ("loom:num_requests_running", "gauge", "Requests in the engine's batch.", lambda s: s.num_running),
    ("loom:kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0-1).", lambda s: s.kv_cache_usage),
    ("loom:kv_cache_blocks_used", "gauge", "KV blocks in use.", lambda s: s.kv_blocks_used),
    ("loom:kv_cache_blocks_total", "gauge", "KV blocks of the replica.", lambda s: s.kv_blocks_total),
    ("loom:batch_capacity", "gauge", "Sequences a step may hold (max_num_seqs).", lambda s: s.max_num_seqs),
    ("loom:last_step_seqs", "gauge", "Live requests in the latest step.", lambda s: s.last_step_seqs),
    ("loom:last_step_tokens", "gauge", "Tokens computed in the latest step.", lambda s: s.last_step_tokens),
    (
        "loom:engine_busy_fraction",
        "gauge",
        "Share of the last 10 s spent in forward steps.",
        lambda s: s.busy_fraction,
    ),
    ("loom:engine_steps", "counter", "Forward steps run.", lambda s: s.num_steps),
    ("loom:engine_step_seconds", "counter", "Time inside forward steps.", lambda s: s.step_seconds),
    (
        "loom:engine_step_seq_seconds",
        "counter",
        "Live sequences times step seconds (slot occupancy: rate over step_seconds rate, over capacity).",
        lambda s: s.step_seq_seconds,
    ),
    (
        "loom:engine_step_bytes",
        "counter",
        "Weights plus K/V read and written by the steps (bandwidth utilization).",
        lambda s: s.step_bytes,
    ),
    (
        "loom:engine_recomputed_tokens",
        "counter",
        "Tokens computed again after a preemption (waste).",
        lambda s: s.recomputed_tokens,
    ),
    ("loom:engine_computed_tokens", "counter", "Tokens run through the model.", lambda s: s.computed_tokens),
    ("loom:num_preemptions", "counter", "Sequences preempted (recomputed).", lambda s: s.num_preemptions),
    (
        "loom:prefix_cache_queries",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
        lambda s: s.prefix_cache_queries,
    ),
    (
        "loom:prefix_cache_hits",
        "counter",
        "Prompt tokens found in the prefix cache.",
        lambda s: s.prefix_cache_hits,
    ),
)


ENGINE = EngineCollector()
REGISTRY.register(ENGINE)


def start_metrics_server(host: str, port: int) -> Any:
    """Serve the default registry (gateway, tenancy and engine metrics) over HTTP."""
    server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    return server
