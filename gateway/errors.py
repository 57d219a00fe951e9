"""Every refusal the request path makes, in words no transport owns.

A refusal is one :class:`GatewayError`: a :class:`ErrorKind`, a precise message, and what a client
needs to act on it (each bad field, the quota that refused and how long to wait). Each front maps the
kind to its own vocabulary: the gRPC servicer to a status code with rich details
(gateway/grpc/status.py), the HTTP front to a status and OpenAI's error JSON. The kinds are named after
the gRPC codes because those words are precise and well known, but this module imports no gRPC.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from protocol.limits import Violation
from tenancy import RequestTooLargeError, TenancyError


class ErrorKind(enum.StrEnum):
    """Why a request was refused or ended early; the value names it in metrics and logs."""

    INVALID_ARGUMENT = "invalid_argument"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INTERNAL = "internal"


@dataclass
class GatewayError(Exception):
    kind: ErrorKind
    message: str
    retry_after_s: float | None = None  # RESOURCE_EXHAUSTED: the wait that can help (None: none can)
    limit: str | None = None  # which quota refused the request
    violations: Sequence[Violation] = field(default_factory=tuple)  # (field, description)
    http_status: int | None = None  # where HTTP has a more precise status than the kind's

    def __str__(self) -> str:
        return f"{self.kind.name}: {self.message}"


# A refusal names at most this many bad fields, each cut to a bounded size: a body built to fail in a
# million places gets a short answer (the rest are counted), never one as large as itself.
MAX_VIOLATIONS = 10
MAX_FIELD_CHARS = 128
MAX_DESCRIPTION_CHARS = 256


def invalid_argument(violations: Sequence[Violation]) -> GatewayError:
    """INVALID_ARGUMENT naming the bad fields in the order given, the first ``MAX_VIOLATIONS`` of them."""
    shown = [
        (_cut(f, MAX_FIELD_CHARS), _cut(d, MAX_DESCRIPTION_CHARS)) for f, d in violations[:MAX_VIOLATIONS]
    ]
    message = "; ".join(f"{f}: {d}" for f, d in shown)
    if len(violations) > MAX_VIOLATIONS:
        message += f"; and {len(violations) - MAX_VIOLATIONS} more"
    return GatewayError(ErrorKind.INVALID_ARGUMENT, message, violations=tuple(shown))


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def from_tenancy(exc: TenancyError) -> GatewayError:
    """The one place tenancy's errors become gateway errors.

    Tenancy names the answer it wants in ``status`` (a plain string, so that it imports no gRPC);
    the same words are our kinds. A name we have no kind for (``ABORTED`` from admin writes, which
    never reach the request path) is an internal error rather than a guess.
    """
    kind = ErrorKind.__members__.get(exc.status, ErrorKind.INTERNAL)
    if isinstance(exc, RequestTooLargeError):  # a per-request limit: name the field to change
        return invalid_argument([(_LIMITED_FIELDS.get(exc.field, exc.field), str(exc))])
    return GatewayError(kind, str(exc))


# Tenancy's names for what a per-request limit bounds -> the request field a client changes.
_LIMITED_FIELDS = {
    "prompt_tokens": "prompt",
    "max_tokens": "max_tokens",
    "prompt_tokens + max_tokens": "max_tokens",
}
