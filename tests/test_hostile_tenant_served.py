"""A hostile tenant against a real `loom serve` (its own Redis, a Ray Serve replica of the tiny
model), over real sockets: each protection of ADR 0008 seen from outside, as a client would.

One server for the module; each test is one kind of hostility, and the victim's greedy stream is
checked token for token where a co-batched request could have hurt it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from loadtest.soak import _engine_env, create_tenants
from loadtest.soak_server import SECRET, ServedLoom
from tenancy import RedisTenantStore, TenancySettings
from tenancy.models import Quotas, Tenant

PATIENCE_S = 1.0


@dataclass
class Served:
    server: ServedLoom
    keys: dict[str, str]

    def url(self, path: str) -> str:
        return f"http://{self.server.http_address}{path}"

    def auth(self, who: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[who]}"}


@pytest.fixture(scope="module")
async def served() -> AsyncIterator[Served]:
    patience = {
        "LOOM_GATEWAY_HTTP_HEADER_TIMEOUT_S": str(PATIENCE_S),
        "LOOM_GATEWAY_HTTP_BODY_TIMEOUT_S": str(PATIENCE_S),
    }
    server = ServedLoom.create(1, _engine_env() | patience)
    await server.start()
    try:
        keys, _ = create_tenants(server.redis_url)
        store = RedisTenantStore.from_settings(
            TenancySettings(store="redis", redis_url=server.redis_url, secret=SECRET)
        )
        store.create_tenant(Tenant(id="frozen", quotas=Quotas.unlimited(), status="suspended"), actor="t")
        keys["frozen"] = store.create_key("frozen", actor="t").plaintext.get_secret_value()
        store.close()
        s = Served(server, keys)
        async with httpx.AsyncClient(timeout=60) as http:  # the gateway has learned the keys
            for _ in range(120):
                r = await http.get(s.url("/v1/models"), headers=s.auth("soak-chat"))
                if r.status_code == 200:
                    break
                await asyncio.sleep(0.5)
        yield s
    finally:
        await server.stop()
        server.remove()


async def _greedy(http: httpx.AsyncClient, s: Served, who: str, **extra: object) -> dict[str, object]:
    body = {"model": "tiny", "prompt": "the loom weaves", "max_tokens": 24, "temperature": 0, **extra}
    r = await http.post(s.url("/v1/completions"), json=body, headers=s.auth(who))
    assert r.status_code == 200, r.text
    return r.json()


async def test_a_poisoned_sampling_value_leaves_a_co_batched_victim_untouched(served: Served) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        alone = await _greedy(http, served, "soak-chat")
        poisoned = {"model": "tiny", "prompt": "x", "max_tokens": 24, "temperature": 1, "top_p": 1e-46}
        victim, *hostile = await asyncio.gather(
            _greedy(http, served, "soak-chat"),
            *(
                http.post(served.url("/v1/completions"), json=poisoned, headers=served.auth("soak-standard"))
                for _ in range(4)
            ),
        )
    assert victim["choices"][0]["text"] == alone["choices"][0]["text"]  # type: ignore[index]
    assert all(r.status_code == 200 for r in hostile)  # a tiny top_p samples greedily: no failure


async def test_a_body_built_to_fail_everywhere_gets_one_short_answer(served: Served) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        for body in (
            {"model": "tiny", "prompt": [{}] * 100_000},
            {"model": "tiny", "prompt": "hi", "stop": ["x"] * 100_000},
            {"model": "tiny", "messages": [{"role": 1}] * 100_000},
        ):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = await http.post(served.url(path), json=body, headers=served.auth("soak-standard"))
            assert r.status_code == 400 and len(r.content) < 4096


async def test_a_half_sent_request_is_cut_off(served: Served) -> None:
    host, port = served.server.http_address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({"model": "tiny", "prompt": "hi"}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body) + 50}\r\n"
    writer.write(
        head.encode() + f"authorization: Bearer {served.keys['soak-standard']}\r\n\r\n".encode() + body
    )
    async with asyncio.timeout(PATIENCE_S + 10):
        answer = await reader.read(-1)  # answered, then closed
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408")


async def test_a_flood_of_large_prompts_is_refused_at_the_tenants_bound(served: Served) -> None:
    """The tight-quota tenant (2 concurrent) sends 12 at once: the rest are refused at once, 429 with
    a retry delay, and nothing fails."""
    prompt = "weave " * 40_000  # 240 KB: tokenized in the huge lane, then too long for the context
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    async with httpx.AsyncClient(timeout=120) as http:
        answers = await asyncio.gather(
            *(
                http.post(served.url("/v1/completions"), json=body, headers=served.auth("soak-limited"))
                for _ in range(12)
            )
        )
    codes = sorted(r.status_code for r in answers)
    assert set(codes) <= {400, 429} and 429 in codes, codes
    assert all("retry-after" in r.headers for r in answers if r.status_code == 429)


async def test_a_suspended_tenant_cannot_list_models(served: Served) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.get(served.url("/v1/models"), headers=served.auth("frozen"))
    assert r.status_code == 403
