"""What an :class:`~protocol.engine_config.EngineConfig`'s ``auto`` choices mean on this host."""

from __future__ import annotations

import torch

from protocol.engine_config import EngineConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolved_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolved_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    if config.kv_cache_memory_mb is not None:
        return config.kv_cache_memory_mb << 20
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.6)
    return 1 << 30
