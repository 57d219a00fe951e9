"""The worker's public API: everything other components (gateway, loadtest, CLI) may use.

Import from here, not from the modules behind it, so the engine's insides can move freely.
"""

from common import Priority
from worker.async_engine import AsyncEngine, EngineDeadError
from worker.checkpoint import (
    Checkpoint,
    CheckpointError,
    embedded_model_path,
    load_checkpoint,
    load_tokenizer,
)
from worker.engine import EngineConfig, LLMEngine
from worker.limits import LIMITS, RequestLimits, Violation, sampling_violations
from worker.model_config import UnsupportedModelError
from worker.replica_stats import ReplicaStatsRegistry, process_registry
from worker.request import (
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
)
from worker.scheduler import SchedulingMode
from worker.stats import EngineStats
from worker.tokenizer import TemplateError, Tokenizer

__all__ = [
    "LIMITS",
    "AsyncEngine",
    "Checkpoint",
    "CheckpointError",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "FinishReason",
    "GenerationRequest",
    "InvalidRequestError",
    "LLMEngine",
    "Priority",
    "ReplicaStatsRegistry",
    "RequestLimits",
    "RequestOutput",
    "SamplingParams",
    "SchedulingMode",
    "TemplateError",
    "Tokenizer",
    "UnsupportedModelError",
    "Violation",
    "embedded_model_path",
    "load_checkpoint",
    "load_tokenizer",
    "process_registry",
    "sampling_violations",
]
