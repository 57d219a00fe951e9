"""Per-request state inside the engine: tokens, progress through the KV cache, and block table."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from worker.request import FinishReason, GenerationRequest, Priority, SamplingParams

_arrivals = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by everything generated so far
    num_prompt_tokens: int
    sampling: SamplingParams
    tenant: str
    priority: Priority
    weight: float
    cache_salt: bytes
    arrival: int = field(default_factory=lambda: next(_arrivals))  # FCFS order, stable across preemption
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks, in order
    num_registered_blocks: int = 0  # leading blocks already findable in the prefix cache
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    padding: bool = False  # static batching: ended, but still occupies its cohort slot
    first_token_time: float | None = None

    @classmethod
    def from_request(cls, req: GenerationRequest) -> Sequence:
        return cls(
            request_id=req.request_id,
            token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids),
            sampling=req.sampling,
            tenant=req.tenant,
            priority=req.priority,
            weight=req.weight,
            cache_salt=req.cache_salt,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next sample (1 for a decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
