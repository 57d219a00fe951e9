"""Multi-LoRA throughput: one shared base model serving many tenants' adapters in the same steps.

The engine benchmark's seeded workload (chat prompts, long-tailed output lengths, greedy, ignore-eos,
all submitted at once) runs, in one process run, against the embedded model:

* ``base``: no adapter at all (the reference);
* ``1``, ``4``, ``16`` adapters: requests spread round-robin over that many adapters, every adapter
  resident (as many slots as adapters), so each step mixes them;
* ``16 over 4 slots``: the adapters outnumber the slots: they are loaded and evicted as requests
  come and go (what a replica with too few slots costs).

Adapters are random, in the PEFT format, written by loadtest/tiny_model.py's ``save_random_adapter``
(rank and targets stated in the report). Also reports each adapter's load time from disk. Writes
``lora.json`` and ``lora.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from loadtest.bench_engine import make_workload
from loadtest.machine import cpu_line
from loadtest.markdown import render
from loadtest.tiny_model import save_random_adapter
from protocol.adapters import LoraRequest
from protocol.engine_config import EngineConfig
from protocol.requests import GenerationRequest, SamplingParams
from worker.api import LLMEngine, load_checkpoint

RESULTS_DIR = Path(__file__).parent / "results"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _run(
    ckpt: Any, items: list[Any], adapters: list[LoraRequest], slots: int, max_num_seqs: int
) -> dict[str, Any]:
    engine = LLMEngine(EngineConfig(max_num_seqs=max_num_seqs, max_loras=max(slots, 1)), ckpt)
    for i, w in enumerate(items):
        lora = adapters[i % len(adapters)] if adapters else None
        params = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True)
        engine.add_request(GenerationRequest(f"r{i}", w.prompt_ids, params, adapter=lora))
    produced = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        produced += sum(len(o.token_ids) for o in engine.step())
        if engine.stalled():  # only adapters being read: sleep until a load ends, never spin
            engine.wait_for_progress(timeout=1.0)
    wall = time.perf_counter() - t0
    expected = sum(w.max_tokens for w in items)
    if produced != expected:
        raise RuntimeError(f"produced {produced} tokens, expected {expected}")
    loads = engine.lora.load_seconds if engine.lora is not None else []
    return {
        "adapters": len(adapters),
        "slots": slots,
        "output_tokens": produced,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(produced / wall, 2),
        "adapter_loads": len(loads),
        "adapter_load_ms_p50": round(statistics.median(loads) * 1000, 2) if loads else None,
    }


def run_benchmark(
    requests: int = 64,
    seed: int = 3,
    rank: int = 16,
    max_num_seqs: int = 32,
    max_output: int = 200,
    out_dir: Path | None = RESULTS_DIR,
    log: Any = print,
) -> dict[str, Any]:
    torch.set_num_threads(torch.get_num_threads())
    ckpt = load_checkpoint()
    items = make_workload(ckpt, requests, seed, max_output)
    workdir = Path(tempfile.mkdtemp(prefix="loom-bench-lora-"))
    adapters = [
        LoraRequest(
            f"bench/a{i}",
            str(save_random_adapter(ckpt.config, workdir / f"a{i}", rank=rank, targets=TARGETS, seed=i)),
        )
        for i in range(16)
    ]
    runs = {}
    for name, subset, slots in (
        ("base", [], 0),
        ("1 adapter", adapters[:1], 1),
        ("4 adapters", adapters[:4], 4),
        ("16 adapters", adapters, 16),
        ("16 adapters over 4 slots", adapters, 4),
    ):
        log(f"running {name} ...")
        runs[name] = _run(ckpt, items, subset, slots, max_num_seqs)
        log(f"  {runs[name]['output_tokens_per_s']} output tokens/s")
    base = runs["base"]["output_tokens_per_s"]
    for r in runs.values():
        r["of_base"] = round(r["output_tokens_per_s"] / base, 4)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_line(),
        "torch_threads": torch.get_num_threads(),
        "workload": {
            "requests": requests,
            "seed": seed,
            "max_output": max_output,
            "max_num_seqs": max_num_seqs,
            "rank": rank,
            "targets": list(TARGETS),
            "model": ckpt.name,
            "dtype": "float32",
        },
        "runs": runs,
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "lora.json").write_text(json.dumps(report, indent=2) + "\n")
        (out_dir / "lora.md").write_text(to_markdown(report))
    return report


def to_markdown(report: dict[str, Any]) -> str:
    return render("lora.md.j2", report=report)


def _main(args: argparse.Namespace) -> int:
    run_benchmark(args.requests, args.seed, args.rank, args.max_num_seqs, args.max_output, args.out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lora", help="multi-LoRA throughput: 1, 4 and 16 adapters against the base model")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-output", type=int, default=200)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.set_defaults(func=_main)
