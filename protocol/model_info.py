"""What an engine serves, as a replica reports it to the pool that routes to it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    model: str  # the name clients use
    context_length: int  # tokens: prompt and output together
    vocab_size: int
    pool: str = ""  # the engine pool the replica belongs to ("" in-process)
    device: str = "cpu"
    pid: int = 0  # the process the engine runs in
