"""Drives the real scheduler and block manager with a stand-in model, one simulated step at a time.

Scheduling questions (fairness, priority, chunking, preemption) do not need real logits, so this runs
thousands of steps per second: used by the scheduler tests and for what-if runs of policies.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from worker.block_manager import BlockManager
from worker.request import FinishReason, Priority, SamplingParams
from worker.scheduler import ScheduledBatch, Scheduler, SchedulerConfig, SchedulingMode
from worker.sequence import Sequence

_ids = itertools.count()


@dataclass
class SimRequest:
    seq: Sequence
    submitted_step: int
    first_scheduled_step: int | None = None
    first_token_step: int | None = None
    finished_step: int | None = None


@dataclass
class SchedulerSim:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    num_blocks: int = 256
    block_size: int = 4
    mode: SchedulingMode = SchedulingMode.CONTINUOUS
    enable_prefix_caching: bool = True
    step_no: int = 0
    requests: dict[str, SimRequest] = field(default_factory=dict)
    batches: list[ScheduledBatch] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bm = BlockManager(self.num_blocks, self.block_size, self.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.mode), self.bm
        )

    def submit(
        self,
        prompt_len: int,
        max_tokens: int,
        tenant: str = "t",
        priority: Priority = Priority.STANDARD,
        weight: float = 1.0,
        prompt: list[int] | None = None,
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
        )
        self.scheduler.add(seq)
        self.requests[rid] = SimRequest(seq, self.step_no)
        return rid

    def step(self) -> ScheduledBatch:
        batch = self.scheduler.schedule()
        self.batches.append(batch)
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            rec = self.requests[seq.request_id]
            if rec.first_scheduled_step is None:
                rec.first_scheduled_step = self.step_no
            seq.num_computed_tokens += n
            self.bm.register_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:  # a "sampled" token
                seq.token_ids.append(7)
                if seq.padding:  # static batching: ended already, only occupies its slot
                    continue
                if rec.first_token_step is None:
                    rec.first_token_step = self.step_no
                if seq.num_output_tokens >= seq.sampling.max_tokens:
                    self.scheduler.finish(seq, FinishReason.LENGTH)
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
