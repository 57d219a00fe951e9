"""The engine's public request/response types: what callers (gateway, CLI, benchmarks) exchange with it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common import Priority
from protocol.adapters import LoraRequest
from protocol.limits import LIMITS, sampling_violations
from protocol.structured import Constraint


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the model's context length
    CANCELLED = "cancelled"  # aborted by the caller
    ERROR = "error"


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as given; the message names the offending field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.detail = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # crosses process boundaries (Ray) intact
        return (type(self), (self.field, self.detail))


class EngineDeadError(RuntimeError):
    """The engine thread is not running (stopped, or crashed): the replica cannot serve."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # benchmarks: generate exactly max_tokens
    logprobs: int | None = None  # None: none; k: each token's log-probability and its k best rivals
    constraint: Constraint | None = None  # what the output must match (a JSON schema, a regex...)

    def __post_init__(self) -> None:
        bad = sampling_violations(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
            logprobs=self.logprobs,
        )
        if bad:
            raise InvalidRequestError(*bad[0])

    @property
    def greedy(self) -> bool:
        return self.temperature < LIMITS.greedy_below_temperature


@dataclass(frozen=True)
class KvShare:
    """A tenant's share of each replica's KV blocks, as fractions of the pool (admins set it).

    ``floor``: blocks the tenant keeps whatever others do: another tenant neither evicts its
    prefix-cache entries nor preempts its sequences to take them. ``cap``: the most it may hold,
    its cached prefixes included (its only running sequence may still grow past it, so a cap never
    stops a request that fits the model's context).
    """

    floor: float = 0.0
    cap: float = 1.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.floor <= 1.0):
            raise InvalidRequestError("kv_share.floor", f"must be within [0, 1], got {self.floor!r}")
        if not (0.0 < self.cap <= 1.0):
            raise InvalidRequestError("kv_share.cap", f"must be within (0, 1], got {self.cap!r}")
        if self.floor > self.cap:
            raise InvalidRequestError("kv_share", f"floor {self.floor} is above cap {self.cap}")


@dataclass
class GenerationRequest:
    """One completion request as the engine sees it: tokens in, deltas out."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = "default"
    priority: Priority = Priority.STANDARD
    weight: float = 1.0  # the tenant's fair-share weight inside its priority class
    cache_salt: bytes = b""  # prefix-cache isolation: derived per tenant by the gateway
    kv_share: KvShare = field(default_factory=KvShare)  # the tenant's floor and cap of KV blocks
    # A stream resumed after its replica was lost: the last N prompt tokens are output an earlier
    # attempt generated and delivered. Text (a character split at the cut, text held back for a stop
    # string) and stop strings continue from them exactly as an uninterrupted run would.
    num_resumed_tokens: int = 0
    # A retry of the request with this engine id, which a replica failed or lost before any output:
    # the router ranks that replica last.
    retry_of: str | None = None
    adapter: LoraRequest | None = None  # a LoRA adapter over the base model (None: the base model)
    # Opted into speculative decoding (by its tenant or itself): the engine may verify proposed tokens
    # for it several at a time. Its output is the same either way (greedy) or drawn from the same
    # distribution (sampled).
    speculative: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if not (0 <= self.num_resumed_tokens < len(self.prompt_token_ids)):
            raise InvalidRequestError("num_resumed_tokens", "must leave at least one prompt token")
        if not (self.weight > 0):
            raise InvalidRequestError("weight", f"must be > 0, got {self.weight!r}")


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (before temperature or top-k/top-p, as
    vLLM reports by default) and the most likely tokens at that position, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """One streamed delta. The last one has ``finish_reason`` set and the final counts."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    # The error is the request's own (its output constraint cannot be followed): it would fail the
    # same way anywhere, so it is not retried, and the caller is told it was its request.
    request_fault: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
