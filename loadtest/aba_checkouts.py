"""A-B-A: the engine's continuous-batching throughput at two checkouts, alternated in fresh processes.

For a change that should not move the engine's figures (a restructuring): each run serves the engine
benchmark's seeded workload (``bench_engine.make_workload``, fp32, the embedded model, 32 sequences,
ignore-eos lengths) in a process of its own, checkouts alternating, and prints tokens/s and a digest
of every request's tokens (equal digests: identical outputs).

    python -m loadtest.aba_checkouts --base /path/to/old/checkout --rounds 3 --out loadtest/results

The base checkout gets a torch extensions folder of its own, so the two never rebuild each other's
compiled kernels.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from loadtest.machine import cpu_line

_RUN = """
import hashlib, json, sys, time
import torch
torch.set_num_threads(2)
try:  # before ADR 0005 the types came from worker.api
    from worker.api import EngineConfig, GenerationRequest, SamplingParams
except ImportError:
    from protocol.engine_config import EngineConfig
    from protocol.requests import GenerationRequest, SamplingParams
from worker.api import LLMEngine, load_checkpoint
from loadtest.bench_engine import make_workload

n = int(sys.argv[1])
ckpt = load_checkpoint()
items = make_workload(ckpt, n, 3)
config = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, kv_cache_memory_mb=1024)
engine = LLMEngine(config, ckpt)
warmup = GenerationRequest("w", items[0].prompt_ids, SamplingParams(max_tokens=8, ignore_eos=True))
engine.run_to_completion([warmup])
reqs = [
    GenerationRequest(f"r{i}", w.prompt_ids, SamplingParams(max_tokens=w.max_tokens, ignore_eos=True))
    for i, w in enumerate(items)
]
t = time.perf_counter()
out = engine.run_to_completion(reqs)
wall = time.perf_counter() - t
tokens = [out[f"r{i}"].token_ids for i in range(n)]
digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:12]
print(json.dumps({"tokens": sum(map(len, tokens)), "wall_s": wall, "digest": digest}))
"""


def _run(checkout: Path, requests: int, extensions: Path | None) -> dict[str, float | str]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    if extensions is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    out = subprocess.run(
        [sys.executable, "-c", _RUN, str(requests)], cwd=checkout, env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"{checkout}: {out.stderr[-2000:]}")
    result: dict[str, float | str] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _commit(checkout: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(checkout), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.aba_checkouts", description=__doc__)
    p.add_argument("--base", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    p.add_argument("--head", type=Path, default=Path(__file__).resolve().parents[1])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="write aba-checkouts.json and .md here")
    args = p.parse_args(argv)
    base_ext = (
        Path("/tmp") / f"loom-aba-ext-{hashlib.sha1(str(args.base.resolve()).encode()).hexdigest()[:8]}"
    )
    runs: list[dict[str, float | str]] = []
    for i in range(args.rounds * 2):
        which = "base" if i % 2 == 0 else "head"
        checkout = args.base if which == "base" else args.head
        r = _run(checkout.resolve(), args.requests, base_ext if which == "base" else None)
        r["checkout"] = which
        r["tok_s"] = float(r["tokens"]) / float(r["wall_s"])
        runs.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    mean = {
        w: statistics.fmean(float(r["tok_s"]) for r in runs if r["checkout"] == w) for w in ("base", "head")
    }
    commits = {w: _commit(c) for w, c in (("base", args.base), ("head", args.head))}
    report = {
        "workload": f"bench_engine.make_workload seed 3, {args.requests} requests, fp32, 32 sequences, "
        "2 threads",
        "commits": commits,
        "machine": cpu_line(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "runs": runs,
        "head_over_base": mean["head"] / mean["base"],
        "identical_outputs": len({r["digest"] for r in runs}) == 1,
    }
    table = "\n".join(
        f"| {i + 1} | {r['checkout']} | {float(r['tok_s']):.1f} | {r['digest']} |" for i, r in enumerate(runs)
    )
    md = (
        "# Engine throughput across a restructuring (A-B-A)\n\n"
        f"{report['workload']}; {report['machine']}; {report['date']}. "
        f"base {commits['base']}, head {commits['head']}.\n\n"
        "| run | checkout | output tok/s | outputs digest |\n|---:|---|---:|---|\n"
        f"{table}\n\nhead / base: {report['head_over_base']:.3f}x; identical outputs: "
        f"{'yes' if report['identical_outputs'] else 'no'}.\n"
    )
    print(md)
    if args.out is not None:
        (args.out / "aba-checkouts.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "aba-checkouts.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
