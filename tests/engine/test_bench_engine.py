"""The engine benchmark runs end to end (tiny model, tiny workload) and writes what the issues ask:
every mode, the roofline, the step-time breakdown, bf16 rows with their agreement, and the vLLM peer's
rows (with a stand-in for the subprocess: vLLM itself lives in its own venv, ``make peer-vllm``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from loadtest import peer_vllm
from loadtest import peer_vllm_runner as runner
from loadtest.bench_engine import (
    REFERENCE_PROMPTS,
    greedy_agreement,
    make_workload,
    native_bf16,
    parse_dtypes,
    run_benchmark,
    run_engine,
    step_breakdown,
)
from loadtest.static_batching import Batching
from worker.api import load_checkpoint
from worker.checkpoint import Checkpoint


def test_benchmark_writes_every_mode_and_the_roofline(tiny: Checkpoint, tmp_path: Path) -> None:
    report = run_benchmark(
        tiny,
        n=6,
        seed=1,
        max_num_seqs=3,
        max_output=12,
        hf=True,
        roofline_points=[(2, 16), (4, 8)],
        out_dir=tmp_path,
        log=lambda _: None,
    )
    saved = json.loads((tmp_path / "engine.json").read_text())
    assert saved == json.loads(json.dumps(report))
    for mode in ("continuous", "static", "static_no_padding", "hf_static"):
        m = saved["modes"][mode]
        assert m["output_tokens"] == saved["workload"]["output_tokens"]
        assert m["output_tokens_per_s"] > 0 and m["requests_per_s"] > 0
    assert set(saved["ratios"]) == {
        "continuous_over_static",
        "continuous_over_static_no_padding",
        "continuous_over_hf_static",
    }
    assert saved["roofline"]["step_over_roofline"] > 0
    for probe in saved["roofline_points"]:  # phase by phase can only be slower than overlapped
        assert probe["sequential_bound_ms"] >= probe["roofline_ms"] > 0
        assert probe["step_over_sequential_bound"] <= probe["step_over_roofline"]
    assert len(saved["roofline_points"]) == 2
    assert saved["roofline"] in saved["roofline_points"]
    md = (tmp_path / "engine.md").read_text()
    assert "| continuous |" in md and "non-compute share" in md
    assert saved["native_bf16"] == native_bf16()
    assert ("No bfloat16 rows: this CPU has no native bf16" in md) == (not native_bf16())
    assert "flags" in saved["versions"]["cpu"]  # loadtest.machine.cpu_line()
    assert "peer" not in saved and "vllm" not in saved["modes"]
    assert not (tmp_path / "engine.partial.json").exists()


def test_step_time_splits_a_step_into_schedule_forward_and_the_rest(tiny: Checkpoint) -> None:
    items = make_workload(tiny, 5, seed=2, max_output=10)
    tokens: list[list[int]] = []
    m = run_engine(tiny, items, Batching.CONTINUOUS, 4, 64, outputs=tokens)
    t = m["step_time"]
    assert t["steps"] == m["decode_steps"]  # the warm-up's steps are not counted
    assert t["forward_ms"] > 0 and t["schedule_ms"] > 0 and t["other_ms"] >= 0
    assert t["step_ms"] == pytest.approx(t["schedule_ms"] + t["forward_ms"] + t["other_ms"], abs=2e-3)
    assert 0 < t["non_compute_share"] < 1
    # the ms figures are rounded to 1 us, which moves a sub-millisecond step's share by up to 1e-3 / step_ms
    share = (t["step_ms"] - t["forward_ms"]) / t["step_ms"]
    assert t["non_compute_share"] == pytest.approx(share, abs=1e-4 + 1e-3 / t["step_ms"])
    assert [len(x) for x in tokens] == [w.max_tokens for w in items]


def test_step_breakdown_arithmetic() -> None:
    b = step_breakdown(steps=4, step_s=2.0, schedule_s=0.1, forward_s=1.5)
    assert b["step_ms"] == 500.0 and b["forward_ms"] == 375.0 and b["schedule_ms"] == 25.0
    assert b["other_ms"] == 100.0
    assert b["non_compute_share"] == 0.25 and b["schedule_share"] == 0.05 and b["other_share"] == 0.2
    assert step_breakdown(0, 0.0, 0.0, 0.0)["non_compute_share"] == 0.0


def test_greedy_agreement_is_total_in_float32_and_measured_in_bf16(tiny: Checkpoint) -> None:
    fp32 = greedy_agreement(tiny, "float32", max_tokens=8, prompts=REFERENCE_PROMPTS[:3])
    assert fp32["positions"] == 24 and fp32["top1_agreement"] == 1.0
    assert fp32["first_mismatch"] == [None, None, None]
    bf16 = greedy_agreement(tiny, "bfloat16", max_tokens=8, prompts=REFERENCE_PROMPTS[:3])
    assert bf16["positions"] == 24 and 0.5 <= bf16["top1_agreement"] <= 1.0


def test_parse_dtypes() -> None:
    assert parse_dtypes("float32") == ("float32",)
    assert parse_dtypes("bfloat16") == ("float32", "bfloat16")
    assert parse_dtypes("auto")[0] == "float32"
    with pytest.raises(ValueError, match="float16"):
        parse_dtypes("float16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_export_round_trips(tiny: Checkpoint, tmp_path: Path, dtype: str) -> None:
    """What vLLM loads: Loom reads the directory back to the same model, and transformers' Auto
    classes (which vLLM uses) read its config and tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    path = peer_vllm.export_hf(tiny, tmp_path / "hf", dtype)
    back = load_checkpoint(str(path))
    assert back.config.to_hf_dict() == tiny.config.to_hf_dict()
    assert set(back.weights) == set(tiny.weights)
    for name, w in tiny.weights.items():
        torch.testing.assert_close(back.weights[name].float(), w.to(getattr(torch, dtype)).float())
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {getattr(torch, dtype)}  # noqa: SIM118
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == tiny.config.num_layers
    text = "Loom weaves threads."
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.encode(text, add_special_tokens=False) == tiny.tokenizer.backend.encode(text).ids


