"""End to end over a real socket: gRPC client -> gateway -> Ray Serve engine replicas, tenants in Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from prometheus_client import REGISTRY

from common import Priority
from gateway.grpc.status import RETRY_AFTER_METADATA
from gateway.grpc.stubs import pb
from protocol.engine_config import EngineConfig
from protocol.requests import GenerationRequest, SamplingParams
from tests.gateway.conftest import SMOL, TINY, Gateway, engine_idle, eventually
from worker.api import LLMEngine, load_checkpoint


async def collect(call: Any) -> tuple[list[pb.GenerateResponse], str, list[int], pb.GenerateResponse]:
    chunks = [c async for c in call]
    text = "".join(c.text for c in chunks)
    ids = [t for c in chunks for t in c.token_ids]
    return chunks, text, ids, chunks[-1]


def rich_status(err: grpc.aio.AioRpcError) -> status_pb2.Status:
    for key, value in err.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            return status_pb2.Status.FromString(value)
    raise AssertionError("no rich status in the trailers")


def req(model: str = TINY, prompt: str = "hello loom", **kw: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=model, prompt=prompt, **kw)


async def expect_error(
    gateway: Gateway, key: str | None, request: pb.GenerateRequest
) -> grpc.aio.AioRpcError:
    async with gateway.client(key) as client:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(client.generate_call(request))
    return info.value


# ---- the happy path ----------------------------------------------------------------------------


async def test_greedy_stream_equals_offline_engine(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    question = "Name three primary colors."
    async with gateway.client(key) as client:
        request = pb.GenerateRequest(model=SMOL, max_tokens=20, temperature=0.0)
        request.messages.add(role="user", content=question)
        chunks, text, ids, last = await collect(client.generate_call(request))
    ckpt = load_checkpoint()
    offline = LLMEngine(EngineConfig(num_blocks=64), ckpt)
    prompt = ckpt.tokenizer.encode_chat([{"role": "user", "content": question}])
    want = offline.run_to_completion([GenerationRequest("o", prompt, SamplingParams(max_tokens=20))])["o"]
    assert ids == want.token_ids
    assert text == want.text
    assert len(chunks) > 3  # streamed, not one blob
    assert last.usage.prompt_tokens == len(prompt)
    assert last.usage.completion_tokens == len(ids)
    assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)


async def test_two_tenants_stream_concurrently(gateway: Gateway) -> None:
    (_, key_a), (_, key_b) = await gateway.tenant(), await gateway.tenant()
    async with gateway.client(key_a) as a, gateway.client(key_b) as b:
        solo = await collect(a.generate_call(req(prompt="alpha", max_tokens=30, temperature=0.0)))
        both = await asyncio.gather(
            collect(a.generate_call(req(prompt="alpha", max_tokens=30, temperature=0.0))),
            collect(b.generate_call(req(prompt="beta", max_tokens=25, temperature=0.0))),
        )
    assert both[0][2] == solo[2]
    assert both[0][3].usage.completion_tokens == 30 or both[0][3].finish_reason == pb.FINISH_REASON_STOP
    assert both[1][3].usage.completion_tokens == len(both[1][2])


async def test_request_id_is_echoed_and_models_listed(gateway: Gateway) -> None:
    _, key = await gateway.tenant(models=("tiny",))
    async with gateway.client(key) as client:
        chunks, *_ = await collect(client.generate_call(req(request_id="my-req.1", max_tokens=3)))
        models = await client.list_models()
    assert {c.request_id for c in chunks} == {"my-req.1"}
    assert [m.id for m in models] == [TINY]
    assert models[0].context_length > 0 and models[0].pool == "shared"


# ---- refusals ------------------------------------------------------------------------------------


async def test_missing_wrong_and_revoked_keys_are_unauthenticated(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    missing = await expect_error(gateway, None, req())
    wrong = await expect_error(gateway, key[:-4] + "0000", req())
    record = gateway.tenancy.authenticate(key)
    gateway.store.revoke_key(record.key_id, actor="tests")
    await eventually(lambda: not gateway._knows(key))
    revoked = await expect_error(gateway, key, req())
    assert {e.code() for e in (missing, wrong, revoked)} == {grpc.StatusCode.UNAUTHENTICATED}
    assert wrong.details() == revoked.details()  # no oracle on why a key failed


async def test_suspended_tenant_and_disallowed_model_are_permission_denied(gateway: Gateway) -> None:
    tenant, key = await gateway.tenant(models=("tiny",))
    disallowed = await expect_error(gateway, key, req(model=SMOL))
    assert disallowed.code() == grpc.StatusCode.PERMISSION_DENIED and SMOL in disallowed.details()
    gateway.store.update_tenant(tenant.id, {"status": "suspended"}, actor="tests")
    await eventually(lambda: not gateway.tenancy.authenticate(key).tenant.is_active)
    suspended = await expect_error(gateway, key, req())
    assert suspended.code() == grpc.StatusCode.PERMISSION_DENIED and "suspended" in suspended.details()


async def test_unknown_model_is_not_found(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    err = await expect_error(gateway, key, req(model="no-such-model"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "tiny" in err.details()


@pytest.mark.parametrize(
    ("field", "request_fields"),
    [
        ("model", dict(model="")),
        ("prompt", dict(prompt="")),
        ("max_tokens", dict(max_tokens=0)),
        ("temperature", dict(temperature=3.5)),
        ("top_p", dict(top_p=0.0)),
        ("top_k", dict(top_k=5_000_000)),
        ("seed", dict(seed=2**63 + 1)),
        ("stop[0]", dict(stop=[""])),
        ("priority", dict(priority=42)),
        ("request_id", dict(request_id="has spaces")),
        ("messages[0].role", dict(prompt="", messages=[pb.ChatMessage(role="robot", content="x")])),
    ],
)
async def test_each_invalid_field_is_named(
    gateway: Gateway, field: str, request_fields: dict[str, Any]
) -> None:
    _, key = await gateway.tenant()
    fields = {"model": TINY, "prompt": "hi", **request_fields}
    err = await expect_error(gateway, key, pb.GenerateRequest(**fields))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(field)
    bad = error_details_pb2.BadRequest()
    assert rich_status(err).details[0].Unpack(bad)
    assert [v.field for v in bad.field_violations] == [field]


async def test_prompt_too_long_for_the_context_is_invalid(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    err = await expect_error(gateway, key, req(prompt="x" * 5000))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in err.details()


async def test_exhausted_quota_returns_retry_delay(gateway: Gateway) -> None:
    _, key = await gateway.tenant(quotas={"requests_per_minute": 2})
    async with gateway.client(key) as client:
        for _ in range(2):
            await collect(client.generate_call(req(max_tokens=2)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(client.generate_call(req(max_tokens=2)))
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests_per_minute" in err.details()
    trailers = dict(err.trailing_metadata())
    assert 0 < int(trailers[RETRY_AFTER_METADATA]) <= 60_000
    retry = error_details_pb2.RetryInfo()
    assert any(d.Unpack(retry) for d in rich_status(err).details)
    assert 0 < retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9 <= 60


async def test_slo_admission_refuses_a_predicted_miss_with_its_reason_and_counts_goodput(
    gateway: Gateway,
) -> None:
    # A target no replica can meet (1 us to the first token) against one any can (an hour).
    strict, strict_key = await gateway.tenant(slo={"standard": {"ttft_ms": 0.001}})
    easy, easy_key = await gateway.tenant(slo={"standard": {"ttft_ms": 3_600_000}})
    async with gateway.client(easy_key) as client:
        await collect(client.generate_call(req(max_tokens=2)))  # the replicas publish a rate

    async def refused() -> grpc.aio.AioRpcError | None:
        async with gateway.client(strict_key) as client:
            try:
                await collect(client.generate_call(req(max_tokens=2)))
            except grpc.aio.AioRpcError as err:
                return err
        return None  # no replica could tell yet: admitted

    err = None

    async def got_refused() -> bool:
        nonlocal err
        err = await refused()
        return err is not None

    await eventually(got_refused, timeout_s=20)
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "predicted time to first token" in err.details() and "standard target of 0.00 s" in err.details()

    def goodput(tenant_id: str, outcome: str) -> float:
        labels = {"tenant": tenant_id, "priority": "standard", "outcome": outcome}
        return REGISTRY.get_sample_value("loom:slo_requests_total", labels) or 0.0

    assert goodput(easy.id, "met") == 1
    assert goodput(strict.id, "refused") >= 1


# ---- cancellation, deadlines, accounting ---------------------------------------------------------


async def _usage(gateway: Gateway, tenant_id: str) -> tuple[int, int, int]:
    days = gateway.store.usage(tenant_id, days=1)
    if not days:
        return (0, 0, 0)
    return days[0].requests, days[0].prompt_tokens, days[0].completion_tokens


async def test_cancelled_stream_frees_kv_and_lease_and_counts_delivered_tokens(gateway: Gateway) -> None:
    tenant, key = await gateway.tenant(quotas={"max_concurrent": 1})
    handle = gateway.handles["tiny"]
    generated_before = (await handle.stats.remote()).generated_tokens
    delivered = 0
    async with gateway.client(key) as client:
        call = client.generate_call(req(max_tokens=900, temperature=0.0, stop=[]))
        async for chunk in call:
            delivered += len(chunk.token_ids)
            if delivered >= 5:
                break
        call.cancel()
        await eventually(lambda: engine_idle(handle))
        # The lease came back: the only slot admits again.
        _, _, ids, _ = await collect(client.generate_call(req(max_tokens=2)))
    assert ids
    await eventually(lambda: _usage_matches(gateway, tenant.id, 2))
    requests, _, completion = await _usage(gateway, tenant.id)
    assert requests == 2
    generated = (await handle.stats.remote()).generated_tokens - generated_before - len(ids)
    # Charged: at least what the client read, at most what the engine produced before the cancel
    # reached it (messages already in the HTTP/2 window count as sent), far from the 900 reserved.
    assert 5 <= delivered <= completion - len(ids) <= generated < 900


async def _usage_matches(gateway: Gateway, tenant_id: str, requests: int) -> bool:
    return (await _usage(gateway, tenant_id))[0] == requests


async def test_deadline_frees_kv_and_lease(gateway: Gateway) -> None:
    _, key = await gateway.tenant(quotas={"max_concurrent": 1})
    async with gateway.client(key) as client:
        # Far shorter than 900 tokens take on the tiny model (it got fast enough to finish in 0.5 s).
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(client.generate_call(req(max_tokens=900), timeout=0.1))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: engine_idle(gateway.handles["tiny"]))
        await collect(client.generate_call(req(max_tokens=2)))  # the slot is free again


async def test_usage_recorded_equals_tokens_delivered(gateway: Gateway) -> None:
    tenant, key = await gateway.tenant()
    total_prompt = total_completion = 0
    async with gateway.client(key) as client:
        for i in range(3):
            _, _, ids, last = await collect(client.generate_call(req(prompt=f"count {i}", max_tokens=5 + i)))
            assert last.usage.completion_tokens == len(ids)
            total_prompt += last.usage.prompt_tokens
            total_completion += len(ids)
    await eventually(lambda: _usage_matches(gateway, tenant.id, 3))
    assert await _usage(gateway, tenant.id) == (3, total_prompt, total_completion)


# ---- scheduling and isolation --------------------------------------------------------------------


async def test_interactive_request_starts_before_a_batch_backlog_drains(gateway: Gateway) -> None:
    _, bulk_key = await gateway.tenant(default_priority="batch", priority_ceiling="batch")
    _, chat_key = await gateway.tenant(priority_ceiling="interactive")
    async with gateway.client(bulk_key) as b, gateway.client(chat_key) as c:
        backlog = [
            asyncio.create_task(collect(b.generate_call(req(prompt=f"bulk {i}", max_tokens=900, stop=[]))))
            for i in range(12)
        ]
        await eventually(lambda: _running(gateway, "batch", 4))
        _, _, ids, _ = await collect(
            c.generate_call(req(prompt="urgent", max_tokens=3, priority=pb.PRIORITY_INTERACTIVE))
        )
        unfinished = sum(not t.done() for t in backlog)
        for t in backlog:  # 900 tokens each, so no wave ends first on a slow machine; drop the rest
            t.cancel()
        await asyncio.gather(*backlog, return_exceptions=True)
    await eventually(lambda: engine_idle(gateway.handles["tiny"]))
    assert ids
    assert unfinished >= 8  # the interactive request did not wait for the backlog (FIFO would leave 4)


async def _running(gateway: Gateway, prio: str, n: int) -> bool:
    s = await gateway.handles["tiny"].stats.remote()
    return s.running.get(Priority(prio), 0) >= n


async def test_prefix_cache_hits_within_a_tenant_never_across(gateway: Gateway) -> None:
    (_, key_a), (_, key_b) = await gateway.tenant(), await gateway.tenant()
    long_prompt = "The loom weaves threads of many colors into one cloth. " * 4
    async with gateway.client(key_a) as a, gateway.client(key_b) as b:
        first = (await collect(a.generate_call(req(prompt=long_prompt, max_tokens=2))))[3]
        again = (await collect(a.generate_call(req(prompt=long_prompt, max_tokens=2))))[3]
        other = (await collect(b.generate_call(req(prompt=long_prompt, max_tokens=2))))[3]
    assert first.usage.cached_prompt_tokens == 0
    assert again.usage.cached_prompt_tokens >= first.usage.prompt_tokens - 8
    assert other.usage.cached_prompt_tokens == 0


async def test_dedicated_tenant_uses_its_own_pool(gateway: Gateway) -> None:
    _, key = await gateway.tenant(pool="dedicated", dedicated_pool="vip")
    _, lost_key = await gateway.tenant(pool="dedicated", dedicated_pool="nowhere")
    before = (await gateway.handles["vip"].stats.remote()).finished_requests
    async with gateway.client(key) as client:
        await collect(client.generate_call(req(max_tokens=3)))
        models = await client.list_models()
    after = (await gateway.handles["vip"].stats.remote()).finished_requests
    assert after == before + 1
    assert [(m.id, m.pool) for m in models] == [(TINY, "vip")]
    err = await expect_error(gateway, lost_key, req())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "nowhere" in err.details()
