"""``loom bench noisy``: a quiet tenant beside a flooder, on the real scheduler and block manager with
a virtual clock (loadtest/simulator.py; Llama-3-8B on one H100 by the cost model, deterministic).

The quiet tenant sends 0.5 requests/s, each a 512-token system prompt it always sends plus 128
tokens of its own, 64 tokens out. The flooder sends ten times as many requests with ten times the
context (6,400 prompt tokens, none shared): about what the replica can serve. The KV cache is held
to 2,048 blocks (32,768 tokens), so the flood turns it over in about a second, faster than the
quiet tenant comes back. Runs: the quiet tenant alone; beside the flooder with no KV share; beside
it with a KV floor of 5% of the blocks, at the default step budget (2,048 tokens) and at 512 and
256, since the quiet tenant's TTFT beside a flood is the step it lands in. Reported for the quiet
tenant: TTFT p50 / p99 against alone, and the share of its prompt tokens the prefix cache served;
for the flooder, what it got through (so the protection's price is in view). Writes
``noisy.json`` and ``noisy.md``.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from common import Priority
from loadtest.costmodel import H100, LLAMA3_8B, Deployment
from loadtest.generator import PlannedRequest
from loadtest.markdown import render, write_report
from loadtest.simulator import EngineSpec, Simulator
from loadtest.stats import RequestRecord, percentile
from protocol.requests import KvShare

RESULTS_DIR = Path(__file__).parent / "results"
QUIET_RATE = 0.5  # requests/s
SYSTEM_PROMPT = 512
OWN_PROMPT = 128
OUTPUT = 64
FLOOD_FACTOR = 10  # times the quiet tenant's rate, and times its context
DURATION_S = 300.0
FLOOR = 0.05


def plan(with_flooder: bool, floor: float, seed: int = 0) -> list[PlannedRequest]:
    rng = random.Random(seed)
    share = KvShare(floor=floor)
    streams = [("quiet", QUIET_RATE, SYSTEM_PROMPT + OWN_PROMPT, SYSTEM_PROMPT, share)]
    if with_flooder:
        context = FLOOD_FACTOR * (SYSTEM_PROMPT + OWN_PROMPT)
        streams.append(("flood", FLOOD_FACTOR * QUIET_RATE, context, 0, None))
    requests: list[PlannedRequest] = []
    for tenant, rate, prompt, shared, kv in streams:
        at = rng.expovariate(rate)
        while at < DURATION_S:
            requests.append(
                PlannedRequest(
                    index=len(requests),
                    stage=0,
                    at_s=at,
                    tenant=tenant,
                    priority=Priority.STANDARD,
                    prompt_len=prompt,
                    max_tokens=OUTPUT,
                    shared_prefix_len=shared,
                    kv_share=kv,
                )
            )
            at += rng.expovariate(rate)
    return requests


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _summary(records: list[RequestRecord], tenant: str, end_s: float) -> dict[str, Any]:
    mine = [r for r in records if r.tenant == tenant]
    started = [r for r in mine if r.first_token_s is not None]
    ttft = [r.first_token_s - r.scheduled_s for r in started if r.first_token_s is not None]
    done = [r for r in mine if r.end_s is not None]
    prompt = sum(r.prompt_tokens for r in done)
    return {
        "requests": len(mine),
        "started": len(started),
        "finished": len(done),
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "prefix_hit_rate": sum(r.cached_prompt_tokens for r in done) / prompt if prompt else None,
        "output_tokens_per_s": sum(r.completion_tokens for r in mine) / end_s,
    }


NUM_BLOCKS = 2048  # 32,768 tokens of KV: the flood turns the cache over in about a second
BUDGETS = (2048, 512, 256)  # max_num_batched_tokens: 2,048 is the default, the others trade step size
CASES = [  # (name, with the flooder, the quiet tenant's floor, step budget)
    *((f"quiet alone, budget {b}", False, 0.0, b) for b in (BUDGETS[0], BUDGETS[-1])),
    (f"beside the flooder, no KV share, budget {BUDGETS[0]}", True, 0.0, BUDGETS[0]),
    *((f"beside the flooder, KV floor {FLOOR:.0%}, budget {b}", True, FLOOR, b) for b in BUDGETS),
]


def engine_spec(budget: int) -> EngineSpec:
    return EngineSpec(
        enable_prefix_caching=True, num_blocks=NUM_BLOCKS, max_model_len=8192, max_num_batched_tokens=budget
    )


def run_case(with_flooder: bool, floor: float, budget: int) -> dict[str, Any]:
    sim = Simulator(Deployment(LLAMA3_8B, H100, 1), engine_spec(budget))
    result = sim.run(plan(with_flooder, floor), horizon_s=DURATION_S)
    out = {
        "budget": budget,
        "quiet": _summary(result.records, "quiet", result.end_s),
        "preemptions": result.preemptions,
    }
    if with_flooder:
        out["flood"] = _summary(result.records, "flood", result.end_s)
    return out


def run_benchmark(out_dir: Path | None = RESULTS_DIR) -> dict[str, Any]:
    cases = {name: run_case(flooder, floor, budget) for name, flooder, floor, budget in CASES}
    alone = {c["budget"]: c["quiet"] for c in cases.values() if "flood" not in c}
    for case in cases.values():
        q, solo = case["quiet"], alone.get(case["budget"], alone[BUDGETS[0]])
        q["ttft_p99_vs_alone"] = q["ttft_p99_ms"] / solo["ttft_p99_ms"]
        q["hit_rate_points_vs_alone"] = 100 * (q["prefix_hit_rate"] - solo["prefix_hit_rate"])
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "deployment": Deployment(LLAMA3_8B, H100, 1).describe(),
        "engine": engine_spec(BUDGETS[0]).describe() | {"num_blocks": NUM_BLOCKS, "budgets": list(BUDGETS)},
        "workload": {
            "duration_s": DURATION_S,
            "quiet": {"rate": QUIET_RATE, "system_prompt": SYSTEM_PROMPT, "own_prompt": OWN_PROMPT},
            "flood": {
                "rate": FLOOD_FACTOR * QUIET_RATE,
                "prompt": FLOOD_FACTOR * (SYSTEM_PROMPT + OWN_PROMPT),
            },
            "output": OUTPUT,
            "floor": FLOOR,
        },
        "cases": cases,
    }
    if out_dir is not None:
        write_report(out_dir, "noisy", report, to_markdown(report))
    return report


def to_markdown(report: dict[str, Any]) -> str:
    return render("noisy.md.j2", report=report)


def _main(args: argparse.Namespace) -> int:
    run_benchmark(out_dir=args.out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "noisy", help="a quiet tenant beside a flooder: TTFT and prefix-cache hits (simulated)"
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.set_defaults(func=_main)
