"""``loom bench speculative``: output tokens/s with and without speculative decoding (prompt lookup).

Two workloads on the embedded model, greedy, at batch 1, 8 and 32 (max_num_seqs n, and n requests
submitted at once, or every prompt once if there are more: batch 1 runs them one after another):

* ``grounded``: copy a given passage, or copy it with one word replaced: the output quotes its input,
  which is where prompt lookup finds what comes next;
* ``open chat``: the engine benchmark's chat prompts, whose answers seldom repeat their prompt: here
  speculation must back off and cost (almost) nothing.

Each cell runs without speculation, with it, and without it again (A-B-A, one process), and checks
that both give the same tokens. Writes ``speculative.json`` and ``speculative.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from loadtest.bench_engine import REFERENCE_PROMPTS
from loadtest.machine import cpu_line
from loadtest.markdown import render, write_report
from protocol.engine_config import EngineConfig
from protocol.requests import GenerationRequest, SamplingParams
from worker.api import LLMEngine, load_checkpoint

RESULTS_DIR = Path(__file__).parent / "results"
BATCHES = (1, 8, 32)
PASSAGES = [
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, "
    "members agreed to fund the children's reading room and to extend opening hours on weekends.",
    "To reset the router, hold the power button for ten seconds until the light blinks orange, then "
    "release it and wait two minutes before connecting your laptop to the network again.",
    "Rain fell steadily over the valley all night. By morning the river had risen above the old stone "
    "bridge, and the farmers moved their sheep to the higher fields beyond the forest.",
    "The function reads the configuration file, checks that every required key is present, and returns "
    "a dictionary of settings. If a key is missing, it raises an error naming that key.",
]
TASKS = [
    ("Repeat the following text exactly, word for word:\n\n{p}", None),
    ("Copy the following text exactly, but write '{new}' instead of '{old}':\n\n{p}", ("the", "THE")),
]


def grounded_messages() -> list[str]:
    out = []
    for p in PASSAGES:
        for template, swap in TASKS:
            old, new = swap or ("", "")
            out.append(template.format(p=p, old=old, new=new))
    return out


def _run(ckpt: Any, prompts: list[list[int]], batch: int, spec: bool, max_tokens: int) -> dict[str, Any]:
    # Batch n: n at a time, and at least every prompt once (batch 1 runs them one after another).
    engine = LLMEngine(EngineConfig(max_num_seqs=batch), ckpt)
    count = max(batch, len(prompts))
    requests = [
        GenerationRequest(
            f"r{i}", prompts[i % len(prompts)], SamplingParams(max_tokens=max_tokens), speculative=spec
        )
        for i in range(count)
    ]
    t0 = time.perf_counter()
    out = engine.run_to_completion(requests)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in out.values())
    counts = engine.stats().speculation.get("default")
    return {
        "output_tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "steps": engine.counters.steps,
        "draft_tokens": counts.draft_tokens if counts else 0,
        "accepted_tokens": counts.accepted_tokens if counts else 0,
        "tokens": [out[f"r{i}"].token_ids for i in range(count)],
    }


def run_benchmark(
    max_tokens: int = 96, out_dir: Path | None = RESULTS_DIR, log: Any = print
) -> dict[str, Any]:
    ckpt = load_checkpoint()
    workloads = {
        "grounded": [
            ckpt.tokenizer.encode_chat([{"role": "user", "content": m}]) for m in grounded_messages()
        ],
        "open chat": [
            ckpt.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in REFERENCE_PROMPTS
        ],
    }
    cells: dict[str, Any] = {}
    for name, prompts in workloads.items():
        for batch in BATCHES:
            off1 = _run(ckpt, prompts, batch, False, max_tokens)
            on = _run(ckpt, prompts, batch, True, max_tokens)
            off2 = _run(ckpt, prompts, batch, False, max_tokens)
            if not (off1["tokens"] == on["tokens"] == off2["tokens"]):
                raise RuntimeError(f"{name}, batch {batch}: speculation changed the greedy tokens")
            base = (off1["tokens_per_s"] + off2["tokens_per_s"]) / 2
            cell = {
                "workload": name,
                "batch": batch,
                "output_tokens": on["output_tokens"],
                "off_tokens_per_s": round(base, 2),
                "off_spread": round(abs(off1["tokens_per_s"] - off2["tokens_per_s"]) / base, 4),
                "on_tokens_per_s": round(on["tokens_per_s"], 2),
                "speedup": round(on["tokens_per_s"] / base, 3),
                "steps_off": off1["steps"],
                "steps_on": on["steps"],
                "draft_tokens": on["draft_tokens"],
                "accepted_tokens": on["accepted_tokens"],
                "acceptance": round(on["accepted_tokens"] / on["draft_tokens"], 3)
                if on["draft_tokens"]
                else None,
            }
            cells[f"{name}, batch {batch}"] = cell
            speeds = f"{cell['off_tokens_per_s']} -> {cell['on_tokens_per_s']} tok/s"
            log(f"{name}, batch {batch}: {speeds} ({cell['speedup']}x)")
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_line(),
        "torch_threads": torch.get_num_threads(),
        "workload": {
            "model": ckpt.name,
            "dtype": "float32",
            "max_tokens": max_tokens,
            "grounded_prompts": len(workloads["grounded"]),
            "chat_prompts": len(workloads["open chat"]),
            "speculative_tokens": EngineConfig().speculative_tokens,
            "ngram": [EngineConfig().speculative_ngram_min, EngineConfig().speculative_ngram_max],
        },
        "cells": cells,
    }
    if out_dir is not None:
        write_report(out_dir, "speculative", report, to_markdown(report))
    return report


def to_markdown(report: dict[str, Any]) -> str:
    return render("speculative.md.j2", report=report)


def _main(args: argparse.Namespace) -> int:
    run_benchmark(args.max_tokens, args.out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "speculative", help="speculative decoding (prompt lookup): grounded and chat, batch 1/8/32"
    )
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.set_defaults(func=_main)
