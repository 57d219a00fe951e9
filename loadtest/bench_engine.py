"""Engine throughput: continuous batching vs static (cohort) batching vs Hugging Face ``generate``.

All three modes serve the same seeded workload in one process run, one after another: chat prompts
of varied length, output lengths drawn from a heavy-tailed distribution (a few tokens to several
hundred, exact via ignore-eos), all submitted at once. Static batching pays for the longest member
of every cohort, which is the case continuous batching exists for.

It also measures this machine (memory bandwidth, fp32 matmul rate) and times a saturated decode step
against the roofline those give: max(weights + KV bytes / bandwidth, FLOPs / matmul rate).

Every Loom run splits its steps' time into the scheduler, the model's forward pass and the rest
(batch building, sampling, sequence updates, detokenization): the non-compute share of a step.
Continuous batching also runs in bfloat16 when the CPU has native bf16 (AVX-512-BF16 or AMX), with the
top-1 agreement of Loom's bf16 greedy tokens against transformers in bf16 on the engine tests' prompts.

``--peer vllm`` serves the same requests with vLLM's CPU build (``make peer-vllm``; see
``loadtest/peer_vllm.py``) in each dtype, same batching limits and cores, and reports Loom / vLLM.

Writes ``engine.json`` and ``engine.md`` under ``--out`` (default ``loadtest/results``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loadtest import peer_vllm
from loadtest.machine import cpu_info, cpu_line
from loadtest.markdown import render
from loadtest.static_batching import Batching
from loadtest.words import BENCHMARK_WORDS
from protocol.engine_config import EngineConfig
from protocol.requests import GenerationRequest, RequestOutput, SamplingParams
from worker.api import Checkpoint, LLMEngine, StepTrace, load_checkpoint

RESULTS_DIR = Path(__file__).parent / "results"

_ASKS = [
    "Explain {a} and {b} to a child.",
    "Write a short poem about {a}.",
    "Give three facts about {a}, {b} and {c}.",
    "What is the link between {a} and {b}? Answer in detail, with examples about {c} and {d}.",
    "Summarize the idea of {a}.",
    "Tell a story about a {a} that found a {b} near the {c}, then went to the {d} and met a {e}.",
]


@dataclass(frozen=True)
class WorkItem:
    prompt_ids: list[int]
    max_tokens: int


def make_workload(ckpt: Checkpoint, n: int, seed: int, max_output: int = 400) -> list[WorkItem]:
    """Seeded chat prompts with log-normal output lengths (median ~40) clipped to [4, max_output]."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        words = {k: rng.choice(BENCHMARK_WORDS) for k in "abcde"}
        text = rng.choice(_ASKS).format(**words)
        ids = ckpt.tokenizer.encode_chat([{"role": "user", "content": text}])
        out = int(min(max_output, max(4, rng.lognormvariate(math.log(40), 1.1))))
        items.append(WorkItem(ids, out))
    return items


def _summary(
    name: str, items: list[WorkItem], wall: float, occupancy: list[int], capacity: int
) -> dict[str, Any]:
    out_tokens = sum(w.max_tokens for w in items)
    return {
        "mode": name,
        "requests": len(items),
        "output_tokens": out_tokens,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(items) / wall, 4),
        "output_tokens_per_s": round(out_tokens / wall, 2),
        "decode_steps": len(occupancy),
        "mean_batch_size": round(statistics.fmean(occupancy), 2) if occupancy else 0.0,
        "mean_batch_occupancy": round(statistics.fmean(occupancy) / capacity, 4) if occupancy else 0.0,
    }


