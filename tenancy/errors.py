"""Exceptions raised by the tenancy package.

Each error carries ``status``: the name of the gRPC status the gateway should answer with. The names
are plain strings so that this package never imports grpc; the gateway maps them with
``grpc.StatusCode[err.status]``.
"""

from __future__ import annotations


class TenancyError(Exception):
    """Base class of every error this package raises on purpose."""

    status: str = "INTERNAL"


class AuthenticationError(TenancyError):
    """The presented API key does not authenticate.

    Unknown, malformed, tampered, revoked and expired keys all raise this same error with the same
    message, so a caller cannot tell which case it hit (no key-id enumeration, no "this key used to
    work"). The reason is kept out of the exception on purpose; it goes to a server-side metric only.
    """

    status = "UNAUTHENTICATED"
    MESSAGE = "invalid API key"

    def __init__(self) -> None:
        super().__init__(self.MESSAGE)


class PermissionDeniedError(TenancyError):
    """The key is valid but the tenant may not do this (suspended, model not allowed)."""

    status = "PERMISSION_DENIED"


class TenantSuspendedError(PermissionDeniedError):
    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"tenant {tenant_id!r} is suspended")
        self.tenant_id = tenant_id


class ModelNotAllowedError(PermissionDeniedError):
    def __init__(self, tenant_id: str, model: str) -> None:
        super().__init__(f"tenant {tenant_id!r} may not use model {model!r}")
        self.tenant_id = tenant_id
        self.model = model


class RequestTooLargeError(TenancyError):
    """A request exceeds one of the tenant's per-request limits; retrying the same request never helps."""

    status = "INVALID_ARGUMENT"

    def __init__(self, field: str, value: int, limit: int, detail: str = "") -> None:
        message = f"{field}={value} exceeds this tenant's limit of {limit}"
        if detail:
            message = f"{message} ({detail})"
        super().__init__(message)
        self.field = field
        self.value = value
        self.limit = limit


class TenancyArgumentError(TenancyError):
    """Malformed input to the tenancy API (negative token counts, bad request id...)."""

    status = "INVALID_ARGUMENT"


class TenantValidationError(TenancyError):
    """A tenant or key definition failed validation; the message lists every problem."""

    status = "INVALID_ARGUMENT"


class TenantNotFoundError(TenancyError):
    status = "NOT_FOUND"

    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"no tenant {tenant_id!r}")
        self.tenant_id = tenant_id


class TenantExistsError(TenancyError):
    status = "ALREADY_EXISTS"

    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"tenant {tenant_id!r} already exists")
        self.tenant_id = tenant_id


class KeyNotFoundError(TenancyError):
    status = "NOT_FOUND"

    def __init__(self, key_id: str) -> None:
        super().__init__(f"no API key with id {key_id!r}")
        self.key_id = key_id


class ConcurrentModificationError(TenancyError):
    """Another admin changed the same tenant while this change was being prepared, too many times."""

    status = "ABORTED"


class StoreUnavailableError(TenancyError):
    """The tenant store (Redis) did not answer in time. Admin operations never fall back silently."""

    status = "UNAVAILABLE"
