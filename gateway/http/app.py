"""The FastAPI application: the routes, each a translation between HTTP and the request path.

The key is authenticated from the ``Authorization`` header before a byte of the body is read; the body
is decoded into the neutral request by its endpoint (fields Loom cannot honour refused by name), and
the path's deltas go back as server-sent events or one answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from gateway.errors import GatewayError
from gateway.http.body import decode, read_body
from gateway.http.endpoints import CHAT, COMPLETIONS, Endpoint
from gateway.http.errors import DOCUMENTED, on_gateway_error, on_internal_error
from gateway.http.schema import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from gateway.http.streaming import stream_answer, whole_answer
from gateway.request_path import RequestPath
from tenancy import Principal


def build_app(path: RequestPath, serving: Callable[[], bool]) -> FastAPI:
    """The routes over ``path``; ``serving`` says whether /health answers ok (not while draining)."""
    app = FastAPI(
        title="Loom",
        summary="OpenAI-compatible completions on Loom's multi-tenant engine pool",
        version="1",
        docs_url=None,
        redoc_url=None,
    )
    app.add_exception_handler(GatewayError, on_gateway_error)
    app.add_exception_handler(Exception, on_internal_error)
    responses: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in DOCUMENTED}

    def authenticate(request: Request) -> Principal:
        return path.authenticate(request.headers.get("authorization"))

    async def complete(request: Request, endpoint: Endpoint) -> Response:
        principal = authenticate(request)  # before a byte of the body is read
        ticket = path.enter(principal)  # the tenant's bound on requests not yet admitted
        try:
            try:
                body = await decode(
                    endpoint.body_model, await read_body(request, path.settings.http_body_timeout_s)
                )
            except GatewayError as err:  # counted under the tenant, as the path counts its own
                path.record_refusal(principal, err)
                raise
            neutral, bad = endpoint.to_request(body)
            deltas = path.generate(principal, neutral, decode_violations=bad, ticket=ticket)
            if body.stream:
                return await stream_answer(deltas, endpoint, body, path.stall_watch, request)
            return await whole_answer(deltas, endpoint, body, request)
        finally:
            ticket.release()  # the path released it at admission, unless the request never got there

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=responses)
    async def chat_completions(request: Request) -> Response:
        return await complete(request, CHAT)

    @app.post("/v1/completions", response_model=Completion, responses=responses)
    async def completions(request: Request) -> Response:
        return await complete(request, COMPLETIONS)

    @app.get("/v1/models", response_model=ModelList, responses=responses)
    async def models(request: Request) -> ModelList:
        cards = [
            ModelCard(id=m.id, context_length=m.context_length, pool=m.pool)
            for m in path.list_models(authenticate(request))
        ]
        return ModelList(data=cards)

    @app.get("/health")
    async def health() -> Response:
        ok = serving()
        return JSONResponse({"status": "ok" if ok else "draining"}, status_code=200 if ok else 503)

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with the request bodies documented: the routes read them by hand
    (authentication comes first), so FastAPI cannot see them."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for route, model in (
            ("/v1/chat/completions", ChatCompletionRequest),
            ("/v1/completions", CompletionRequest),
        ):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][route]["post"]["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
                },
            }
        app.openapi_schema = schema
    return app.openapi_schema