class StepTimer:
    """Where a Loom engine's steps spend their time, from the engine's own step traces.

    The engine reports each step's scheduling, forward-pass and whole duration
    (``LLMEngine.add_step_observer``); the rest of a step (batch building, sampling, sequence
    updates, detokenization) is ``step - schedule - forward``; the non-compute share is
    ``(step - forward) / step``.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.reset()
        engine.add_step_observer(self._record)

    def _record(self, trace: StepTrace) -> None:
        self.steps += 1
        self.schedule_s += trace.schedule_s
        self.forward_s += trace.forward_s
        self.step_s += trace.step_s

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def reset(self) -> None:
        self.schedule_s = self.forward_s = self.step_s = 0.0
        self.steps = 0

    def summary(self) -> dict[str, Any]:
        return step_breakdown(self.steps, self.step_s, self.schedule_s, self.forward_s)


def step_breakdown(steps: int, step_s: float, schedule_s: float, forward_s: float) -> dict[str, Any]:
    """Totals of ``steps`` engine steps as mean milliseconds per step and shares of the step."""
    other = max(0.0, step_s - schedule_s - forward_s)
    per = 1e3 / steps if steps else 0.0
    return {
        "steps": steps,
        "step_ms": round(step_s * per, 3),
        "schedule_ms": round(schedule_s * per, 3),
        "forward_ms": round(forward_s * per, 3),
        "other_ms": round(other * per, 3),
        "schedule_share": round(schedule_s / step_s, 4) if step_s else 0.0,
        "other_share": round(other / step_s, 4) if step_s else 0.0,
        "non_compute_share": round(max(0.0, step_s - forward_s) / step_s, 4) if step_s else 0.0,
    }


def warmup_prompt(ckpt: Checkpoint, length: int = 16) -> list[int]:
    """Token ids for the warm-up request both engines serve before timing: seeded random ids that
    share no prefix with the workload's chat prompts, so no prefix-cache block is warmed for them."""
    rng = random.Random(1234)
    return [rng.randrange(100, ckpt.config.vocab_size) for _ in range(length)]


WARMUP_TOKENS = 4


def run_engine(
    ckpt: Checkpoint,
    items: list[WorkItem],
    mode: Batching,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    dtype: str = "float32",
    outputs: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Serve ``items`` all at once after one short warm-up request; the mode's summary with its
    step-time breakdown. ``outputs``, if given, receives each request's generated token ids."""
    engine = LLMEngine(
        EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            scheduler_cls=mode.scheduler_cls,
            dtype=dtype,
        ),
        ckpt,
    )
    timer = StepTimer(engine)
    engine.add_request(
        GenerationRequest(
            "warmup", warmup_prompt(ckpt), SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True)
        )
    )
    while engine.has_unfinished():
        timer.step()
    timer.reset()
    index = {}
    for i, w in enumerate(items):
        rid = f"{mode}-{i}"
        index[rid] = i
        engine.add_request(
            GenerationRequest(rid, w.prompt_ids, SamplingParams(max_tokens=w.max_tokens, ignore_eos=True))
        )
    tokens: list[list[int]] = [[] for _ in items]
    occupancy: list[int] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in timer.step():
            tokens[index[o.request_id]].extend(o.token_ids)
        occupancy.append(engine.stats().last_step_seqs)  # live requests only, padding excluded
    wall = time.perf_counter() - t0
    produced, expected = sum(map(len, tokens)), sum(w.max_tokens for w in items)
    if produced != expected:
        raise RuntimeError(f"{mode}: produced {produced} tokens, expected {expected}")
    result = _summary(str(mode), items, wall, occupancy, max_num_seqs)
    result["dtype"] = dtype
    result["preemptions"] = engine.stats().num_preemptions
    result["max_model_len"] = engine.max_model_len
    result["kv_bytes_per_token"] = engine.kv_cache.bytes_per_token()
    result["step_time"] = timer.summary()
    if outputs is not None:
        outputs[:] = tokens
    return result


