"""The transport-neutral request path without gRPC, Ray or Redis: validation, the steps in order,
metrics, settlement, and how a stream that ends early is recorded. Engines are stand-ins (the fake
pool pattern of test_resume.py); tenants live in the embedded file store."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from common import Priority
from gateway.catalog import ModelCatalog, ModelRoute
from gateway.engine_pool import WorkerLostError
from gateway.errors import MAX_VIOLATIONS, ErrorKind, GatewayError, invalid_argument
from gateway.request_path import HUGE_TOKENIZE_BYTES, INLINE_TOKENIZE_BYTES, RequestPath
from gateway.schema import ChatMessage, Delta, InferenceRequest, ServedModel
from gateway.settings import GatewaySettings
from gateway.validation import validate
from protocol.limits import LIMITS
from protocol.model_info import ModelInfo
from protocol.requests import FinishReason, GenerationRequest, RequestOutput
from tenancy import FileTenantStore, Quotas, Tenancy, TenancySettings, Tenant

MODEL = "fake"
CONTEXT = 64


# ---- validation: every bad field at once, the prompt limit in bytes ------------------------------------


def _fields(request: InferenceRequest, decode: list[tuple[str, str]] | None = None) -> list[str]:
    with pytest.raises(GatewayError) as info:
        validate(request, decode or [])
    assert info.value.kind is ErrorKind.INVALID_ARGUMENT
    return [f for f, _ in info.value.violations]


def test_every_bad_field_is_named_at_once() -> None:
    request = InferenceRequest(
        model="",
        prompt="hi",
        max_tokens=0,
        temperature=3.0,
        top_p=0.0,
        top_k=-1,
        seed=-1,
        stop=("", "x"),
        request_id="has spaces",
    )
    assert _fields(request, [("priority", "unknown priority 42")]) == [
        "priority",  # what the front found decoding comes first
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop[0]",
        "request_id",
    ]


def test_a_list_over_its_limit_is_refused_by_length_without_walking_its_items() -> None:
    """A million bad stop strings or messages make one violation, not a million."""
    many = 100_000
    stop = InferenceRequest(model=MODEL, prompt="hi", stop=("",) * many)
    with pytest.raises(GatewayError) as info:
        validate(stop)
    assert [f for f, _ in info.value.violations] == ["stop"]
    assert f"got {many}" in info.value.message
    messages = InferenceRequest(model=MODEL, messages=(ChatMessage("nobody", "\ud800"),) * many)
    with pytest.raises(GatewayError) as info:
        validate(messages)
    assert [f for f, _ in info.value.violations] == ["messages"]


def test_a_refusal_names_a_bounded_number_of_fields_in_bounded_words() -> None:
    bad = [(f"field{i}" + "x" * 1000, "d" * 10_000) for i in range(1000)]
    err = invalid_argument(bad)
    assert len(err.violations) == MAX_VIOLATIONS
    assert err.message.endswith(f"and {1000 - MAX_VIOLATIONS} more")
    assert len(err.message) < MAX_VIOLATIONS * 500
    assert err.violations[0][0].startswith("field0")


def test_the_prompt_limit_counts_utf8_bytes_not_characters() -> None:
    limit = LIMITS.max_prompt_bytes
    at_limit = "é" * (limit // 2)  # two bytes each: exactly the limit
    assert validate(InferenceRequest(model=MODEL, prompt=at_limit)).prompt_bytes == limit
    over = at_limit + "é"  # far fewer characters than the limit, one character over in bytes
    assert len(over) < limit
    with pytest.raises(GatewayError) as info:
        validate(InferenceRequest(model=MODEL, prompt=over))
    assert info.value.violations == (("prompt", f"is {limit + 2} bytes of UTF-8; the limit is {limit}"),)
    assert _fields(InferenceRequest(model=MODEL, prompt="a" * (limit + 1))) == ["prompt"]


def test_message_contents_count_together_and_roles_are_checked() -> None:
    half = "€" * (LIMITS.max_prompt_bytes // 6 + 1)  # three bytes each: two of them exceed the limit
    messages = (ChatMessage("user", half), ChatMessage("robot", half))
    assert _fields(InferenceRequest(model=MODEL, messages=messages)) == ["messages[1].role", "messages"]
    too_many = tuple(ChatMessage("user", "x") for _ in range(LIMITS.max_messages + 1))
    assert _fields(InferenceRequest(model=MODEL, messages=too_many)) == ["messages"]


def test_prompt_and_messages_are_exclusive_and_text_must_be_unicode() -> None:
    both = InferenceRequest(model=MODEL, prompt="a", messages=(ChatMessage("user", "b"),))
    assert _fields(both) == ["prompt"]
    assert _fields(InferenceRequest(model=MODEL)) == ["prompt"]
    assert _fields(InferenceRequest(model=MODEL, prompt="lone \ud800 surrogate")) == ["prompt"]
    chat = (ChatMessage("user", "\udfff"),)
    assert _fields(InferenceRequest(model=MODEL, messages=chat)) == ["messages[0].content"]


def test_defaults_are_filled_in() -> None:
    v = validate(InferenceRequest(model=MODEL, messages=(ChatMessage("user", "hi"),)))
    assert v.messages == [{"role": "user", "content": "hi"}] and v.prompt is None
    assert v.max_tokens is None and v.priority is None and v.temperature == 1.0
    assert len(v.request_id) == 32  # generated


# ---- stand-ins -------------------------------------------------------------------------------------------


class ByteTokenizer:
    """One token per UTF-8 byte; records the thread each prompt was encoded on."""

    max_token_bytes = 1

    def __init__(self) -> None:
        self.threads: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.get_ident())
        return list(text.encode())

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")


class ScriptedPool:
    """Streams ``reply`` one byte-token per delta. ``stall_after``: wait forever after that many
    tokens (a long generation to leave). ``fail``: raise it instead of streaming."""

    name = "shared"

    def __init__(self) -> None:
        self.reply = "hello world"
        self.stall_after: int | None = None
        self.fail: Exception | None = None
        self.own_fault_after: int | None = None  # end with the request's own error after N tokens
        self.requests: list[GenerationRequest] = []
        self.closed = 0  # engine streams stopped (finished, aborted or failed)

    async def describe(self) -> ModelInfo:
        return ModelInfo(MODEL, CONTEXT, 256)

    def replica_stats(self) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        try:
            if self.fail is not None:
                raise self.fail
            ids = list(self.reply.encode())[: request.sampling.max_tokens]
            for i, tok in enumerate(ids):
                if i == self.stall_after:
                    await asyncio.Event().wait()
                if i == self.own_fault_after:
                    error = "the output constraint failed: too many items; it was stopped (others were not)"
                    fault = RequestOutput(request.request_id, "", [], FinishReason.ERROR, error=error)
                    fault.request_fault = True
                    yield fault
                    return
                yield RequestOutput(
                    request.request_id,
                    chr(tok),
                    [tok],
                    FinishReason.LENGTH if i + 1 == len(ids) else None,
                    prompt_tokens=len(request.prompt_token_ids),
                    completion_tokens=i + 1,
                )
        finally:
            self.closed += 1


@dataclass
class World:
    path: RequestPath
    tenancy: Tenancy
    pool: ScriptedPool
    tokenizer: ByteTokenizer
    keys: dict[str, str]  # role -> API key
    ids: dict[str, str]  # role -> tenant id

    def principal(self, role: str = "main") -> Any:
        return self.path.authenticate(f"Bearer {self.keys[role]}")

    def usage(self, role: str = "main") -> tuple[int, int, int, int]:
        u = self.tenancy.admission.usage(self.ids[role], 1)[-1]  # type: ignore[attr-defined]
        return u.requests, u.prompt_tokens, u.completion_tokens, u.cancelled

    def requests(self, code: str, role: str = "main", priority: str = "standard") -> float:
        labels = {"tenant": self.ids[role], "priority": priority, "code": code}
        return REGISTRY.get_sample_value("loom:gateway_requests_total", labels) or 0.0


TENANTS: dict[str, dict[str, Any]] = {
    "main": {"priority_ceiling": "interactive", "allowed_models": ["*"]},
    "solo": {"quotas": {"max_concurrent": 1}},
    "once": {"quotas": {"requests_per_minute": 1}},
    "frozen": {"status": "suspended"},
    "other": {"allowed_models": ["something-else"]},
}


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    settings = TenancySettings(
        store="file", tenants_file=tmp_path / "tenants.yaml", secret="path-test-secret-0123456789"
    )
    store = FileTenantStore(settings.tenants_file, settings.hasher())
    keys, ids = {}, {}
    for role, fields in TENANTS.items():
        fields = dict(fields)
        quotas = Quotas.unlimited().model_copy(update=fields.pop("quotas", {}))
        models = fields.pop("allowed_models", [MODEL])
        tenant = Tenant(id=f"{role}-{uuid.uuid4().hex[:8]}", quotas=quotas, allowed_models=models, **fields)
        store.create_tenant(tenant, actor="tests")
        keys[role] = store.create_key(tenant.id, actor="tests").plaintext.get_secret_value()
        ids[role] = tenant.id
    tenancy = Tenancy.from_settings(settings)
    await tenancy.start()
    pool, tokenizer = ScriptedPool(), ByteTokenizer()
    catalog = ModelCatalog([ModelRoute(MODEL, pool, CONTEXT, tokenizer)])  # type: ignore[arg-type]
    path = RequestPath(tenancy, catalog, GatewaySettings(metrics_port=None))
    yield World(path, tenancy, pool, tokenizer, keys, ids)
    await tenancy.stop()


def ask(prompt: str = "hi", *, model: str = MODEL, **fields: Any) -> InferenceRequest:
    return InferenceRequest(model=model, prompt=prompt, **fields)


async def drain(stream: AsyncIterator[Delta]) -> list[Delta]:
    return [d async for d in stream]


async def refusal(world: World, request: InferenceRequest, role: str = "main", **kw: Any) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        await drain(world.path.generate(world.principal(role), request, **kw))
    return info.value


# ---- the path ----------------------------------------------------------------------------------------


async def test_streams_deltas_then_settles_usage_and_counts_the_call(world: World) -> None:
    request = ask("hi", max_tokens=5, priority=Priority.INTERACTIVE, request_id="r-1")
    deltas = await drain(world.path.generate(world.principal(), request))
    assert "".join(d.text for d in deltas) == "hello"
    assert [t for d in deltas for t in d.token_ids] == list(b"hello")
    assert {d.request_id for d in deltas} == {"r-1"}  # the client's id, not the engine's
    assert [d.finish_reason for d in deltas] == [None] * 4 + [FinishReason.LENGTH]
    assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == 5
    sent = world.pool.requests[0]
    assert sent.request_id == f"{world.ids['main']}/r-1"
    assert sent.priority is Priority.INTERACTIVE  # within this tenant's ceiling
    assert sent.cache_salt == world.tenancy.prefix_cache_salt(world.ids["main"])
    assert world.usage() == (1, 2, 5, 0)
    assert world.requests("OK", priority="interactive") == 1
    assert world.pool.closed == 1


async def test_unset_max_tokens_takes_the_default_bounded_by_the_context(world: World) -> None:
    world.pool.reply = "x" * CONTEXT
    deltas = await drain(world.path.generate(world.principal(), ask("0123456789")))
    assert world.pool.requests[0].sampling.max_tokens == CONTEXT - 10
    assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == CONTEXT - 10


async def test_refusal_order_fields_then_access_then_model_then_sizes(world: World) -> None:
    bad_field = await refusal(world, ask(top_p=0.0, model="nope"), role="frozen")
    assert bad_field.kind is ErrorKind.INVALID_ARGUMENT and [f for f, _ in bad_field.violations] == ["top_p"]
    suspended = await refusal(world, ask(model="nope"), role="frozen")
    assert suspended.kind is ErrorKind.PERMISSION_DENIED and "suspended" in suspended.message
    not_allowed = await refusal(world, ask(), role="other")
    assert not_allowed.kind is ErrorKind.PERMISSION_DENIED
    unknown = await refusal(world, ask(model="nope", max_tokens=1))
    assert unknown.kind is ErrorKind.NOT_FOUND and MODEL in unknown.message
    too_long = await refusal(world, ask("x" * CONTEXT))
    assert too_long.kind is ErrorKind.INVALID_ARGUMENT and "context" in too_long.message
    assert world.pool.requests == []  # nothing reached an engine
    # Refused before tagging: the priority is not known yet.
    assert world.requests("INVALID_ARGUMENT", role="main", priority="unknown") == 1
    assert world.requests("NOT_FOUND", role="main", priority="unknown") == 1
    assert world.requests("PERMISSION_DENIED", role="frozen", priority="unknown") == 1


async def test_quota_refusal_carries_the_limit_and_the_wait(world: World) -> None:
    await drain(world.path.generate(world.principal("once"), ask(max_tokens=1)))
    err = await refusal(world, ask(max_tokens=1), role="once")
    assert err.kind is ErrorKind.RESOURCE_EXHAUSTED and err.limit == "requests_per_minute"
    assert err.retry_after_s is not None and 0 < err.retry_after_s <= 60
    labels = {"tenant": world.ids["once"], "reason": "requests_per_minute"}
    assert REGISTRY.get_sample_value("loom:gateway_admission_refusals_total", labels) == 1


async def test_a_tenant_refused_for_its_rate_is_refused_again_before_tokenizing(world: World) -> None:
    """Until its refusal's wait has passed, a tenant's further requests cost no tokenizing work."""
    await drain(world.path.generate(world.principal("once"), ask(max_tokens=1)))
    first = await refusal(world, ask(max_tokens=1), role="once")
    tokenized = len(world.tokenizer.threads)
    again = await refusal(world, ask("a different prompt", max_tokens=1), role="once")
    assert len(world.tokenizer.threads) == tokenized  # refused before the tokenizer ran
    assert again.limit == "requests_per_minute" and again.retry_after_s is not None
    assert first.retry_after_s is not None and 0 < again.retry_after_s <= first.retry_after_s
    assert world.usage("once")[0] == 1  # and nothing more was charged


async def test_a_used_request_id_is_already_exists(world: World) -> None:
    await drain(world.path.generate(world.principal(), ask(max_tokens=1, request_id="same")))
    err = await refusal(world, ask(max_tokens=1, request_id="same"))
    assert err.kind is ErrorKind.ALREADY_EXISTS and "same" in err.message


@pytest.mark.parametrize("ended", [ErrorKind.CANCELLED, ErrorKind.DEADLINE_EXCEEDED])
async def test_a_stream_left_mid_way_frees_engine_and_lease_and_records_how_it_ended(
    world: World, ended: ErrorKind
) -> None:
    world.pool.stall_after = 3
    got: list[Delta] = []

    async def consume() -> None:
        async for delta in world.path.generate(world.principal("solo"), ask(), ended_early=lambda: ended):
            got.append(delta)

    task = asyncio.create_task(consume())
    while len(got) < 3:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert world.pool.closed == 1  # the engine's stream was stopped at once
    assert world.usage("solo") == (1, 2, 3, 1)  # settled: the tokens delivered, as cancelled
    assert world.requests(ended.name, role="solo") == 1
    world.pool.stall_after = None
    await drain(world.path.generate(world.principal("solo"), ask(max_tokens=2)))  # the only slot is free


async def test_closing_the_stream_settles_before_close_returns(world: World) -> None:
    world.pool.stall_after = 2
    stream = world.path.generate(world.principal(), ask())
    await anext(stream)
    await stream.aclose()
    assert world.pool.closed == 1
    assert world.usage() == (1, 2, 1, 1)
    assert world.requests("CANCELLED") == 1


async def test_a_stream_whose_output_stops_coming_ends_at_the_duration_limit(world: World) -> None:
    """The limit holds while waiting for output, not only when output arrives; the lease is settled."""
    world.path.settings = GatewaySettings(metrics_port=None, max_stream_duration_s=0.3)
    world.pool.stall_after = 1  # one token, then nothing ever again
    got: list[Delta] = []
    started = time.monotonic()
    with pytest.raises(GatewayError) as info:
        async with asyncio.timeout(5):
            async for delta in world.path.generate(world.principal(), ask(max_tokens=5)):
                got.append(delta)
    assert info.value.kind is ErrorKind.DEADLINE_EXCEEDED and "0.3 s" in info.value.message
    assert len(got) == 1 and time.monotonic() - started < 2
    assert world.usage() == (1, 2, 1, 0)  # the one token delivered is billed; nothing is left held
    assert world.requests("DEADLINE_EXCEEDED") == 1
    assert world.pool.closed == 1


async def test_a_client_that_cancels_is_not_taken_for_the_duration_limit(world: World) -> None:
    world.path.settings = GatewaySettings(metrics_port=None, max_stream_duration_s=30)
    world.pool.stall_after = 1
    stream = world.path.generate(world.principal(), ask(max_tokens=5))
    await anext(stream)
    waiting = asyncio.create_task(anext(stream))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await stream.aclose()
    assert world.requests("CANCELLED") == 1


async def test_a_lost_engine_is_unavailable_and_a_bug_is_internal(world: World) -> None:
    world.pool.fail = WorkerLostError("the replica died")
    lost = await refusal(world, ask(max_tokens=1))
    assert lost.kind is ErrorKind.UNAVAILABLE and "died" in lost.message
    world.pool.fail = KeyError("a bug")
    bug = await refusal(world, ask(max_tokens=1))
    assert bug.kind is ErrorKind.INTERNAL and "bug" not in bug.message  # no internals leak
    assert world.requests("UNAVAILABLE") == 1 and world.requests("INTERNAL") == 1
    assert world.usage()[0] == 2  # both admitted requests were settled


async def test_an_error_of_the_requests_own_making_is_invalid_argument(world: World) -> None:
    """A replica that ends a request for its own constraint (past its fuel, say) after some output:
    the caller is told its request was at fault, not to retry, and the tokens it got are paid."""
    world.pool.own_fault_after = 3
    own = await refusal(world, ask(max_tokens=8))
    assert own.kind is ErrorKind.INVALID_ARGUMENT and "too many items" in own.message
    assert world.requests("INVALID_ARGUMENT") == 1 and world.usage()[2] == 3


async def test_large_prompts_are_tokenized_off_the_event_loop(world: World) -> None:
    world.tokenizer.max_token_bytes = INLINE_TOKENIZE_BYTES  # no size floor: the prompt is tokenized
    loop_thread = threading.get_ident()
    await refusal(world, ask("y" * (INLINE_TOKENIZE_BYTES + 1)))  # too long for the context anyway
    await drain(world.path.generate(world.principal(), ask("small", max_tokens=1)))
    assert world.tokenizer.threads[0] != loop_thread
    assert world.tokenizer.threads[1] == loop_thread


async def test_a_medium_prompt_never_waits_behind_a_huge_one(world: World) -> None:
    """Huge prompts (over HUGE_TOKENIZE_BYTES) have a lane of their own: a 20 KB prompt is tokenized
    while a 1 MB one still is."""
    world.tokenizer.max_token_bytes = 10**9  # no size floor: both are tokenized
    release = threading.Event()
    encode = world.tokenizer.encode

    def slow_for_huge(text: str) -> list[int]:
        if len(text) > HUGE_TOKENIZE_BYTES:
            release.wait(10)
        return encode(text)

    world.tokenizer.encode = slow_for_huge  # type: ignore[method-assign]
    huge = asyncio.create_task(refusal(world, ask("h" * (HUGE_TOKENIZE_BYTES + 1))))
    await asyncio.sleep(0.05)
    try:
        async with asyncio.timeout(5):
            medium = await refusal(world, ask("m" * 20_000), role="main")
        assert medium.violations[0][0] == "prompt" and not huge.done()  # tokenized, then too long
    finally:
        release.set()
    assert (await huge).kind is ErrorKind.INVALID_ARGUMENT


async def test_a_prompt_too_large_by_its_bytes_alone_is_refused_before_tokenizing(world: World) -> None:
    """One token stands for at most max_token_bytes (1 here): CONTEXT + 1 bytes cannot fit."""
    err = await refusal(world, ask("y" * (CONTEXT + 1)))
    assert err.kind is ErrorKind.INVALID_ARGUMENT and err.violations[0][0] == "prompt"
    assert f"at least {CONTEXT + 1} tokens" in err.message
    assert world.tokenizer.threads == []  # no tokenizing work was spent on it
    fits = await drain(world.path.generate(world.principal(), ask("y" * (CONTEXT - 2), max_tokens=1)))
    assert fits[-1].finish_reason is not None


async def test_requests_not_yet_admitted_are_bounded_per_tenant(world: World) -> None:
    """A front's ticket (taken before it reads a body) counts against the tenant's concurrency; the
    path releases it at admission, so a stream does not hold it."""
    solo = world.principal("solo")
    ticket = world.path.enter(solo)
    with pytest.raises(GatewayError) as info:
        world.path.enter(solo)
    assert info.value.kind is ErrorKind.RESOURCE_EXHAUSTED and info.value.limit == "max_concurrent"
    assert info.value.retry_after_s is not None
    refused = await refusal(world, ask(max_tokens=1), role="solo")  # the path takes one itself
    assert refused.limit == "max_concurrent" and "prepared for admission" in refused.message
    world.pool.stall_after = 1
    stream = world.path.generate(solo, ask(max_tokens=3), ticket=ticket)
    await anext(stream)  # admitted and streaming: the ticket is free again
    assert world.path.pre_admission.held(world.ids["solo"]) == 0
    await stream.aclose()
    assert world.path.pre_admission.held(world.ids["main"]) == 0  # unlimited tenants hold none


async def test_a_suspended_tenant_cannot_list_models_and_not_found_names_only_allowed_ones(
    world: World,
) -> None:
    with pytest.raises(GatewayError) as info:
        world.path.list_models(world.principal("frozen"))
    assert info.value.kind is ErrorKind.PERMISSION_DENIED
    err = await refusal(world, ask(model="something-else"), role="other")
    assert err.kind is ErrorKind.NOT_FOUND and MODEL not in err.message


async def test_authenticate_and_list_models(world: World) -> None:
    refused = REGISTRY.get_sample_value("loom:gateway_unauthenticated_total") or 0.0
    for authorization in (None, "", "Bearer nope", world.keys["main"][:-4] + "0000"):
        with pytest.raises(GatewayError) as info:
            world.path.authenticate(authorization)
        assert info.value.kind is ErrorKind.UNAUTHENTICATED
    assert REGISTRY.get_sample_value("loom:gateway_unauthenticated_total") == refused + 4
    assert world.principal().tenant.id == world.ids["main"]
    assert world.path.list_models(world.principal()) == [ServedModel(MODEL, CONTEXT, "shared")]
    assert world.path.list_models(world.principal("other")) == []


# ---- no gRPC in the path ---------------------------------------------------------------------------

NEUTRAL_MODULES = ("gateway.request_path", "gateway.schema", "gateway.validation", "gateway.errors")
TRANSPORT_SIDE = {"gateway.server"} | {
    f"gateway.{front}.{m}"
    for front, modules in {
        "grpc": ("stubs", "auth", "status", "service", "server", "client"),
        "http": ("app", "body", "endpoints", "errors", "server", "streaming"),
    }.items()
    for m in modules
}

_PROBE = """
import json, sys
for module in sys.argv[1:]:
    __import__(module)
