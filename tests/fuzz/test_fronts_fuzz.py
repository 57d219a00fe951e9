"""Fuzzing both fronts of the real server: random GenerateRequest fields, raw protobuf bodies (garbage,
truncated, invalid UTF-8 in every string field), random chat/completions JSON bodies and raw bytes,
oversized or odd metadata, near-miss API keys, hostile output constraints and tools.

The cases come from loadtest/soak_fuzz.py (``loom soak --fuzz N`` sends the same kinds by the ten
thousand); here hypothesis drives their random choices, derandomized so CI runs the same few hundred
examples every time, and shrinks a failure to its smallest case. Every answer must be OK or a
well-defined refusal (never UNKNOWN or INTERNAL, never an HTTP 5xx), a near-miss key is never served,
no message shows Python internals, and the server is healthy afterwards (the last test).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.grpc.client import LoomClient
from gateway.grpc.status import MAX_MESSAGE_BYTES
from gateway.grpc.stubs import SERVICE_NAME, pb
from loadtest.soak_fuzz import Case, Sender, make_case, problems
from tests.fuzz.conftest import Fuzzed

FUZZ = settings(
    deadline=None,
    derandomize=True,  # the same examples on every run: CI is stable, a failure reproduces
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
RNG = st.randoms(use_true_random=False)  # hypothesis records (and shrinks) every random choice
STRING_FIELDS = {"model": 1, "prompt": 2, "stop": 9, "request_id": 11, "user": 14}


@pytest.fixture(scope="module")
async def sender(fuzzed: Fuzzed) -> AsyncIterator[Sender]:
    s = Sender(fuzzed.target, timeout_s=30)
    yield s
    await s.close()


async def check(sender: Sender, case: Case) -> None:
    outcome = await sender.send(case)
    assert problems(outcome) == [], (
        case.kind,
        case.note,
        case.body[:300],
        outcome.code,
        outcome.message[:300],
    )


def _invalid_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _field(number: int, payload: bytes) -> bytes:
    assert number < 16 and len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


# ---- gRPC ---------------------------------------------------------------------------------------------


@settings(FUZZ, max_examples=80)
@given(rng=RNG)
async def test_generate_request_fields(sender: Sender, fuzzed: Fuzzed, rng: random.Random) -> None:
    await check(sender, make_case(rng, fuzzed.target, "grpc_fields"))


@settings(FUZZ, max_examples=40)
@given(rng=RNG)
async def test_corrupted_protobuf_bodies(sender: Sender, fuzzed: Fuzzed, rng: random.Random) -> None:
    await check(sender, make_case(rng, fuzzed.target, "grpc_bytes"))


@settings(FUZZ, max_examples=30)
@given(body=st.binary(max_size=400))
async def test_garbage_protobuf_bodies(sender: Sender, fuzzed: Fuzzed, body: bytes) -> None:
    auth = (("authorization", f"Bearer {fuzzed.target.api_key}"),)
    await check(sender, Case("grpc_bytes", body, auth, note="hypothesis bytes"))


@settings(FUZZ, max_examples=30)
@given(
    where=st.sampled_from(sorted(STRING_FIELDS)),
    bad=st.binary(min_size=1, max_size=12).filter(_invalid_utf8),
    cut=st.integers(min_value=0, max_value=40),
)
async def test_invalid_utf8_and_truncation(
    sender: Sender, fuzzed: Fuzzed, where: str, bad: bytes, cut: int
) -> None:
    """Invalid UTF-8 in each string field is INVALID_ARGUMENT; so is the message cut anywhere."""
    body = _field(1, fuzzed.target.model.encode()) + _field(STRING_FIELDS[where], b"hi" + bad)
    auth = (("authorization", f"Bearer {fuzzed.target.api_key}"),)
    outcome = await sender.send(Case("grpc_bytes", body, auth, note=f"invalid UTF-8 in {where}"))
    assert outcome.code == "INVALID_ARGUMENT" and problems(outcome) == [], outcome
    await check(sender, Case("grpc_bytes", body[: min(cut, len(body))], auth, note="truncated"))


@settings(FUZZ, max_examples=25)
@given(rng=RNG)
async def test_odd_and_oversized_metadata(sender: Sender, fuzzed: Fuzzed, rng: random.Random) -> None:
    await check(sender, make_case(rng, fuzzed.target, "grpc_metadata"))


async def test_huge_bad_values_are_refused_as_themselves(sender: Sender, fuzzed: Fuzzed) -> None:
    """A refusal that echoes a 20 KB value, or lists 512 bad fields, still reaches the client as
    INVALID_ARGUMENT (grpc clients drop trailers over 8-16 KiB: it used to arrive as
    RESOURCE_EXHAUSTED 'received metadata size exceeds ...')."""
    auth = (("authorization", f"Bearer {fuzzed.target.api_key}"),)
    huge_role = pb.GenerateRequest(
        model=fuzzed.target.model, messages=[pb.ChatMessage(role="r" * 20_000, content="x")]
    )
    many = pb.GenerateRequest(
        model=fuzzed.target.model,
        messages=[pb.ChatMessage(role=f"nobody {i}", content="x") for i in range(512)],
    )
    for request in (huge_role, many):
        outcome = await sender.send(Case("grpc_fields", request.SerializeToString(), auth))
        assert outcome.code == "INVALID_ARGUMENT", outcome.message[:300]
        assert len(outcome.message.encode()) <= MAX_MESSAGE_BYTES
        assert outcome.message.startswith("messages[0].role")


# ---- HTTP ---------------------------------------------------------------------------------------------


@settings(FUZZ, max_examples=60)
@given(rng=RNG)
async def test_chat_and_completion_bodies(sender: Sender, fuzzed: Fuzzed, rng: random.Random) -> None:
    await check(sender, make_case(rng, fuzzed.target, "http_body"))


@settings(FUZZ, max_examples=40)
@given(rng=RNG)
async def test_raw_http_bodies(sender: Sender, fuzzed: Fuzzed, rng: random.Random) -> None:
    await check(sender, make_case(rng, fuzzed.target, "http_bytes"))


# ---- hostile tenants: lists at their limits and far past, slow clients, floods ------------------------


@settings(FUZZ, max_examples=30)
@given(rng=RNG, front=st.sampled_from(["grpc_lists", "http_lists"]))
async def test_every_list_at_its_limit_and_far_past_it(
    sender: Sender, fuzzed: Fuzzed, rng: random.Random, front: str
) -> None:
    """One short refusal for a list too long, whatever its items (never one error per item)."""
    case = make_case(rng, fuzzed.target, front)
    outcome = await sender.send(case)
    assert problems(outcome) == [], (case.note, outcome.code, outcome.message[:300])
    assert len(outcome.message) < 4096, case.note


@settings(FUZZ, max_examples=8)
@given(rng=RNG)
async def test_half_sent_requests_are_cut_off(sender: Sender, fuzzed: Fuzzed, rng: random.Random) -> None:
    await check(sender, make_case(rng, fuzzed.target, "http_slow"))


@settings(FUZZ, max_examples=6)
@given(rng=RNG)
async def test_a_tenants_flood_of_large_prompts_is_bounded(
    sender: Sender, fuzzed: Fuzzed, rng: random.Random
) -> None:
    await check(sender, make_case(rng, fuzzed.target, "http_flood"))


@settings(FUZZ, max_examples=60)
@given(rng=RNG, front=st.sampled_from(["grpc_constraints", "http_constraints"]))
async def test_output_constraints_pathological_oversized_and_malformed(
    sender: Sender, fuzzed: Fuzzed, rng: random.Random, front: str
) -> None:
    """Every constraint the generator makes (long enums, deep nesting, numeric bounds at their
    extremes, exploding repeats, $ref cycles, ambiguous grammars, each kind at its size limit and
    past it, malformed specs, tools past their count): OK or a short, precise refusal, and one past
    a limit or not well-formed is never served."""
    case = make_case(rng, fuzzed.target, front)
    outcome = await sender.send(case)
    assert problems(outcome) == [], (case.note, outcome.code, outcome.message[:300])
    assert len(outcome.message) < 4096, case.note
    if case.must_refuse:  # refused as bad input (or for the tenant's quota, which comes later)
        assert outcome.code in ("INVALID_ARGUMENT", "HTTP 400", "RESOURCE_EXHAUSTED", "HTTP 429"), (
            case.note,
            outcome.code,
        )


# ---- keys ---------------------------------------------------------------------------------------------


@settings(FUZZ, max_examples=50)
@given(rng=RNG, front=st.sampled_from(["grpc_key", "http_key"]))
async def test_near_miss_keys_are_never_served(
    sender: Sender, fuzzed: Fuzzed, rng: random.Random, front: str
) -> None:
    await check(sender, make_case(rng, fuzzed.target, front))


# ---- afterwards ------------------------------------------------------------------------------------


async def test_server_is_healthy_after_the_fuzzing(fuzzed: Fuzzed) -> None:
    async with grpc.aio.insecure_channel(fuzzed.target.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            assert (await health.Check(health_pb2.HealthCheckRequest(service=service))).status == (
                health_pb2.HealthCheckResponse.SERVING
            )
    client = fuzzed.target
    async with LoomClient(client.grpc_address, client.api_key) as loom:
        chunks = [
            c
            async for c in loom.generate_call(
                pb.GenerateRequest(model=client.model, prompt="hello", max_tokens=5)
            )
        ]
    assert sum(len(c.token_ids) for c in chunks) == 5 and chunks[-1].usage.completion_tokens == 5
    async with httpx.AsyncClient(base_url=f"http://{client.http_address}", timeout=30) as http:
        answer = await http.post(
            "/v1/completions",
            json={"model": client.model, "prompt": "hello", "max_tokens": 5},
            headers={"authorization": f"Bearer {client.api_key}"},
        )
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5