def run_hf_static(ckpt: Checkpoint, items: list[WorkItem], batch_size: int) -> dict[str, Any]:
    """Hugging Face ``generate`` over fixed cohorts: each runs until its longest member is done."""
    model = hf_reference_model(ckpt)
    pad = ckpt.tokenizer.eos_token_ids[0]
    occupancy: list[int] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(items), batch_size):
            cohort = items[start : start + batch_size]
            width = max(len(w.prompt_ids) for w in cohort)
            ids = torch.full((len(cohort), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, w in enumerate(cohort):  # left padding, as decoder-only generation needs
                ids[r, width - len(w.prompt_ids) :] = torch.tensor(w.prompt_ids)
                mask[r, width - len(w.prompt_ids) :] = 1
            longest = max(w.max_tokens for w in cohort)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=None,
            )
            occupancy += [sum(1 for w in cohort if w.max_tokens > s) for s in range(longest)]
    wall = time.perf_counter() - t0
    return _summary("hf_static", items, wall, occupancy, batch_size)


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512-BF16 or AMX-BF16)."""
    flags = cpu_info()["cpu_flags"]
    return any(f in flags for f in ("avx512_bf16", "amx_bf16"))  # type: ignore[operator]


# The engine tests' reference prompts (tests/engine/conftest.py PROMPTS; a test holds them equal).
REFERENCE_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about weaving.",
    "Explain gravity in one sentence.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish.",
    "Give me a short tip for learning to play the guitar as an adult beginner with little free time.",
    "What is 12 times 7?",
    "Describe the smell of rain.",
]


def hf_reference_model(ckpt: Checkpoint, dtype: str = "float32") -> Any:
    """transformers' LlamaForCausalLM on the checkpoint's weights, in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = LlamaForCausalLM(LlamaConfig(**ckpt.config.to_hf_dict())).eval()
    model.load_state_dict(ckpt.weights, strict=False)
    model.tie_weights()
    return model.to(getattr(torch, dtype))


def greedy_agreement(
    ckpt: Checkpoint, dtype: str = "bfloat16", max_tokens: int = 24, prompts: list[str] | None = None
) -> dict[str, Any]:
    """Top-1 agreement of Loom's greedy tokens with transformers' in the same ``dtype``.

    Loom generates each reference prompt's greedy continuation (up to ``max_tokens``, stopping at
    end-of-sequence); transformers then reads prompt + continuation in one forward pass and, at each
    generated position, its argmax next token is compared with Loom's. Both see the same prefix at
    every position (Loom's own), so one early difference does not count against all that follow.
    """
    prompts = prompts if prompts is not None else REFERENCE_PROMPTS
    ids = [ckpt.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    engine = LLMEngine(EngineConfig(max_num_seqs=len(ids), dtype=dtype), ckpt)
    outs = engine.run_to_completion(
        [GenerationRequest(f"r{i}", x, SamplingParams(max_tokens=max_tokens)) for i, x in enumerate(ids)]
    )
    conts = [outs[f"r{i}"].token_ids for i in range(len(ids))]
    model = hf_reference_model(ckpt, dtype)
    agree = positions = 0
    first_mismatch: list[int | None] = []
    with torch.inference_mode():
        for prompt, cont in zip(ids, conts, strict=True):
            full = torch.tensor([prompt + cont])
            logits = model(full).logits[0, len(prompt) - 1 : len(prompt) + len(cont) - 1]
            hits = (logits.argmax(-1) == torch.tensor(cont)).tolist()
            agree += sum(hits)
            positions += len(cont)
            first_mismatch.append(next((j for j, h in enumerate(hits) if not h), None))
    return {
        "dtype": dtype,
        "prompts": len(ids),
        "positions": positions,
        "agree": agree,
        "top1_agreement": round(agree / positions, 4) if positions else 0.0,
        "prompts_all_agree": sum(1 for m in first_mismatch if m is None),
        "first_mismatch": first_mismatch,
    }


def measure_machine() -> dict[str, float]:
    """Memory bandwidth (large copy: bytes read + written) and peak fp32 matmul rate, best of several."""
    src = torch.randn(64 << 20)  # 256 MiB
    dst = torch.empty_like(src)
    copies = []
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t)
    bandwidth = 2 * src.numel() * 4 / min(copies)
    # The faster of torch.mm and oneDNN's prepacked linear (the path Loom's projections take, see
    # worker/dense.py): on AMD CPUs torch.mm's MKL GEMM ran slower than the prepacked one, and a
    # roofline from it put large decode steps below 1.0x.
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    gemms = [lambda: torch.mm(a, b)]
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
        gemms.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        pass
    mm = []
    for gemm in gemms:
        for _ in range(5):
            t = time.perf_counter()
            gemm()
            mm.append(time.perf_counter() - t)
    return {
        "memory_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "matmul_gflop_s": round(2 * n**3 / min(mm) / 1e9, 1),
    }


