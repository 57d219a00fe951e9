"""``loom serve`` receives SIGTERM while two tenants stream: the streams in flight complete within the
drain grace, new calls are refused, the process exits 0, and the quota state it leaves behind holds
the usage the clients received and no running reservation."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
from pathlib import Path

import grpc
import httpx

from gateway.grpc.client import LoomClient
from gateway.grpc.stubs import pb
from loadtest.soak_streams import GreedyReference, Received, grpc_stream
from tenancy import FileTenantStore, TenancySettings
from tenancy.models import Quotas, Tenant
from tests.faults.harness import TINY
from tests.helpers import eventually

LOOM = str(Path(sys.executable).with_name("loom"))
STREAMS_PER_TENANT = 3
MAX_TOKENS = 900
DRAIN_GRACE_S = 60  # generous: the test is about what a drain keeps, not how fast the machine is


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_sigterm_drains_streams_refuses_new_calls_and_exits_zero(
    model_dir: Path, reference: GreedyReference, tmp_path: Path
) -> None:
    port, http_port, metrics_port = _free_port(), _free_port(), _free_port()
    env = {
        **os.environ,
        "LOOM_ENGINE_KV_CACHE_MEMORY_MB": "8",
        "LOOM_ENGINE_NUM_THREADS": "1",
        "LOOM_GATEWAY_DRAIN_GRACE_S": str(DRAIN_GRACE_S),
    }
    env.pop("LOOM_API_KEY", None)
    serve = await asyncio.create_subprocess_exec(
        *(LOOM, "serve", "--port", str(port), "--http-port", str(http_port)),
        *("--metrics-port", str(metrics_port), "--model", str(model_dir)),
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=(tmp_path / "serve.log").open("wb"),
    )
    clients: list[LoomClient] = []
    try:
        banner = await asyncio.wait_for(_read_banner(serve), 240)
        demo_key = re.search(r"loom_[0-9a-f]+_[0-9a-f]+", banner)
        assert demo_key, banner
        address = f"127.0.0.1:{port}"
        # A second tenant, added to the embedded store the server watches.
        settings = TenancySettings(
            store="file", tenants_file=tmp_path / ".loom/tenants.yaml", secret_file=tmp_path / ".loom/secret"
        )
        store = FileTenantStore(settings.tenants_file, settings.hasher())
        store.create_tenant(Tenant(id="other", quotas=Quotas.unlimited()), actor="fault-tests")
        other_key = store.create_key("other", actor="fault-tests").plaintext.get_secret_value()
        keys = {"demo": demo_key.group(0), "other": other_key}
        by_tenant = {name: LoomClient(address, key) for name, key in keys.items()}
        clients += by_tenant.values()
        await eventually(lambda: _serves(by_tenant["other"]), timeout_s=30)

        streams = [
            Received(name, f"{name} streams through a drain {i}", MAX_TOKENS)
            for name in keys
            for i in range(STREAMS_PER_TENANT)
        ]
        reference.compute((r.prompt, r.max_tokens) for r in streams)
        tasks = [
            asyncio.create_task(grpc_stream(by_tenant[r.tenant_id], r, timeout_s=2 * DRAIN_GRACE_S))
            for r in streams
        ]
        await eventually(lambda: all(r.tokens for r in streams), timeout_s=60, interval_s=0.005)
        serve.send_signal(signal.SIGTERM)

        # New calls are refused while the streams in flight go on.
        refused, served_before = await _refused_while_draining(address, keys["demo"], streams)
        assert refused == grpc.StatusCode.UNAVAILABLE
        http = await _http_status(http_port)
        assert http in (503, None), http  # draining, or no longer listening
        await asyncio.wait_for(asyncio.gather(*tasks), DRAIN_GRACE_S)
        assert [(r.code, r.finish_reason) for r in streams] == [("OK", "FINISH_REASON_LENGTH")] * len(
            streams
        ), [(r.code, r.message) for r in streams]
        assert reference.check(streams) == []
        assert await asyncio.wait_for(serve.wait(), 120) == 0

        # The quota state written at stop: usage is what the clients received, nothing left running.
        state = json.loads((tmp_path / ".loom/usage.json").read_text())
        assert not any(state.get("running", {}).values()), state.get("running")
        for name in keys:
            days = state["usage"].get(name, {}).values()
            mine = [r for r in streams if r.tenant_id == name]
            # one-token calls: the one that found the server knew "other"'s key, and any "demo" made
            # before the signal was handled
            probe = 1 if name == "other" else served_before
            assert sum(d["completion_tokens"] for d in days) == sum(r.tokens for r in mine) + probe
            assert sum(d["requests"] for d in days) == len(mine) + probe
    finally:
        for client in clients:
            await client.close()
        if serve.returncode is None:
            serve.kill()
            await serve.wait()


async def _read_banner(serve: asyncio.subprocess.Process) -> str:
    """stdout up to the banner's last line (the curl example when a demo key is printed)."""
    assert serve.stdout is not None
    banner = ""
    while "-d '{" not in banner:
        line = await serve.stdout.readline()
        if not line:
            raise AssertionError(f"loom serve exited before its banner: {banner!r}")
        banner += line.decode()
    return banner


async def _serves(client: LoomClient) -> bool:
    try:
        async for _ in client.generate_call(
            pb.GenerateRequest(model=TINY, prompt="hi", max_tokens=1), timeout=10
        ):
            pass
        return True
    except grpc.aio.AioRpcError:
        return False


async def _refused_while_draining(
    address: str, key: str, streams: list[Received]
) -> tuple[grpc.StatusCode, int]:
    """The code a new call gets once the drain has begun, checked while the streams are still running,
    and how many one-token calls were served before it began."""
    deadline = asyncio.get_running_loop().time() + 10
    served = 0
    while True:
        assert not all(r.finished for r in streams), "the streams ended before a new call was refused"
        async with LoomClient(address, key) as client:
            try:
                async for _ in client.generate_call(
                    pb.GenerateRequest(model=TINY, prompt="too late", max_tokens=1), timeout=5
                ):
                    pass
                served += 1
            except grpc.aio.AioRpcError as err:
                return err.code(), served
        assert asyncio.get_running_loop().time() < deadline, "new calls were still served 10 s into the drain"
        await asyncio.sleep(0.05)


async def _http_status(http_port: int) -> int | None:
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            return (await http.get(f"http://127.0.0.1:{http_port}/health")).status_code
    except httpx.TransportError:
        return None
