"""Per-request state inside the engine: tokens, progress through the KV cache, and block table.

Who writes what: the scheduler owns progress and lifecycle (``status``, ``num_computed_tokens``,
``token_ids`` growth, ``finish_reason``, preemption counts); the block manager owns the block state
(``block_table``, ``block_hashes``, ``num_registered_blocks``). Nothing else writes a sequence.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from common import Priority
from protocol.adapters import LoraRequest
from protocol.requests import FinishReason, GenerationRequest, KvShare, SamplingParams

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
    stop_token_ids: frozenset[int] = frozenset()  # end-of-sequence (unless ignore_eos) and stop ids
    adapter: LoraRequest | None = None
    kv_share: KvShare = field(default_factory=KvShare)
    num_resumed_tokens: int = 0  # the prompt's last tokens that an earlier attempt generated
    speculative: bool = False  # opted into speculative decoding (worker/speculation.py)
    arrival: int = field(default_factory=lambda: next(_arrivals))  # FCFS order, stable across preemption
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    computed_high_water: int = 0  # the most tokens ever computed (a preempted sequence recomputes below it)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks, in order
    num_registered_blocks: int = 0  # leading blocks already findable in the prefix cache
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None

    @classmethod
    def from_request(cls, req: GenerationRequest, eos_token_ids: Iterable[int] = ()) -> Sequence:
        params = req.sampling
        stop = set(params.stop_token_ids)
        # A grammar's end is the output's end: a constrained row stops at the end-of-sequence token
        # the grammar allows only once it is complete, ignore_eos or not.
        if not params.ignore_eos or params.constraint is not None:
            stop.update(eos_token_ids)
        # An adapter changes every K/V it touches: its prefix-cache entries are its own, never the
        # base model's or another adapter's.
        salt = (
            req.cache_salt if req.adapter is None else req.cache_salt + b"\x00lora:" + req.adapter.id.encode()
        )
        return cls(
            request_id=req.request_id,
            token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids),
            sampling=params,
            tenant=req.tenant,
            priority=req.priority,
            weight=req.weight,
            cache_salt=salt,
            stop_token_ids=frozenset(stop),
            adapter=req.adapter,
            kv_share=req.kv_share,
            num_resumed_tokens=req.num_resumed_tokens,
            speculative=req.speculative,
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
    def is_prefilling(self) -> bool:
        """More than the one last token is still to run through the model."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def is_live(self) -> bool:
        """Still owed output by the engine: waiting or running, and not ended for its caller (a
        scheduler subclass may keep an ended sequence in the batch, as static batching's padding)."""
        return self.finish_reason is None and self.status in (SequenceStatus.WAITING, SequenceStatus.RUNNING)
