"""The benchmarks' command line: ``python -m loadtest bench|loadtest|soak ...``, which ``loom bench``,
``loom loadtest`` and ``loom soak`` launch from a source checkout (the benchmarks are not part of the
installed product; loom/cmd_bench.py)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from loadtest import (
        bench_admission,
        bench_engine,
        bench_fairness,
        bench_gateway,
        bench_guidellm,
        bench_isolation,
        bench_lora,
        bench_noisy,
        bench_served,
        bench_slo,
        bench_speculative,
        bench_stream_cost,
        bench_structured,
        calibrate,
        loadtest_cli,
        sim_experiments,
        soak,
    )

    parser = argparse.ArgumentParser(prog="loom", description="Loom's benchmarks, load tests and soak.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bench", help="run a benchmark (results under loadtest/results/)")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    bench_engine.register(bench_sub)
    bench_gateway.register(bench_sub)
    bench_admission.register(bench_sub)
    sim_experiments.register(bench_sub)  # loom bench simulate
    calibrate.register(bench_sub)  # loom bench calibrate
    bench_lora.register(bench_sub)  # loom bench lora
    bench_isolation.register(bench_sub)  # loom bench isolation
    bench_served.register(bench_sub)  # loom bench served
    bench_stream_cost.register(bench_sub)  # loom bench stream-cost
    bench_structured.register(bench_sub)  # loom bench structured
    bench_fairness.register(bench_sub)  # loom bench fairness
    bench_noisy.register(bench_sub)  # loom bench noisy
    bench_slo.register(bench_sub)  # loom bench slo
    bench_guidellm.register(bench_sub)  # loom bench guidellm
    bench_speculative.register(bench_sub)  # loom bench speculative
    loadtest_cli.register(sub)  # loom loadtest WORKLOAD.yaml
    soak.register(sub)  # loom soak
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        code = 130
    sys.exit(code or 0)
