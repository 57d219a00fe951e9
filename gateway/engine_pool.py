"""Where the gateway sends a request: a pool of engine replicas serving one model, as a protocol.

The gateway knows only this seam; the pools themselves (a Ray Serve deployment of engine replicas,
or an engine in the gateway's own process) are the serving layer's (serving/pools.py). A pool streams
``RequestOutput`` deltas and stops the request in the engine when its caller closes the stream.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from protocol.model_info import ModelInfo
from protocol.requests import GenerationRequest, RequestOutput
from protocol.stats import EngineStats


class WorkerLostError(RuntimeError):
    """The replica serving a request died or became unreachable after it had streamed output (a
    loss before any output is retried by the pool itself); gateway/resume.py continues the stream."""


class EnginePool(Protocol):
    name: str

    async def describe(self) -> ModelInfo: ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]: ...

    def replica_stats(self) -> dict[str, EngineStats]: ...

    async def close(self) -> None:
        """Stop what the pool runs in the background (before its transport shuts down)."""
