"""``loom bench fairness``: the weighted service difference between backlogged tenants, measured as
the VTC paper (OSDI'24) states it, on the real scheduler with a stand-in model (deterministic; steps,
not seconds).

Two tenants (one of long prompts and short outputs, one of short prompts and long outputs) at weights
1:1 and 1:3, and four tenants of mixed lengths at 1:1:3:3, every one kept backlogged for 2,000 steps,
at two batch shapes: the engine's defaults (64 sequences, 512 tokens a step) and a slot-bound one (16
sequences, 256 tokens), where the batch is full of decodes while most of the step's budget idles, so a
tenant that falls behind waits for a slot to free before the scheduler can favour it. Last, a pool
of two replicas (engine defaults) where tenant b is pinned to one replica (an adapter or prefix
affinity) and tenant a spreads over both, with each replica fair on its own and with the replicas
sharing their service through the pool's ledger (serving/pool_ledger.py).
Service counts prefill tokens at 1 and decode tokens at 2, from each step's batch. Each run is shown
with Loom's accounting (VTC's costs) and, beside it, with every token charged alike: the baseline
the accounting is there to beat. Writes ``fairness.json`` and ``fairness.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from loadtest.fairness import Shapes, backlogged_run, pool_run
from loadtest.markdown import render, write_report
from protocol.engine_config import EngineConfig
from worker.api import ServiceCosts

RESULTS_DIR = Path(__file__).parent / "results"
LEDGER_EVERY = 20  # steps between the replicas' reports to the pool's ledger (1 s at 50 ms a step)
LONG_PROMPTS: Shapes = ((8, 512), (4, 64))
LONG_OUTPUTS: Shapes = ((8, 64), (16, 256))
MIXED: Shapes = ((8, 512), (4, 256))
CASES: dict[str, tuple[dict[str, float], dict[str, Shapes]]] = {
    "2 tenants 1:1": ({"a": 1.0, "b": 1.0}, {"a": LONG_PROMPTS, "b": LONG_OUTPUTS}),
    "2 tenants 1:3": ({"a": 1.0, "b": 3.0}, {"a": LONG_PROMPTS, "b": LONG_OUTPUTS}),
    "4 tenants 1:1:3:3": ({"a": 1.0, "b": 1.0, "c": 3.0, "d": 3.0}, dict.fromkeys("abcd", MIXED)),
}


# (sequences a step, tokens a step): the engine's defaults, then a batch bound by its slots.
BATCHES: dict[str, tuple[int, int]] = {
    "engine defaults": (
        EngineConfig.model_fields["max_num_seqs"].default,
        EngineConfig.model_fields["max_num_batched_tokens"].default,
    ),
    "slot-bound": (16, 256),
}


def run_benchmark(window: int = 200, out_dir: Path | None = RESULTS_DIR) -> dict[str, Any]:
    batches: dict[str, Any] = {}
    for batch, (max_num_seqs, step_budget) in BATCHES.items():
        runs: dict[str, Any] = {}
        for name, (weights, shapes) in CASES.items():
            accountings = (("VTC costs (1, 2)", None), ("tokens alike (1, 1)", ServiceCosts(1.0, 1.0)))
            for accounting, costs in accountings:
                f = backlogged_run(
                    weights, shapes, costs, max_num_seqs=max_num_seqs, step_budget=step_budget, window=window
                )
                runs[f"{name}, {accounting}"] = {k: round(v, 4) for k, v in dataclasses.asdict(f).items()}
        batches[batch] = {"max_num_seqs": max_num_seqs, "step_budget": step_budget, "runs": runs}
    pool: dict[str, Any] = {}
    for name, every in (("each replica alone", None), (f"a ledger every {LEDGER_EVERY} steps", LEDGER_EVERY)):
        f, shares = pool_run(
            {"a": 1.0, "b": 1.0}, dict.fromkeys("ab", MIXED), {"b": 0}, ledger_every=every, window=window
        )
        pool[name] = {**{k: round(v, 4) for k, v in dataclasses.asdict(f).items()}, "shares": shares}
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "batches": batches,
        "pool": {"replicas": 2, "ledger_every": LEDGER_EVERY, "runs": pool},
        "workload": {
            "window_steps": window,
            "steps": 2000,
            "shapes": {
                name: {"prompt": list(prompt), "output": list(output)}
                for name, (prompt, output) in (
                    ("long prompts", LONG_PROMPTS),
                    ("long outputs", LONG_OUTPUTS),
                    ("mixed", MIXED),
                )
            },
        },
    }
    if out_dir is not None:
        write_report(out_dir, "fairness", report, to_markdown(report))
    return report


def to_markdown(report: dict[str, Any]) -> str:
    return render("fairness.md.j2", report=report)


def _main(args: argparse.Namespace) -> int:
    run_benchmark(out_dir=args.out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fairness", help="weighted service difference of backlogged tenants (VTC's measure)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.set_defaults(func=_main)
