"""The OpenAI-compatible HTTP front: a second thin adapter over the request path, beside gRPC.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as server-sent events ending with
``data: [DONE]``, or whole), ``GET /v1/models`` and ``GET /health``, under FastAPI and uvicorn in the
gateway's own event loop. Like the gRPC servicer it only translates: the key is authenticated before
the body is read, the body is decoded into the neutral request (fields Loom cannot honour refused by
name), deltas become OpenAI chunks, and refusals become OpenAI's error JSON with the HTTP status the
SDKs expect. Validation, admission, priority, salt, resume, metrics and usage are the path's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import ssl
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from gateway.errors import ErrorKind, GatewayError, invalid_argument
from gateway.openai_schema import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    unsupported_fields,
)
from gateway.request_path import RequestPath
from gateway.schema import ChatMessage, Delta, InferenceRequest, TokenLogprobs
from gateway.settings import GatewaySettings
from gateway.tls import TlsFiles
from protocol.limits import LIMITS, Violation
from protocol.requests import FinishReason
from tenancy import Principal

log = logging.getLogger(__name__)

# (HTTP status, OpenAI error type) per kind: the status each SDK maps to its exception class.
_STATUS: dict[ErrorKind, tuple[int, str]] = {
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
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
# A JSON body may spell a prompt with escapes: allow several times the prompt limit, then refuse.
MAX_BODY_BYTES = 4 * LIMITS.max_prompt_bytes + 65_536


def error_json(err: GatewayError) -> JSONResponse:
    status, kind = _STATUS[err.kind]
    param = err.violations[0][0] if err.violations else ("model" if err.kind is ErrorKind.NOT_FOUND else None)
    body = ErrorResponse.model_validate(
        {"error": {"message": err.message, "type": kind, "param": param, "code": err.limit or err.kind.value}}
    )
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
        headers["retry-after-ms"] = str(math.ceil(err.retry_after_s * 1000))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _decode(model: type[BaseModel], raw: bytes) -> Any:
    """The body as ``model``, or INVALID_ARGUMENT naming each bad field (dotted, as OpenAI's param)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        bad: list[Violation] = []
        for e in exc.errors(include_url=False):
            if e["type"] == "json_invalid":
                bad.append(("body", "is not valid JSON"))
                continue
            loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".")
            bad.append((loc or "body", e["msg"]))
        raise invalid_argument(bad or [("body", "is not a valid request")]) from None


def _stop(value: str | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _text_of(content: str | list[dict[str, Any]] | None) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content)
    return content or ""


def _common(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "model": body.model,
        "stop": _stop(body.stop),
        "n": body.n,
        "priority": body.priority,
        "request_id": body.request_id,
        "user": body.user,
    }
    for name in ("temperature", "top_p", "top_k", "seed"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    return fields


def chat_request(body: ChatCompletionRequest) -> tuple[InferenceRequest, list[Violation]]:
    bad = unsupported_fields(body)
    if body.top_logprobs is not None and not body.logprobs:
        bad.append(("top_logprobs", "needs logprobs: true"))
    roles = {"developer": "system"}  # OpenAI's newer name for the system turn
    messages = tuple(ChatMessage(roles.get(m.role, m.role), _text_of(m.content)) for m in body.messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request = InferenceRequest(
        messages=messages or None,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        **_common(body),
    )
    return request, bad


def completion_request(body: CompletionRequest) -> tuple[InferenceRequest, list[Violation]]:
    bad = unsupported_fields(body)
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        else:
            bad.append(
                (
                    "prompt",
                    "send one text prompt per request (token-id and batched prompts are not supported)",
                )
            )
            prompt = ""
    request = InferenceRequest(
        prompt=prompt or None, max_tokens=body.max_tokens, logprobs=body.logprobs, **_common(body)
    )
    return request, bad


@dataclass
class _Choice:
    """What a non-streamed answer accumulates for one choice."""

    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


def _usage(delta: Delta) -> dict[str, Any]:
    u = delta.usage
    assert u is not None
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


def _top(entries: list[Any]) -> list[dict[str, Any]]:
    return [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())} for t in entries]


def chat_logprobs(items: list[TokenLogprobs] | tuple[TokenLogprobs, ...]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": list(lp.token.encode()),
                "top_logprobs": _top(list(lp.top)),
            }
            for lp in items
        ]
    }


