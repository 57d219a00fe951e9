"""How an engine is built: one settings model, from ``LOOM_ENGINE_*`` environment variables, flags or code.

The same object configures an in-process engine, every Serve replica and the RayService manifests'
environment; nothing mirrors its fields. It is plain data (no torch): what the device and dtype
``auto`` resolve to is the engine's business (worker/device.py).
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class EngineConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_ENGINE_", extra="forbid", frozen=True)

    model_path: str | None = Field(
        None, description="a .gguf file or a Hugging Face directory; empty: embedded"
    )
    model_name: str | None = Field(None, description="the name clients use; default: the checkpoint's")
    device: str = Field("auto", description="auto: cuda when available, else cpu")
    dtype: str = Field(
        "auto", pattern="^(auto|float32|float16|bfloat16)$", description="auto: bf16 on cuda, fp32 on cpu"
    )
    block_size: int = Field(16, ge=1, le=256)
    kv_cache_memory_mb: int | None = Field(
        None, ge=1, description="default: 1 GiB on cpu, 60% of free on cuda"
    )
    num_blocks: int | None = Field(None, ge=1, description="overrides the KV memory budget")
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    scheduler_cls: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="'module:Class' of a Scheduler subclass to run instead (a benchmark's baseline)",
    )
    fair_prefill_cost: float = Field(
        1.0, gt=0, le=1000, description="fair share: the service one prefill token counts for"
    )
    fair_decode_cost: float = Field(
        2.0, gt=0, le=1000, description="fair share: the service one decode token counts for"
    )
    preemption_limit: int | None = Field(
        3, ge=1, description="preemptions after which a request yields only to higher classes (aging)"
    )
    priority_scheduling: bool = Field(
        True, description="off: every request is scheduled as standard (a baseline for measurements)"
    )
    enable_prefix_caching: bool = True
    max_model_len: int | None = Field(None, ge=2)
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads on cpu")
    speculative_tokens: int = Field(
        4,
        ge=0,
        le=16,
        description="the most tokens a request that opts into speculation proposes a step; 0 disables it",
    )
    speculative_draft_model: str | None = Field(
        None,
        description="a smaller model of the same vocabulary (.gguf or HF directory) that proposes "
        "instead of prompt lookup",
    )
    speculative_ngram_max: int = Field(
        4, ge=1, le=16, description="prompt lookup: the longest suffix matched against earlier tokens"
    )
    speculative_ngram_min: int = Field(
        2, ge=1, le=16, description="prompt lookup: the shortest suffix matched against earlier tokens"
    )
    stream_interval: int = Field(
        1,
        ge=1,
        le=64,
        description="tokens a streamed delta waits for after a request's first (vLLM's "
        "--stream-interval): 1 ships every step's token; more cut the host's work per token",
    )
    max_loras: int = Field(4, ge=0, description="LoRA adapters resident at once (slots); 0 disables LoRA")
    max_lora_rank: int = Field(64, ge=1, le=64)

    @model_validator(mode="after")
    def _ngram_range(self) -> EngineConfig:
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError("speculative_ngram_min must not exceed speculative_ngram_max")
        return self
