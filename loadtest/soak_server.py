"""A served Loom that ``loom soak`` starts and breaks: a private ``redis-server`` (the tenant and quota
store, with an append-only file so a restart keeps its data), ``loom serve`` as a subprocess in front
of engine replicas of a tiny random model, and what the soak reads about them from outside: the
processes (replica pids to SIGKILL, resident memory of the gateway and the replicas) and the
gateway's Prometheus metrics (each replica's KV blocks, running and waiting requests).

Everything listens on loopback ports picked free; everything is stopped and its files removed when
the soak ends (the server's log is kept next to the results if asked).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

SECRET = "loom-soak-secret-0123456789abcdef0123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server: started, stopped (SIGTERM: it writes its append-only file and exits) and
    started again on the same port and data directory."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--protected-mode", "no",
                "--loglevel", "warning"]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(redis.exceptions.RedisError):
                client = redis.Redis.from_url(self.url, socket_timeout=0.5)
                try:
                    if client.ping():
                        return
                finally:
                    client.close()
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


# ---- processes ----------------------------------------------------------------------------------


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                out[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def rss_mb(pid: int) -> float | None:
    """Resident memory of a process in MiB (None if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# ---- metrics --------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^(?P<name>[\w:]+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")


@dataclass
class ReplicaGauges:
    kv_blocks_used: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    preemptions: float = 0.0

    @property
    def idle(self) -> bool:
        return self.kv_blocks_used == 0 and self.running == 0 and self.waiting == 0


def replica_gauges(metrics_url: str) -> dict[str, ReplicaGauges]:
    """Per replica of every pool: the engine gauges the gateway re-exports (docs: gateway/metrics.py)."""
    out: dict[str, ReplicaGauges] = {}
    for name, labels, value in _samples(metrics_url):
        replica = labels.get("replica")
        if replica is None:
            continue
        g = out.setdefault(replica, ReplicaGauges())
        if name == "loom:kv_cache_blocks_used":
            g.kv_blocks_used = value
        elif name == "loom:num_requests_running":
            g.running = value
        elif name == "loom:num_requests_waiting":
            g.waiting += value
        elif name in ("loom:num_preemptions", "loom:num_preemptions_total"):
            g.preemptions = value
    return out


def loop_lag_buckets(metrics_url: str) -> dict[float, float]:
    """The gateway's event-loop lag histogram (gateway/loop_lag.py): upper bound -> cumulative count."""
    return {
        float(labels["le"]): value
        for name, labels, value in _samples(metrics_url)
        if name == "loom:gateway_event_loop_lag_seconds_bucket"
    }


def by_tenant(metrics_url: str, name: str) -> dict[str, float]:
    """A per-tenant counter or gauge of the gateway's endpoint: tenant -> value."""
    return {
        labels["tenant"]: value
        for n, labels, value in _samples(metrics_url)
        if n == name and "tenant" in labels
    }


def _samples(metrics_url: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Each labelled sample of a Prometheus endpoint: (name, labels, value)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is not None:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))
            yield m.group("name"), labels, float(m.group("value"))


def histogram_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The ``q`` quantile of what a histogram observed between two scrapes, as the upper bound of the
    bucket it falls in (None: nothing observed)."""
    counts = sorted((le, after.get(le, 0.0) - before.get(le, 0.0)) for le in after)
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return None
    for le, cumulative in counts:
        if cumulative >= q * total:
            return le
    return counts[-1][0]


# ---- loom serve ------------------------------------------------------------------------------------


@dataclass
class ServedLoom:
    """``loom serve`` in a subprocess, with its store; ``start`` returns once the banner is printed."""

    workdir: Path
    model_dir: Path | None  # None: the embedded SmolLM2
    replicas: int = 2
    engine_env: dict[str, str] = field(default_factory=dict)
    redis: RedisServer | None = None
    # 0: the gateway in the ``loom serve`` process; N: N gateway processes as Serve replicas, sharing
    # the ports (with N > 1 there is no metrics port).
    gateways: int = 0
    proc: asyncio.subprocess.Process | None = None
    grpc_address: str = ""
    http_address: str = ""
    metrics_url: str = ""

    @classmethod
    def create(
        cls, replicas: int, engine_env: dict[str, str], embedded: bool = False, gateways: int = 0
    ) -> ServedLoom:
        """A tiny random model (the soak's: cheap steps), or the embedded model (``embedded``)."""
        from loadtest.tiny_model import random_checkpoint, save_hf_dir

        workdir = Path(tempfile.mkdtemp(prefix="loom-soak-"))
        model_dir = None if embedded else save_hf_dir(random_checkpoint(), workdir / "tiny")
        return cls(workdir, model_dir, replicas, engine_env, RedisServer(workdir / "redis"), gateways)

    @property
    def redis_url(self) -> str:
        assert self.redis is not None
        return self.redis.url

    async def start(self) -> None:
        assert self.redis is not None
        await asyncio.to_thread(self.redis.start)
        port, http_port, metrics_port = free_port(), free_port(), free_port()
        env = {
            **os.environ,
            "LOOM_TENANCY_SECRET": SECRET,
            "LOOM_GATEWAY_DRAIN_GRACE_S": "20",
            **self.engine_env,
        }
        env.pop("RAY_ADDRESS", None)  # a cluster of its own, never the caller's
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loom.cli", "serve",
            *(["--model", str(self.model_dir)] if self.model_dir is not None else []),
            "--replicas", str(self.replicas), "--redis-url", self.redis.url, "--port", str(port),
            "--http-port", str(http_port), "--metrics-port", str(metrics_port),
            *(["--gateway-in-serve", "--gateways", str(self.gateways)] if self.gateways else []),
            cwd=self.workdir, env=env, stdout=asyncio.subprocess.PIPE,
            stderr=(self.workdir / "serve.log").open("wb"),
        )  # fmt: skip
        assert self.proc.stdout is not None
        banner = ""
        deadline = time.monotonic() + 300
        while "Create a key" not in banner and "-d '{" not in banner:
            line = await asyncio.wait_for(self.proc.stdout.readline(), max(1.0, deadline - time.monotonic()))
            if not line:
                raise RuntimeError(f"loom serve exited (see {self.workdir / 'serve.log'})")
            banner += line.decode()
        self.grpc_address = f"127.0.0.1:{port}"
        self.http_address = f"127.0.0.1:{http_port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics" if self.gateways <= 1 else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def replica_pids(self) -> list[int]:
        """The engine replicas' processes (Ray workers running a Serve replica of an engine pool)."""
        return [p for p in descendants(self.pid) if "ServeReplica" in cmdline(p) and "engine-" in cmdline(p)]

    async def stop(self) -> int | None:
        """SIGTERM (the gateway drains) and wait; returns the exit status (None if it had to be killed)."""
        code = None
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = await asyncio.wait_for(self.proc.wait(), 120)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        elif self.proc is not None:
            code = self.proc.returncode
        if self.redis is not None:
            await asyncio.to_thread(self.redis.stop)
        return code

    def remove(self, keep_log: Path | None = None) -> None:
        if keep_log is not None and (self.workdir / "serve.log").exists():
            shutil.copy(self.workdir / "serve.log", keep_log)
        shutil.rmtree(self.workdir, ignore_errors=True)
