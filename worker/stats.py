"""A snapshot of an engine's load, published to routers and metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineStats:
    running: dict[str, int] = field(default_factory=dict)  # by priority class name
    waiting: dict[str, int] = field(default_factory=dict)
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    last_step_tokens: int = 0
    last_step_seqs: int = 0  # live requests in the last step
    last_step_padding_seqs: int = 0  # static batching: ended members still computed
    mean_tokens_per_step: float = 0.0
    busy_fraction: float = 0.0  # share of the last 10 s spent inside forward steps
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    finished_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def num_running(self) -> int:
        return sum(self.running.values())

    @property
    def num_waiting(self) -> int:
        return sum(self.waiting.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kv_cache_usage"] = self.kv_cache_usage
        return d
