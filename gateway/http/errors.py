"""A refusal as an HTTP status and OpenAI's error object, the one shape for a JSON answer and for an
error that arrives as a server-sent event after the stream's headers were sent."""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from gateway.errors import ErrorKind, GatewayError
from gateway.http.schema import ErrorResponse

log = logging.getLogger(__name__)

# (HTTP status, OpenAI error type) per kind: the status each SDK maps to its exception class.
STATUS: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorKind.UNAUTHENTICATED: (401, "authentication_error"),
    ErrorKind.PERMISSION_DENIED: (403, "permission_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.ALREADY_EXISTS: (409, "invalid_request_error"),
    ErrorKind.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    ErrorKind.CANCELLED: (499, "request_cancelled"),
    ErrorKind.INTERNAL: (500, "server_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable"),
    ErrorKind.DEADLINE_EXCEEDED: (504, "timeout"),
}
# Statuses the routes document (the OpenAPI schema's responses).
DOCUMENTED = (400, 401, 403, 404, 409, 429, 500, 503)


def error_body(err: GatewayError) -> dict[str, Any]:
    """``{"error": {message, type, param, code}}``: ``param`` the first bad field, ``code`` the quota
    that refused or the kind of refusal."""
    _, kind = STATUS[err.kind]
    param = err.violations[0][0] if err.violations else ("model" if err.kind is ErrorKind.NOT_FOUND else None)
    body = {
        "error": {"message": err.message, "type": kind, "param": param, "code": err.limit or err.kind.value}
    }
    return ErrorResponse.model_validate(body).model_dump()


# Statuses sent while the client may still owe part of its body: the connection is closed after the
# answer, or a client that never sends the rest would keep it open for good.
CLOSES_CONNECTION = frozenset({408, 413})


def error_response(err: GatewayError) -> JSONResponse:
    status = err.http_status or STATUS[err.kind][0]
    headers = {"Connection": "close"} if status in CLOSES_CONNECTION else {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
        headers["retry-after-ms"] = str(math.ceil(err.retry_after_s * 1000))
    return JSONResponse(error_body(err), status_code=status, headers=headers)


async def on_gateway_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GatewayError)  # registered for GatewayError only
    return error_response(exc)


async def on_internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug outside the path: 500 in OpenAI's shape with an id to quote; the traceback only in the log."""
    ref = uuid.uuid4().hex[:16]
    log.error("HTTP %s %s failed (ref %s)", request.method, request.url.path, ref, exc_info=exc)
    return error_response(GatewayError(ErrorKind.INTERNAL, f"internal error (ref {ref})"))