def test_job_round_trips_to_the_runner_and_counts_are_checked(tiny: Checkpoint, tmp_path: Path) -> None:
    items = make_workload(tiny, 4, seed=0, max_output=9)
    job = peer_vllm.make_job(
        tmp_path / "hf",
        "bfloat16",
        [(w.prompt_ids, w.max_tokens) for w in items],
        [([101, 102, 103], 4)],
        max_num_seqs=3,
        max_num_batched_tokens=64,
        max_model_len=1024,
        seed=5,
    )
    parsed = runner.PeerJob.from_dict(json.loads(json.dumps(job)))  # what the subprocess reads
    assert parsed.model == str(tmp_path / "hf") and parsed.dtype == "bfloat16"
    assert (parsed.max_num_seqs, parsed.max_num_batched_tokens, parsed.max_model_len) == (3, 64, 1024)
    assert [(r.prompt_token_ids, r.max_tokens) for r in parsed.requests] == [
        (w.prompt_ids, w.max_tokens) for w in items
    ]
    assert parsed.warmup == [runner.PeerRequest([101, 102, 103], 4)]
    assert peer_vllm.JOB_VERSION == runner.JOB_VERSION
    runner.check_counts(parsed.requests, [[0] * w.max_tokens for w in items])
    with pytest.raises(RuntimeError, match="wrong number"):
        runner.check_counts(parsed.requests, [[0] * (w.max_tokens + 1) for w in items])
    with pytest.raises(ValueError, match="max_tokens"):
        runner.PeerJob.from_dict({**job, "requests": [{"prompt_token_ids": [1], "max_tokens": 0}]})
    with pytest.raises(ValueError, match="version"):
        runner.PeerJob.from_dict({**job, "version": 99})


