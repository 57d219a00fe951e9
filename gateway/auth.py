"""Authentication interceptor: ``authorization: Bearer <key>`` metadata -> the caller, before any
handler runs.

The rule itself is the request path's ``authenticate`` (every front calls the same one); this module
only reads the gRPC metadata and answers UNAUTHENTICATED in gRPC's terms. The principal travels to
the handler in a context variable (the interceptor's wrapper runs in the handler's own task). Health
checks and reflection need no key.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from gateway.api import SERVICE_NAME
from gateway.errors import GatewayError
from gateway.grpc_status import abort
from tenancy import Principal

Authenticate = Callable[[str | None], Principal]  # RequestPath.authenticate

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


class AuthInterceptor(grpc.aio.ServerInterceptor):
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

        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    principal = authenticate(_authorization(context.invocation_metadata()))
                except GatewayError as err:
                    await abort(context, err)
                    return
                _principal.set(principal)
                async with contextlib.aclosing(inner_stream(request, context)) as items:
                    async for item in items:
                        yield item

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    principal = authenticate(_authorization(context.invocation_metadata()))
                except GatewayError as err:
                    await abort(context, err)
                    return None
                _principal.set(principal)
                return await inner_unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, handler.request_deserializer, handler.response_serializer
            )
        return handler