def roofline_probe(ckpt: Checkpoint, batch: int, context: int) -> dict[str, Any]:
    """Median decode step at ``batch`` sequences of ``context`` tokens vs the machine's roofline.

    The machine is measured right before and right after the timed steps, and the higher figures of
    the two set the roofline: a shared VM's bandwidth drifts by a third within minutes, and a roofline
    measured minutes away from its steps said more about the drift than about the engine."""
    engine = LLMEngine(EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(batch, 2048)), ckpt)
    rng = random.Random(7)
    for i in range(batch):
        prompt = [rng.randrange(100, ckpt.config.vocab_size) for _ in range(context)]
        engine.add_request(GenerationRequest(f"p{i}", prompt, SamplingParams(max_tokens=64, ignore_eos=True)))
    while any(s.is_prefilling for s in engine.scheduler.running) or engine.scheduler.num_waiting():
        engine.step()
    before = measure_machine()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    after = measure_machine()
    machine = {k: max(before[k], after[k]) for k in before}
    step = statistics.median(times)
    model = engine.model
    kv_bytes = batch * (context + 5) * engine.kv_cache.bytes_per_token()
    weight_bytes = model.weight_bytes()
    flops = batch * model.flops_per_token()
    attn_flops = batch * 4 * context * ckpt.config.q_size * ckpt.config.num_layers
    bandwidth, rate = machine["memory_bandwidth_gb_s"] * 1e9, machine["matmul_gflop_s"] * 1e9
    t_mem = (weight_bytes + kv_bytes) / bandwidth
    t_flop = (flops + attn_flops) / rate
    roof = max(t_mem, t_flop)
    # The roofline lets the KV stream overlap the GEMMs' arithmetic; a step runs them one after the
    # other (attention needs the layer's projections, the next projection its attention), so the
    # bound for phase-by-phase execution adds each phase's own max.
    sequential = max(weight_bytes / bandwidth, flops / rate) + max(kv_bytes / bandwidth, attn_flops / rate)
    return {
        "batch": batch,
        "context": context,
        "step_ms": round(step * 1e3, 2),
        "roofline_ms": round(roof * 1e3, 2),
        "memory_bound_ms": round(t_mem * 1e3, 2),
        "compute_bound_ms": round(t_flop * 1e3, 2),
        "step_over_roofline": round(step / roof, 3),
        "sequential_bound_ms": round(sequential * 1e3, 2),
        "step_over_sequential_bound": round(step / sequential, 3),
        "tokens_per_s": round(batch / step, 1),
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "gflop_per_step": round((flops + attn_flops) / 1e9, 2),
        "machine": machine,
    }


# (batch, context) decode probes, from latency-bound to the compute-bound knee of a 2-core CPU.
ROOFLINE_POINTS = [(16, 256), (64, 256), (128, 128), (256, 64)]


def add_roofline(report: dict[str, Any], ckpt: Checkpoint, points: list[tuple[int, int]], log: Any) -> None:
    """Each probe, with the machine measured around it; the report's machine figures are the highest
    the probes saw, and the saturation point is the probe with most tokens/s."""
    log("measuring the machine and the roofline ...")
    probes = []
    for batch, context in points:
        probes.append(roofline_probe(ckpt, batch, context))
        log(f"  {probes[-1]}")
    report["machine"] = {k: max(p["machine"][k] for p in probes) for k in probes[0]["machine"]}
    report["roofline_points"] = probes
    report["roofline"] = max(probes, key=lambda p: p["tokens_per_s"])


def versions() -> dict[str, str]:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu_line(),
        "torch_threads": str(torch.get_num_threads()),
    }


PeerRunner = Callable[[dict[str, Any], Path, dict[str, str]], dict[str, Any]]


