"""Iteration-level scheduler: decides, every step, which sequences run and how many tokens each.

Order of service: priority classes strictly (interactive, standard, batch); inside a class the tenant
with the least weighted service first (fair_share.py), FCFS inside a tenant. Within a class, every
decode runs first; prompt work (a running sequence's next chunk or a waiting one's admission) then
goes to the least-served tenant first. Prompts are split into chunks that fit the step's token
budget, so a long prompt never stalls the decodes of others.

When a running sequence needs a block and none is free, the most preemptable sequence (lowest class,
then the tenant furthest over its share of KV blocks, then furthest over its fair share of service,
then latest arrival) is preempted: its blocks are freed now and its tokens recomputed later
(cheaply, if its blocks survive in the prefix cache). Only sequences whose blocks would help are
candidates: never those of a tenant at or under its KV floor, and only the tenant's own when it is
at its cap. A waiting request may preempt strictly lower classes, and, while its tenant is under
its KV floor, the sequences of tenants over theirs. Preempted work ages: a sequence preempted
``preemption_limit`` times is not preempted again except by a higher class, so no request waits
without bound behind others of its class. Nothing is ever dropped.

After the forward pass the scheduler applies the step's output to its sequences
(``update_from_output``, as vLLM v1's scheduler does): progress through the cache, newly full blocks
registered for prefix reuse, the sampled token appended, and the length and stop-token checks that
end a sequence and free its blocks. Stop strings need text, so the engine's output processor asks
for those endings through ``finish``.

The engine can run a subclass instead (``EngineConfig.scheduler_cls``, as vLLM's ``scheduler_cls``):
the benchmarks bring static batching, the baseline continuous batching is measured against, that way
(loadtest/static_batching.py), so nothing here knows of cohorts or padding. ``admits_waiting`` is
the one question asked for such a subclass's sake.
"""

from __future__ import annotations

import enum
import importlib
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Protocol

from common import Priority
from protocol.engine_config import EngineConfig
from protocol.requests import FinishReason, InvalidRequestError
from worker.block_manager import BlockManager
from worker.fair_share import FairShare, ServiceCosts
from worker.sequence import Sequence, SequenceStatus


class Gate(enum.Enum):
    """What an admission gate says about a waiting sequence the scheduler would admit now."""

    READY = "ready"  # admit it (the gate has reserved what it needs, e.g. an adapter slot)
    WAIT = "wait"  # not yet (an adapter is loading, or every slot is pinned): try other tenants
    FAILED = "failed"  # never (an adapter that cannot be loaded): the request ends with the reason


class AdmissionGate(Protocol):
    """A resource beyond KV blocks and batch slots that a sequence needs before it runs (LoRA slots).

    The scheduler stays ignorant of what it is: it asks before admitting, and tells the gate when a
    sequence stops holding its resource (finished, aborted or preempted).
    """

    def admit(self, seq: Sequence) -> Gate: ...

    def release(self, seq: Sequence) -> None: ...

    def failure(self, seq: Sequence) -> str | None: ...


class OpenGate:
    """No resource beyond blocks and slots: every sequence is ready."""

    def admit(self, seq: Sequence) -> Gate:
        return Gate.READY

    def release(self, seq: Sequence) -> None:
        return None

    def failure(self, seq: Sequence) -> str | None:
        return None


class GateChain:
    """Several gates asked in order; a later one is asked only once the earlier ones said READY, and
    what the earlier ones reserved is released again when a later one does not (so a gate that holds
    something, as LoRA slots do, goes last)."""

    def __init__(self, *gates: AdmissionGate) -> None:
        self.gates = gates

    def admit(self, seq: Sequence) -> Gate:
        for k, gate in enumerate(self.gates):
            verdict = gate.admit(seq)
            if verdict is not Gate.READY:
                for earlier in self.gates[:k]:
                    earlier.release(seq)
                return verdict
        return Gate.READY

    def release(self, seq: Sequence) -> None:
        for gate in self.gates:
            gate.release(seq)

    def failure(self, seq: Sequence) -> str | None:
        return next((r for g in self.gates if (r := g.failure(seq)) is not None), None)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = EngineConfig.model_fields["max_num_seqs"].default
    max_num_batched_tokens: int = EngineConfig.model_fields["max_num_batched_tokens"].default
    max_model_len: int = 1 << 30  # a sequence reaching this many tokens ends (LENGTH)
    # Off: every request is served as standard (fair share and FCFS only), the baseline that
    # priority protection is measured against (loadtest/bench_served.py).
    priority_classes: bool = True
    costs: ServiceCosts = field(default_factory=ServiceCosts)  # what a prefill and a decode token cost
    # Preemptions after which a sequence yields only to higher classes (aging; None: no limit).
    preemption_limit: int | None = 3

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.preemption_limit is not None and self.preemption_limit < 1:
            raise ValueError("preemption_limit must be positive (or None)")


