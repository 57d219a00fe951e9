"""The engine's door: what the serving layer, the CLI and the benchmarks may use of ``worker``.

The types that cross the engine's boundary (requests, outputs, stats, configuration, tokenizer) are
in ``protocol``, torch-free; this module is the engine itself: loading a checkpoint's weights, the
synchronous core that steps, and its asyncio face. Import from here, not from the modules behind it,
so the engine's insides can move freely (an import-linter contract holds this). Importing it loads
torch and the kernels.
"""

from worker.async_engine import AsyncEngine
from worker.checkpoint import Checkpoint, load_checkpoint
from worker.engine import LLMEngine, merge_output
from worker.fair_share import ServiceCosts
from worker.step_trace import StepObserver, StepRow, StepTrace

__all__ = [
    "AsyncEngine",
    "Checkpoint",
    "LLMEngine",
    "ServiceCosts",
    "StepObserver",
    "StepRow",
    "StepTrace",
    "load_checkpoint",
    "merge_output",
]
