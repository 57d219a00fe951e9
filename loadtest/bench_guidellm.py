"""``loom bench guidellm``: weighted fair share measured by an independent client, beside Loom's own.

``loom serve`` (the embedded SmolLM2, one engine replica, its own ``redis-server``) with two tenants
of weights 1 and 3 at the same priority, both offering more than the engine serves. Run 1: one
``guidellm`` process per tenant key (guidellm 0.8.1 in ``.venv-guidellm``, ``make peer-guidellm``),
Poisson arrivals over the OpenAI ``/v1/completions`` front, synthetic prompts counted by the served
model's tokenizer (exported to a local directory: nothing is fetched). Run 2: ``loom loadtest``'s
runner with the same tenants, rates and lengths. Each run's output tokens per tenant are read from
the client's own report and from the server's ``loom:generation_tokens_total``, so the weighted
split is seen from outside and from inside. Writes ``guidellm.json`` and ``guidellm.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from loadtest.bench_served import _create_tenants
from loadtest.generator import plan_workload
from loadtest.loadtest_cli import run_workload
from loadtest.machine import cpu_line
from loadtest.markdown import render, write_report
from loadtest.soak_server import ServedLoom, by_tenant, replica_gauges
from loadtest.workload import parse_workload

RESULTS_DIR = Path(__file__).parent / "results"
GUIDELLM = Path(".venv-guidellm") / "bin" / "guidellm"  # make peer-guidellm
MODEL = "smollm2-135m-instruct"
TENANTS = {"light": 1.0, "heavy": 3.0}  # bench_served's TENANTS give them these weights
RATE = 4.0  # requests/s per tenant: together more than the engine serves on a laptop-sized CPU
# Constant lengths: the one shape both clients generate alike.
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 64


def export_tokenizer(out: Path) -> Path:
    """The embedded model's tokenizer as a Hugging Face directory (what guidellm counts tokens with)."""
    from transformers import AutoTokenizer

    from worker.api import load_checkpoint

    ckpt = load_checkpoint()
    tok = AutoTokenizer.from_pretrained(str(ckpt.path.parent), gguf_file=ckpt.path.name)
    tok.save_pretrained(str(out))
    return out


def scenario(http: str, key: str, tokenizer: Path, seconds: float, out: Path, seed: int) -> dict[str, Any]:
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": f"http://{http}",
                "model": MODEL,
                "api_key": key,
                "request_format": "/v1/completions",
            },
            "profile": {"kind": "poisson", "rate": [RATE]},
            "data": [
                {"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}
            ],
            "tokenizer": {"kind": "hf_auto", "model": str(tokenizer)},
            "constraints": [{"kind": "max_duration", "seconds": seconds}],
            "seed": {"kind": "static", "value": seed},
            "outputs": [{"kind": "json", "path": str(out)}],
        }
    }


def generation_tokens(metrics_url: str) -> dict[str, float]:
    return by_tenant(metrics_url, "loom:generation_tokens_total")


def _guidellm_tokens(report: Path) -> dict[str, float]:
    """What one guidellm report says its tenant got in the benchmark's window: output tokens of the
    requests that completed and of those still streaming when the window closed (overloaded on
    purpose, many are), requests completed, and the median time to first token."""
    import statistics

    bench = json.loads(report.read_text())["benchmarks"][0]
    requests = bench["requests"]
    seen = requests["successful"] + requests["incomplete"]
    ttfts = [r["time_to_first_token_ms"] for r in seen if r.get("time_to_first_token_ms") is not None]
    return {
        "output_tokens": float(sum(r.get("output_tokens") or 0 for r in seen)),
        "seconds": float(bench["duration"]),
        "requests": float(len(requests["successful"])),
        "ttft_p50_ms": float(statistics.median(ttfts)) if ttfts else float("nan"),
    }


async def _run_guidellm(
    guidellm: Path, served: ServedLoom, keys: dict[str, str], tokenizer: Path, seconds: float, work: Path
) -> dict[str, Any]:
    before = generation_tokens(served.metrics_url)
    procs = []
    for i, tenant in enumerate(TENANTS):
        config = work / f"{tenant}.json"
        config.write_text(
            json.dumps(
                scenario(
                    served.http_address, keys[tenant], tokenizer, seconds, work / f"{tenant}-out.json", i
                )
            )
        )
        log = (work / f"{tenant}.log").open("wb")
        procs.append(
            await asyncio.create_subprocess_exec(
                str(guidellm), "run", "--scenario", str(config), "--disable-console-interactive",
                stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
            )
        )  # fmt: skip
    codes = await asyncio.gather(*(p.wait() for p in procs))
    if any(codes):
        raise RuntimeError(f"guidellm failed ({codes}); see {work}/*.log")
    idle_after_s = await _until_idle(served.metrics_url)
    after = generation_tokens(served.metrics_url)
    client = {t: _guidellm_tokens(work / f"{t}-out.json") for t in TENANTS}
    return {
        **_shares(client, {t: after.get(t, 0.0) - before.get(t, 0.0) for t in TENANTS}),
        "idle_after_s": idle_after_s,
    }


