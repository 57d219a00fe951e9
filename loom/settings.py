"""Settings of a Loom process, from flags, environment (``LOOM_*``) or defaults."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.engine import EngineConfig
from worker.scheduler import SchedulingMode


class EngineSettings(BaseSettings):
    """How each engine replica is built (``LOOM_ENGINE_*`` environment variables)."""

    model_config = SettingsConfigDict(env_prefix="LOOM_ENGINE_", extra="ignore")

    model_path: str | None = Field(
        None, description="a .gguf file or a Hugging Face directory; empty: embedded"
    )
    model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = Field(16, ge=1, le=256)
    kv_cache_memory_mb: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    scheduling: SchedulingMode = SchedulingMode.CONTINUOUS
    enable_prefix_caching: bool = True
    max_model_len: int | None = Field(None, ge=2)
    num_threads: int | None = Field(None, ge=1)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model_path=self.model_path or None,
            model_name=self.model_name,
            device=self.device,
            dtype=self.dtype,
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_mb << 20 if self.kv_cache_memory_mb else None,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            scheduling=self.scheduling,
            enable_prefix_caching=self.enable_prefix_caching,
            max_model_len=self.max_model_len,
            num_threads=self.num_threads,
        )
