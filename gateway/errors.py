"""Every refusal the gateway sends: a standard gRPC code, a precise message, and rich details.

RESOURCE_EXHAUSTED carries the retry delay twice: a ``google.rpc.RetryInfo`` detail (for clients that
read rich status) and ``retry-after-ms`` trailing metadata (for everyone else). INVALID_ARGUMENT
carries a ``google.rpc.BadRequest`` naming each offending field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

RETRY_AFTER_METADATA = "retry-after-ms"
QUOTA_METADATA = "loom-quota-limit"


@dataclass
class GatewayError(Exception):
    code: grpc.StatusCode
    message: str
    retry_after_s: float | None = None
    limit: str | None = None  # which quota refused the request
    violations: Sequence[tuple[str, str]] = field(default_factory=tuple)  # (field, description)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


def invalid_argument(violations: Sequence[tuple[str, str]]) -> GatewayError:
    message = "; ".join(f"{f}: {d}" for f, d in violations)
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, message, violations=tuple(violations))


@dataclass(frozen=True)
class _Status(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]


def to_status(err: GatewayError) -> grpc.Status:
    """The grpc.Status (code, message, trailing metadata with google.rpc details) for ``err``."""
    rich = status_pb2.Status(code=getattr(code_pb2, err.code.name), message=err.message)
    metadata: list[tuple[str, str | bytes]] = []
    if err.retry_after_s is not None:
        delay = max(0.0, err.retry_after_s)
        whole = math.floor(delay)
        info = error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(seconds=whole, nanos=int((delay - whole) * 1e9))
        )
        rich.details.add().Pack(info)
        metadata.append((RETRY_AFTER_METADATA, str(math.ceil(delay * 1000))))
    if err.limit is not None:
        metadata.append((QUOTA_METADATA, err.limit))
        quota = error_details_pb2.QuotaFailure(
            violations=[error_details_pb2.QuotaFailure.Violation(subject="tenant", description=err.limit)]
        )
        rich.details.add().Pack(quota)
    if err.violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in err.violations
            ]
        )
        rich.details.add().Pack(bad)
    metadata.append(("grpc-status-details-bin", rich.SerializeToString()))
    return _Status(err.code, err.message, tuple(metadata))


async def abort(context: grpc.aio.ServicerContext, err: GatewayError) -> None:
    """End the call with ``err`` (raises, as ``context.abort`` does)."""
    await context.abort_with_status(to_status(err))