async def _until_idle(metrics_url: str, limit_s: float = 120.0) -> float | None:
    """Seconds until no replica holds a request or a KV block once the clients have gone (their
    abandoned requests are aborted, not served: a backlog left behind would be served at its tenant's
    share in the next run); None past ``limit_s``."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        gauges = await asyncio.to_thread(replica_gauges, metrics_url)
        if gauges and all(g.idle for g in gauges.values()):
            return time.monotonic() - start
        await asyncio.sleep(0.2)
    return None


async def _run_loadtest(
    served: ServedLoom, keys: dict[str, str], seconds: float, console: Console
) -> dict[str, Any]:
    before = generation_tokens(served.metrics_url)
    w = parse_workload(
        {
            "name": "guidellm-beside",
            "target": {
                "address": served.grpc_address,
                "http_address": served.http_address,
                "model": MODEL,
                "metrics_url": served.metrics_url,
            },
            "front": "http",
            "seed": 0,
            "duration_s": seconds,
            "max_requests": int(RATE * seconds * len(TENANTS) * 2),
            "max_seconds": seconds + 240,
            "drain_s": 0,  # streams still open when arrivals stop are cut, as guidellm's are
            "max_in_flight": 512,
            "request_timeout_s": 300,
            "priorities": {"standard": 1},
            "prompt": {"dist": "constant", "value": PROMPT_TOKENS},
            "output": {"dist": "constant", "value": OUTPUT_TOKENS},
            "tenants": [
                {
                    "name": t,
                    "api_key_env": f"LOOM_KEY_{t.upper()}",
                    "weight": w,
                    "arrival": {"process": "poisson", "rate": RATE},
                }
                for t, w in TENANTS.items()
            ],
        },
        "guidellm-beside",
    )
    mine = {t: keys[t] for t in TENANTS}
    report = await run_workload(w, plan_workload(w), mine, True, console)
    after = generation_tokens(served.metrics_url)
    tenants = report["stages"][-1]["stats"]["tenants"]
    client = {
        t: {
            "output_tokens": float(tenants[t]["output_tokens_per_s"]) * float(tenants[t]["window_s"]),
            "seconds": float(tenants[t]["window_s"]),
            "requests": float(tenants[t]["ok"]),
            "ttft_p50_ms": 1000.0 * float(tenants[t]["ttft_s"]["p50"]),
        }
        for t in TENANTS
    }
    return _shares(client, {t: after.get(t, 0.0) - before.get(t, 0.0) for t in TENANTS})


def _shares(client: dict[str, dict[str, float]], server: dict[str, float]) -> dict[str, Any]:
    light, heavy = "light", "heavy"
    c_rate = {t: v["output_tokens"] / v["seconds"] for t, v in client.items()}
    return {
        "client": client,
        "client_tokens_per_s": c_rate,
        "client_ratio": c_rate[heavy] / c_rate[light],
        "server_tokens": server,
        "server_ratio": server[heavy] / server[light] if server[light] else None,
    }


async def _bench(guidellm: Path, seconds: float, out_dir: Path | None, console: Console) -> dict[str, Any]:
    if not guidellm.exists():
        raise SystemExit(f"{guidellm} not found: run `make peer-guidellm` first")
    work = Path(tempfile.mkdtemp(prefix="loom-guidellm-"))
    tokenizer = await asyncio.to_thread(export_tokenizer, work / "tokenizer")
    served = ServedLoom.create(replicas=1, engine_env={}, embedded=True)
    try:
        console.print("starting loom serve ...")
        await served.start()
        keys = await asyncio.to_thread(_create_tenants, served.redis_url)
        await asyncio.sleep(2.0)  # the gateway polls the store for new keys every second
        console.print(f"guidellm, one process per tenant, {seconds:g} s ...")
        guide = await _run_guidellm(guidellm, served, keys, tokenizer, seconds, work)
        console.print(
            f"  heavy / light: {guide['client_ratio']:.2f} (client), {guide['server_ratio']:.2f} (server)"
        )
        await asyncio.sleep(5.0)
        console.print(f"loom loadtest, {seconds:g} s ...")
        own = await _run_loadtest(served, keys, seconds, console)
        console.print(
            f"  heavy / light: {own['client_ratio']:.2f} (client), {own['server_ratio']:.2f} (server)"
        )
    finally:
        await served.stop()
        served.remove()
    version = subprocess.run([str(guidellm), "--version"], capture_output=True, text=True).stdout.strip()
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_line(),
        "guidellm": version,
        "workload": {
            "seconds": seconds,
            "rate": RATE,
            "weights": TENANTS,
            "prompt_tokens": PROMPT_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
        },
        "runs": {"guidellm": guide, "loom loadtest": own},
        "work_dir": str(work),
    }
    if out_dir is not None:
        write_report(out_dir, "guidellm", report, to_markdown(report))
    return report


def to_markdown(report: dict[str, Any]) -> str:
    return render("guidellm.md.j2", report=report)


def _main(args: argparse.Namespace) -> int:
    asyncio.run(_bench(args.guidellm, args.seconds, args.out, Console()))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "guidellm", help="fair share seen by guidellm (an independent client) beside loom loadtest"
    )
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--guidellm", type=Path, default=GUIDELLM, help="the guidellm executable")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.set_defaults(func=_main)