def completion_logprobs(
    items: list[TokenLogprobs] | tuple[TokenLogprobs, ...], offset: int
) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy logprobs object, and the text offset after these tokens."""
    offsets = []
    for lp in items:
        offsets.append(offset)
        offset += len(lp.token)
    body = {
        "tokens": [lp.token for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in items],
        "text_offset": offsets,
    }
    return body, offset


class _Api:
    """One endpoint kind (chat or completions): how its body decodes and its answers encode."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.body_model: type[BaseModel] = ChatCompletionRequest if chat else CompletionRequest
        self.object = "chat.completion" if chat else "text_completion"
        self.id_prefix = "chatcmpl-" if chat else "cmpl-"

    def to_request(self, body: Any) -> tuple[InferenceRequest, list[Violation]]:
        return chat_request(body) if self.chat else completion_request(body)

    def chunk_choice(self, delta: Delta, first: bool, offsets: dict[int, int]) -> dict[str, Any]:
        finish = _FINISH.get(delta.finish_reason) if delta.finish_reason else None
        if self.chat:
            d: dict[str, Any] = {"content": delta.text}
            if first:
                d["role"] = "assistant"
            lp = chat_logprobs(delta.logprobs) if delta.logprobs is not None else None
            return {"index": delta.index, "delta": d, "logprobs": lp, "finish_reason": finish}
        lp = None
        if delta.logprobs is not None:
            lp, offsets[delta.index] = completion_logprobs(delta.logprobs, offsets.get(delta.index, 0))
        return {"index": delta.index, "text": delta.text, "logprobs": lp, "finish_reason": finish}

    def whole(
        self, rid: str, model: str, choices: dict[int, _Choice], usage: dict[str, Any], want_lp: bool
    ) -> Any:
        created = int(time.time())
        if self.chat:
            return ChatCompletion.model_validate(
                {
                    "id": self.id_prefix + rid,
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": i,
                            "message": {"role": "assistant", "content": c.text},
                            "logprobs": chat_logprobs(c.logprobs) if want_lp else None,
                            "finish_reason": c.finish_reason,
                        }
                        for i, c in sorted(choices.items())
                    ],
                    "usage": usage,
                }
            )
        return Completion.model_validate(
            {
                "id": self.id_prefix + rid,
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": i,
                        "text": c.text,
                        "logprobs": completion_logprobs(c.logprobs, 0)[0] if want_lp else None,
                        "finish_reason": c.finish_reason,
                    }
                    for i, c in sorted(choices.items())
                ],
                "usage": usage,
            }
        )


_CHAT, _COMPLETIONS = _Api(chat=True), _Api(chat=False)


