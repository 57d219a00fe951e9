"""The worker's public API: everything other components (gateway, loadtest, CLI) may use.

Import from here, not from the modules behind it, so the engine's insides can move freely (an
import-linter contract in pyproject.toml holds this). The scheduler, block manager and sequence are
exported for the scheduler simulator (loadtest/), which drives the real scheduling code without a model.

``engine_deployment`` (the Ray Serve deployment of engine replicas) is imported on first use: it pulls
in Ray Serve and gRPC, which in-process users of the engine (the gateway's neutral request path, the
CLI, the simulator) should not pay for or depend on.
"""

from typing import Any

from common import Priority
from worker.async_engine import AsyncEngine, EngineDeadError
from worker.batching_policy import SchedulingMode
from worker.block_manager import BlockManager
from worker.checkpoint import (
    Checkpoint,
    CheckpointError,
    embedded_model_path,
    load_checkpoint,
    load_model_config,
    load_tokenizer,
)
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.limits import LIMITS, RequestLimits, Violation, sampling_violations
from worker.lora import AdapterError, AdapterInfo, LoraRequest, inspect_adapter, target_shape
from worker.model_config import ModelConfig, UnsupportedModelError
from worker.replica_stats import ReplicaStatsRegistry, process_registry
from worker.request import (
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
)
from worker.scheduler import ScheduledBatch, Scheduler, SchedulerConfig, SequenceUpdate
from worker.sequence import Sequence
from worker.stats import EngineStats
from worker.tokenizer import TemplateError, Tokenizer

__all__ = [
    "LIMITS",
    "AdapterError",
    "AdapterInfo",
    "AsyncEngine",
    "BlockManager",
    "Checkpoint",
    "CheckpointError",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "FinishReason",
    "GenerationRequest",
    "InvalidRequestError",
    "LLMEngine",
    "LoraRequest",
    "ModelConfig",
    "Priority",
    "ReplicaStatsRegistry",
    "RequestLimits",
    "RequestOutput",
    "SamplingParams",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerConfig",
    "SchedulingMode",
    "Sequence",
    "SequenceUpdate",
    "TemplateError",
    "Tokenizer",
    "UnsupportedModelError",
    "Violation",
    "embedded_model_path",
    "inspect_adapter",
    "load_checkpoint",
    "load_model_config",
    "load_tokenizer",
    "process_registry",
    "sampling_violations",
    "target_shape",
]


def __getattr__(name: str) -> Any:
    if name == "engine_deployment":
        from worker.serve_engine import engine_deployment

        return engine_deployment
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
