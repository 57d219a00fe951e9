"""The paged KV cache tensors: per layer ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.model_config import ModelConfig


def blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks fit in ``budget_bytes`` of cache memory."""
    per_block = config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size
    num = budget_bytes // per_block
    if num < 1:
        raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {per_block} bytes")
    return int(num)


@dataclass
class KVCache:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # Zeros rather than empty: a never-written slot must not hold NaNs that a masked-out
        # attention lane could multiply by zero and still propagate.
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        return cls(k=k, v=v, block_size=block_size)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    def bytes_per_token(self) -> int:
        t = self.k[0]
        return 2 * len(self.k) * t.shape[2] * t.shape[3] * t.element_size()
