"""What a caller's thread asks of the engine thread (worker/async_engine.py), one typed command each."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.requests import GenerationRequest


@dataclass(frozen=True)
class AddRequest:
    request: GenerationRequest


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


EngineCommand = AddRequest | AbortRequest
