"""Drives the real scheduler and block manager with a stand-in model, one simulated step at a time.

Scheduling questions (fairness, priority, chunking, preemption) do not need real logits, so this runs
thousands of steps per second: used by the scheduler tests and for what-if runs of policies. It counts
steps; loadtest/simulator.py is the same idea on a virtual clock (step durations from a bytes/FLOPs
cost model, arrivals in time, several replicas), for questions about latency and utilization.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from common import Priority
from loadtest.static_batching import Batching
from protocol.requests import FinishReason, KvShare, SamplingParams
from worker.block_manager import BlockManager
from worker.fair_share import ServiceCosts
from worker.scheduler import ScheduledBatch, SchedulerConfig
from worker.sequence import Sequence

_ids = itertools.count()


@dataclass
class SimRequest:
    seq: Sequence
    submitted_step: int = 0
    first_scheduled_step: int | None = None
    first_token_step: int | None = None
    finished_step: int | None = None


@dataclass
class SchedulerSim:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    num_blocks: int = 256
    block_size: int = 4
    mode: Batching = Batching.CONTINUOUS
    enable_prefix_caching: bool = True
    priority_classes: bool = True
    step_no: int = 0
    requests: dict[str, SimRequest] = field(default_factory=dict)
    batches: list[ScheduledBatch] = field(default_factory=list)
    # Per step, what each tenant got computed for the first time: (prefill, decode) tokens, counted
    # here from the batch itself (not from the scheduler's own accounting, which it checks).
    served: list[dict[str, tuple[int, int]]] = field(default_factory=list)
    costs: ServiceCosts = field(default_factory=ServiceCosts)
    preemption_limit: int | None = SchedulerConfig.preemption_limit

    def __post_init__(self) -> None:
        self.bm = BlockManager(self.num_blocks, self.block_size, self.enable_prefix_caching)
        self.scheduler = self.mode.scheduler(
            SchedulerConfig(
                self.max_num_seqs,
                self.max_num_batched_tokens,
                priority_classes=self.priority_classes,
                costs=self.costs,
                preemption_limit=self.preemption_limit,
            ),
            self.bm,
        )

    def submit(
        self,
        prompt_len: int,
        max_tokens: int,
        tenant: str = "t",
        priority: Priority = Priority.STANDARD,
        weight: float = 1.0,
        prompt: list[int] | None = None,
        kv_share: KvShare | None = None,
    ) -> str:
        rid = f"sim-{next(_ids)}"
        tokens = prompt if prompt is not None else [1000 + next(_ids) % 30000 for _ in range(prompt_len)]
        seq = Sequence(
            request_id=rid,
            token_ids=list(tokens),
            num_prompt_tokens=len(tokens),
            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            tenant=tenant,
            priority=priority,
            weight=weight,
            cache_salt=tenant.encode(),
            kv_share=kv_share or KvShare(),
        )
        self.scheduler.add(seq)
        self.requests[rid] = SimRequest(seq, submitted_step=self.step_no)
        return rid

    def step(self) -> ScheduledBatch:
        """One step: the real schedule and update, with token 7 standing in for every sample."""
        batch = self.scheduler.schedule()
        self.batches.append(batch)
        served: dict[str, tuple[int, int]] = {}
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            new = range(max(seq.num_computed_tokens, seq.computed_high_water), seq.num_computed_tokens + n)
            prefill = sum(1 for i in new if i < seq.num_prompt_tokens)
            p, d = served.get(seq.tenant, (0, 0))
            served[seq.tenant] = (p + prefill, d + len(new) - prefill)
        self.served.append(served)
        sampled = {}
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            rec = self.requests[seq.request_id]
            if rec.first_scheduled_step is None:
                rec.first_scheduled_step = self.step_no
            if seq.num_computed_tokens + n == seq.num_tokens:
                sampled[seq] = 7
        for update in self.scheduler.update_from_output(batch, sampled):
            rec = self.requests[update.seq.request_id]
            if rec.first_token_step is None:
                rec.first_token_step = self.step_no
            if update.finish_reason is not None:
                rec.finished_step = self.step_no
        self.step_no += 1
        return batch

    def run(self, max_steps: int = 100_000) -> None:
        while self.scheduler.has_work() and max_steps > 0:
            self.step()
            max_steps -= 1

    def abort(self, rid: str) -> None:
        seq = self.requests[rid].seq
        self.scheduler.finish(seq, FinishReason.CANCELLED)
