"""The OpenAI-compatible HTTP front, driven by the official ``openai`` SDK over a real socket.

The same gateway, tenancy and engine replicas as the gRPC tests: what a client gets must not depend on
the front it uses.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from gateway.grpc.stubs import pb
from tests.gateway.conftest import SMOL, TINY, Gateway, engine_idle, eventually
from tests.gateway.test_gateway_e2e import _usage, _usage_matches, collect


async def grpc_greedy(
    gateway: Gateway, key: str, **fields: Any
) -> tuple[str, list[int], pb.GenerateResponse]:
    async with gateway.client(key) as client:
        _, text, ids, last = await collect(
            client.generate_call(pb.GenerateRequest(temperature=0.0, **fields))
        )
    return text, ids, last


# ---- the same answers as gRPC ---------------------------------------------------------------------


async def test_chat_streamed_and_whole_equal_the_grpc_path(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    question = [("user", "What is the capital of France?")]
    want_text, want_ids, want_last = await grpc_greedy(
        gateway,
        key,
        model=SMOL,
        max_tokens=16,
        messages=[pb.ChatMessage(role=r, content=c) for r, c in question],
    )
    client = gateway.openai(key)
    messages = [{"role": r, "content": c} for r, c in question]
    whole = await client.chat.completions.create(model=SMOL, messages=messages, max_tokens=16, temperature=0)
    assert whole.choices[0].message.content == want_text
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens == want_last.usage.prompt_tokens
    assert whole.usage.completion_tokens == len(want_ids)

    stream = await client.chat.completions.create(
        model=SMOL,
        messages=messages,
        max_completion_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want_text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want_ids)
    assert all(c.usage is None for c in chunks[:-1])


async def test_speculation_asked_through_the_sdk_streams_the_same_text(gateway: Gateway) -> None:
    """``extra_body={"speculative": True}``: the same greedy text, streamed; a non-boolean is a 400
    naming the field."""
    _, key = await gateway.tenant()
    prompt = "a b c d e f g h " * 6 + "a b c"  # the model goes on with the pattern: proposals hold
    client = gateway.openai(key)
    plain = await client.completions.create(model=SMOL, prompt=prompt, max_tokens=16, temperature=0)
    stream = await client.completions.create(
        model=SMOL, prompt=prompt, max_tokens=16, temperature=0, stream=True, extra_body={"speculative": True}
    )
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(
            model=SMOL, prompt=prompt, max_tokens=4, extra_body={"speculative": "x"}
        )
    assert "speculative" in str(bad.value)


async def test_completions_streamed_and_whole_equal_the_grpc_path(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    want_text, want_ids, _ = await grpc_greedy(gateway, key, model=TINY, prompt="the loom", max_tokens=12)
    client = gateway.openai(key)
    whole = await client.completions.create(model=TINY, prompt="the loom", max_tokens=12, temperature=0)
    assert whole.choices[0].text == want_text and whole.usage.completion_tokens == len(want_ids)
    stream = await client.completions.create(
        model=TINY, prompt="the loom", max_tokens=12, temperature=0, stream=True
    )
    assert "".join([c.choices[0].text async for c in stream]) == want_text


async def test_n_choices_with_a_seed_differ_and_reproduce(gateway: Gateway) -> None:
    tenant, key = await gateway.tenant()
    client = gateway.openai(key)
    reported = 0

    async def two() -> list[str]:
        nonlocal reported
        r = await client.completions.create(
            model=TINY, prompt="weave a story", max_tokens=20, n=2, seed=11, temperature=1.0, logprobs=0
        )
        assert [c.index for c in r.choices] == [0, 1]
        assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
        reported += r.usage.completion_tokens
        return [c.text for c in r.choices]

    first, again = await two(), await two()
    assert first[0] != first[1]  # two different completions
    assert first == again  # and the same ones for the same seed
    await eventually(lambda: _usage_matches(gateway, tenant.id, 2))
    _, _, completion = await _usage(gateway, tenant.id)
    assert completion == reported  # metered is what the responses reported


async def test_logprobs_over_http_and_grpc_agree(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    async with gateway.client(key) as c:
        chunks, _, ids, _ = await collect(
            c.generate_call(
                pb.GenerateRequest(model=TINY, prompt="hi", max_tokens=6, temperature=0.0, logprobs=2)
            )
        )
    grpc_lps = [lp for ch in chunks for lp in ch.logprobs]
    assert [lp.token_id for lp in grpc_lps] == ids and all(len(lp.top) == 2 for lp in grpc_lps)
    client = gateway.openai(key)
    r = await client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(e.top_logprobs[0].token == e.token and e.logprob <= 0 for e in content)  # greedy: the best
    rc = await client.completions.create(model=TINY, prompt="hi", max_tokens=6, temperature=0, logprobs=2)
    assert rc.choices[0].logprobs.token_logprobs == pytest.approx([lp.logprob for lp in grpc_lps], abs=1e-5)


# ---- refusals, as the SDK's exception classes --------------------------------------------------------


async def test_each_refusal_maps_to_the_sdks_exception(gateway: Gateway) -> None:
    _, key = await gateway.tenant(models=(TINY,))
    suspended, s_key = await gateway.tenant()
    gateway.store.update_tenant(suspended.id, {"status": "suspended"}, actor="tests")
    await eventually(lambda: not gateway.tenancy.authenticate(s_key).tenant.is_active)
    ok = gateway.openai(key)
    chat = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2)

    with pytest.raises(openai.AuthenticationError):
        await gateway.openai("loom_nope_nope").chat.completions.create(model=TINY, **chat)
    with pytest.raises(openai.PermissionDeniedError):
        await gateway.openai(s_key).chat.completions.create(model=TINY, **chat)
    with pytest.raises(openai.PermissionDeniedError):
        await ok.chat.completions.create(model=SMOL, **chat)  # not among the tenant's models
    all_models_key = (await gateway.tenant())[1]
    with pytest.raises(openai.NotFoundError) as missing:
        await gateway.openai(all_models_key).chat.completions.create(model="no-such-model", **chat)
    assert missing.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        await ok.chat.completions.create(model=TINY, temperature=3.5, **chat)
    assert bad.value.body["param"] == "temperature" and bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as functions:
        await ok.chat.completions.create(model=TINY, functions=[{"name": "f", "parameters": {}}], **chat)
    assert functions.value.body["param"] == "functions"  # the deprecated form: refused, pointing to tools
    with pytest.raises(openai.BadRequestError) as choice:
        await ok.chat.completions.create(
            model=TINY,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
            **chat,
        )
    assert choice.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as image:
        await ok.chat.completions.create(
            model=TINY,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
            ],
        )
    assert image.value.body["param"] == "messages[0].content[0]"


async def test_exhausted_quota_is_429_with_retry_after(gateway: Gateway) -> None:
    _, key = await gateway.tenant(quotas={"requests_per_minute": 1})
    client = gateway.openai(key)
    await client.completions.create(model=TINY, prompt="a", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        await client.completions.create(model=TINY, prompt="a", max_tokens=1)
    headers = info.value.response.headers
    assert 1 <= int(headers["retry-after"]) <= 60
    assert info.value.body["code"] == "requests_per_minute"


async def test_bad_json_and_unknown_fields(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    url = f"http://{gateway.server.http_address}/v1/completions"
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient() as http:
        garbage = await http.post(url, content=b"{not json", headers=headers)
        unauthenticated = await http.post(url, content=b"{not json")
        unknown = await http.post(
            url, json={"model": TINY, "prompt": "a", "max_tokens": 1, "some_future_field": 1}, headers=headers
        )
    assert garbage.status_code == 400 and garbage.json()["error"]["param"] == "body"
    assert unauthenticated.status_code == 401  # the key is checked before the body is read
    assert unknown.status_code == 200  # unknown fields are ignored


async def test_bodies_built_to_fail_everywhere_get_one_short_answer(gateway: Gateway) -> None:
    """Lists of a hundred thousand bad items (a prompt of empty objects, stop strings, messages,
    content parts) are refused by their length or shape: one short 400 each, the refusal counted
    under the tenant, the gateway's loop never stalled for the time a per-item error list would take."""
    tenant, key = await gateway.tenant()
    url = f"http://{gateway.server.http_address}/v1"
    headers = {"authorization": f"Bearer {key}"}
    many = 100_000
    chat = {"model": TINY, "max_tokens": 1}
    bodies = {
        "prompt": ("completions", {"model": TINY, "prompt": [{}] * many}),
        "stop": ("completions", {"model": TINY, "prompt": "a", "stop": [{}] * many}),
        "messages": ("chat/completions", {**chat, "messages": [{"role": 1}] * many}),
        "messages[0].content": (
            "chat/completions",
            {**chat, "messages": [{"role": "user", "content": [7] * many}]},
        ),
    }
    before = gateway.refusals(tenant.id, "invalid_argument")
    async with httpx.AsyncClient(timeout=30) as http:
        for param, (route, body) in bodies.items():
            reply = await http.post(f"{url}/{route}", json=body, headers=headers)
            assert reply.status_code == 400, (param, reply.text[:200])
            assert len(reply.content) < 4096, param
            assert reply.json()["error"]["param"] == param
    assert gateway.refusals(tenant.id, "invalid_argument") == before + len(bodies)


