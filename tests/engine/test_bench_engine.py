"""The engine benchmark runs end to end (tiny model, tiny workload) and writes what the issue asks."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.bench_engine import run_benchmark
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
    assert len(saved["roofline_points"]) == 2
    assert saved["roofline"] in saved["roofline_points"]
    assert "| continuous |" in (tmp_path / "engine.md").read_text()
    assert not (tmp_path / "engine.partial.json").exists()
