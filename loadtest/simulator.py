"""GPU scale without a GPU: the real scheduler and block manager on a virtual clock.

Each replica is Loom's own ``Scheduler`` over its own ``BlockManager`` (worker/scheduler.py, the code
that runs in production), so admission, chunked prefill, strict priority classes, weighted fair
share and preemption behave exactly as they do in the engine (static batching is the benchmarks'
scheduler subclass, loadtest/static_batching.py, the same one the engine runs for them). Only the
forward pass is replaced: a step's duration comes from the cost model (loadtest/costmodel.py) and
every sampled token is a stand-in, so a request produces exactly ``max_tokens`` tokens (as
``ignore_eos`` does).

Events are processed in time order: an arrival joins the least-loaded replica (fewest outstanding
requests; Loom's router also weighs KV usage and prefix affinity, which a workload without shared
prefixes does not exercise) and wakes it if idle; a replica that finishes a step applies it with
``Scheduler.update_from_output`` and schedules the next at once. Requests arriving during a step join
the next one, as in the engine loop. Everything is deterministic: same inputs, same numbers.

The step log keeps, per step, what the utilization definitions of docs/utilization.md need (busy
time, live and padding slots, useful and computed tokens, KV blocks and tokens, bytes and FLOPs) and,
for the same resident sequences, what a contiguous max-length reservation would have held.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from loadtest.costmodel import Deployment, StepItem, step_cost
from loadtest.generator import PlannedRequest
from loadtest.static_batching import Batching
from loadtest.stats import INCOMPLETE, OK, RequestRecord, SloSpec, grouped
from protocol.requests import KvShare, SamplingParams
from protocol.stats import EngineStats
from worker.block_manager import BlockManager
from worker.engine_counters import EngineCounters
from worker.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from worker.sequence import Sequence

_STAND_IN_TOKEN = 7
_ids = itertools.count()


@dataclass(frozen=True)
class EngineSpec:
    """The engine settings a replica runs with (``LOOM_ENGINE_*`` equivalents)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    mode: Batching = Batching.CONTINUOUS
    # "contiguous": one block of max_model_len tokens per sequence, i.e. a max-length reservation at
    # admission (what engines did before paging), run by the same scheduler for a fair comparison.
    kv_layout: Literal["paged", "contiguous"] = "paged"
    max_model_len: int = 4096
    num_blocks: int | None = None  # default: the deployment's KV capacity
    client_cap_tokens: int = 1024  # a typical client max_tokens: the "reserve prompt + cap" baseline
    enable_prefix_caching: bool = False  # on only where a workload's prompts share prefixes

    def describe(self) -> dict[str, Any]:
        return {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "mode": str(self.mode),
            "kv_layout": self.kv_layout,
            "max_model_len": self.max_model_len,
        }


def make_sequence(req: PlannedRequest, request_id: str | None = None) -> Sequence:
    """A scheduler sequence for a planned request: prompt of ``prompt_len`` tokens, exact output length.

    The prompt's first ``shared_prefix_len`` tokens are the same for every request of its tenant (a
    system prompt the prefix cache can serve); the rest are this request's own, so two requests
    share nothing more.
    """
    serial = next(_ids)
    shared = min(req.shared_prefix_len, req.prompt_len)
    return Sequence(
        request_id=request_id or f"sim-{serial}",
        token_ids=[2 + i for i in range(shared)] + [1_000_000 + serial] * (req.prompt_len - shared),
        num_prompt_tokens=req.prompt_len,
        sampling=SamplingParams(max_tokens=req.max_tokens, ignore_eos=True),
        tenant=req.tenant,
        priority=req.priority,
        weight=req.weight,
        cache_salt=req.tenant.encode(),
        kv_share=req.kv_share or KvShare(),
    )


_COLUMNS = (
    "replica",
    "start",
    "dur",
    "live",
    "padding",
    "tokens",
    "useful",
    "kv_blocks",
    "kv_live_tokens",
    "kv_alloc_slots",
    "res_max_len",
    "res_cap",
    "res_oracle",
    "bytes",
    "flops",
    "bound",  # 0 memory, 1 compute, 2 launch
)
_BOUND = {"memory": 0, "compute": 1, "launch": 2}