# ---- the connection ----------------------------------------------------------------------------------


async def test_client_that_disconnects_frees_kv_and_lease(gateway: Gateway) -> None:
    tenant, key = await gateway.tenant(quotas={"max_concurrent": 1})
    handle = gateway.handles["tiny"]
    generated_before = (await handle.stats.remote()).generated_tokens
    url = f"http://{gateway.server.http_address}/v1/completions"
    body = {
        "model": TINY,
        "prompt": "a long one",
        "max_tokens": 900,
        "temperature": 0,
        "stream": True,
        "logprobs": 0,
    }
    events = received = 0
    headers = {"authorization": f"Bearer {key}"}
    async with (
        httpx.AsyncClient(timeout=30) as http,
        http.stream("POST", url, json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events += 1
                received += len((json.loads(line[6:])["choices"][0]["logprobs"] or {}).get("tokens", []))
                if events >= 5:
                    break  # leaving the block closes the connection mid-stream
    await eventually(lambda: engine_idle(handle))
    client = gateway.openai(key)
    done = await client.completions.create(model=TINY, prompt="a", max_tokens=1)  # the slot is free again
    assert done.choices[0].finish_reason == "length"
    await eventually(lambda: _usage_matches(gateway, tenant.id, 2))
    _, _, completion = await _usage(gateway, tenant.id)
    generated = (await handle.stats.remote()).generated_tokens - generated_before - 1
    # The disconnected stream paid for what was sent: at least what the client read, at most what the
    # engine produced before the abort (events already in the socket when the client closed count as
    # sent), and nowhere near the 900 tokens reserved.
    assert 5 <= received <= completion - 1 <= generated < 900


async def test_a_stream_whose_client_leaves_while_queued_is_aborted_at_once(gateway: Gateway) -> None:
    """Before its first token a streamed request writes nothing, so only the connection says that its
    client left: the request leaves the engine's queue then, not when a slot frees and its first
    token finds the socket closed (a benchmark's abandoned backlog was served for 15 s after its
    clients left, at its tenant's share)."""
    _, holder_key = await gateway.tenant()
    victim, victim_key = await gateway.tenant()
    handle = gateway.handles["tiny"]
    slots = (await handle.stats.remote()).max_num_seqs
    url = f"http://{gateway.server.http_address}/v1/completions"
    body = {"model": TINY, "prompt": "hold", "max_tokens": 600, "temperature": 0, "stream": True}
    holders_done: list[bool] = []

    async def hold(http: httpx.AsyncClient) -> None:
        headers = {"authorization": f"Bearer {holder_key}"}
        async with http.stream("POST", url, json=body, headers=headers) as r:
            async for _ in r.aiter_lines():
                pass
        holders_done.append(True)

    async def queued(http: httpx.AsyncClient) -> None:
        headers = {"authorization": f"Bearer {victim_key}"}
        async with http.stream("POST", url, json={**body, "prompt": "wait"}, headers=headers) as r:
            await r.aread()

    async with httpx.AsyncClient(timeout=60) as http, httpx.AsyncClient(timeout=60) as other:
        holders = [asyncio.create_task(hold(http)) for _ in range(slots)]
        await eventually(lambda: _counts(handle, running=slots))
        waiting = asyncio.create_task(queued(other))
        await eventually(lambda: _counts(handle, running=slots, waiting=1))
        waiting.cancel()  # the client closes its connection with no response yet
        await asyncio.gather(waiting, return_exceptions=True)
        await eventually(lambda: _counts(handle, running=slots, waiting=0))
        assert not holders_done, "the queued request left only when a slot freed"
        await asyncio.gather(*holders)
    await eventually(lambda: engine_idle(handle))
    assert (await _usage(gateway, victim.id))[2] == 0  # it never got a token


async def _counts(handle: Any, *, running: int, waiting: int | None = None) -> bool:
    s = await handle.stats.remote()
    return s.num_running == running and (waiting is None or s.num_waiting == waiting)


async def test_models_health_and_openapi(gateway: Gateway) -> None:
    _, key = await gateway.tenant(models=(TINY,))
    models = await gateway.openai(key).models.list()
    assert [m.id for m in models.data] == [TINY]
    base = f"http://{gateway.server.http_address}"
    async with httpx.AsyncClient() as http:
        health = await http.get(f"{base}/health")
        spec = (await http.get(f"{base}/openapi.json")).json()
    assert health.status_code == 200
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(spec["paths"])
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("ChatCompletionRequest")
    assert "ChatCompletionRequest" in spec["components"]["schemas"]
    json.dumps(spec)


async def test_concurrent_http_and_grpc_streams(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    client = gateway.openai(key)
    want, _, _ = await grpc_greedy(gateway, key, model=TINY, prompt="together", max_tokens=20)

    async def http_text() -> str:
        r = await client.completions.create(model=TINY, prompt="together", max_tokens=20, temperature=0)
        return r.choices[0].text

    texts = await asyncio.gather(*(http_text() for _ in range(4)))
    assert texts == [want] * 4


async def test_n_choices_share_the_prompts_kv_blocks(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    handle = gateway.handles["tiny"]
    prompt = "A prompt long enough to fill several KV blocks of eight tokens each. " * 2
    before = (await handle.stats.remote()).prefix_cache_hits
    r = await gateway.openai(key).completions.create(
        model=TINY, prompt=prompt, max_tokens=4, n=3, temperature=1.0
    )
    hits = (await handle.stats.remote()).prefix_cache_hits - before
    full_blocks = (r.usage.prompt_tokens - 1) // 8 * 8
    assert full_blocks >= 64
    assert hits >= 2 * full_blocks  # the second and third choice found the first one's prompt blocks
