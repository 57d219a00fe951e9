"""The engine's public request/response types: what callers (gateway, CLI, benchmarks) exchange with it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Priority(enum.IntEnum):
    """Strict scheduling classes; a lower value is always served first."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2


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

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature <= 100.0) or self.temperature != self.temperature:
            raise InvalidRequestError("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidRequestError("seed", f"must be in [0, 2**63), got {self.seed!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty")
        if len(self.stop) > 16:
            raise InvalidRequestError("stop", f"at most 16 stop strings, got {len(self.stop)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if not (self.weight > 0):
            raise InvalidRequestError("weight", f"must be > 0, got {self.weight!r}")


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
