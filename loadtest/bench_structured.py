"""What output constraints cost the batch: engine step time with 0%, 25% and 100% of the rows
constrained, at batch 32 and 64, on the embedded model.

Each run submits one full batch of seeded chat requests at once (the engine benchmark's prompts),
``--decode-tokens`` output tokens each; the constrained rows carry one of a few JSON schemas (an enum,
a bounded integer, an array of strings, then a long free-text field, so that no row ends before the
run does and every row's grammar passes through keys, numbers and free text). Step times are those of
the steps in which every row of the full batch decoded one token (the engine's step observer), in
interleaved repetitions so that drift on the machine falls on every fraction alike. The overhead of a
fraction is its median step time over the unconstrained run's; beside it, the step's time filling
masks (``StepTrace.grammar_s``), which is free of the run-to-run noise of whole steps.

Rows without a constraint pay only the grammar table's look-up (is any row of this step constrained,
and is this sampled row): that cost is measured directly, per step at the batch size, against the
unconstrained step time. Compile time is reported per schema (the tests' shapes and pathological ones:
a long enum, deep nesting, a long bounded string and pattern), median of fresh builds. Writes
``structured.json`` and ``structured.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from loadtest.bench_engine import make_workload
from loadtest.machine import cpu_line
from loadtest.markdown import render, write_report
from protocol.engine_config import EngineConfig
from protocol.requests import GenerationRequest, SamplingParams
from protocol.structured import Constraint, ConstraintKind, grammar_tokenizer, new_matcher
from worker.api import LLMEngine, StepTrace, load_checkpoint

RESULTS_DIR = Path(__file__).parent / "results"


def _decode_schema(i: int) -> dict[str, Any]:
    """A schema no row completes within the run: short fields first, then free text of at least
    2,000 characters."""
    return {
        "type": "object",
        "properties": {
            "kind": {"enum": ["answer", "question", "note", f"other-{i}"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 100},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
            "text": {"type": "string", "minLength": 2000},
        },
        "required": ["kind", "score", "tags", "text"],
        "additionalProperties": False,
    }


def _compile_schemas() -> dict[str, dict[str, Any]]:
    """Schemas whose compile time is reported: what tenants send, and what a hostile one might."""
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        },
        "required": ["name", "age"],
    }
    nested: dict[str, Any] = {"type": "integer"}
    for depth in range(40):
        nested = {"type": "object", "properties": {f"k{depth}": nested}, "required": [f"k{depth}"]}
    return {
        "flat object (3 fields, pattern)": person,
        "array of objects": {"type": "array", "items": person, "minItems": 1, "maxItems": 20},
        "decode schema (this benchmark's)": _decode_schema(0),
        "enum of 3,000 strings": {"enum": [f"value-{i:04d}" for i in range(3000)]},
        "40 nested objects": nested,
        "string of maxLength 5,000": {"type": "string", "maxLength": 5000},
        "pattern with {200,500} repeat": {"type": "string", "pattern": "^[a-z0-9]{200,500}$"},
    }


def _run(
    engine: LLMEngine, items: list[Any], fraction: float, decode_tokens: int, tag: str
) -> list[tuple[float, float]]:
    """(step, mask filling) times (s) of the steps in which the whole batch decoded."""
    batch = len(items)
    constrained = round(batch * fraction)
    for i, w in enumerate(items):
        # Spread constrained rows over the batch (every fourth row at 25%).
        on = constrained > 0 and (i * constrained) // batch != ((i + 1) * constrained) // batch
        constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(_decode_schema(i % 4))) if on else None
        params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True, constraint=constraint)
        engine.add_request(GenerationRequest(f"{tag}-{i}", w.prompt_ids, params))
    steps: list[tuple[float, float]] = []

    def observe(trace: StepTrace) -> None:
        if len(trace.rows) == batch and all(r.num_tokens == 1 and r.samples for r in trace.rows):
            steps.append((trace.step_s, trace.grammar_s))

    remove = engine.add_step_observer(observe)
    try:
        outputs = engine.drain()
    finally:
        remove()
    short = [rid for rid, o in outputs.items() if len(o.token_ids) != decode_tokens]
    if short:
        raise RuntimeError(f"rows ended early, the batch shrank: {short[:4]}")
    return steps


def _unconstrained_path_us(engine: LLMEngine, items: list[Any], repeats: int = 2000) -> float:
    """Microseconds per step that an unconstrained batch spends in the grammar table (its mask query
    and its advance), measured on a batch of real sequences."""
    for i, w in enumerate(items):
        engine.add_request(GenerationRequest(f"plain-{i}", w.prompt_ids, SamplingParams(max_tokens=1)))
    seqs = [engine.scheduler.get(f"plain-{i}") for i in range(len(items))]
    live = [s for s in seqs if s is not None]
    sampled = dict.fromkeys(live, 0)
    t0 = time.perf_counter()
    for _ in range(repeats):
        if engine.grammars.masks(live) is not None:
            raise RuntimeError("an unconstrained batch got masks")
        engine.grammars.advance(sampled)
    elapsed = time.perf_counter() - t0
    engine.drain()
    return elapsed / repeats * 1e6


def _compile_ms(ckpt: Any, repeats: int) -> tuple[float, dict[str, dict[str, float]]]:
    t0 = time.perf_counter()
    tok = grammar_tokenizer(ckpt.tokenizer, ckpt.config.vocab_size)
    tokenizer_ms = (time.perf_counter() - t0) * 1000
    out = {}
    for name, schema in _compile_schemas().items():
        c = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            matcher = new_matcher(c, tok)
            times.append((time.perf_counter() - t) * 1000)
            if matcher.is_error():
                raise RuntimeError(f"{name}: {matcher.get_error()}")
        out[name] = {"median_ms": round(statistics.median(times), 2), "max_ms": round(max(times), 2)}
    return round(tokenizer_ms, 1), out


def run_benchmark(
    batches: tuple[int, ...] = (32, 64),
    fractions: tuple[float, ...] = (0.0, 0.25, 1.0),
    decode_tokens: int = 32,
    repeats: int = 4,
    seed: int = 3,
    out_dir: Path | None = RESULTS_DIR,
    log: Any = print,
) -> dict[str, Any]:
    ckpt = load_checkpoint()
    tokenizer_ms, compile_ms = _compile_ms(ckpt, repeats=5)
    log(f"grammar tokenizer {tokenizer_ms} ms; compile: {compile_ms}")
    runs: dict[str, dict[str, Any]] = {}
    for batch in batches:
        engine = LLMEngine(EngineConfig(max_num_seqs=batch), ckpt)
        items = make_workload(ckpt, batch, seed, max_output=4)
        _run(engine, items, 1.0, 8, f"warm{batch}")  # builds the grammars, warms the kernels
        times: dict[float, list[tuple[float, float]]] = {f: [] for f in fractions}
        for rep in range(repeats):
            for f in fractions:
                times[f] += _run(engine, items, f, decode_tokens, f"b{batch}-{f}-{rep}")
        base = statistics.median(s for s, _ in times[0.0]) if 0.0 in times else None
        plain_us = _unconstrained_path_us(engine, items)
        for f in fractions:
            median = statistics.median(s for s, _ in times[f])
            masks = statistics.median(m for _, m in times[f])
            runs[f"batch {batch}, {f:.0%} constrained"] = {
                "batch": batch,
                "constrained_fraction": f,
                "steps": len(times[f]),
                "step_ms_median": round(median * 1000, 2),
                "step_ms_mean": round(statistics.fmean(s for s, _ in times[f]) * 1000, 2),
                "overhead": None if base is None else round(median / base - 1, 4),
                "mask_ms_median": round(masks * 1000, 3),
                "mask_ms_mean": round(statistics.fmean(m for _, m in times[f]) * 1000, 3),
                "mask_ms_max": round(max(m for _, m in times[f]) * 1000, 3),
                "mask_of_step": round(statistics.fmean(m for _, m in times[f]) / median, 4),
            }
            log(f"batch {batch}, {f:.0%} constrained: {median * 1000:.1f} ms/step")
        if base is not None:
            runs[f"batch {batch}, 0% constrained"]["unconstrained_path_us"] = round(plain_us, 1)
            runs[f"batch {batch}, 0% constrained"]["unconstrained_path_of_step"] = round(
                plain_us / 1e6 / base, 5
            )
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_line(),
        "torch_threads": torch.get_num_threads(),
        "workload": {
            "model": ckpt.name,
            "dtype": "float32",
            "decode_tokens": decode_tokens,
            "repeats": repeats,
            "seed": seed,
            "grammar_library": "llguidance " + _version("llguidance"),
        },
        "grammar_tokenizer_ms": tokenizer_ms,
        "compile": compile_ms,
        "runs": runs,
    }
    if out_dir is not None:
        write_report(out_dir, "structured", report, to_markdown(report))
    return report


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def to_markdown(report: dict[str, Any]) -> str:
    return render("structured.md.j2", report=report)


def _main(args: argparse.Namespace) -> int:
    run_benchmark(
        tuple(args.batches), decode_tokens=args.decode_tokens, repeats=args.repeats, out_dir=args.out
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("structured", help="step time with 0%%, 25%% and 100%% of rows under a JSON schema")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.set_defaults(func=_main)
