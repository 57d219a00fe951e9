"""A LoRA adapter's weights, read from its PEFT directory for a replica's slot (worker/lora_slots.py).

What an adapter is and how it is checked against a base model is torch-free (protocol/adapters.py);
this reads the tensors once that check passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from protocol.adapters import (
    CONFIG_FILE,
    MAX_RANK,
    WEIGHT_KEY,
    WEIGHTS_FILE,
    AdapterError,
    check_config,
    files_digest,
    inspect_adapter,
    read_config,
)
from protocol.model_config import ModelConfig


@dataclass
class LoadedAdapter:
    """An adapter's weights, ready to copy into a replica's slot."""

    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, target) -> (A, B)


def load_adapter(
    path: str | Path, config: ModelConfig, max_rank: int = MAX_RANK, *, expected_digest: str | None = None
) -> LoadedAdapter:
    """Read and check an adapter's weights (on the CPU; the caller moves them into its slot).

    With ``expected_digest`` (the one registered), files that differ are refused: an adapter swapped
    in place must not be served under the old identity. The bytes hashed are the bytes loaded.
    """
    from safetensors.torch import load as load_bytes

    path = Path(path)
    inspect_adapter(path, config, max_rank)
    rank, alpha, rslora = check_config(read_config(path), path / CONFIG_FILE, max_rank)
    weights = (path / WEIGHTS_FILE).read_bytes()
    if expected_digest is not None:
        found = files_digest((path / CONFIG_FILE).read_bytes(), weights)
        if found != expected_digest:
            raise AdapterError(
                f"{path} changed since it was registered (digest {found}, registered {expected_digest}); "
                "register it again"
            )
    tensors = load_bytes(weights)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = WEIGHT_KEY.search(key)
        assert m is not None  # inspect_adapter refused anything else
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    return LoadedAdapter(rank, scale, {k: (v["A"], v["B"]) for k, v in pairs.items()})
