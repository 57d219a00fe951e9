"""What the fault tests (and the fuzz tests) share: Ray for one test folder, engine deployments of the
tiny random model, tenants a gateway knows, streams that record exactly what their client received,
the greedy reference computed in-process, and the checks every fault test ends with.

The checks are the invariants a fault must not break:

* every stream that completes carries exactly the greedy tokens of an uninterrupted run
  (:class:`GreedyReference`, the engine in this process on the same weights);
* no KV block, running or waiting sequence is left in any replica once the traffic is over
  (:func:`pool_idle`);
* no lease is left in the quota store, and the tenant's concurrency slots all come back
  (:func:`leases_of`, :func:`slots_come_back`);
* the usage metered for a tenant equals the tokens its clients received (:func:`usage_of`,
  :func:`billed_of` per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import redis

from gateway.api import pb
from gateway.client import LoomClient
from loom.app import PoolSpec, engine_app
from tenancy import RedisTenantStore, Tenancy, TenancySettings
from tenancy.models import Quotas, Tenant
from tenancy.redis_layout import RedisLayout
from tests.helpers import eventually
from worker.api import (
    EngineConfig,
    GenerationRequest,
    LLMEngine,
    SamplingParams,
    load_tokenizer,
    process_registry,
)

TINY = "tiny"
SECRET = "faults-test-secret-0123456789abcdef"
# Replicas publish their stats to the router every second (worker.serve_engine), and Serve forwards a
# publication only when it changed: a state that lasted this long has been published.
STATS_SETTLE_S = 2.5


# ---- Ray and the engine deployments ---------------------------------------------------------------


class Engines:
    """Engine deployments of one model on the folder's Ray (see :func:`ray_for_folder`)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir

    @contextlib.contextmanager
    def deploy(self, app_name: str, replicas: int = 1, **engine: Any) -> Iterator[Any]:
        """An engine deployment of its own (a Serve application), deleted afterwards."""
        from ray import serve

        spec = PoolSpec(name="shared", replicas=replicas, engine=tiny_engine(self.model_dir, **engine))
        handle = serve.run(engine_app(spec), name=app_name, route_prefix=None)
        try:
            yield handle
        finally:
            serve.delete(app_name)


