"""``loom bench slo``: SLO-aware admission past the knee, on the real scheduler and block manager with
a virtual clock (loadtest/simulator.py; Llama-3-8B on one H100 by the cost model, deterministic)
and the gateway's own admission code (gateway/slo.py) reading the replicas' stats as published,
once a second.

An interactive tenant (1,024-token prompts, 128 tokens out, targets: first token within 500 ms,
50 ms per token after it) beside a batch tenant that keeps the replica busy (2,048-token prompts,
512 out, no target: its work queues). The knee is the highest interactive rate at which, with no
admission control, 95% of interactive requests still meet both targets (found by bisection). At
1.5x the knee each run is made twice: admitting everything, and with SLO admission refusing the
interactive requests predicted to miss. Reported: interactive goodput (met over admitted, and over
offered), refusals with a sample of their reasons, and the batch tenant's throughput. Writes
``slo.json`` and ``slo.md``.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from common import Priority
from gateway.errors import GatewayError
from gateway.slo import SloAdmission
from loadtest.costmodel import H100, LLAMA3_8B, Deployment
from loadtest.generator import PlannedRequest
from loadtest.markdown import render, write_report
from loadtest.simulator import EngineSpec, SimResult, Simulator
from loadtest.stats import RequestRecord
from protocol.stats import EngineStats
from tenancy import SloTarget, Tenant

RESULTS_DIR = Path(__file__).parent / "results"
TARGET = SloTarget(ttft_ms=500, tpot_ms=50)
CHAT = Tenant(id="chat", priority_ceiling=Priority.INTERACTIVE, slo={Priority.INTERACTIVE: TARGET})
BULK = Tenant(id="bulk", default_priority=Priority.BATCH)
CHAT_SHAPE = (1024, 128)
BULK_SHAPE = (2048, 512)
BULK_RATE = 4.0  # requests/s: about half the replica's capacity
DURATION_S = 120.0
GOODPUT = 0.95


def plan(chat_rate: float, seed: int = 0) -> list[PlannedRequest]:
    rng = random.Random(seed)
    requests: list[PlannedRequest] = []
    for tenant, priority, rate, (prompt, output) in (
        (CHAT, Priority.INTERACTIVE, chat_rate, CHAT_SHAPE),
        (BULK, Priority.BATCH, BULK_RATE, BULK_SHAPE),
    ):
        at = rng.expovariate(rate)
        while at < DURATION_S:
            requests.append(PlannedRequest(len(requests), 0, at, tenant.id, priority, prompt, output))
            at += rng.expovariate(rate)
    return requests


def _run(chat_rate: float, admit: bool) -> SimResult:
    slo = SloAdmission()
    tenants = {CHAT.id: CHAT, BULK.id: BULK}

    def admission(req: PlannedRequest, stats: dict[str, EngineStats]) -> str | None:
        try:
            slo.admit(tenants[req.tenant], req.priority, req.prompt_len, "sim", lambda: stats, now=req.at_s)
        except GatewayError as err:
            return err.message
        return None

    sim = Simulator(Deployment(LLAMA3_8B, H100, 1), EngineSpec())
    return sim.run(plan(chat_rate), horizon_s=DURATION_S + 60, admission=admission if admit else None)


def _met(r: RequestRecord) -> bool:
    if r.first_token_s is None or r.end_s is None:
        return False
    tpot = (r.end_s - r.first_token_s) / (r.completion_tokens - 1) if r.completion_tokens > 1 else None
    return TARGET.met(r.first_token_s - r.scheduled_s, tpot)


def summarize(result: SimResult) -> dict[str, Any]:
    chat = [r for r in result.records if r.tenant == CHAT.id]
    refused = [r for r in chat if r.code == "RESOURCE_EXHAUSTED"]
    admitted = [r for r in chat if r.code != "RESOURCE_EXHAUSTED"]
    met = sum(_met(r) for r in admitted)
    bulk = [r for r in result.records if r.tenant == BULK.id]
    return {
        "chat_offered": len(chat),
        "chat_admitted": len(admitted),
        "chat_refused": len(refused),
        "chat_met": met,
        "goodput_of_admitted": met / len(admitted) if admitted else 0.0,
        "goodput_of_offered": met / len(chat) if chat else 0.0,
        "refusals_with_reason": sum(
            1 for r in refused if r.error and "predicted time to first token" in r.error
        ),
        "refusal_sample": refused[0].error if refused else None,
        "bulk_finished": sum(1 for r in bulk if r.end_s is not None),
        "bulk_offered": len(bulk),
        "bulk_output_tokens_per_s": sum(r.completion_tokens for r in bulk) / result.end_s,
    }


def find_knee(lo: float = 0.5, hi: float = 64.0, rounds: int = 8) -> float:
    """The highest interactive rate (requests/s) whose goodput with no admission is >= 95%."""
    for _ in range(rounds):
        mid = (lo + hi) / 2
        if summarize(_run(mid, admit=False))["goodput_of_admitted"] >= GOODPUT:
            lo = mid
        else:
            hi = mid
    return lo


def run_benchmark(out_dir: Path | None = RESULTS_DIR) -> dict[str, Any]:
    knee = find_knee()
    rate = 1.5 * knee
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "deployment": Deployment(LLAMA3_8B, H100, 1).describe(),
        "engine": EngineSpec().describe(),
        "workload": {
            "duration_s": DURATION_S,
            "chat": {
                "prompt": CHAT_SHAPE[0],
                "output": CHAT_SHAPE[1],
                "ttft_ms": TARGET.ttft_ms,
                "tpot_ms": TARGET.tpot_ms,
            },
            "bulk": {"prompt": BULK_SHAPE[0], "output": BULK_SHAPE[1], "rate": BULK_RATE},
        },
        "knee_rate": knee,
        "rate": rate,
        "runs": {
            "at the knee, admitting everything": summarize(_run(knee, admit=False)),
            "1.5x the knee, admitting everything": summarize(_run(rate, admit=False)),
            "1.5x the knee, SLO admission": summarize(_run(rate, admit=True)),
        },
    }
    if out_dir is not None:
        write_report(out_dir, "slo", report, to_markdown(report))
    return report


def to_markdown(report: dict[str, Any]) -> str:
    return render("slo.md.j2", report=report)


def _main(args: argparse.Namespace) -> int:
    run_benchmark(out_dir=args.out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "slo", help="SLO admission at 1.5x the knee: interactive goodput, refusals (simulated)"
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.set_defaults(func=_main)