@dataclass
class ScheduledBatch:
    """The work of one step: ``num_tokens[i]`` new tokens of ``seqs[i]`` (in this order in the batch)."""

    seqs: list[Sequence]
    num_tokens: list[int]
    preempted: list[Sequence] = field(default_factory=list)
    # Proposed tokens a decoding row verifies in this step (its last ``len`` scheduled tokens).
    spec: dict[Sequence, list[int]] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass(frozen=True)
class SequenceUpdate:
    """What one step did for a live sequence: the tokens it gained (one, or more where proposed
    tokens held) and, if it ended, why."""

    seq: Sequence
    tokens: tuple[int, ...]
    finish_reason: FinishReason | None


@dataclass
class _Step:
    budget: int
    scheduled: dict[Sequence, int] = field(default_factory=dict)  # insertion-ordered
    preempted: list[Sequence] = field(default_factory=list)
    charged: dict[Sequence, tuple[int, int]] = field(default_factory=dict)  # (prefill, decode) tokens
    stalled: list[Sequence] = field(default_factory=list)  # aged sequences waiting in place for blocks
    spec: dict[Sequence, list[int]] = field(default_factory=dict)  # proposals scheduled for verification


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, gate: AdmissionGate | None = None
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.gate: AdmissionGate = gate or OpenGate()
        self._rejected: list[tuple[Sequence, str]] = []  # failed by the gate, for the engine to report
        self.fair = FairShare(config.costs)
        self.waiting: dict[Priority, dict[str, deque[Sequence]]] = {p: {} for p in Priority}
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed again after a preemption freed them (waste)
        self._by_id: dict[str, Sequence] = {}

    # ---- queue management ----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise InvalidRequestError("request_id", f"{seq.request_id!r} is already running")
        self._by_id[seq.request_id] = seq
        if not self.config.priority_classes:
            seq.priority = Priority.STANDARD
        self.fair.activate(seq.priority, seq.tenant)
        self.bm.shares.update(seq.tenant, seq.kv_share, seq.weight)
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        queue = self.waiting[seq.priority].setdefault(seq.tenant, deque())
        # FCFS by arrival: a preempted sequence returns ahead of those that arrived after it.
        i = len(queue)
        while i > 0 and queue[i - 1].arrival > seq.arrival:
            i -= 1
        queue.insert(i, seq)

    def _dequeue(self, seq: Sequence) -> None:
        queues = self.waiting[seq.priority]
        queue = queues[seq.tenant]
        queue.remove(seq)
        if not queue:
            del queues[seq.tenant]

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq`` (finished or aborted) and free its blocks at once."""
        if not seq.is_live:
            return
        self._release(seq)
        seq.finish_reason = reason
        self.fair.deactivate(seq.priority, seq.tenant)
        del self._by_id[seq.request_id]

    def _release(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.WAITING:
            self._dequeue(seq)
        else:
            self.running.remove(seq)
        self.bm.free(seq)
        self.gate.release(seq)
        seq.status = SequenceStatus.FINISHED

    def take_rejected(self) -> list[tuple[Sequence, str]]:
        """Sequences the gate failed since the last call, with why (they are finished already)."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def waiting_adapters(self) -> set[str]:
        return {
            s.adapter.id
            for q in self.waiting.values()
            for d in q.values()
            for s in d
            if s.adapter is not None
        }

    def request_ids(self) -> list[str]:
        return list(self._by_id)

    def has_work(self) -> bool:
        return bool(self._by_id)

    def num_waiting(self, priority: Priority | None = None) -> int:
        classes = [priority] if priority is not None else list(Priority)
        return sum(len(q) for p in classes for q in self.waiting[p].values())

    def pending_prompt_tokens(self, priority: Priority) -> int:
        """Prompt tokens of class ``priority`` still to compute: waiting requests' whole prompts (or
        what a preemption left to recompute) and running ones' remaining chunks."""
        queues = self.waiting[priority].values()
        waiting = sum(s.num_tokens - s.num_computed_tokens for q in queues for s in q)
        return waiting + sum(
            s.num_tokens - s.num_computed_tokens
            for s in self.running
            if s.priority == priority and s.is_prefilling
        )

    def num_running(self, priority: Priority | None = None) -> int:
        return sum(1 for s in self.running if priority is None or s.priority == priority)

    # ---- the step ------------------------------------------------------------------------------

    def admits_waiting(self) -> bool:
        """Whether waiting sequences may join the batch in this step: always, in continuous batching
        (a subclass that admits otherwise, as static batching's cohorts, says no here)."""
        return True

    def schedule(self, proposals: dict[Sequence, list[int]] | None = None) -> ScheduledBatch:
        """The next step's batch. ``proposals``: tokens decoding rows would verify (speculation.py);
        each costs the budget a token, and a row drops its proposals before anyone is preempted for
        their blocks."""
        proposals = proposals or {}
        step = _Step(budget=self.config.max_num_batched_tokens)
        admission_open = self.admits_waiting()
        for prio in Priority:
            running = sorted(
                (s for s in self.running if s.priority == prio),
                key=lambda s: (self.fair.counter(s.priority, s.tenant), s.arrival),
            )
            # Decodes first: one token each keeps every stream of the class moving.
            for seq in running:
                if step.budget == 0:
                    break
                if (
                    seq.status is SequenceStatus.RUNNING
                    and seq not in step.scheduled
                    and not seq.is_prefilling
                ):
                    self._schedule_running(seq, step, proposals.get(seq))
            # Then prompt work, the least-served tenant's first, whether its sequence is running
            # or waiting: a tenant's long prompts in flight never hold back another's new request.
            prefilling = [s for s in running if s.is_prefilling]
            gated: set[str] = set()  # tenants whose next sequence the gate holds back this step
            while step.budget > 0:
                prefilling = [
                    s for s in prefilling if s.status is SequenceStatus.RUNNING and s not in step.scheduled
                ]
                ahead = min(prefilling, key=self._fair_key, default=None)
                head = self._next_waiting(prio, gated) if admission_open else None
                if ahead is None and head is None:
                    break
                if head is None or (ahead is not None and self._runs_before(ahead, head)):
                    assert ahead is not None
                    self._schedule_running(ahead, step)
                    prefilling.remove(ahead)
                    continue
                admitted = self._admit(head, step)
                if admitted is None:
                    gated.add(head.tenant)
                elif not admitted:
                    admission_open = False  # strict classes: nothing lower may take what this one needs
        if step.stalled and not step.scheduled:
            # Every aged sequence that could run waits on blocks the others hold: one must yield,
            # the youngest, so that the oldest always progresses and every wait ends.
            self._preempt(max(step.stalled, key=lambda s: s.arrival), step)
        return ScheduledBatch(
            seqs=list(step.scheduled),
            num_tokens=list(step.scheduled.values()),
            preempted=step.preempted,
            spec=step.spec,
        )

    def _fair_key(self, seq: Sequence) -> tuple[float, int]:
        return (self.fair.counter(seq.priority, seq.tenant), seq.arrival)

    def _runs_before(self, running: Sequence, waiting: Sequence) -> bool:
        """Whether a running sequence's prompt chunk goes before a waiting one's admission: the
        less-served tenant first; at a tie, FCFS inside a tenant, and across tenants the newcomer
        (a tenant coming back is lifted to the others' counter, and must not lose every tie)."""
        ran, wait = (
            self.fair.counter(running.priority, running.tenant),
            self.fair.counter(waiting.priority, waiting.tenant),
        )
        if ran != wait:
            return ran < wait
        return running.tenant == waiting.tenant

    def _next_waiting(self, prio: Priority, skip: set[str] | frozenset[str] = frozenset()) -> Sequence | None:
        queues = self.waiting[prio]
        tenants = [t for t in queues if t not in skip]
        if not tenants:
            return None
        if len(tenants) > 1:  # at a tie of counters, the tenant with the least running goes first
            running = Counter(s.tenant for s in self.running if s.priority == prio)
            tenants.sort(key=lambda t: (self.fair.counter(prio, t), running[t], queues[t][0].arrival))
        return queues[tenants[0]][0]

    def _prefix(self, seq: Sequence) -> list[int] | None:
        """Prefix-cache hits for a sequence about to get its first blocks; None once it has some."""
        if seq.block_table or seq.num_computed_tokens:
            return None
        return self.bm.match_prefix(seq)

    def _chunk(self, seq: Sequence, prefix: list[int] | None, budget: int) -> int:
        computed = seq.num_computed_tokens + len(prefix or ()) * self.bm.block_size
        return min(seq.num_tokens - computed, budget)

    def _take(self, seq: Sequence, n: int, prefix: list[int] | None, step: _Step) -> None:
        self.bm.allocate(seq, n, prefix)
        if prefix:
            seq.num_computed_tokens += len(prefix) * self.bm.block_size
        if prefix is not None and seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = len(prefix or ()) * self.bm.block_size
        step.scheduled[seq] = n
        step.budget -= n
        # Charged: the positions computed for the first time (not prefix-cache hits, which were
        # skipped above, nor a recompute after a preemption); prompt positions are prefill.
        start = max(seq.num_computed_tokens, seq.computed_high_water)
        end = seq.num_computed_tokens + n
        prefill = max(0, min(end, seq.num_prompt_tokens) - start)
        decode = max(0, end - max(start, seq.num_prompt_tokens))
        step.charged[seq] = (prefill, decode)
        self.fair.charge(seq.priority, seq.tenant, seq.weight, prefill, decode)

    def _schedule_running(self, seq: Sequence, step: _Step, proposal: list[int] | None = None) -> None:
        prefix = self._prefix(seq)
        n = self._chunk(seq, prefix, step.budget)
        spec = (proposal or [])[: step.budget - n]
        if spec and self.bm.can_allocate(seq, n + len(spec), prefix):
            self._take(seq, n + len(spec), prefix, step)
            step.spec[seq] = spec
            return
        while not self.bm.can_allocate(seq, n, prefix):
            victim = self._victim(seq, [s for s in self.running if s is not seq])
            if self._aged(seq):
                if victim is None:  # it keeps its blocks and waits for some to be freed
                    step.stalled.append(seq)
                    return
            elif victim is None or self._more_preemptable(seq, victim):
                self._preempt(seq, step)
                return
            self._preempt(victim, step)
            prefix = self._prefix(seq)
            n = self._chunk(seq, prefix, step.budget)
        self._take(seq, n, prefix, step)

    def _victim(self, seq: Sequence, candidates: list[Sequence]) -> Sequence | None:
        """Whom ``seq`` may preempt for room, the most preemptable first; None: nobody.

        Freeing a sequence helps only if ``seq`` may take its blocks: the tenant's own when the
        tenant is at its cap, otherwise its own or those of a tenant over its floor. An aged
        sequence yields only to a higher class.
        """
        own_only = self.bm.cap_bound(seq, 1)
        eligible = [
            s
            for s in candidates
            if (s.tenant == seq.tenant or (not own_only and self.bm.over_floor(s.tenant)))
            and not (self._aged(s) and s.priority <= seq.priority)
        ]
        running = self._running_tenants()
        return max(eligible, key=lambda s: self._preempt_key(s, running), default=None)

    def _aged(self, seq: Sequence) -> bool:
        limit = self.config.preemption_limit
        return limit is not None and seq.num_preemptions >= limit

    def _admit(self, seq: Sequence, step: _Step) -> bool | None:
        """Move the head of a waiting queue into the batch, preempting lower classes if they block it
        (or, while its tenant is under its KV floor, tenants over theirs).

        False: no room (blocks or batch slots); None: the gate holds it back, its tenant is at its KV
        cap, or it is aged and waits for older aged sequences (other tenants may go). The gate is
        asked first, so nothing is preempted for a sequence that could not run anyway.
        """
        if self._aged(seq) and any(self._aged(s) and s.arrival < seq.arrival for s in self.running):
            # Aged sequences that cannot all fit would trade blocks forever: the younger waits for
            # its elders (it was the one to yield), so each yields at most once per elder.
            return None
        if not self._passes_gate(seq):
            return None
        while True:
            prefix = self._prefix(seq)
            n = self._chunk(seq, prefix, step.budget)
            if self.bm.cap_bound(seq, self.bm.new_blocks(seq, n, prefix)):
                self.gate.release(seq)
                return None
            fits_slot = len(self.running) < self.config.max_num_seqs
            if fits_slot and self.bm.can_allocate(seq, n, prefix):
                break
            under_floor = self.bm.held(seq.tenant) < self.bm.shares.floor(seq.tenant)
            victim = self._victim(
                seq,
                [
                    s
                    for s in self.running
                    if s.priority > seq.priority or (under_floor and s.tenant != seq.tenant)
                ],
            )
            if victim is None:
                self.gate.release(seq)  # it keeps waiting; its adapter slot is not held meanwhile
                return False
            self._preempt(victim, step)
        self._dequeue(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._take(seq, n, prefix, step)
        return True

    def _passes_gate(self, seq: Sequence) -> bool:
        verdict = self.gate.admit(seq)
        if verdict is Gate.FAILED:
            reason = self.gate.failure(seq) or "the request cannot run on this replica"
            self.finish(seq, FinishReason.ERROR)
            self._rejected.append((seq, reason))
        return verdict is Gate.READY

    def _preempt_key(self, seq: Sequence, running: set[str]) -> tuple[int, bool, float, float, int]:
        """Larger is preempted first; ``running``: the tenants now running (``_running_tenants``),
        among whom a tenant's KV share is due."""
        return (
            seq.priority.order,
            self.bm.over_floor(seq.tenant),  # within its floor: last
            self.bm.held(seq.tenant) - self.bm.shares.fair(seq.tenant, running),
            self.fair.over_share(seq.priority, seq.tenant),
            seq.arrival,
        )

    def _running_tenants(self) -> set[str]:
        return {s.tenant for s in self.running}

    def _more_preemptable(self, seq: Sequence, other: Sequence) -> bool:
        running = self._running_tenants()
        return self._preempt_key(seq, running) > self._preempt_key(other, running)

    def _unschedule(self, seq: Sequence, step: _Step) -> None:
        """Take ``seq`` out of this step: its tokens go back to the budget, its charge is refunded."""
        n = step.scheduled.pop(seq, 0)
        step.spec.pop(seq, None)
        if n:
            step.budget += n
            prefill, decode = step.charged.pop(seq)
            self.fair.charge(seq.priority, seq.tenant, seq.weight, -prefill, -decode)

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        """Free ``seq``'s blocks now; it waits again and recomputes its tokens when readmitted."""
        self._unschedule(seq, step)
        self.running.remove(seq)
        self.bm.free(seq)
        self.gate.release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted.append(seq)
        self._enqueue(seq)

    # ---- after the forward pass --------------------------------------------------------------

    def update_from_output(
        self,
        batch: ScheduledBatch,
        sampled: dict[Sequence, int],
        accepted: dict[Sequence, list[int]] | None = None,
    ) -> list[SequenceUpdate]:
        """Apply a step's results; returns an update per live sequence that sampled a token.

        ``accepted``: of a row's proposals, those that held (a prefix); they precede its sampled
        token. Rejected proposals' cache positions are not computed, and their blocks go back.
        """
        accepted = accepted or {}
        updates: list[SequenceUpdate] = []
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            if seq.status is SequenceStatus.FINISHED:  # ended earlier in the step (a subclass ends several)
                continue
            proposed, kept = len(batch.spec.get(seq, ())), accepted.get(seq, [])
            done = n - proposed + len(kept)
            start, seq.num_computed_tokens = seq.num_computed_tokens, seq.num_computed_tokens + done
            self.num_recomputed_tokens += max(
                0, min(seq.num_computed_tokens, seq.computed_high_water) - start
            )
            seq.computed_high_water = max(seq.computed_high_water, seq.num_computed_tokens)
            self.bm.register_full_blocks(seq)
            token = sampled.get(seq)
            if token is None:  # a prefill chunk that has not reached the prompt's end
                continue
            gained: list[int] = []
            reason = None
            for t in (*kept, token):
                seq.token_ids.append(t)
                gained.append(t)
                if (reason := self._stop_reason(seq, t)) is not None:
                    break
            if reason is not None:
                self.finish(seq, reason)
            elif proposed:
                self.bm.trim(seq)
            updates.append(SequenceUpdate(seq, tuple(gained), reason))
        return updates

    def drop_last_tokens(self, seq: Sequence, count: int) -> None:
        """Forget the last ``count`` tokens of an ended sequence: a stop string completed before them
        (several tokens gained in one step), so they are not output."""
        assert not seq.is_live and 0 <= count <= seq.num_output_tokens
        del seq.token_ids[len(seq.token_ids) - count :]

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        if token in seq.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= seq.sampling.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None


def scheduler_class(path: str | None) -> type[Scheduler]:
    """The scheduler an engine runs: Loom's, or the subclass ``path`` names (``"module:Class"``)."""
    if not path:
        return Scheduler
    module_name, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"scheduler_cls {path!r} cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise ValueError(f"scheduler_cls {path!r} is not a subclass of worker.scheduler.Scheduler")
    return cls
