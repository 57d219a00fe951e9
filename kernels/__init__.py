"""Loom's kernels: one dispatch point per op (Triton on CUDA, the torch reference on CPU)."""

from kernels.activation import silu_and_mul
from kernels.attention import paged_attention
from kernels.attention_metadata import PagedAttentionMetadata
from kernels.dispatch import force_triton, use_triton
from kernels.kv_write import write_kv
from kernels.lora import LoraBatch, lora_expand, lora_shrink
from kernels.rmsnorm import rms_norm
from kernels.rotary import apply_rotary, build_cos_sin_cache

__all__ = [
    "LoraBatch",
    "PagedAttentionMetadata",
    "apply_rotary",
    "build_cos_sin_cache",
    "force_triton",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "use_triton",
    "write_kv",
]
