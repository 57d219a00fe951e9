"""The engine's running totals and recent step timings, and the ``EngineStats`` snapshot built from them."""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common import Priority
from protocol.stats import EngineStats
from worker.block_manager import BlockManager
from worker.scheduler import ScheduledBatch, Scheduler

if TYPE_CHECKING:  # a type only: the scheduler simulator counts steps without torch
    from worker.lora_slots import LoraSlots

BUSY_WINDOW_S = 10.0


@dataclass
class EngineCounters:
    step_budget: int = 1  # max_num_batched_tokens: a step using half of it or more counts as full
    steps: int = 0
    step_tokens: int = 0
    step_seconds: float = 0.0
    step_seq_seconds: float = 0.0
    step_bytes: int = 0
    # Of the steps that used half the budget or more: prompt tokens (rows of more than one token)
    # and seconds, the pace at which prompt queues drain.
    full_step_prompt_tokens: int = 0
    full_step_seconds: float = 0.0
    last_step_tokens: int = 0
    last_step_seqs: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    consecutive_failed_steps: int = 0  # forward passes that raised since the last one that did not
    started: float = field(default_factory=time.monotonic)
    busy: deque[tuple[float, float]] = field(default_factory=deque)  # (start, end) of recent steps

    def record_step(self, t0: float, t1: float, batch: ScheduledBatch, step_bytes: int) -> None:
        # Live rows only: a scheduler subclass may keep ended sequences computing (static batching).
        tokens, seqs = batch.total_tokens, sum(1 for s in batch.seqs if s.is_live)
        self.step_seconds += t1 - t0
        self.step_seq_seconds += seqs * (t1 - t0)
        self.step_bytes += step_bytes
        self.steps += 1
        self.consecutive_failed_steps = 0
        self.step_tokens += tokens
        if 2 * tokens >= self.step_budget:
            self.full_step_prompt_tokens += sum(n for n in batch.num_tokens if n > 1)
            self.full_step_seconds += t1 - t0
        self.last_step_tokens = tokens
        self.last_step_seqs = seqs
        self.busy.append((t0, t1))
        while self.busy and self.busy[0][1] < t1 - BUSY_WINDOW_S:
            self.busy.popleft()

    def snapshot(
        self, scheduler: Scheduler, bm: BlockManager, lora: LoraSlots | None = None, now: float | None = None
    ) -> EngineStats:
        """``now``: on the clock the steps were recorded on (default: the monotonic one)."""
        now = time.monotonic() if now is None else now
        window_start = max(self.started, now - BUSY_WINDOW_S)
        busy = sum(min(b, now) - max(a, window_start) for a, b in self.busy if b > window_start)
        return EngineStats(
            running={p: scheduler.num_running(p) for p in Priority},
            waiting={p: scheduler.num_waiting(p) for p in Priority},
            pending_prompt_tokens={p: scheduler.pending_prompt_tokens(p) for p in Priority},
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks,
            kv_by_tenant=bm.by_tenant(),
            max_num_seqs=scheduler.config.max_num_seqs,
            num_preemptions=scheduler.num_preemptions,
            num_steps=self.steps,
            last_step_tokens=self.last_step_tokens,
            last_step_seqs=self.last_step_seqs,
            computed_tokens=self.step_tokens,
            recomputed_tokens=scheduler.num_recomputed_tokens,
            step_seconds=self.step_seconds,
            step_seq_seconds=self.step_seq_seconds,
            step_bytes=self.step_bytes,
            full_step_prompt_tokens=self.full_step_prompt_tokens,
            full_step_seconds=self.full_step_seconds,
            busy_fraction=busy / max(now - window_start, 1e-9),
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            finished_requests=self.finished,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
            consecutive_failed_steps=self.consecutive_failed_steps,
            max_loras=lora.max_loras if lora is not None else 0,
            loaded_adapters=lora.resident() if lora is not None else (),
            running_adapters=lora.running() if lora is not None else (),
            waiting_adapters=tuple(sorted(scheduler.waiting_adapters())),
            pid=os.getpid(),
        )