def add_peer(
    report: dict[str, Any],
    ckpt: Checkpoint,
    items: list[WorkItem],
    loom_tokens: dict[str, list[list[int]]],
    max_num_seqs: int,
    max_num_batched_tokens: int,
    seed: int,
    log: Callable[[str], None],
    runner: PeerRunner | None = None,
    python: Path | None = None,
    loom_again: Callable[[str], dict[str, Any]] | None = None,
) -> None:
    """Serve ``items`` with vLLM in each dtype Loom's continuous mode ran in (``loom_tokens``' keys),
    same limits, cores and warm-up; add ``vllm[_<dtype>]`` rows, Loom / vLLM ratios and ``peer``.

    This machine's speed drifts by 10-30% over minutes (other tenants of the host), and Loom's rows
    run minutes before the peer's. ``loom_again(dtype)`` reruns Loom's row right after the peer's, and
    the ratio divides the mean of Loom's two runs (A-B-A), so a drift moves both sides of it.

    ``runner`` stands in for ``peer_vllm.run_peer`` (tests); the model directories and vLLM's logs
    live in a temporary directory, kept (and named in the error) only if vLLM fails."""
    run = runner or (lambda job, wd, env: peer_vllm.run_peer(job, wd, env, python))
    cores = peer_vllm.loom_cores()
    workdir = Path(tempfile.mkdtemp(prefix="loom-peer-"))
    peer: dict[str, Any] = {"engine": "vllm", "cores": cores, "runs": {}}
    for dtype, ours in loom_tokens.items():
        loom = report["modes"][_loom_mode(dtype)]
        longest = max(len(w.prompt_ids) + w.max_tokens for w in items)
        kv_gib = peer_vllm.kv_space_gib(
            loom["kv_bytes_per_token"], max_num_seqs, longest, loom["max_model_len"]
        )
        model_dir = peer_vllm.export_hf(ckpt, workdir / f"hf-{dtype}", dtype)
        job = peer_vllm.make_job(
            model_dir,
            dtype,
            [(w.prompt_ids, w.max_tokens) for w in items],
            [(warmup_prompt(ckpt), WARMUP_TOKENS)],
            max_num_seqs,
            max_num_batched_tokens,
            loom["max_model_len"],
            seed,
        )
        log(f"running vllm {dtype} (cores {cores}, KV {kv_gib} GiB) ...")
        result = run(job, workdir, peer_vllm.peer_env(cores, kv_gib))
        theirs = result.pop("token_ids")
        shutil.rmtree(model_dir)
        row = {
            "mode": _peer_mode(dtype),
            "dtype": dtype,
            **{k: result[k] for k in ("requests", "output_tokens", "wall_s", "requests_per_s")},
            "output_tokens_per_s": result["output_tokens_per_s"],
        }
        report["modes"][row["mode"]] = row
        loom_runs = [loom["output_tokens_per_s"]]
        if loom_again is not None:
            log(f"running {_loom_mode(dtype)} again, after the peer ...")
            loom_runs.append(loom_again(dtype)["output_tokens_per_s"])
        peer["versions"] = result.get("versions", {})
        peer["runs"][dtype] = {
            "loom_output_tokens_per_s": loom_runs,
            "init_s": result.get("init_s"),
            "warmup_s": result.get("warmup_s"),
            "config": result.get("config", {}),
            "env": result.get("env", {}),
            "ld_preload": result.get("ld_preload", []),
            "kv_cache_gib": kv_gib,
            "same_tokens_as_loom": peer_vllm.same_outputs(ours, theirs),
        }
        report["ratios"][f"{_loom_mode(dtype)}_over_{row['mode']}"] = round(
            statistics.fmean(loom_runs) / row["output_tokens_per_s"], 3
        )
        log(f"  {row} {peer['runs'][dtype]['same_tokens_as_loom']}")
    shutil.rmtree(workdir, ignore_errors=True)
    report["peer"] = peer
    report["versions"].update({f"peer_{k}": v for k, v in peer.get("versions", {}).items()})


def _loom_mode(dtype: str) -> str:
    return "continuous" if dtype == "float32" else f"continuous_{dtype}"


def _peer_mode(dtype: str) -> str:
    return "vllm" if dtype == "float32" else f"vllm_{dtype}"


def to_markdown(report: dict[str, Any]) -> str:
    order = ["continuous", "static", "static_no_padding", "hf_static"]
    order += sorted(k for k in report["modes"] if k not in order)
    return render(
        "engine.md.j2",
        report=report,
        modes=[(k, report["modes"][k]) for k in order if report["modes"].get(k)],
        timed=[(k, m) for k, m in report["modes"].items() if "step_time" in m],
    )