@contextlib.contextmanager
def ray_for_folder(model_dir: Path) -> Iterator[Engines]:
    """Ray and Serve for the tests of one folder, shut down when the folder is done.

    pytest cannot share a session fixture between sibling folders without running it once per folder,
    and tests/gateway starts its own Ray: so a folder that finds Ray already running (its tests were
    selected after the gateway's) uses it and leaves it up; otherwise it starts Ray and stops it at the
    end, before the next folder starts its own.
    """
    import ray
    from ray import serve
    from ray.serve.config import ProxyLocation

    started = not ray.is_initialized()
    if started:
        # Logical CPUs: replicas reserve them for scheduling; the real cores are shared anyway.
        ray.init(num_cpus=8, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    serve.start(proxy_location=ProxyLocation.Disabled)
    try:
        yield Engines(model_dir)
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()


def tiny_engine(model_dir: Path, **overrides: Any) -> EngineConfig:
    base: dict[str, Any] = dict(
        model_path=str(model_dir), block_size=8, kv_cache_memory_mb=8, max_num_seqs=8, num_threads=1
    )
    return EngineConfig(**{**base, **overrides})


def replica_stats(handle: Any) -> dict[str, Any]:
    """The latest stats each replica of a deployment published (to this process's router)."""
    return process_registry().replicas(f"{handle.app_name}/{handle.deployment_name}")


async def pool_idle(handle: Any, replicas: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait until every one of ``replicas`` replicas reports no KV block in use and nothing running or
    waiting; returns their stats. Called when the traffic is over: the wait first lets every replica
    publish what it holds now, so a snapshot from before the traffic cannot pass for idle."""
    await asyncio.sleep(STATS_SETTLE_S)

    def idle() -> bool:
        stats = replica_stats(handle)
        return len(stats) == replicas and all(
            s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0 for s in stats.values()
        )

    try:
        await eventually(idle, timeout_s=timeout_s, interval_s=0.2)
    except AssertionError:
        raise AssertionError(f"replicas not idle: {_describe(replica_stats(handle))}") from None
    return replica_stats(handle)


def _describe(stats: dict[str, Any]) -> str:
    return ", ".join(
        f"{rid[:8]}: kv={s.kv_blocks_used} running={s.num_running} waiting={s.num_waiting}"
        for rid, s in stats.items()
    )


# ---- tenants and usage ----------------------------------------------------------------------------


def tenancy_settings(redis_url: str, **overrides: Any) -> TenancySettings:
    """A Redis tenant store under a key prefix of its own (the caller deletes it)."""
    base: dict[str, Any] = dict(
        store="redis",
        redis_url=redis_url,
        key_prefix=f"loomfault-{uuid.uuid4().hex[:8]}",
        secret=SECRET,
        resync_interval_s=1.0,
    )
    return TenancySettings(**{**base, **overrides})


def delete_prefix(settings: TenancySettings) -> None:
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5)
    try:
        for key in client.scan_iter(match=f"{settings.key_prefix}*", count=1000):
            client.delete(key)
    finally:
        client.close()


class Tenants:
    """Creates tenants in a Redis store and waits until a gateway's tenancy knows their keys."""

    def __init__(self, settings: TenancySettings, tenancy: Tenancy) -> None:
        self.settings = settings
        self.store = RedisTenantStore.from_settings(settings)
        self.tenancy = tenancy
        self.layout = RedisLayout(settings.key_prefix)

    async def create(self, **fields: Any) -> tuple[Tenant, str]:
        quotas = Quotas.unlimited().model_copy(update=fields.pop("quotas", {}))
        tenant = Tenant(id=f"t-{uuid.uuid4().hex[:10]}", quotas=quotas, **fields)
        self.store.create_tenant(tenant, actor="fault-tests")
        key = self.store.create_key(tenant.id, actor="fault-tests").plaintext.get_secret_value()
        await eventually(lambda: self._knows(key), timeout_s=20)
        return tenant, key

    def _knows(self, key: str) -> bool:
        try:
            self.tenancy.authenticate(key)
            return True
        except Exception:
            return False

    def _redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.settings.redis_url, socket_timeout=5)

    def usage(self, tenant_id: str) -> tuple[int, int]:
        """(requests, completion tokens) metered for the tenant (the last two UTC days, summed)."""
        days = self.store.usage(tenant_id, days=2)
        return sum(d.requests for d in days), sum(d.completion_tokens for d in days)

    def leases(self, tenant_id: str) -> tuple[int, int]:
        """(unexpired leases, lease entries of any age) in the quota store."""
        client = self._redis()
        try:
            entries = int(client.zcard(self.layout.leases(tenant_id)))
        finally:
            client.close()
        return self.store.quota_status(tenant_id)["active_leases"], entries

    def billed(self, tenant_id: str, request_id: str) -> tuple[str | None, int | None]:
        """(state, completion tokens) of one request's record: what it was charged."""
        client = self._redis()
        try:
            state, completion = client.hmget(
                self.layout.request(tenant_id, request_id), "state", "completion"
            )
        finally:
            client.close()
        return (
            state.decode() if state is not None else None,
            int(completion) if completion is not None else None,
        )


# ---- streams ----------------------------------------------------------------------------------------


@dataclass
class Received:
    """What one client received from one stream."""

    tenant_id: str
    prompt: str
    max_tokens: int
    front: str = "grpc"
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:20])
    token_ids: list[int] = field(default_factory=list)  # gRPC: the token ids, in order
    tokens: int = 0  # tokens received (gRPC: ids; HTTP: one log-probability entry per token)
    text: str = ""
    finish_reason: str | None = None  # set when the stream's final delta arrived
    usage_completion: int | None = None
    code: str = "OK"  # gRPC status name, or the HTTP status as a string
    message: str = ""
    cancelled: bool = False  # the client left before the end

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def grpc_request(r: Received, **fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        model=TINY,
        prompt=r.prompt,
        max_tokens=r.max_tokens,
        temperature=0.0,
        request_id=r.request_id,
        **fields,
    )


async def grpc_stream(
    client: LoomClient,
    r: Received,
    *,
    cancel_after: int | None = None,
    first_chunk: asyncio.Event | None = None,
    timeout_s: float = 120.0,
    **fields: Any,
) -> Received:
    """Stream ``r``'s request over gRPC, recording every chunk; ``cancel_after`` tokens, cancel the call.
    A task running this may be cancelled at any point: the call is cancelled with it."""
    call = client.generate_call(grpc_request(r, **fields), timeout=timeout_s)
    try:
        async for chunk in call:
            r.token_ids += chunk.token_ids
            r.tokens += len(chunk.token_ids)
            r.text += chunk.text
            if first_chunk is not None:
                first_chunk.set()
            if chunk.finish_reason:
                r.finish_reason = pb.FinishReason.Name(chunk.finish_reason)
                r.usage_completion = chunk.usage.completion_tokens
            elif cancel_after is not None and r.tokens >= cancel_after:
                r.cancelled = True
                r.code = "CANCELLED"
                call.cancel()
                break
    except grpc.aio.AioRpcError as err:
        r.code, r.message = err.code().name, err.details() or ""
    except asyncio.CancelledError:
        r.cancelled, r.code = True, "CANCELLED"
        call.cancel()
        raise
    return r


