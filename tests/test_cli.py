"""The commands a newcomer runs: `loom serve` (as `make run` does) and `loom generate` against it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai

from loadtest.tiny_model import random_checkpoint, save_hf_dir

LOOM = str(Path(sys.executable).with_name("loom"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_generate_local_streams_a_completion() -> None:
    out = subprocess.run(
        [LOOM, "generate", "--local", "--max-tokens", "8", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "Paris" in out.stdout
    assert "completion tokens" in out.stderr


def test_serve_prints_a_key_that_generate_uses_then_shuts_down_on_ctrl_c(tmp_path: Path) -> None:
    model = save_hf_dir(random_checkpoint(), tmp_path / "tiny")
    port, http_port, metrics = _free_port(), _free_port(), _free_port()
    env = {**os.environ, "LOOM_ENGINE_KV_CACHE_MEMORY_MB": "8", "LOOM_ENGINE_NUM_THREADS": "1"}
    env.pop("LOOM_API_KEY", None)
    serve = subprocess.Popen(
        [
            *(LOOM, "serve", "--port", str(port), "--http-port", str(http_port)),
            *("--metrics-port", str(metrics), "--model", str(model)),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        banner = ""
        deadline = time.monotonic() + 240
        while "-d '{" not in banner and time.monotonic() < deadline and serve.poll() is None:
            banner += serve.stdout.readline()  # type: ignore[union-attr]
        key = re.search(r"loom_[0-9a-f]+_[0-9a-f]+", banner)
        assert key, f"no demo key in the banner: {banner!r}"
        assert f"127.0.0.1:{port}" in banner
        assert key.group(0) not in (tmp_path / ".loom" / "tenants.yaml").read_text()  # only its hash
        ok = subprocess.run(
            [
                LOOM,
                "generate",
                "--address",
                f"127.0.0.1:{port}",
                "--api-key",
                key.group(0),
                "--max-tokens",
                "5",
                "--raw",
                "hello",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ok.returncode == 0, ok.stderr
        assert "5 completion tokens" in ok.stderr
        bad = subprocess.run(
            [LOOM, "generate", "--address", f"127.0.0.1:{port}", "--api-key", "loom_0_0", "hello"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == 1 and "UNAUTHENTICATED" in bad.stderr
        # The banner's HTTP address serves the OpenAI API to the same key, streamed.
        assert f"http://127.0.0.1:{http_port}/v1" in banner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=key.group(0))
        chunks = list(
            client.completions.create(
                model=client.models.list().data[0].id, prompt="hi", max_tokens=5, stream=True
            )
        )
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1
    finally:
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=120) == 0


def test_generate_warns_before_sending_a_key_in_plaintext_off_this_machine() -> None:
    from loom.cmd_generate import _is_loopback

    assert all(_is_loopback(a) for a in ("127.0.0.1:50051", "localhost:1", "[::1]:50051", "127.9.9.9:1"))
    assert not any(_is_loopback(a) for a in ("10.0.0.5:50051", "gateway.svc:50051", "[2001:db8::1]:1"))
