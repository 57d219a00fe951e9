"""The vLLM side of ``loom bench engine --peer vllm``: run in the peer venv (``make peer-vllm``).

``python peer_vllm_runner.py JOB.json RESULT.json``. The job (written by ``loadtest/peer_vllm.py``)
holds a Hugging Face model directory, the dtype, the batching limits and the benchmark's requests as
token ids with their output lengths. This script serves them with vLLM's offline ``LLM`` API: one
warm-up ``generate`` (random token ids, not the workload's prompts, so no prefix is cached), then the
whole workload in one timed ``generate`` call, greedy and ignoring end-of-sequence. It checks every
request produced exactly its number of tokens and writes the timing, the tokens and the versions.

It imports nothing of Loom's (the peer venv does not have Loom) and only the standard library at
module level, so the job format is testable from Loom's venv.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOB_VERSION = 1


@dataclass(frozen=True)
class PeerRequest:
    """One request: its prompt as token ids and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class PeerJob:
    """Everything the subprocess needs; built by ``loadtest.peer_vllm.make_job``."""

    model: str
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    seed: int
    warmup: list[PeerRequest]
    requests: list[PeerRequest]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PeerJob:
        """Parse and check a job dict (the JSON file's content)."""
        if data.get("version") != JOB_VERSION:
            raise ValueError(f"job version {data.get('version')!r}, this runner reads {JOB_VERSION}")

        def reqs(key: str) -> list[PeerRequest]:
            out = []
            for r in data[key]:
                ids, n = r["prompt_token_ids"], r["max_tokens"]
                if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                    raise ValueError(f"{key}: prompt_token_ids must be non-empty non-negative ints")
                if not isinstance(n, int) or n < 1:
                    raise ValueError(f"{key}: max_tokens must be a positive int, got {n!r}")
                out.append(PeerRequest(list(ids), n))
            return out

        if data["dtype"] not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {data['dtype']!r}")
        return cls(
            model=str(data["model"]),
            dtype=data["dtype"],
            max_num_seqs=int(data["max_num_seqs"]),
            max_num_batched_tokens=int(data["max_num_batched_tokens"]),
            max_model_len=int(data["max_model_len"]),
            seed=int(data["seed"]),
            warmup=reqs("warmup"),
            requests=reqs("requests"),
        )


def check_counts(requests: list[PeerRequest], token_ids: list[list[int]]) -> None:
    """Raise unless request ``i`` produced exactly ``requests[i].max_tokens`` tokens."""
    if len(token_ids) != len(requests):
        raise RuntimeError(f"vLLM returned {len(token_ids)} outputs for {len(requests)} requests")
    wrong = [
        (i, len(t), r.max_tokens)
        for i, (r, t) in enumerate(zip(requests, token_ids, strict=True))
        if len(t) != r.max_tokens
    ]
    if wrong:
        raise RuntimeError(f"vLLM produced the wrong number of tokens (index, got, asked): {wrong[:10]}")


def _generate(llm: Any, requests: list[PeerRequest]) -> list[list[int]]:
    """One ``LLM.generate`` call over ``requests`` (token-id prompts, greedy, ignore-eos); the
    generated token ids in request order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0) for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def run(job: PeerJob) -> dict[str, Any]:
    """Build the engine, warm it up, time the workload's ``generate`` call; the result dict."""
    import torch
    import transformers
    import vllm
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        model=job.model,
        dtype=job.dtype,
        max_num_seqs=job.max_num_seqs,
        max_num_batched_tokens=job.max_num_batched_tokens,
        max_model_len=job.max_model_len,
        enable_chunked_prefill=True,
        seed=job.seed,
        generation_config="vllm",  # vLLM's own defaults, never sampling settings from the model dir
    )
    init_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    check_counts(job.warmup, _generate(llm, job.warmup))
    warmup_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    token_ids = _generate(llm, job.requests)
    wall = time.perf_counter() - t0
    check_counts(job.requests, token_ids)

    out_tokens = sum(len(t) for t in token_ids)
    cfg = llm.llm_engine.vllm_config
    mode = cfg.compilation_config.mode
    return {
        "requests": len(job.requests),
        "output_tokens": out_tokens,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(job.requests) / wall, 4),
        "output_tokens_per_s": round(out_tokens / wall, 2),
        "init_s": round(init_s, 1),
        "warmup_s": round(warmup_s, 2),
        "token_ids": token_ids,
        "config": {
            "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "max_model_len": cfg.model_config.max_model_len,
            "enable_chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
            "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            "kv_cache_memory_bytes": cfg.cache_config.kv_cache_memory_bytes,
            "compilation_mode": getattr(mode, "name", str(mode)),
        },
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_CPU_", "OMP_", "VLLM_ENABLE"))},
        # What vLLM preloaded into its worker (it adds torch's libgomp itself; tcmalloc only if found).
        "ld_preload": [Path(x).name for x in os.environ.get("LD_PRELOAD", "").split(":") if x],
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} JOB.json RESULT.json", file=sys.stderr)
        return 2
    job = PeerJob.from_dict(json.loads(Path(argv[1]).read_text()))
    result = run(job)
    Path(argv[2]).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