class HttpFront:
    """The FastAPI application over a request path, and the uvicorn server that serves it."""

    def __init__(self, path: RequestPath, settings: GatewaySettings, serving: Callable[[], bool]) -> None:
        self.path = path
        self.settings = settings
        self._serving = serving
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None
        self.app = self._build()

    # ---- the application ---------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI(
            title="Loom",
            summary="OpenAI-compatible completions on Loom's multi-tenant engine pool",
            version="1",
            docs_url=None,
            redoc_url=None,
        )
        app.add_exception_handler(GatewayError, lambda _req, exc: error_json(exc))  # type: ignore[arg-type]
        app.add_exception_handler(Exception, _internal_error)
        responses: dict[int | str, dict[str, Any]] = {
            code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 429, 500, 503)
        }

        @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=responses)
        async def chat_completions(request: Request) -> Response:
            return await self._complete(request, _CHAT)

        @app.post("/v1/completions", response_model=Completion, responses=responses)
        async def completions(request: Request) -> Response:
            return await self._complete(request, _COMPLETIONS)

        @app.get("/v1/models", response_model=ModelList, responses=responses)
        async def models(request: Request) -> ModelList:
            principal = self._authenticate(request)
            return ModelList(
                data=[
                    ModelCard(id=m.id, context_length=m.context_length, pool=m.pool)
                    for m in self.path.list_models(principal)
                ]
            )

        @app.get("/health")
        async def health() -> Response:
            ok = self._serving()
            return JSONResponse({"status": "ok" if ok else "draining"}, status_code=200 if ok else 503)

        # The request bodies are read by hand (authentication comes first); document them anyway.
        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                schema = get_openapi(
                    title=app.title, version=app.version, summary=app.summary, routes=app.routes
                )
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

        app.openapi = openapi  # type: ignore[method-assign]
        return app

    def _authenticate(self, request: Request) -> Principal:
        return self.path.authenticate(request.headers.get("authorization"))

    async def _complete(self, request: Request, api: _Api) -> Response:
        principal = self._authenticate(request)  # before a byte of the body is read
        parsed = _decode(api.body_model, await _read_body(request))
        neutral, bad = api.to_request(parsed)
        deltas = self.path.generate(principal, neutral, decode_violations=bad)
        if parsed.stream:
            return await self._stream(deltas, api, parsed, request)
        return await self._whole(deltas, api, parsed, request)

    async def _stream(
        self, deltas: AsyncGenerator[Delta, None], api: _Api, body: Any, request: Request
    ) -> Response:
        # The first delta comes before any header: a refusal is still an HTTP status, not an SSE event.
        try:
            first = await anext(deltas)
        except StopAsyncIteration:  # pragma: no cover - the path always yields a final delta
            raise GatewayError(ErrorKind.INTERNAL, "internal error") from None
        except BaseException:
            await deltas.aclose()
            raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        header = {
            "id": api.id_prefix + first.request_id,
            "object": api.object + ("" if not api.chat else ".chunk"),
            "created": int(time.time()),
            "model": body.model,
        }

        async def events() -> AsyncIterator[bytes]:
            started: set[int] = set()
            offsets: dict[int, int] = {}
            async with contextlib.aclosing(deltas):
                delta: Delta | None = first
                try:
                    while delta is not None:
                        choice = api.chunk_choice(delta, delta.index not in started, offsets)
                        started.add(delta.index)
                        chunk = {**header, "choices": [choice]}
                        if include_usage:
                            chunk["usage"] = None
                        yield _sse(chunk)
                        if delta.usage is not None and include_usage:
                            yield _sse({**header, "choices": [], "usage": _usage(delta)})
                        delta = await anext(deltas, None)
                except GatewayError as err:  # after the headers: the error travels as an event
                    status, kind = _STATUS[err.kind]
                    yield _sse(
                        {"error": {"message": err.message, "type": kind, "param": None, "code": status}}
                    )
            yield b"data: [DONE]\n\n"

        return _StallGuardedStream(
            self.settings.stream_stall_timeout_s,
            events(),
            media_type="text/event-stream",
            headers={"X-Request-Id": first.request_id, "Cache-Control": "no-cache"},
        )

    async def _whole(
        self, deltas: AsyncGenerator[Delta, None], api: _Api, body: Any, request: Request
    ) -> Response:
        choices: dict[int, _Choice] = {}
        last: Delta | None = None

        async def collect() -> None:
            nonlocal last
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    c = choices.setdefault(delta.index, _Choice())
                    c.text += delta.text
                    c.logprobs += delta.logprobs or ()
                    if delta.finish_reason is not None:
                        c.finish_reason = _FINISH.get(delta.finish_reason)
                    last = delta

        await _unless_client_leaves(collect(), request)
        assert last is not None and last.usage is not None
        want_lp = body.logprobs if api.chat else body.logprobs is not None
        answer = api.whole(last.request_id, body.model, choices, _usage(last), bool(want_lp))
        return JSONResponse(answer.model_dump(), headers={"X-Request-Id": last.request_id})

    # ---- serving -----------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> int:
        s = self.settings
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=s.http_keepalive_s,
            timeout_graceful_shutdown=max(1, math.ceil(s.drain_grace_s)),
            ssl_certfile=s.tls_cert_file,
            ssl_keyfile=s.tls_key_file,
            ssl_ca_certs=s.tls_client_ca_file,
            ssl_cert_reqs=ssl.CERT_REQUIRED if s.tls_client_ca_file else ssl.CERT_NONE,
        )
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # the host process owns signals
        self._task = asyncio.create_task(server.serve())
        while not server.started:
            if self._task.done():
                await self._task  # raises what stopped it (a port in use...)
                raise OSError(f"the HTTP front did not start on {host}:{port}")
            await asyncio.sleep(0.01)
        self._server = server
        self.port = server.servers[0].sockets[0].getsockname()[1]
        return self.port

    def use_certificate(self, files: TlsFiles) -> None:
        """Serve a renewed certificate to new connections (gateway/tls.py). A new client CA is added
        beside the old one: Python's SSL context cannot forget a CA, so dropping one needs a restart."""
        context = self._server.config.ssl if self._server is not None else None
        if context is None:
            return
        context.load_cert_chain(files.cert_file, files.key_file)
        if files.client_ca_file:
            context.load_verify_locations(files.client_ca_file)

    async def stop(self) -> None:
        """Stop accepting; streams in flight get up to the drain grace to finish."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self._server = None


class _StallGuardedStream(StreamingResponse):
    """Server-sent events whose every write must complete within ``stall_s``.

    A write waits only once the socket's buffers are full, that is when the client has read nothing
    for a while; then the stream is ended (the path's generator closes, aborting the engine work and
    settling the lease) instead of holding its slot and buffers for as long as the client lingers.
    """

    def __init__(self, stall_s: float, content: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.stall_s = stall_s

    async def stream_response(self, send: Any) -> None:
        async def guarded(message: Any) -> None:
            async with asyncio.timeout(self.stall_s):  # no task per write, unlike wait_for
                await send(message)

        try:
            await super().stream_response(guarded)
        except TimeoutError:
            log.warning("a client read nothing for %.0f s; its stream was ended", self.stall_s)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug outside the path: 500 in OpenAI's shape with an id to quote; the traceback only in the log."""
    ref = uuid.uuid4().hex[:16]
    log.error("HTTP %s %s failed (ref %s)", request.method, request.url.path, ref, exc_info=exc)
    return error_json(GatewayError(ErrorKind.INTERNAL, f"internal error (ref {ref})"))


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def _read_body(request: Request) -> bytes:
    """The body, refused (INVALID_ARGUMENT) past ``MAX_BODY_BYTES`` without reading the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise invalid_argument([("body", f"is {declared} bytes; the limit is {MAX_BODY_BYTES}")])
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise invalid_argument([("body", f"is over the limit of {MAX_BODY_BYTES} bytes")])
            chunks.append(chunk)
    except ClientDisconnect:  # the client left while sending its body: not a server error
        raise GatewayError(ErrorKind.CANCELLED, "the client went away") from None
    return b"".join(chunks)


async def _unless_client_leaves(work: Any, request: Request) -> None:
    """Run ``work``; if the client disconnects first, cancel it (which aborts the engine request and
    settles the lease) instead of computing an answer nobody will read."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise GatewayError(ErrorKind.CANCELLED, "the client went away")
    task.result()
