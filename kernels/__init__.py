"""Loom's kernels: one dispatch point per op (Triton on CUDA, the torch reference on CPU)."""

from kernels.activation import silu_and_mul
from kernels.attention import paged_attention
from kernels.attention_metadata import PagedAttentionMetadata
from kernels.dispatch import force_triton, use_triton
from kernels.kv_write import write_kv
from kernels.rmsnorm import rms_norm
from kernels.rotary import apply_rotary, build_cos_sin_cache

__all__ = [
    "PagedAttentionMetadata",
    "apply_rotary",
    "build_cos_sin_cache",
    "force_triton",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "use_triton",
    "write_kv",
]