async def http_stream(
    http: httpx.AsyncClient, key: str, r: Received, *, cancel_after: int | None = None
) -> Received:
    """Stream ``r``'s request over the OpenAI-compatible front (``/v1/completions``, server-sent
    events, a log-probability per token so that tokens can be counted); ``cancel_after`` tokens, drop
    the connection. A task running this may be cancelled at any point: the connection drops with it."""
    r.front = "http"
    body = {
        "model": TINY,
        "prompt": r.prompt,
        "max_tokens": r.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 0,
        "request_id": r.request_id,
    }
    headers = {"authorization": f"Bearer {key}"}
    try:
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                r.code = str(response.status_code)
                r.message = (await response.aread()).decode(errors="replace")
                return r
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    r.code, r.message = str(event["error"].get("code")), event["error"].get("message", "")
                    continue
                if event.get("usage"):
                    r.usage_completion = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or ():
                    r.text += choice["text"]
                    r.tokens += len((choice.get("logprobs") or {}).get("tokens") or ())
                    if choice.get("finish_reason"):
                        r.finish_reason = choice["finish_reason"]
                if cancel_after is not None and r.tokens >= cancel_after and not r.finished:
                    r.cancelled, r.code = True, "CANCELLED"
                    break  # leaving the block closes the connection mid-stream
    except asyncio.CancelledError:
        r.cancelled, r.code = True, "CANCELLED"
        raise
    except httpx.HTTPError as err:
        r.code, r.message = "transport", str(err)
    return r


# ---- the greedy reference ------------------------------------------------------------------------


class GreedyReference:
    """Greedy outputs of raw prompts from the engine in this process, on the same weights: what an
    uninterrupted stream must deliver. Outputs are computed in batches and kept by (prompt, max_tokens).
    """

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = LLMEngine(
            EngineConfig(
                model_path=str(model_dir), block_size=8, num_blocks=4096, max_num_seqs=64, num_threads=1
            )
        )
        self._outputs: dict[tuple[str, int], tuple[list[int], str]] = {}

    def compute(self, wanted: Iterable[tuple[str, int]]) -> None:
        missing = sorted({w for w in wanted if w not in self._outputs})
        for start in range(0, len(missing), 64):
            batch = {f"ref-{i}": w for i, w in enumerate(missing[start : start + 64])}
            outs = self.engine.run_to_completion(
                [
                    GenerationRequest(rid, self.tokenizer.encode(p), SamplingParams(max_tokens=n))
                    for rid, (p, n) in batch.items()
                ]
            )
            for rid, w in batch.items():
                self._outputs[w] = (list(outs[rid].token_ids), outs[rid].text)

    def ids(self, prompt: str, max_tokens: int) -> list[int]:
        self.compute([(prompt, max_tokens)])
        return self._outputs[(prompt, max_tokens)][0]

    def text(self, prompt: str, max_tokens: int) -> str:
        self.compute([(prompt, max_tokens)])
        return self._outputs[(prompt, max_tokens)][1]

    def check(self, received: Sequence[Received]) -> list[str]:
        """What is wrong with these streams: a completed one must equal the uninterrupted run token for
        token (gRPC) or character for character (HTTP), a cut one must be its beginning."""
        self.compute((r.prompt, r.max_tokens) for r in received)
        problems = []
        for r in received:
            want_ids, want_text = self.ids(r.prompt, r.max_tokens), self.text(r.prompt, r.max_tokens)
            if r.front == "grpc" and r.token_ids != want_ids[: len(r.token_ids)]:
                problems.append(f"{r.request_id}: tokens differ from the greedy run")
            if not want_text.startswith(r.text):
                problems.append(f"{r.request_id}: text is not the greedy run's")
            if r.finished and r.code == "OK":
                if r.tokens != len(want_ids) or (r.front == "grpc" and r.token_ids != want_ids):
                    problems.append(f"{r.request_id}: {r.tokens} tokens, the greedy run has {len(want_ids)}")
                if r.text != want_text:
                    problems.append(f"{r.request_id}: final text differs from the greedy run's")
                if r.usage_completion != r.tokens:
                    problems.append(f"{r.request_id}: usage says {r.usage_completion}, received {r.tokens}")
        return problems


# ---- the invariants ------------------------------------------------------------------------------


async def slots_come_back(client: LoomClient, tenant_id: str, n: int, prompt: str = "slots") -> None:
    """All ``n`` concurrency slots of a tenant are free: ``n`` streams run at once, none refused."""
    streams = [Received(tenant_id, f"{prompt} {i}", 200) for i in range(n)]
    started = [asyncio.Event() for _ in streams]
    tasks = [
        asyncio.create_task(grpc_stream(client, r, first_chunk=e))
        for r, e in zip(streams, started, strict=True)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)  # all admitted at once
    finally:
        await asyncio.gather(*tasks, return_exceptions=True)
    assert [r.code for r in streams] == ["OK"] * n, [(r.code, r.message) for r in streams]


async def wait_usage(
    tenants: Tenants, tenant_id: str, requests: int, timeout_s: float = 30.0
) -> tuple[int, int]:
    """The tenant's metered (requests, completion tokens), once ``requests`` requests are recorded."""
    await eventually(lambda: tenants.usage(tenant_id)[0] >= requests, timeout_s=timeout_s, interval_s=0.1)
    return tenants.usage(tenant_id)