@dataclass
class StepLog:
    cols: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in _COLUMNS})

    def add(self, **values: float) -> None:
        for c in _COLUMNS:
            self.cols[c].append(values[c])

    def arrays(self) -> dict[str, np.ndarray]:
        return {c: np.asarray(v, dtype=float) for c, v in self.cols.items()}

    def __len__(self) -> int:
        return len(self.cols["start"])


@dataclass
class _Replica:
    index: int
    scheduler: Scheduler
    bm: BlockManager
    counters: EngineCounters  # the engine's own, on the virtual clock
    outstanding: int = 0
    in_flight: tuple[ScheduledBatch, list[Sequence]] | None = None
    high_water: dict[Sequence, int] = field(default_factory=dict)  # tokens ever computed, per sequence
    published: EngineStats | None = None  # the stats as last published (every PUBLISH_PERIOD_S)
    published_at: float = -math.inf

    def publish(self, now: float) -> EngineStats:
        """What the replica's routing stats say at ``now``: refreshed once a period, as Serve's are."""
        if self.published is None or now - self.published_at >= PUBLISH_PERIOD_S:
            self.published_at = now
            self.published = self.counters.snapshot(self.scheduler, self.bm, now=now)
        return self.published


# An arrival's admission: None to admit it, else the reason it is refused (RESOURCE_EXHAUSTED).
Admission = Callable[[PlannedRequest, dict[str, EngineStats]], str | None]
PUBLISH_PERIOD_S = 1.0  # serving/replica.py's routing stats period


class SimulationStuckError(RuntimeError):
    """The scheduler holds work it can never schedule (a request larger than the whole KV cache)."""


@dataclass
class SimResult:
    deployment: Deployment
    engine: EngineSpec
    replicas: int
    records: list[RequestRecord]
    steps: StepLog
    num_blocks: int
    block_size: int
    end_s: float
    preemptions: int

    def utilization(self, window_s: float | None = None) -> dict[str, Any]:
        """The docs/utilization.md figures over [0, window_s] (default: the whole run)."""
        T = window_s if window_s is not None else self.end_s
        a = self.steps.arrays()
        if len(self.steps) == 0 or T <= 0:
            return {}
        start, dur = a["start"], a["dur"]
        overlap = np.clip(np.minimum(start + dur, T) - start, 0.0, None)
        f = np.divide(overlap, dur, out=np.zeros_like(dur), where=dur > 0)  # share of each step inside
        busy = overlap.sum()
        hw = self.deployment.hw
        cap = self.engine.max_num_seqs
        live_t = (a["live"] * overlap).sum()

        def ratio(num: float, den: float) -> float | None:
            return float(num / den) if den > 0 else None

        kv_live = (a["kv_live_tokens"] * overlap).sum()
        bound_time = {
            k: float(overlap[a["bound"] == v].sum() / busy) if busy else 0.0 for k, v in _BOUND.items()
        }
        return {
            "window_s": T,
            "steps": int((overlap > 0).sum()),
            "step_busy_fraction": ratio(busy, T * self.replicas),
            "slot_occupancy": ratio(live_t, busy * cap),
            "mean_live_batch": ratio(live_t, busy),
            "useful_token_fraction": ratio((a["useful"] * f).sum(), (a["tokens"] * f).sum()),
            "padding_slot_fraction": ratio(
                (a["padding"] * overlap).sum(), ((a["live"] + a["padding"]) * overlap).sum()
            ),
            "kv_blocks_used_mean": ratio((a["kv_blocks"] * overlap).sum(), busy * self.num_blocks),
            "kv_blocks_used_peak": float(a["kv_blocks"][overlap > 0].max() / self.num_blocks)
            if busy
            else None,
            "kv_waste": {
                "allocated": ratio(
                    (a["kv_alloc_slots"] - a["kv_live_tokens"]).clip(0).dot(overlap),
                    (a["kv_alloc_slots"] * overlap).sum(),
                ),
                "contiguous_max_len": ratio(
                    (a["res_max_len"] * overlap).sum() - kv_live, (a["res_max_len"] * overlap).sum()
                ),
                "contiguous_prompt_plus_cap": ratio(
                    (a["res_cap"] * overlap).sum() - kv_live, (a["res_cap"] * overlap).sum()
                ),
                "contiguous_oracle": ratio(
                    (a["res_oracle"] * overlap).sum() - kv_live, (a["res_oracle"] * overlap).sum()
                ),
            },
            "mbu_busy": ratio((a["bytes"] * f).sum(), busy * hw.mem_bw),
            "mbu_wall": ratio((a["bytes"] * f).sum(), T * self.replicas * hw.mem_bw),
            "mfu_busy": ratio((a["flops"] * f).sum(), busy * hw.matmul_rate),
            "bound_time_share": bound_time,
            "preemptions": self.preemptions,
        }

    def summary(self, slo: SloSpec, window_s: float | None = None) -> dict[str, Any]:
        T = window_s if window_s is not None else self.end_s
        return {
            "deployment": self.deployment.describe(),
            "engine": self.engine.describe(),
            "replicas": self.replicas,
            "devices": self.replicas * self.deployment.devices,
            "num_blocks": self.num_blocks,
            "end_s": self.end_s,
            "stats": grouped(self.records, T, slo),
            "utilization": self.utilization(T),
        }


