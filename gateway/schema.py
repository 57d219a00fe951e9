"""What every front exchanges with the request path: a neutral request in, neutral deltas out.

A front (the gRPC servicer, the OpenAI-compatible HTTP front) decodes its wire format into an
:class:`InferenceRequest` and encodes each :class:`Delta` back; the rules in between exist once, in
gateway/request_path.py. Nothing here knows a transport.

Growing the API: a new request field (``n`` choices, ``logprobs``) is added here with a default that
means "as before", checked in gateway/validation.py, and carried to the engine by the path; what it adds
to the output goes on :class:`Delta` (e.g. a choice ``index``) with a default, so fronts that ignore it
keep working.
"""

from __future__ import annotations

from dataclasses import dataclass

from common import Priority
from protocol.requests import FinishReason
from protocol.structured import Constraint

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatMessage:
    role: str  # one of ROLES
    content: str


@dataclass(frozen=True, kw_only=True)
class InferenceRequest:
    """One completion request as any front sends it; unchecked (see ``validation.validate``).

    ``None`` means "not given": the path applies the default (the tenant's priority, the gateway's
    ``default_max_tokens`` bounded by the context, a generated request id).
    """

    model: str
    prompt: str | None = None  # raw text, no template; exactly one of prompt and messages
    messages: tuple[ChatMessage, ...] | None = None  # chat: the model's template applies
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    priority: Priority | None = None  # a hint, capped by the tenant's ceiling
    request_id: str | None = None  # echoed on every delta; also the admission's idempotency key
    n: int = 1  # completions of the one prompt (choices); copies share the prompt's KV blocks
    logprobs: int | None = None  # None: none; k: each token's log-probability and its k best rivals
    user: str | None = None  # the client's own end-user id: logged with the request id, never trusted
    constraint: Constraint | None = None  # what the output must match: a JSON schema, a regex...
    speculative: bool | None = None  # opt into speculative decoding; None: the tenant's setting


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # prompt tokens served from this tenant's prefix cache


@dataclass(frozen=True)
class TopLogprob:
    token: str
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability and the most likely tokens at its position, best first."""

    token: str  # the token's text (a token may hold part of a character: then it shows U+FFFD)
    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Delta:
    """The text and tokens new since the previous delta of its choice.

    A choice's last delta has its finish reason; the request's very last delta carries the usage of
    all its choices (the prompt counted once: what admission metered).
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    index: int = 0  # which choice, for n > 1
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token id, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ServedModel:
    """A model a tenant may call, and where it is served."""

    id: str
    context_length: int
    pool: str  # "shared" or the tenant's dedicated pool
