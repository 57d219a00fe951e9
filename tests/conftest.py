"""Project-wide test fixtures: the Redis harness (engine fixtures live in tests/engine/conftest.py).

Which Redis: ``REDIS_URL`` if set; else ``127.0.0.1:6379`` if it answers PING; else a private
``redis-server`` started on a free port for the session. Every test that writes to Redis uses its own
key prefix (``redis_prefix``) and its keys are deleted afterwards, so tests never see each other's data
and a shared Redis is left as it was found.

Fault tests (kill, restart, SIGSTOP) never touch the shared server: they start their own with
``redis_server_factory``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

# pytest puts tests/ on sys.path (this conftest has no package around it), where tests/tenancy would
# be found as a namespace package named ``tenancy`` and shadow the real one whenever the repo root is
# not on sys.path too (e.g. `.venv/bin/pytest` with an editable install). Make the real one win.
_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import pytest  # noqa: E402
import redis  # noqa: E402

DEFAULT_URL = "redis://127.0.0.1:6379/0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.exceptions.RedisError:
        return False


class RedisProcess:
    """A ``redis-server`` owned by the test session: start, stop, kill -9, pause (SIGSTOP), resume."""

    def __init__(self, workdir: Path, *, port: int | None = None, persistent: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.persistent = persistent
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "yes" if self.persistent else "no",
            "--appendfsync", "always",
            "--protected-mode", "no",
            "--loglevel", "warning",
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not _answers(self.url):
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start within 10 s")
            time.sleep(0.02)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: the process vanishes without saving anything."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the port stays open and connections stay up, but nothing answers."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of the Redis the tests share (see module docstring for how it is chosen)."""
    url = os.environ.get("REDIS_URL")
    if url:
        if not _answers(url):
            pytest.fail(f"REDIS_URL={url} does not answer")
        yield url
        return
    if _answers(DEFAULT_URL):
        yield DEFAULT_URL
        return
    server = RedisProcess(tmp_path_factory.mktemp("redis-shared")).start()
    try:
        yield server.url
    finally:
        server.stop()


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    deleted = 0
    for batch in _batched(client.scan_iter(match=f"{prefix}:*", count=1000), 500):
        deleted += client.delete(*batch)
    return deleted


def _batched(it: Iterator[bytes], n: int) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for item in it:
        batch.append(item)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    yield client
    client.close()


@pytest.fixture
def redis_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A key prefix unique to this test; every key under it is deleted afterwards."""
    prefix = f"loomtest-{uuid.uuid4().hex[:12]}"
    yield prefix
    delete_prefix(redis_client, prefix)


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisProcess]]:
    """Start private ``redis-server`` processes for fault tests; all are killed at teardown."""
    started: list[RedisProcess] = []

    def start(*, persistent: bool = False) -> RedisProcess:
        server = RedisProcess(tmp_path / f"redis-{len(started)}", persistent=persistent).start()
        started.append(server)
        return server

    yield start
    for server in started:
        with contextlib.suppress(Exception):
            server.kill()


# ---- the fast tier (`make test-fast`: pytest -m "not slow") ------------------------------------------

# Fixtures whose tests are integration tests: a Ray cluster, Serve deployments, the served model's
# weights and its transformers reference.
_SLOW_FIXTURES = frozenset(
    {"ray_serve", "engine_handles", "gateway", "folder_ray", "engines", "smollm", "hf_model", "hf_reference"}
)
# Modules whose tests start processes (loom serve, Ray clusters, compilers) or run for minutes.
_SLOW_MODULES = frozenset(
    {
        "tests/test_cli.py",
        "tests/deploy/test_multinode.py",
        "tests/loadtest/test_served_smoke.py",
        "tests/loadtest/test_bench_served.py",
        "tests/loadtest/test_soak_memory.py",
        "tests/engine/test_bench_engine.py",
        "tests/kernels/test_kernel_bench.py",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: an integration test (Ray, the served model, processes)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = Path(str(item.fspath)).resolve().relative_to(_REPO_ROOT).as_posix()
        fixtures = set(getattr(item, "fixturenames", ()))
        if (
            module in _SLOW_MODULES
            or module.startswith(("tests/faults/", "tests/fuzz/"))
            or fixtures & _SLOW_FIXTURES
        ):
            item.add_marker(pytest.mark.slow)
