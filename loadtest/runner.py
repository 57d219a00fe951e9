"""The open-loop executor: sends the plan's requests at their planned instants, records what comes back.

Open loop: a request leaves at its planned offset whether or not earlier ones have been answered, as
independent users do; a closed loop (N workers each waiting for its answer) slows down with the
server and hides exactly the queueing a load test is for. The client protects itself and the
machine instead: at most ``max_in_flight`` streams (an arrival beyond that is recorded as
CLIENT_DROPPED, not sent), and the run is bounded twice, by the plan's ``max_requests`` and by
``max_seconds`` of wall clock, draining included; whatever still streams when time is up is
cancelled and recorded INCOMPLETE. A sweep runs its stages one after another, each drained (up to
``drain_s``) before the next, so each rate is measured on an idle-to-steady system of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from loadtest.driver import Driver, DriverError, DriverRequest
from loadtest.generator import Plan, PlannedRequest, Stage, prompt_text
from loadtest.prometheus import MetricsSampler
from loadtest.stats import CLIENT_DROPPED, INCOMPLETE, NOT_SENT, OK, RequestRecord, percentile
from loadtest.workload import Workload


@dataclass
class StageResult:
    stage: Stage
    records: list[RequestRecord]
    started_s: float  # since the run's start
    ended_s: float
    cut_short: bool  # max_seconds ended it


@dataclass
class RunResult:
    run_id: str
    stages: list[StageResult]
    wall_s: float
    metrics: MetricsSampler | None
    skipped_stages: list[str] = field(default_factory=list)


@dataclass
class _Live:
    """Counters the progress display reads."""

    stage: str = ""
    planned: int = 0
    sent: int = 0
    in_flight: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    tokens: int = 0
    recent_ttft: list[float] = field(default_factory=list)
    token_marks: list[tuple[float, int]] = field(default_factory=list)


class Runner:
    def __init__(
        self,
        workload: Workload,
        plan: Plan,
        driver: Driver,
        *,
        sampler: MetricsSampler | None = None,
        console: Console | None = None,
        live: bool = True,
    ) -> None:
        self.w = workload
        self.plan = plan
        self.driver = driver
        self.sampler = sampler
        self.console = console or Console(stderr=True)
        self.live = live and self.console.is_terminal
        self.run_id = uuid.uuid4().hex[:8]  # request ids must be new: the gateway refuses reuse for 1 h
        self.state = _Live()

    async def run(self) -> RunResult:
        t0 = time.monotonic()
        deadline = t0 + self.w.max_seconds
        if self.sampler is not None:
            self.sampler.start(t0)
        results: list[StageResult] = []
        skipped: list[str] = []
        display = Live(self._render(t0), console=self.console, refresh_per_second=4) if self.live else None
        ticker = asyncio.get_running_loop().create_task(self._tick(t0, display))
        try:
            with display if display is not None else contextlib.nullcontext():
                for stage in self.plan.stages:
                    if time.monotonic() >= deadline:
                        skipped.append(stage.name)
                        continue
                    results.append(await self._stage(stage, t0, deadline))
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            if self.sampler is not None:
                await self.sampler.stop()
        return RunResult(self.run_id, results, time.monotonic() - t0, self.sampler, skipped)

    async def _stage(self, stage: Stage, t0: float, deadline: float) -> StageResult:
        s = self.state
        s.stage, s.planned, s.sent = stage.name, len(stage.requests), 0
        start = time.monotonic()
        records = [
            RequestRecord(
                index=r.index,
                tenant=r.tenant,
                priority=r.priority.value,
                scheduled_s=r.at_s,
                stage=stage.index,
                max_tokens=r.max_tokens,
                code=INCOMPLETE,
                front=self.w.front_of(r.tenant),
            )
            for r in stage.requests
        ]
        tasks: set[asyncio.Task[None]] = set()
        cut = False
        for req, rec in zip(stage.requests, records, strict=True):
            delay = start + req.at_s - time.monotonic()
            if start + req.at_s >= deadline:
                rec.code = NOT_SENT
                s.codes[NOT_SENT] += 1
                cut = True
                continue
            if delay > 0:
                await asyncio.sleep(delay)
            if len(tasks) >= self.w.max_in_flight:
                rec.code = CLIENT_DROPPED
                s.codes[CLIENT_DROPPED] += 1
                continue
            task = asyncio.get_running_loop().create_task(self._one(req, rec, start))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            s.sent += 1
        drain_until = min(deadline, time.monotonic() + self.w.drain_s)
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=max(0.0, drain_until - time.monotonic()))
            for task in pending:
                task.cancel()
            if pending:
                cut = cut or time.monotonic() >= deadline
                await asyncio.gather(*pending, return_exceptions=True)
        end = time.monotonic()
        return StageResult(stage, records, start - t0, end - t0, cut)

    def _request(self, req: PlannedRequest) -> DriverRequest:
        w = self.w
        return DriverRequest(
            request_id=f"lt-{self.run_id}-{req.index}",
            tenant=req.tenant,
            model=w.target.model,
            prompt=prompt_text(req.prompt_len, req.index, w.seed),
            chat=w.chat,
            max_tokens=req.max_tokens,
            temperature=w.temperature,
            priority=req.priority,
            seed=(w.seed * 1_000_003 + req.index) % (2**63) if w.temperature > 0 else None,
            timeout_s=w.request_timeout_s,
        )

    async def _one(self, req: PlannedRequest, rec: RequestRecord, start: float) -> None:
        s = self.state
        s.in_flight += 1
        rec.sent_s = time.monotonic() - start
        tokens = 0
        try:
            stream = self.driver.stream(self._request(req))
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for chunk in stream:
                    now = time.monotonic() - start
                    if chunk.tokens:
                        if rec.first_token_s is None:
                            rec.first_token_s = now
                            s.recent_ttft.append(now - rec.scheduled_s)
                        rec.chunk_times.append(now)
                        rec.chunk_tokens = rec.chunk_tokens or []
                        rec.chunk_tokens.append(chunk.tokens)
                        tokens += chunk.tokens
                        s.tokens += chunk.tokens
                    if chunk.finish_reason is not None:
                        rec.finish_reason = chunk.finish_reason
                    if chunk.prompt_tokens is not None:
                        rec.prompt_tokens = chunk.prompt_tokens
                    if chunk.completion_tokens is not None:
                        rec.completion_tokens = chunk.completion_tokens
            rec.code = OK
        except DriverError as exc:
            rec.code = exc.code
            rec.error = exc.message[:300]
        except asyncio.CancelledError:
            rec.code = INCOMPLETE  # the run's time was up
        except Exception as exc:  # a client-side failure is a result too, never a crash of the run
            rec.code = "CLIENT_ERROR"
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            rec.end_s = time.monotonic() - start
            rec.completion_tokens = rec.completion_tokens or tokens
            s.codes[rec.code] += 1
            s.in_flight -= 1

    # ---- progress ------------------------------------------------------------------------------

    async def _tick(self, t0: float, display: Live | None) -> None:
        last_log = 0.0
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            self.state.token_marks.append((now, self.state.tokens))
            self.state.token_marks = [m for m in self.state.token_marks if m[0] >= now - 5.0]
            self.state.recent_ttft = self.state.recent_ttft[-500:]
            if display is not None:
                display.update(self._render(t0))
            elif now - last_log >= 5.0:  # not a terminal: a plain line every 5 s (CI logs)
                last_log = now
                self.console.print(self._line(t0), highlight=False)

    def _rates(self) -> tuple[float, float | None]:
        m = self.state.token_marks
        tps = (m[-1][1] - m[0][1]) / (m[-1][0] - m[0][0]) if len(m) > 1 and m[-1][0] > m[0][0] else 0.0
        return tps, percentile(self.state.recent_ttft, 50) if self.state.recent_ttft else None

    def _line(self, t0: float) -> str:
        s = self.state
        tps, ttft = self._rates()
        codes = " ".join(f"{k}={v}" for k, v in sorted(s.codes.items()))
        ttft_s = f"{ttft * 1e3:.0f} ms" if ttft is not None else "-"
        return (
            f"[{time.monotonic() - t0:6.1f} s] stage {s.stage}: sent {s.sent}/{s.planned}, in flight "
            f"{s.in_flight}, {tps:.0f} tok/s, TTFT p50 {ttft_s}; {codes}"
        )

    def _render(self, t0: float) -> Table:
        s = self.state
        tps, ttft = self._rates()
        table = Table(title=f"loom loadtest {self.w.name} (run {self.run_id})", show_header=False)
        table.add_column(style="bold")
        table.add_column()
        table.add_row("elapsed", f"{time.monotonic() - t0:.1f} s of at most {self.w.max_seconds:g} s")
        table.add_row("stage", f"{s.stage} ({len(self.plan.stages)} in all)")
        table.add_row("sent", f"{s.sent} / {s.planned}   in flight {s.in_flight}")
        table.add_row("results", ", ".join(f"{k} {v}" for k, v in sorted(s.codes.items())) or "-")
        table.add_row("output", f"{tps:,.0f} tokens/s (last 5 s), {s.tokens:,} tokens")
        table.add_row("TTFT p50", f"{ttft * 1e3:.0f} ms (last 500)" if ttft is not None else "-")
        if self.sampler is not None:
            latest = self.sampler.latest()
            for replica, g in latest.items():
                table.add_row(
                    f"engine {replica}",
                    f"running {g.get('loom:num_requests_running', 0):.0f}, waiting "
                    f"{g.get('loom:num_requests_waiting', 0):.0f}, "
                    f"KV {g.get('loom:kv_cache_usage_perc', 0):.0%}, "
                    f"busy {g.get('loom:engine_busy_fraction', 0):.0%}",
                )
            if self.sampler.errors:
                table.add_row("metrics", f"{self.sampler.errors} failed scrapes ({self.sampler.last_error})")
        return table


def records_of(result: RunResult) -> list[RequestRecord]:
    return [r for st in result.stages for r in st.records]


def stage_window(st: StageResult) -> float:
    """The measurement window of a stage: its planned arrival window."""
    return st.stage.duration_s


def describe_plan(plan: Plan) -> dict[str, Any]:
    return {
        "stages": [
            {
                "name": s.name,
                "duration_s": s.duration_s,
                "offered_rps": s.offered_rate,
                "requests": len(s.requests),
                "max_tokens_total": sum(r.max_tokens for r in s.requests),
            }
            for s in plan.stages
        ],
        "requests": len(plan.requests),
        "truncated_by_max_requests": plan.truncated,
    }
