"""The worker's public API: everything other components (gateway, loadtest, CLI) may use.

Import from here, not from the modules behind it, so the engine's insides can move freely.
"""

from worker.async_engine import AsyncEngine, EngineDeadError
from worker.checkpoint import (
    Checkpoint,
    CheckpointError,
    embedded_model_path,
    load_checkpoint,
    load_tokenizer,
)
from worker.engine import EngineConfig, LLMEngine
from worker.model_config import UnsupportedModelError
from worker.request import (
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    Priority,
    RequestOutput,
    SamplingParams,
)
from worker.scheduler import SchedulingMode
from worker.serve_router import published_replica_stats
from worker.stats import EngineStats
from worker.tokenizer import TemplateError, Tokenizer

__all__ = [
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
    "RequestOutput",
    "SamplingParams",
    "SchedulingMode",
    "TemplateError",
    "Tokenizer",
    "UnsupportedModelError",
    "embedded_model_path",
    "load_checkpoint",
    "load_tokenizer",
    "published_replica_stats",
]
