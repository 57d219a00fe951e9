"""Authentication interceptor: ``authorization: Bearer <key>`` -> the tenant, before any handler runs.

The principal travels to the handler in a context variable (the interceptor's wrapper runs in the
handler's own task). Health checks and reflection need no key.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from gateway.api import SERVICE_NAME
from gateway.errors import GatewayError, to_status
from tenancy import AuthenticationError, Principal, Tenancy

_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("loom_principal", default=None)


def current_principal() -> Principal:
    principal = _principal.get()
    if principal is None:  # a handler reached without the interceptor: a wiring bug, not a client error
        raise RuntimeError("no authenticated principal in this context")
    return principal


def _token(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tenancy: Tenancy, on_refused: Callable[[], None] | None = None) -> None:
        self._tenancy = tenancy
        self._on_refused = on_refused

    def _authenticate(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> Principal:
        token = _token(metadata)
        if not token:
            raise GatewayError(
                grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <api key>' metadata"
            )
        try:
            return self._tenancy.authenticate(token)
        except AuthenticationError as exc:
            raise GatewayError(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        authenticate = self._authenticate
        on_refused = self._on_refused

        async def refuse(err: GatewayError, context: grpc.aio.ServicerContext) -> None:
            if on_refused is not None:
                on_refused()
            await context.abort_with_status(to_status(err))

        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    principal = authenticate(context.invocation_metadata())
                except GatewayError as err:
                    await refuse(err, context)
                    return
                _principal.set(principal)
                async for item in inner_stream(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    principal = authenticate(context.invocation_metadata())
                except GatewayError as err:
                    await refuse(err, context)
                    return None
                _principal.set(principal)
                return await inner_unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, handler.request_deserializer, handler.response_serializer
            )
        return handler