print(json.dumps(sorted(sys.modules)))
"""


@pytest.fixture(scope="module")
def neutral_imports() -> Iterator[set[str]]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *NEUTRAL_MODULES], capture_output=True, text=True, check=True
    )
    yield set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_request_path_imports_no_grpc(neutral_imports: set[str]) -> None:
    """Importing the path in a fresh interpreter loads no transport (gRPC, its stubs, FastAPI, uvicorn),
    no front of the gateway, and no engine (import-linter holds the imports; this holds what they load
    at run time too)."""
    transport = {"grpc", "grpc_health", "grpc_reflection", "loomapi", "fastapi", "starlette", "uvicorn"}
    assert not {m.split(".")[0] for m in neutral_imports} & (transport | {"torch", "ray", "triton"})
    assert not {m for m in neutral_imports if m.startswith("google.rpc")}
    assert not TRANSPORT_SIDE & neutral_imports


async def test_a_deadline_during_admission_leaves_nothing_reserved(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    admission = world.tenancy.admission
    real_admit = admission.admit
    admitting = asyncio.Event()

    async def slow_admit(*args: Any, **kwargs: Any) -> Any:
        granted = await real_admit(*args, **kwargs)  # reserved in the store...
        admitting.set()
        await asyncio.sleep(0.2)  # ...but the answer arrives after the caller has left
        return granted

    monkeypatch.setattr(admission, "admit", slow_admit)
    task = asyncio.create_task(drain(world.path.generate(world.principal("solo"), ask(max_tokens=50))))
    await admitting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.3)  # the late grant is finished as soon as it lands
    monkeypatch.setattr(admission, "admit", real_admit)
    _, prompt, completion, cancelled = world.usage("solo")
    assert (prompt, completion, cancelled) == (2, 0, 1)  # the prompt as admitted; max_tokens refunded
    assert world.pool.requests == []  # never dispatched
    await drain(world.path.generate(world.principal("solo"), ask(max_tokens=2)))  # the only slot is free


def test_tokenizing_threads_yield_the_cpu_to_the_rest_of_the_gateway() -> None:
    """A 1 MB prompt's second of tokenizing runs at a lower priority than the loop and the engine."""
    import os

    from gateway.request_path import _TOKENIZE_THREADS

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = nice()
    theirs = _TOKENIZE_THREADS.submit(nice).result(timeout=10)
    assert theirs == min(19, mine + 10)
