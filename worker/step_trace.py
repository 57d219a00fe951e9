"""What one engine step did and how long its phases took, for whoever observes the engine.

Benchmarks and calibration read steps through this public hook (``LLMEngine.add_step_observer``)
instead of wrapping the scheduler's or the model's methods. The engine builds a trace only when an
observer is registered; otherwise a step pays one check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRow:
    """One sequence of a step's batch, as scheduled (before the step's results changed it)."""

    num_tokens: int  # new tokens run through the model for it in this step
    num_computed_tokens: int  # its tokens already in the KV cache before the step
    samples: bool  # the chunk reached its last token: the step sampled a token for it


@dataclass(frozen=True)
class StepTrace:
    rows: tuple[StepRow, ...]
    schedule_s: float  # choosing the batch (scheduler and block manager)
    forward_s: float  # the model's forward pass (on CUDA: its launch, not its completion)
    step_s: float  # the whole step, sampling, updates and detokenization included
    grammar_s: float = 0.0  # filling output constraints' token masks (worker/grammars.py)


StepObserver = Callable[[StepTrace], None]
