"""A request body, read under its size limit and decoded into its pydantic model.

The size is refused before anything is read when the client declares it, and as soon as it is
exceeded otherwise. A body that does not decode is INVALID_ARGUMENT naming its first bad fields,
dotted as OpenAI's ``param``; the errors are made without copies of the input they refer to.

Large bodies are decoded in the decoder process (gateway/http/decoder.py): a decode holds the GIL
throughout, so on a thread it would still stall the event loop.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar, cast

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from gateway.errors import ErrorKind, GatewayError, invalid_argument
from gateway.http.decoder import DecoderProcess
from gateway.http.schema import compact_extras
from protocol.limits import LIMITS, Violation

# A JSON body may spell a prompt with escapes: allow several times the prompt limit, then refuse.
MAX_BODY_BYTES = 4 * LIMITS.max_prompt_bytes + 65_536

# Bodies above this size are decoded in the decoder process (below it, a decode takes at most a few
# milliseconds, less than the hop).
INLINE_DECODE_BYTES = 64 * 1024

Body = TypeVar("Body", bound=BaseModel)

_decoder: DecoderProcess | None = None


async def read_body(request: Request, timeout_s: float) -> bytes:
    """The body, refused (INVALID_ARGUMENT) past ``MAX_BODY_BYTES`` without reading the rest, and
    given up (DEADLINE_EXCEEDED) if it has not all arrived within ``timeout_s``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large(f"is {declared} bytes; the limit is {MAX_BODY_BYTES}")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise _too_large(f"is over the limit of {MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
    except ClientDisconnect:  # the client left while sending its body: not a server error
        raise GatewayError(ErrorKind.CANCELLED, "the client went away") from None
    except TimeoutError:  # HTTP says it precisely: 408, the client was too slow to send its request
        raise GatewayError(
            ErrorKind.DEADLINE_EXCEEDED,
            f"the request body did not arrive within {timeout_s:g} s",
            http_status=408,
        ) from None
    return b"".join(chunks)


def _too_large(why: str) -> GatewayError:
    """413: the rest of the body is never read (the connection closes after the answer)."""
    err = invalid_argument([("body", why)])
    err.http_status = 413
    return err


async def decode(model: type[Body], raw: bytes) -> Body:
    """The body as ``model``, or INVALID_ARGUMENT naming its bad fields; large bodies in the decoder
    process."""
    global _decoder
    if len(raw) <= INLINE_DECODE_BYTES:
        return decode_now(model, raw)
    if _decoder is None:
        _decoder = DecoderProcess()
    return cast(Body, await _decoder.decode(model, raw))


def decode_now(model: type[Body], raw: bytes) -> Body:
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        bad: list[Violation] = []
        for e in exc.errors(include_url=False, include_context=False, include_input=False):
            if e["type"] == "json_invalid":
                bad.append(("body", "is not valid JSON"))
                continue
            parts = [p for p in e["loc"] if not _is_union_branch(p)]
            loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
            bad.append((loc or "body", e["msg"]))
        raise invalid_argument(bad or [("body", "is not a valid request")]) from None
    compact_extras(body)
    return body


# pydantic names the member of a union that failed inside an error's location (``stop.str``,
# ``stop.list[str]``); the client's field is ``stop``. No field of these bodies is spelled like a type.
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _is_union_branch(part: str | int) -> bool:
    return isinstance(part, str) and (part in _TYPE_NAMES or "[" in part or "-" in part)
