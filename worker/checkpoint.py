"""Loads a model checkpoint's weights (Hugging Face names, fp32), with its config and tokenizer.

Two sources: a GGUF file (dequantized with the ``gguf`` package) or a Hugging Face directory on local
disk (config.json, *.safetensors, tokenizer.json). The metadata half (shapes, tokenizer, where the
embedded model is) is torch-free and lives in protocol/model_files.py. Nothing is fetched from a hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from protocol.model_config import ModelConfig
from protocol.model_files import CheckpointError, gguf_metadata, hf_config, resolve
from protocol.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    name: str
    path: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face parameter names, fp32 on CPU
    tokenizer: Tokenizer


def load_checkpoint(path: str | Path | None = None, name: str | None = None) -> Checkpoint:
    """Load ``path`` (a .gguf file or a Hugging Face directory); ``None`` means the embedded model."""
    path, name = resolve(path, name)
    if not path.exists():
        raise CheckpointError(f"no model at {path}")
    if path.is_dir():
        config, weights, tokenizer = _load_hf_dir(path)
    elif path.suffix == ".gguf":
        config, weights, tokenizer = _load_gguf(path)
    else:
        raise CheckpointError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
    return Checkpoint(name or path.stem, path, config, weights, tokenizer)


def _load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    from safetensors.torch import load_file

    config = hf_config(path)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no *.safetensors files in {path}")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        for key, tensor in load_file(str(shard)).items():
            weights[key] = tensor.float()
    tokenizer = Tokenizer.from_hf_dir(path, config.eos_token_ids)
    return config, weights, tokenizer


# ---- GGUF ---------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freq_factors",
}
# llama.cpp permutes q/k rows of these architectures for its interleaved rotary; we undo it.
_PERMUTED_ARCHS = ("llama",)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (interleaved pairs back to rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    import gguf

    reader, arch, config, tokenizer = gguf_metadata(path)
    n_heads, n_kv = config.num_heads, config.num_kv_heads
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        hf_name = _GGUF_GLOBAL_NAMES.get(t.name)
        if hf_name is None:
            parts = t.name.split(".", 2)
            if parts[0] != "blk" or parts[2] not in _GGUF_LAYER_NAMES:
                raise CheckpointError(f"unexpected tensor {t.name!r} in {path}")
            hf_name = f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
            if arch in _PERMUTED_ARCHS and parts[2] in ("attn_q.weight", "attn_q.bias"):
                arr = _unpermute(arr, n_heads)
            elif arch in _PERMUTED_ARCHS and parts[2] in ("attn_k.weight", "attn_k.bias"):
                arr = _unpermute(arr, n_kv)
        weights[hf_name] = torch.from_numpy(np.ascontiguousarray(arr).copy())
    return config, weights, tokenizer
