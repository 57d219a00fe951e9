"""Field-by-field validation of a neutral request; every violation is named, all at once.

The sampling fields are checked by ``protocol.limits.sampling_violations`` against its ``LIMITS``,
the very rules the engine applies, so the gateway can never accept what the engine would refuse (or
the other way round). What only the gateway knows stays here: the prompt's size in UTF-8 bytes (checked
before any tokenizing work is spent on it), chat roles, the model name and the request id's shape.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from common import Priority
from gateway.errors import invalid_argument
from gateway.schema import ROLES, ChatMessage, InferenceRequest
from protocol.limits import LIMITS, Violation, sampling_violations
from protocol.structured import Constraint, size_violations
from tenancy.admission import REQUEST_ID_PATTERN

MAX_MODEL_NAME_CHARS = 256
MAX_USER_CHARS = 256
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed validation, with its defaults that need no tenant or model filled in."""

    model: str
    prompt: str | None
    messages: list[dict[str, str]] | None  # as the tokenizer's chat template takes them
    prompt_bytes: int  # UTF-8 bytes of the prompt, or of all message contents together
    max_tokens: int | None  # None: the gateway's default, bounded by the context
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    priority: Priority | None  # None: the tenant's default
    request_id: str
    n: int
    logprobs: int | None
    user: str | None
    constraint: Constraint | None = None  # its grammar is checked once the model is known
    speculative: bool | None = None  # None: the tenant's setting


_LONE_SURROGATE = "is not valid Unicode text (it holds a lone surrogate)"


def _utf8_bytes(text: str) -> int | None:
    """The UTF-8 size of ``text``; None if it holds a lone surrogate (possible from JSON ``\\ud800``)."""
    if text.isascii():  # O(1) in CPython: most prompts are counted without copying them
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return None


def _prompt_violations(
    prompt: str | None, messages: Sequence[ChatMessage] | None
) -> tuple[list[Violation], int]:
    """The prompt's violations, and its size: UTF-8 bytes of the prompt and every message content."""
    bad: list[Violation] = []
    if prompt and messages:
        bad.append(("prompt", "prompt and messages are mutually exclusive; send one"))
    elif not prompt and not messages:
        bad.append(("prompt", "one of prompt or messages is required"))
    limit = LIMITS.max_prompt_bytes
    size = 0
    if prompt:
        n = _utf8_bytes(prompt)
        if n is None:
            bad.append(("prompt", _LONE_SURROGATE))
        elif n > limit:
            bad.append(("prompt", f"is {n} bytes of UTF-8; the limit is {limit}"))
        size += n or 0
    if messages and len(messages) > LIMITS.max_messages:  # its length first: a long list is not walked
        bad.append(("messages", f"at most {LIMITS.max_messages} messages, got {len(messages)}"))
    elif messages:
        total = 0
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                bad.append((f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {m.role!r}"))
            n = _utf8_bytes(m.content)
            if n is None:
                bad.append((f"messages[{i}].content", _LONE_SURROGATE))
            total += n or 0
        if total > limit:
            bad.append(("messages", f"contents are {total} bytes of UTF-8 in all; the limit is {limit}"))
        size += total
    return bad, size


def validate(request: InferenceRequest, decode_violations: Sequence[Violation] = ()) -> ValidRequest:
    """Return the request's values, or raise GatewayError(INVALID_ARGUMENT) naming each bad field.

    ``decode_violations`` are what the front found while decoding its wire format (an unknown enum
    value, a wrong JSON type); they are reported first, together with everything found here.
    """
    bad: list[Violation] = list(decode_violations)
    if not request.model:
        bad.append(("model", "is required"))
    elif len(request.model) > MAX_MODEL_NAME_CHARS:
        bad.append(("model", f"is longer than {MAX_MODEL_NAME_CHARS} characters"))
    prompt_bad, prompt_bytes = _prompt_violations(request.prompt, request.messages)
    bad += prompt_bad
    # An unset max_tokens is resolved after tokenizing (the context bounds it): check the others.
    bad += sampling_violations(
        max_tokens=1 if request.max_tokens is None else request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop=request.stop,
        logprobs=request.logprobs,
    )
    if not (isinstance(request.n, int) and 1 <= request.n <= LIMITS.max_choices):
        bad.append(("n", f"must be from 1 to {LIMITS.max_choices} choices, got {request.n!r}"))
    if request.constraint is not None:
        bad += size_violations(request.constraint)
    if request.user is not None and len(request.user) > MAX_USER_CHARS:
        bad.append(("user", f"is longer than {MAX_USER_CHARS} characters"))
    if request.request_id is not None and not _REQUEST_ID.fullmatch(request.request_id):
        bad.append(
            ("request_id", "must be 1-128 letters, digits or . _ : - and start with a letter or digit")
        )
    if bad:
        raise invalid_argument(bad)
    return ValidRequest(
        model=request.model,
        prompt=request.prompt or None,
        messages=[{"role": m.role, "content": m.content} for m in request.messages]
        if request.messages
        else None,
        prompt_bytes=prompt_bytes,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop=tuple(request.stop),
        priority=request.priority,
        request_id=request.request_id or uuid.uuid4().hex,
        n=request.n,
        logprobs=request.logprobs,
        speculative=request.speculative,
        user=request.user,
        constraint=request.constraint,
    )