class Simulator:
    """``replicas`` engine replicas of ``deployment`` behind a least-loaded router, on a virtual clock."""

    def __init__(self, deployment: Deployment, engine: EngineSpec | None = None, replicas: int = 1) -> None:
        self.dep = deployment
        self.engine = engine or EngineSpec()
        self.replicas = replicas
        e = self.engine
        self.block_size = e.block_size if e.kv_layout == "paged" else e.max_model_len
        capacity = deployment.kv_capacity_tokens
        self.num_blocks = e.num_blocks or capacity // self.block_size
        if self.num_blocks < 1:
            raise ValueError(
                f"{deployment.name}: KV capacity {capacity} tokens holds no block of {self.block_size}"
            )

    def _replica(self, i: int) -> _Replica:
        e = self.engine
        bm = BlockManager(self.num_blocks, self.block_size, enable_prefix_caching=e.enable_prefix_caching)
        max_len = min(e.max_model_len, self.num_blocks * self.block_size)
        sched = e.mode.scheduler(SchedulerConfig(e.max_num_seqs, e.max_num_batched_tokens, max_len), bm)
        return _Replica(i, sched, bm, EngineCounters(e.max_num_batched_tokens, started=0.0))

    def run(
        self,
        requests: Seq[PlannedRequest],
        horizon_s: float | None = None,
        admission: Admission | None = None,
    ) -> SimResult:
        """Serve ``requests`` (``at_s`` is each arrival); stop at ``horizon_s`` if given, leaving what
        is unfinished INCOMPLETE (an infinite TTFT if it never started). ``admission`` is asked at
        each arrival, with the replicas' published stats, as a gateway would before dispatching."""
        reps = [self._replica(i) for i in range(self.replicas)]
        order = sorted(range(len(requests)), key=lambda i: (requests[i].at_s, i))
        records = [
            RequestRecord(
                index=r.index,
                tenant=r.tenant,
                priority=r.priority.value,
                scheduled_s=r.at_s,
                stage=r.stage,
                prompt_tokens=r.prompt_len,
                max_tokens=r.max_tokens,
                code=INCOMPLETE,
            )
            for r in requests
        ]
        owner: dict[Sequence, int] = {}
        log = StepLog()
        heap: list[tuple[float, int, int]] = []
        tie = itertools.count()
        horizon = math.inf if horizon_s is None else horizon_s
        now = 0.0
        ai = 0
        while True:
            t_arr = requests[order[ai]].at_s if ai < len(order) else math.inf
            t_step = heap[0][0] if heap else math.inf
            t_next = min(t_arr, t_step)
            if t_next == math.inf or t_next > horizon:
                break
            if t_arr <= t_step:
                now = t_arr
                woken: list[_Replica] = []
                while ai < len(order) and requests[order[ai]].at_s == now:  # simultaneous arrivals together
                    i = order[ai]
                    ai += 1
                    if admission is not None:
                        refused = admission(requests[i], {str(r.index): r.publish(now) for r in reps})
                        if refused is not None:
                            records[i].code, records[i].error = "RESOURCE_EXHAUSTED", refused
                            continue
                    rep = min(reps, key=lambda r: (r.outstanding, r.index))
                    seq = make_sequence(requests[i])
                    owner[seq] = i
                    rep.scheduler.add(seq)
                    rep.outstanding += 1
                    if rep.in_flight is None and rep not in woken:
                        woken.append(rep)
                for rep in woken:
                    self._start(rep, now, log, heap, tie)
            else:
                now, _, ri = heapq.heappop(heap)
                rep = reps[ri]
                self._finish(rep, now, records, owner)
                self._start(rep, now, log, heap, tie)
        end = now if horizon == math.inf else min(now, horizon)
        return SimResult(
            self.dep,
            self.engine,
            self.replicas,
            records,
            log,
            self.num_blocks,
            self.block_size,
            end,
            sum(r.scheduler.num_preemptions for r in reps),
        )

    def _start(
        self, rep: _Replica, now: float, log: StepLog, heap: list[tuple[float, int, int]], tie: Any
    ) -> None:
        rep.in_flight = None
        if not rep.scheduler.has_work():
            return
        batch = rep.scheduler.schedule()
        if not batch:
            raise SimulationStuckError(
                f"replica {rep.index}: {rep.scheduler.num_waiting()} waiting requests fit nowhere "
                f"({self.num_blocks} blocks of {self.block_size} tokens)"
            )
        items = []
        sampled = []
        live = padding = useful = 0
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            c = seq.num_computed_tokens
            samples = c + n == seq.num_tokens
            items.append(StepItem(n, c, samples))
            if samples:
                sampled.append(seq)
            if seq.is_live:
                live += 1
                hw = rep.high_water.get(seq, 0)
                useful += max(0, c + n - max(c, hw))  # recomputation after preemption is waste
                rep.high_water[seq] = max(hw, c + n)
            else:
                padding += 1
        cost = step_cost(self.dep, items)
        rep.counters.record_step(now, now + cost.seconds, batch, int(cost.bytes))
        e = self.engine
        res_max = res_cap = res_oracle = kv_live = 0
        scheduled = dict(zip(batch.seqs, batch.num_tokens, strict=True))
        for s in rep.scheduler.running:
            res_max += e.max_model_len
            res_cap += min(s.num_prompt_tokens + e.client_cap_tokens, e.max_model_len)
            res_oracle += min(s.num_prompt_tokens + s.sampling.max_tokens, e.max_model_len)
            if s.is_live:
                kv_live += s.num_computed_tokens + scheduled.get(s, 0)
        log.add(
            replica=rep.index,
            start=now,
            dur=cost.seconds,
            live=live,
            padding=padding,
            tokens=batch.total_tokens,
            useful=useful,
            kv_blocks=rep.bm.num_used_blocks,
            kv_live_tokens=kv_live,
            kv_alloc_slots=rep.bm.num_used_blocks * self.block_size,
            res_max_len=res_max,
            res_cap=res_cap,
            res_oracle=res_oracle,
            bytes=cost.bytes,
            flops=cost.flops,
            bound=_BOUND[cost.bound],
        )
        rep.in_flight = (batch, sampled)
        heapq.heappush(heap, (now + cost.seconds, next(tie), rep.index))

    def _finish(
        self, rep: _Replica, now: float, records: list[RequestRecord], owner: dict[Sequence, int]
    ) -> None:
        assert rep.in_flight is not None
        batch, sampled = rep.in_flight
        updates = rep.scheduler.update_from_output(batch, dict.fromkeys(sampled, _STAND_IN_TOKEN))
        for u in updates:
            rec = records[owner[u.seq]]
            rec.chunk_times.append(now)
            if rec.first_token_s is None:
                rec.first_token_s = now
            if u.finish_reason is not None:
                rec.end_s = now
                rec.code = OK
                rec.finish_reason = str(u.finish_reason)
                rec.completion_tokens = u.seq.num_output_tokens
                rec.cached_prompt_tokens = u.seq.num_cached_prompt_tokens
                rep.outstanding -= 1
                rep.high_water.pop(u.seq, None)
                del owner[u.seq]
        for seq in batch.seqs:  # padding released with its cohort: forget its high-water mark
            if not seq.is_live and seq not in owner:
                rep.high_water.pop(seq, None)
        # Unfinished requests keep counting their delivered tokens (for runs cut at a horizon).
        for seq in sampled:
            i = owner.get(seq)
            if i is not None:
                records[i].completion_tokens = seq.num_output_tokens
