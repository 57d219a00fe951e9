"""Static (request-level) batching, the baseline continuous batching is measured against.

It is a scheduler subclass the benchmarks bring (``EngineConfig.scheduler_cls``, or the simulator's
``EngineSpec.mode``), so the product's scheduler knows nothing of cohorts or padding:

* a cohort forms only when nothing is running: as many waiting requests as the batch holds
  (``max_num_seqs``) whose prompts' blocks are all free, in the scheduler's own order (priority
  class, fair share, arrival); nothing joins a running cohort;
* with padding (:class:`StaticBatchingScheduler`) a member that ends normally keeps its slot and
  its blocks and is computed greedily until the cohort's last member ends, as fixed-shape batch
  generation does; its tokens reach no one. Without (:class:`StaticNoPaddingScheduler`) it leaves at
  once and its slot stays empty until the cohort ends.

A served run loads it in the replica: ``PYTHONPATH=<checkout>
LOOM_ENGINE_SCHEDULER_CLS=loadtest.static_batching:StaticBatchingScheduler loom serve``.
"""

from __future__ import annotations

import enum

from common import Priority
from protocol.requests import FinishReason, SamplingParams
from worker.block_manager import BlockManager
from worker.scheduler import AdmissionGate, ScheduledBatch, Scheduler, SchedulerConfig, SequenceUpdate, _Step
from worker.sequence import Sequence, SequenceStatus

_NORMAL_ENDS = (FinishReason.STOP, FinishReason.LENGTH)


class StaticNoPaddingScheduler(Scheduler):
    """Cohorts without padding: a member that ends leaves, and its slot stays empty."""

    padding_tokens = 0  # tokens computed for padding, all steps (waste)

    def admits_waiting(self) -> bool:
        if not self.running:
            self._admit_cohort()
        return False  # the running loop schedules the cohort; nothing else joins

    def _admit_cohort(self) -> None:
        room = self.bm.num_free_blocks
        for prio in Priority:
            while len(self.running) < self.config.max_num_seqs:
                seq = self._next_waiting(prio)
                if seq is None:
                    break
                need = -(-seq.num_tokens // self.bm.block_size)
                if need > room and self.running:
                    return
                if not self._passes_gate(seq):
                    return  # a cohort forms from ready requests only; the rest join the next one
                room -= need
                self._dequeue(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)


class StaticBatchingScheduler(StaticNoPaddingScheduler):
    """Cohorts with padding: ended members keep computing until the cohort's last one ends."""

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, gate: AdmissionGate | None = None
    ) -> None:
        super().__init__(config, block_manager, gate)
        self.held: set[Sequence] = set()  # ended for their callers, still computed

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq in self.held:
            return  # padding reaching its (extended) end: it stops only with its cohort
        if seq.is_live and seq in self.running and reason in _NORMAL_ENDS:
            seq.finish_reason = reason  # ended for its caller: is_live turns false, no output follows
            seq.sampling = SamplingParams()  # greedy: its tokens are never shown
            self.fair.deactivate(seq.priority, seq.tenant)
            del self._by_id[seq.request_id]
            self.held.add(seq)
        else:
            super().finish(seq, reason)
        if self.held and all(s in self.held for s in self.running):
            self._release_padding(list(self.held))

    def _release_padding(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.held.discard(s)
            self._release(s)

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        if seq not in self.held:
            super()._preempt(seq, step)
            return
        self._unschedule(seq, step)  # padding has nothing to resume: it is released
        self._release_padding([seq])

    def update_from_output(
        self,
        batch: ScheduledBatch,
        sampled: dict[Sequence, int],
        accepted: dict[Sequence, list[int]] | None = None,
    ) -> list[SequenceUpdate]:
        held = set(self.held)
        rows = [(s, n) for s, n in zip(batch.seqs, batch.num_tokens, strict=True) if s in held]
        self.padding_tokens += sum(n for _, n in rows)
        updates = [u for u in super().update_from_output(batch, sampled, accepted) if u.seq not in held]
        self._release_padding([s for s in self.held if s.num_tokens >= self.config.max_model_len])
        return updates


class Batching(enum.StrEnum):
    """How a benchmark's engine batches: Loom's continuous batching, or a static baseline."""

    CONTINUOUS = "continuous"
    STATIC = "static"
    STATIC_NO_PADDING = "static_no_padding"

    @property
    def scheduler(self) -> type[Scheduler]:
        return _SCHEDULERS[self]

    @property
    def scheduler_cls(self) -> str | None:
        """The ``EngineConfig.scheduler_cls`` (``LOOM_ENGINE_SCHEDULER_CLS``) that runs this mode."""
        cls = self.scheduler
        return None if cls is Scheduler else f"{cls.__module__}:{cls.__qualname__}"


_SCHEDULERS: dict[Batching, type[Scheduler]] = {
    Batching.CONTINUOUS: Scheduler,
    Batching.STATIC: StaticBatchingScheduler,
    Batching.STATIC_NO_PADDING: StaticNoPaddingScheduler,
}
