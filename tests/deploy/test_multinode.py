"""The RayService's Serve config on a real multi-node Ray cluster, with an engine node killed.

Runs ``python -m deploy.multinode`` (about 1.5 minutes here; bounded at 7): a head and two engine
worker nodes started with ``ray start`` on free ports and their own temporary directory, the cpu-dev
overlay's ``serveConfigV2`` deployed as KubeRay deploys it, greedy streams from two tenants, one engine
node killed mid-stream, a node rejoining. Whatever happens, every process the run started is killed
afterwards (from the pids.json it keeps current), and nothing else is touched.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.multinode import REPO, stop_recorded


@pytest.mark.skipif(
    not (shutil.which("redis-server") and shutil.which("openssl")), reason="needs redis-server and openssl"
)
@pytest.mark.timeout(480)
def test_a_node_dies_under_live_streams_and_serve_recovers(tmp_path: Path) -> None:
    workdir, out = tmp_path / "run", tmp_path / "multinode"
    argv = [sys.executable, "-m", "deploy.multinode", "--out", str(out), "--workdir", str(workdir)]
    # 96 tokens: the streams on the killed node are still running after the busiest-node lookup.
    argv += ["--max-tokens", "96", "--timeout", "360"]
    try:
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=420)
    finally:
        left = stop_recorded(workdir)  # a no-op when the run stopped its own processes
    assert not left, f"processes left running: {left}"
    assert out.with_suffix(".json").exists(), proc.stderr[-4000:]
    result = json.loads(out.with_suffix(".json").read_text())
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, f"{failed}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0
    resumed = [s for s in result["streams"] if s["resumed"]]
    assert resumed and all(s["equal_to_reference"] and s["tokens_before_kill"] > 0 for s in resumed)
    assert result["timings_s"]["rejoin_to_replicas_restored"] > 0
