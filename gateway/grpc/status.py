"""A gateway error as a gRPC status: a standard code, the message, and rich details.

RESOURCE_EXHAUSTED carries the retry delay twice: a ``google.rpc.RetryInfo`` detail (for clients that
read rich status) and ``retry-after-ms`` trailing metadata (for everyone else); the quota's name goes in
a ``google.rpc.QuotaFailure`` and ``loom-quota-limit`` metadata. INVALID_ARGUMENT carries a
``google.rpc.BadRequest`` naming each offending field.

All of it travels in the trailers, which clients cap (grpc's default: 8 KiB, 16 KiB at most): a
status that echoes a huge bad value, or lists hundreds of bad fields, would reach the client as
RESOURCE_EXHAUSTED "received metadata size exceeds ..." instead of itself. So the message and the
listed violations are bounded (``MAX_MESSAGE_BYTES``, ``MAX_VIOLATION_BYTES``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from gateway.errors import ErrorKind, GatewayError

RETRY_AFTER_METADATA = "retry-after-ms"
QUOTA_METADATA = "loom-quota-limit"
# Trailers stay far below the 8 KiB clients accept: the message goes in twice (grpc-message, percent-
# encoded, so up to 3 bytes per byte; and the rich status, base64), the violations once.
MAX_MESSAGE_BYTES = 1024
MAX_VIOLATION_BYTES = 1536

STATUS_CODES: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


@dataclass(frozen=True)
class _Status(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]


def _bounded(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes (at a character boundary), saying so."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    return raw[: limit - 16].decode("utf-8", "ignore") + " ... (truncated)"


def to_status(err: GatewayError) -> grpc.Status:
    """The grpc.Status (code, message, trailing metadata with google.rpc details) for ``err``."""
    code = STATUS_CODES[err.kind]
    message = _bounded(err.message, MAX_MESSAGE_BYTES)
    rich = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
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
        bad = error_details_pb2.BadRequest()
        budget = MAX_VIOLATION_BYTES
        for f, d in err.violations:  # the first ones, as many as fit
            violation = error_details_pb2.BadRequest.FieldViolation(
                field=_bounded(f, 128), description=_bounded(d, 256)
            )
            budget -= violation.ByteSize()
            if budget < 0 and bad.field_violations:
                break
            bad.field_violations.append(violation)
        rich.details.add().Pack(bad)
    metadata.append(("grpc-status-details-bin", rich.SerializeToString()))
    return _Status(code, message, tuple(metadata))


async def abort(context: grpc.aio.ServicerContext, err: GatewayError) -> NoReturn:
    """End the call with ``err`` (raises, as ``context.abort`` does)."""
    await context.abort_with_status(to_status(err))
    raise AssertionError("grpc's abort_with_status returned instead of raising")
