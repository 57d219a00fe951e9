"""A snapshot of one engine's load: what replicas publish to routers, pools and metrics.

It crosses Ray Serve's routing-stats channel, which carries plain dicts, as ``to_dict`` /
``from_dict``; everywhere else it travels as this typed value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from common import Priority


@dataclass(frozen=True)
class TenantKv:
    """One tenant's KV blocks on a replica: what it holds (in use or caching its prefixes) against
    the floor it keeps and the cap it may not pass."""

    held: int
    floor: int
    cap: int


@dataclass
class SpecCounts:
    """Speculative decoding for one tenant, since the engine started (vLLM's spec-decode counters):
    verifications that had proposals (drafts), tokens proposed, and of those accepted."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    running: dict[Priority, int] = field(default_factory=dict)
    waiting: dict[Priority, int] = field(default_factory=dict)
    # Prompt tokens still to compute by class (waiting requests and running ones mid-prompt): the
    # queue a new request's first token waits behind (what SLO admission predicts from).
    pending_prompt_tokens: dict[Priority, int] = field(default_factory=dict)
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_by_tenant: dict[str, TenantKv] = field(default_factory=dict)
    max_num_seqs: int = 0  # batch capacity: slot occupancy is last_step_seqs / max_num_seqs
    num_preemptions: int = 0
    num_steps: int = 0
    computed_tokens: int = 0  # run through the model, all steps
    recomputed_tokens: int = 0  # of which computed again after a preemption: waste
    step_seconds: float = 0.0  # time inside forward steps, all steps (busy fraction over any window)
    step_seq_seconds: float = 0.0  # live sequences x step seconds (slot occupancy over any window)
    step_bytes: int = 0  # weights + KV read and written by all steps (bandwidth utilization)
    # Prompt tokens (rows of more than one token) and time of the steps that used half the token
    # budget or more: the pace prompt queues drain at (what SLO admission predicts from).
    full_step_prompt_tokens: int = 0
    full_step_seconds: float = 0.0
    last_step_tokens: int = 0
    last_step_seqs: int = 0  # live requests in the last step
    busy_fraction: float = 0.0  # share of the last 10 s spent inside forward steps
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found there
    finished_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    consecutive_failed_steps: int = 0  # forward passes failing in a row: a replica that cannot serve
    pid: int = 0  # the process the engine runs in
    max_loras: int = 0  # adapter slots
    loaded_adapters: tuple[str, ...] = ()  # resident in a slot (the router prefers these replicas)
    running_adapters: tuple[str, ...] = ()  # pinned by running requests
    waiting_adapters: tuple[str, ...] = ()  # wanted by waiting requests
    speculation: dict[str, SpecCounts] = field(default_factory=dict)  # per tenant

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def num_running(self) -> int:
        return sum(self.running.values())

    @property
    def num_waiting(self) -> int:
        return sum(self.waiting.values())

    def waiting_at_or_above(self, priority: Priority) -> int:
        """Requests queued that are served no later than ``priority``."""
        return sum(n for p, n in self.waiting.items() if p <= priority)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["running"] = {p.value: n for p, n in self.running.items()}
        d["waiting"] = {p.value: n for p, n in self.waiting.items()}
        d["pending_prompt_tokens"] = {p.value: n for p, n in self.pending_prompt_tokens.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineStats:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in names}
        values["running"] = {Priority(p): n for p, n in (d.get("running") or {}).items()}
        values["waiting"] = {Priority(p): n for p, n in (d.get("waiting") or {}).items()}
        values["pending_prompt_tokens"] = {
            Priority(p): n for p, n in (d.get("pending_prompt_tokens") or {}).items()
        }
        values["kv_by_tenant"] = {t: TenantKv(**kv) for t, kv in (d.get("kv_by_tenant") or {}).items()}
        values["speculation"] = {t: SpecCounts(**c) for t, c in (d.get("speculation") or {}).items()}
        for name in ("loaded_adapters", "running_adapters", "waiting_adapters"):
            values[name] = tuple(d.get(name) or ())
        return cls(**values)