def test_peer_env_binds_loom_cores_and_reserves_none() -> None:
    env = peer_vllm.peer_env([0, 1], 2, base={"VIRTUAL_ENV": "/x/.venv", "PATH": "/usr/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "VIRTUAL_ENV" not in env and env["PATH"] == "/usr/bin"
    assert peer_vllm.kv_space_gib(46080, 32, 500, 8192) == 1  # Loom's 1 GiB default holds it
    assert peer_vllm.kv_space_gib(46080, 256, 1000, 8192) == 13  # else what the batch needs
    assert 1 <= len(peer_vllm.loom_cores()) <= torch.get_num_threads()


def test_missing_peer_venv_says_how_to_build_it(tmp_path: Path) -> None:
    with pytest.raises(peer_vllm.PeerError, match="make peer-vllm"):
        peer_vllm.peer_python(tmp_path / "nope" / "bin" / "python")


def test_benchmark_with_a_peer_reports_loom_over_peer_per_dtype(tiny: Checkpoint, tmp_path: Path) -> None:
    """The peer path end to end, with the subprocess replaced by a stand-in that reads the job the way
    the runner does and answers in its result format (here: one token fewer per request would fail)."""
    seen: list[dict[str, Any]] = []

    def fake_runner(job: dict[str, Any], workdir: Path, env: dict[str, str]) -> dict[str, Any]:
        parsed = runner.PeerJob.from_dict(json.loads(json.dumps(job)))
        assert (Path(parsed.model) / "config.json").exists()
        assert json.loads((Path(parsed.model) / "config.json").read_text())["torch_dtype"] == parsed.dtype
        seen.append({"dtype": parsed.dtype, "env": env, "n": len(parsed.requests)})
        tokens = [[7] * r.max_tokens for r in parsed.requests]
        runner.check_counts(parsed.requests, tokens)
        out = sum(map(len, tokens))
        return {
            "requests": len(tokens),
            "output_tokens": out,
            "wall_s": 2.0,
            "requests_per_s": len(tokens) / 2.0,
            "output_tokens_per_s": out / 2.0,
            "init_s": 1.0,
            "warmup_s": 0.1,
            "token_ids": tokens,
            "config": {"enable_prefix_caching": True, "compilation_mode": "2"},
            "env": {k: v for k, v in env.items() if k.startswith("VLLM_CPU_")},
            "versions": {"vllm": "0.32.0", "torch": torch.__version__},
        }

    report = run_benchmark(
        tiny,
        n=5,
        seed=3,
        max_num_seqs=3,
        max_output=10,
        hf=False,
        roofline_points=None,
        out_dir=tmp_path,
        log=lambda _: None,
        dtypes=("float32", "bfloat16"),
        peer="vllm",
        peer_runner=fake_runner,
    )
    assert [s["dtype"] for s in seen] == ["float32", "bfloat16"] and {s["n"] for s in seen} == {5}
    assert seen[0]["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    modes = report["modes"]
    assert modes["continuous_bfloat16"]["dtype"] == "bfloat16"
    assert modes["continuous_bfloat16"]["output_tokens"] == report["workload"]["output_tokens"]
    assert (
        modes["vllm"]["output_tokens"]
        == modes["vllm_bfloat16"]["output_tokens"]
        == modes["continuous"]["output_tokens"]
    )
    ratios = report["ratios"]
    runs = report["peer"]["runs"]
    # Loom ran before the peer and again right after it; the ratio divides the mean of both runs.
    before, after = runs["float32"]["loom_output_tokens_per_s"]
    assert before == modes["continuous"]["output_tokens_per_s"] and after > 0
    assert ratios["continuous_over_vllm"] == pytest.approx(
        (before + after) / 2 / modes["vllm"]["output_tokens_per_s"], rel=1e-2
    )
    assert "continuous_bfloat16_over_vllm_bfloat16" in ratios
    assert "continuous_bfloat16_over_continuous" in ratios
    assert [a["dtype"] for a in report["agreement"]] == ["bfloat16"]
    assert set(runs) == {"float32", "bfloat16"}
    assert runs["float32"]["same_tokens_as_loom"]["requests"] == 5
    assert report["versions"]["peer_vllm"] == "0.32.0"
    md = (tmp_path / "engine.md").read_text()
    for row in ("| vllm | float32 |", "| vllm_bfloat16 | bfloat16 |", "| continuous_bfloat16 | bfloat16 |"):
        assert row in md
    assert "Peer: vLLM 0.32.0" in md and "Greedy top-1 agreement in bfloat16" in md


def test_same_outputs_counts_identical_requests_and_common_prefixes() -> None:
    same = peer_vllm.same_outputs([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert same["identical_requests"] == 1 and same["common_prefix_tokens"] == 4
    assert same["common_prefix_share"] == round(4 / 6, 4)
