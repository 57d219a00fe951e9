"""Field-by-field validation of a GenerateRequest; every violation is named, all at once."""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass

from gateway.api import pb
from gateway.errors import invalid_argument
from tenancy.admission import REQUEST_ID_PATTERN

MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 512
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_TOKENS_CEILING = 1_000_000
_ROLES = ("system", "user", "assistant")
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
PRIORITY_NAMES = {
    pb.PRIORITY_INTERACTIVE: "interactive",
    pb.PRIORITY_STANDARD: "standard",
    pb.PRIORITY_BATCH: "batch",
}


@dataclass(frozen=True)
class ValidRequest:
    model: str
    prompt: str | None
    messages: list[dict[str, str]] | None
    max_tokens: int | None  # None: the gateway's default
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    priority_hint: str | None  # None: the tenant's default
    request_id: str


def validate(req: pb.GenerateRequest) -> ValidRequest:
    """Return the request's values, or raise GatewayError(INVALID_ARGUMENT) naming each bad field."""
    bad: list[tuple[str, str]] = []
    if not req.model:
        bad.append(("model", "is required"))
    elif len(req.model) > 256:
        bad.append(("model", "is longer than 256 characters"))

    has_prompt, has_messages = bool(req.prompt), len(req.messages) > 0
    if has_prompt and has_messages:
        bad.append(("prompt", "prompt and messages are mutually exclusive; send one"))
    elif not has_prompt and not has_messages:
        bad.append(("prompt", "one of prompt or messages is required"))
    if len(req.prompt) > MAX_PROMPT_CHARS:
        bad.append(("prompt", f"is longer than {MAX_PROMPT_CHARS} characters"))
    if len(req.messages) > MAX_MESSAGES:
        bad.append(("messages", f"more than {MAX_MESSAGES} messages"))
    total = 0
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            bad.append((f"messages[{i}].role", f"must be one of {', '.join(_ROLES)}, got {m.role!r}"))
        total += len(m.content)
    if total > MAX_PROMPT_CHARS:
        bad.append(("messages", f"contents are longer than {MAX_PROMPT_CHARS} characters in all"))

    if req.HasField("max_tokens") and not (1 <= req.max_tokens <= MAX_TOKENS_CEILING):
        bad.append(("max_tokens", f"must be between 1 and {MAX_TOKENS_CEILING}, got {req.max_tokens}"))
    temperature = req.temperature if req.HasField("temperature") else 1.0
    if not (math.isfinite(temperature) and 0.0 <= temperature <= 2.0):
        bad.append(("temperature", f"must be in [0, 2], got {temperature}"))
    top_p = req.top_p if req.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        bad.append(("top_p", f"must be in (0, 1], got {top_p}"))
    if req.top_k > 1_000_000:
        bad.append(("top_k", f"must be at most 1000000, got {req.top_k}"))
    if req.HasField("seed") and req.seed >= 2**63:
        bad.append(("seed", "must be below 2**63"))
    if len(req.stop) > MAX_STOP:
        bad.append(("stop", f"at most {MAX_STOP} stop strings, got {len(req.stop)}"))
    for i, s in enumerate(req.stop):
        if not s or len(s) > MAX_STOP_CHARS:
            bad.append((f"stop[{i}]", f"must be 1 to {MAX_STOP_CHARS} characters"))
    if req.priority != pb.PRIORITY_UNSPECIFIED and req.priority not in PRIORITY_NAMES:
        bad.append(("priority", f"unknown priority {req.priority}"))
    if req.request_id and not _REQUEST_ID.fullmatch(req.request_id):
        bad.append(
            ("request_id", "must be 1-128 letters, digits or . _ : - and start with a letter or digit")
        )
    if bad:
        raise invalid_argument(bad)

    return ValidRequest(
        model=req.model,
        prompt=req.prompt if has_prompt else None,
        messages=[{"role": m.role, "content": m.content} for m in req.messages] if has_messages else None,
        max_tokens=req.max_tokens if req.HasField("max_tokens") else None,
        temperature=temperature,
        top_p=top_p,
        top_k=req.top_k,
        seed=req.seed if req.HasField("seed") else None,
        stop=tuple(req.stop),
        priority_hint=PRIORITY_NAMES.get(req.priority),
        request_id=req.request_id or uuid.uuid4().hex,
    )
