"""A request body, read under its size limit and decoded into its pydantic model.

The size is refused before anything is read when the client declares it, and as soon as it is
exceeded otherwise. A body that does not decode is INVALID_ARGUMENT naming each bad field, dotted
as OpenAI's ``param``.
"""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from gateway.errors import ErrorKind, GatewayError, invalid_argument
from protocol.limits import LIMITS, Violation

# A JSON body may spell a prompt with escapes: allow several times the prompt limit, then refuse.
MAX_BODY_BYTES = 4 * LIMITS.max_prompt_bytes + 65_536

Body = TypeVar("Body", bound=BaseModel)


async def read_body(request: Request) -> bytes:
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


def decode(model: type[Body], raw: bytes) -> Body:
    """The body as ``model``, or INVALID_ARGUMENT naming each bad field."""
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
