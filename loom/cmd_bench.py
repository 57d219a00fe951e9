"""``loom bench ...``: the benchmarks under loadtest/, runnable from the CLI."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark (results under loadtest/results/)")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    from loadtest import (
        bench_admission,
        bench_engine,
        bench_gateway,
        bench_isolation,
        bench_lora,
        bench_served,
        calibrate,
        sim_experiments,
    )

    bench_engine.register(bench_sub)
    bench_gateway.register(bench_sub)
    bench_admission.register(bench_sub)
    sim_experiments.register(bench_sub)  # loom bench simulate
    calibrate.register(bench_sub)  # loom bench calibrate
    bench_lora.register(bench_sub)  # loom bench lora
    bench_isolation.register(bench_sub)  # loom bench isolation
    bench_served.register(bench_sub)  # loom bench served