def run_benchmark(
    ckpt: Checkpoint,
    n: int = 128,
    seed: int = 0,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 512,
    max_output: int = 400,
    hf: bool = True,
    roofline_points: list[tuple[int, int]] | None = ROOFLINE_POINTS,
    static: bool = True,
    out_dir: Path | None = RESULTS_DIR,
    log: Any = print,
    dtypes: tuple[str, ...] = ("float32",),
    agreement: bool = True,
    peer: str | None = None,
    peer_python: Path | None = None,
    peer_runner: PeerRunner | None = None,
) -> dict[str, Any]:
    """The whole benchmark; ``dtypes`` beyond float32 add a Loom continuous row each (and, with
    ``agreement``, the top-1 agreement with transformers in that dtype); ``peer="vllm"`` adds vLLM's
    rows in every dtype of ``dtypes``."""
    if "float32" not in dtypes:
        raise ValueError("dtypes must include float32 (the static and HF rows run in it)")
    if peer not in (None, "vllm"):
        raise ValueError(f"unknown peer {peer!r}; known: vllm")
    items = make_workload(ckpt, n, seed, max_output)
    outs = [w.max_tokens for w in items]
    prompts = [len(w.prompt_ids) for w in items]
    report: dict[str, Any] = {
        "model": ckpt.name,
        "dtype": "float32",
        "device": "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "workload": {
            "requests": n,
            "seed": seed,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "output_min": min(outs),
            "output_max": max(outs),
            "output_mean": statistics.fmean(outs),
            "output_median": statistics.median(outs),
            "output_tokens": sum(outs),
            "prompt_min": min(prompts),
            "prompt_max": max(prompts),
            "output_distribution": f"lognormal(median 40, sigma 1.1) clipped to [4, {max_output}]",
            "arrival": "all at t=0",
        },
        "machine_cpu": cpu_info(),
        "native_bf16": native_bf16(),
        "versions": versions(),
        "modes": {},
    }

    def save_partial() -> None:  # a crash late in a long run keeps what was measured
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "engine.partial.json").write_text(json.dumps(report, indent=2) + "\n")

    loom_tokens: dict[str, list[list[int]]] = {}
    for mode in Batching if static else [Batching.CONTINUOUS]:
        log(f"running {mode} ...")
        tokens: list[list[int]] = []
        report["modes"][str(mode)] = run_engine(
            ckpt, items, mode, max_num_seqs, max_num_batched_tokens, outputs=tokens
        )
        if mode is Batching.CONTINUOUS:
            loom_tokens["float32"] = tokens
        log(f"  {report['modes'][str(mode)]}")
        save_partial()
    for dtype in dtypes:
        if dtype == "float32":
            continue
        name = _loom_mode(dtype)
        log(f"running {name} ...")
        loom_tokens[dtype] = []
        report["modes"][name] = run_engine(
            ckpt,
            items,
            Batching.CONTINUOUS,
            max_num_seqs,
            max_num_batched_tokens,
            dtype=dtype,
            outputs=loom_tokens[dtype],
        )
        report["modes"][name]["mode"] = name
        log(f"  {report['modes'][name]}")
        save_partial()
    if hf:
        log("running hf_static ...")
        report["modes"]["hf_static"] = run_hf_static(ckpt, items, max_num_seqs)
        log(f"  {report['modes']['hf_static']}")
        save_partial()
    modes = report["modes"]
    cont = modes["continuous"]["output_tokens_per_s"]
    ratios = (
        {
            "continuous_over_static": cont / modes["static"]["output_tokens_per_s"],
            "continuous_over_static_no_padding": cont / modes["static_no_padding"]["output_tokens_per_s"],
        }
        if static
        else {}
    )
    if hf:
        ratios["continuous_over_hf_static"] = cont / modes["hf_static"]["output_tokens_per_s"]
    for dtype in dtypes:
        if dtype != "float32":
            ratios[f"{_loom_mode(dtype)}_over_continuous"] = (
                modes[_loom_mode(dtype)]["output_tokens_per_s"] / cont
            )
    report["ratios"] = {k: round(v, 3) for k, v in ratios.items()}
    if agreement:
        report["agreement"] = []
        for dtype in dtypes:
            if dtype != "float32":
                log(f"greedy agreement with transformers in {dtype} ...")
                report["agreement"].append(greedy_agreement(ckpt, dtype))
                log(f"  {report['agreement'][-1]}")
        save_partial()
    if peer is not None:
        try:
            add_peer(
                report,
                ckpt,
                items,
                loom_tokens,
                max_num_seqs,
                max_num_batched_tokens,
                seed,
                log,
                runner=peer_runner,
                python=peer_python,
                loom_again=lambda dtype: run_engine(
                    ckpt, items, Batching.CONTINUOUS, max_num_seqs, max_num_batched_tokens, dtype=dtype
                ),
            )
        finally:
            save_partial()
    if roofline_points:
        add_roofline(report, ckpt, roofline_points, log)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "engine.json").write_text(json.dumps(report, indent=2) + "\n")
        (out_dir / "engine.md").write_text(to_markdown(report))
        (out_dir / "engine.partial.json").unlink(missing_ok=True)
        log(f"wrote {out_dir / 'engine.json'} and {out_dir / 'engine.md'}")
    return report


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "engine", help="continuous vs static vs HF generate on a seeded workload (~10 min on CPU)"
    )
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-output", type=int, default=400)
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate baseline")
    p.add_argument("--no-roofline", action="store_true", help="skip the roofline probes")
    p.add_argument("--no-static", action="store_true", help="skip the static-batching rows")
    p.add_argument(
        "--dtypes",
        default="auto",
        help="continuous-batching dtypes, comma-separated (float32 always runs); "
        "auto: float32, and bfloat16 when the CPU has native bf16 (avx512_bf16 or amx_bf16)",
    )
    p.add_argument(
        "--peer",
        choices=["vllm"],
        default=None,
        help="also serve the workload with vLLM's CPU build in each dtype (build it: make peer-vllm)",
    )
    p.add_argument(
        "--peer-python",
        type=Path,
        default=None,
        help="the peer venv's python (default: .venv-vllm/bin/python)",
    )
    p.add_argument(
        "--roofline-only",
        action="store_true",
        help="re-measure only the roofline section of an existing engine.json in --out",
    )
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: embedded)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.set_defaults(func=_main)


