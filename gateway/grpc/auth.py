"""Authentication interceptor: ``authorization: Bearer <key>`` metadata -> the caller, before any
handler runs.

The rule itself is the request path's ``authenticate`` (every front calls the same one); this module
only reads the gRPC metadata and answers UNAUTHENTICATED in gRPC's terms, before the request body is
even decoded. The principal travels to the handler in a context variable (the interceptor's wrapper runs
in the handler's own task). Health checks and reflection need no key.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from gateway.errors import ErrorKind, GatewayError
from gateway.grpc.status import abort
from gateway.grpc.stubs import SERVICE_NAME
from tenancy import Principal

Authenticate = Callable[[str | None], Principal]  # RequestPath.authenticate

log = logging.getLogger(__name__)

_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("loom_principal", default=None)


def current_principal() -> Principal:
    principal = _principal.get()
    if principal is None:  # a handler reached without the interceptor: a wiring bug, not a client error
        raise RuntimeError("no authenticated principal in this context")
    return principal


def _authorization(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class Undecodable:
    """A request body protobuf could not decode: handed to the servicer, which refuses it with
    INVALID_ARGUMENT (the caller is authenticated by then, so the refusal is counted as theirs)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every Inference call before its body is decoded, then decodes it itself.

    gRPC would decode first, answering an undecodable body with UNKNOWN and an exception's name (and
    spending work on callers without a key); here the handler receives raw bytes, the key is checked,
    and only then is the message parsed.
    """

    def __init__(self, authenticate: Authenticate) -> None:
        self._authenticate = authenticate

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        authenticate = self._authenticate
        decode = handler.request_deserializer
        message_name = details.method.rsplit("/", 1)[-1] + "Request"

        async def admit(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            """The decoded request (or Undecodable) of an authenticated caller; aborts otherwise."""
            try:
                principal = authenticate(_authorization(context.invocation_metadata()))
            except GatewayError as err:
                await abort(context, err)
            except Exception:  # a bug: never a traceback or a class name to the client
                log.exception("authentication failed unexpectedly")
                await abort(context, GatewayError(ErrorKind.INTERNAL, "internal error"))
            _principal.set(principal)
            try:
                return decode(raw)
            except Exception:  # protobuf's DecodeError, or garbage of any other shape
                return Undecodable(f"is not a valid {message_name} message")

        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner_gen = handler.unary_stream

            async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                request = await admit(raw, context)
                async with contextlib.aclosing(inner_gen(request, context)) as items:
                    async for item in items:
                        yield item

            return grpc.unary_stream_rpc_method_handler(stream, None, handler.response_serializer)
        if handler.unary_stream is not None:  # a handler that writes with context.write
            inner_writer = handler.unary_stream

            async def writer(raw: bytes, context: grpc.aio.ServicerContext) -> None:
                await inner_writer(await admit(raw, context), context)

            return grpc.unary_stream_rpc_method_handler(writer, None, handler.response_serializer)
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await inner_unary(await admit(raw, context), context)

            return grpc.unary_unary_rpc_method_handler(unary, None, handler.response_serializer)
        return handler
