"""The gRPC side without a server: error kinds as status codes with rich details, tenancy's errors as
kinds, and the servicer's protobuf <-> neutral translation."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from common import Priority
from gateway.catalog import ModelCatalog
from gateway.errors import ErrorKind, GatewayError, from_tenancy, invalid_argument
from gateway.grpc.service import to_request, to_response
from gateway.grpc.status import QUOTA_METADATA, RETRY_AFTER_METADATA, STATUS_CODES, to_status
from gateway.grpc.stubs import pb
from gateway.schema import ChatMessage, Delta, InferenceRequest, Usage
from gateway.server import GatewayServer
from gateway.settings import GatewaySettings
from protocol.requests import FinishReason
from tenancy import (
    AuthenticationError,
    ModelNotAllowedError,
    RequestTooLargeError,
    StoreUnavailableError,
    TenancyArgumentError,
    TenancyError,
    TenantNotFoundError,
    TenantSuspendedError,
)
from tenancy.errors import ConcurrentModificationError, TenantExistsError


def _rich(status: grpc.Status) -> status_pb2.Status:
    return status_pb2.Status.FromString(dict(status.trailing_metadata)["grpc-status-details-bin"])


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_every_kind_has_the_grpc_code_of_its_name(kind: ErrorKind) -> None:
    status = to_status(GatewayError(kind, "why"))
    assert status.code is STATUS_CODES[kind] is grpc.StatusCode[kind.name]
    assert status.details == "why"
    rich = _rich(status)
    assert (rich.code, rich.message, list(rich.details)) == (status.code.value[0], "why", [])


def test_exhausted_quota_carries_the_delay_and_the_limit() -> None:
    limit = "tokens_per_minute"
    status = to_status(GatewayError(ErrorKind.RESOURCE_EXHAUSTED, "wait", retry_after_s=1.2501, limit=limit))
    metadata = dict(status.trailing_metadata)
    assert metadata[RETRY_AFTER_METADATA] == "1251" and metadata[QUOTA_METADATA] == limit  # ms, rounded up
    retry, quota = error_details_pb2.RetryInfo(), error_details_pb2.QuotaFailure()
    first, second = _rich(status).details
    assert first.Unpack(retry) and second.Unpack(quota)
    assert (retry.retry_delay.seconds, round(retry.retry_delay.nanos, -4)) == (1, 250_100_000)
    assert quota.violations[0].description == limit


def test_invalid_argument_names_each_field_in_a_bad_request() -> None:
    status = to_status(invalid_argument([("top_p", "must be in (0, 1]"), ("stop[0]", "is empty")]))
    assert status.details == "top_p: must be in (0, 1]; stop[0]: is empty"
    bad = error_details_pb2.BadRequest()
    assert _rich(status).details[0].Unpack(bad)
    assert [(v.field, v.description) for v in bad.field_violations] == [
        ("top_p", "must be in (0, 1]"),
        ("stop[0]", "is empty"),
    ]


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (AuthenticationError(), ErrorKind.UNAUTHENTICATED),
        (TenantSuspendedError("t"), ErrorKind.PERMISSION_DENIED),
        (ModelNotAllowedError("t", "m"), ErrorKind.PERMISSION_DENIED),
        (RequestTooLargeError("max_tokens", 9, 8), ErrorKind.INVALID_ARGUMENT),
        (TenancyArgumentError("bad"), ErrorKind.INVALID_ARGUMENT),
        (TenantNotFoundError("t"), ErrorKind.NOT_FOUND),
        (TenantExistsError("t"), ErrorKind.ALREADY_EXISTS),
        (StoreUnavailableError("down"), ErrorKind.UNAVAILABLE),
        (ConcurrentModificationError("again"), ErrorKind.INTERNAL),  # ABORTED: no kind of ours
        (TenancyError("?"), ErrorKind.INTERNAL),
    ],
)
def test_tenancy_errors_map_by_their_code_name(error: TenancyError, kind: ErrorKind) -> None:
    mapped = from_tenancy(error)
    assert mapped.kind is kind and str(error) in mapped.message


def test_a_per_request_limit_names_the_field_to_change() -> None:
    prompt = from_tenancy(RequestTooLargeError("prompt_tokens", 900, 512))
    cost = from_tenancy(RequestTooLargeError("prompt_tokens + max_tokens", 900, 512, "daily_token_budget"))
    assert [f for f, _ in prompt.violations] == ["prompt"]
    assert [f for f, _ in cost.violations] == ["max_tokens"]
    assert "daily_token_budget" in cost.violations[0][1]


def test_a_protobuf_request_becomes_the_neutral_request() -> None:
    message = pb.GenerateRequest(model="m", temperature=0.0, top_k=5, seed=7, stop=["\n"], request_id="r")
    message.messages.add(role="user", content="hi")
    message.priority = pb.PRIORITY_BATCH
    request, bad = to_request(message)
    assert bad == []
    assert request == InferenceRequest(
        model="m",
        messages=(ChatMessage("user", "hi"),),
        temperature=0.0,
        top_k=5,
        seed=7,
        stop=("\n",),
        priority=Priority.BATCH,
        request_id="r",
    )
    defaults, _ = to_request(pb.GenerateRequest(model="m", prompt="p"))
    assert defaults == InferenceRequest(model="m", prompt="p")  # unset fields: the neutral defaults


def test_an_unknown_priority_is_a_decode_violation() -> None:
    request, bad = to_request(pb.GenerateRequest(model="m", prompt="p", priority=42))  # type: ignore[arg-type]
    assert request.priority is None and bad == [("priority", "unknown priority 42")]


def test_deltas_become_responses_with_usage_on_the_last() -> None:
    middle = to_response(Delta("r", "he", (1, 2)))
    assert (middle.request_id, middle.text, list(middle.token_ids)) == ("r", "he", [1, 2])
    assert not middle.HasField("usage") and middle.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    last = to_response(Delta("r", "", (), FinishReason.STOP, Usage(3, 2, 1)))
    assert last.finish_reason == pb.FINISH_REASON_STOP
    usage = last.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (3, 2, 1)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"tls_cert_file": "c.pem"}, "tls_key_file is not"),
        ({"tls_key_file": "k.pem"}, "tls_cert_file is not"),
        ({"tls_client_ca_file": "ca.pem"}, "needs tls_cert_file"),
    ],
)
def test_half_a_tls_configuration_refuses_to_start(fields: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        GatewaySettings(**fields)


async def test_an_unreadable_certificate_is_named(tmp_path: Path) -> None:
    settings = GatewaySettings(
        port=0, http_port=None, metrics_port=None, tls_cert_file=str(tmp_path / "no.pem"), tls_key_file="k"
    )
    server = GatewayServer(settings, tenancy=None, catalog=ModelCatalog([]))  # type: ignore[arg-type]
    with pytest.raises(OSError, match="cannot read the TLS"):
        await server.start()