def parse_dtypes(spec: str) -> tuple[str, ...]:
    """``--dtypes``: ``auto`` or a comma-separated list; float32 first and always included."""
    if spec == "auto":
        return ("float32", "bfloat16") if native_bf16() else ("float32",)
    names = [d.strip() for d in spec.split(",") if d.strip()]
    unknown = sorted(set(names) - {"float32", "bfloat16"})
    if unknown:
        raise ValueError(f"unknown dtypes {unknown}; known: float32, bfloat16")
    return ("float32", *[d for d in dict.fromkeys(names) if d != "float32"])


def _main(args: argparse.Namespace) -> int:
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.peer:
        try:  # before the long Loom runs: say at once how to build a missing peer venv
            args.peer_python = peer_vllm.peer_python(args.peer_python)
        except peer_vllm.PeerError as exc:
            log(str(exc))
            return 2
    ckpt = load_checkpoint(args.model)
    if args.roofline_only:
        report = json.loads((args.out / "engine.json").read_text())
        add_roofline(report, ckpt, ROOFLINE_POINTS, log)
        (args.out / "engine.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "engine.md").write_text(to_markdown(report))
        print(to_markdown(report))
        return 0
    try:
        report = run_benchmark(
            ckpt,
            args.requests,
            args.seed,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.max_output,
            hf=not args.no_hf,
            static=not args.no_static,
            roofline_points=None if args.no_roofline else ROOFLINE_POINTS,
            out_dir=args.out,
            log=log,
            dtypes=parse_dtypes(args.dtypes),
            peer=args.peer,
            peer_python=args.peer_python,
        )
    except peer_vllm.PeerError as exc:
        log(f"the peer failed (what was measured is in {args.out / 'engine.partial.json'}): {exc}")
        return 1
    print(to_markdown(report))
    return 0
