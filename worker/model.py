"""A Llama-family decoder that runs one flat varlen batch through the paged KV cache.

Every op with a kernel goes through a dispatch point in ``kernels``; the matmuls are plain torch.
q/k/v and gate/up projections are fused into one matmul each (fewer, larger GEMMs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kernels import (
    LoraBatch,
    PagedAttentionMetadata,
    apply_rotary,
    build_cos_sin_cache,
    lora_expand,
    lora_shrink,
    paged_attention,
    rms_norm,
    silu_and_mul,
    write_kv,
)
from kernels.cpu_kernels import cpu_kernels
from protocol.model_config import ModelConfig
from worker.dense import Dense


class LoraWeights(Protocol):
    """The resident adapters' stacked weights (worker/lora_slots.py)."""

    scales: torch.Tensor  # fp32 [slots]

    def weights(self, layer: int, target: str) -> tuple[torch.Tensor, torch.Tensor] | None: ...


@dataclass
class LoraStep:
    batch: LoraBatch  # each token's adapter slot
    weights: LoraWeights


@dataclass
class ForwardBatch:
    """The model inputs of one engine step (flat over all scheduled sequences)."""

    input_ids: torch.Tensor  # long [num_tokens]
    positions: torch.Tensor  # long [num_tokens]
    slot_mapping: torch.Tensor  # long [num_tokens]
    attention: PagedAttentionMetadata
    logits_indices: torch.Tensor  # long [num_outputs]: rows whose next-token logits are wanted
    lora: LoraStep | None = None  # adapters of this step's tokens; None: the base model only


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Dense
    o_proj: Dense
    post_norm: torch.Tensor
    gate_up: Dense
    down: Dense


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair rotary frequencies, with the Llama-3 and GGUF frequency-factor scalings."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv
    if kind == "freq_factors":
        if freq_factors is None:
            raise ValueError("rope frequency factors are missing from the checkpoint")
        return inv / freq_factors.float()
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}")


class LlamaModel:
    """Weights plus the forward pass; holds no per-request state (that lives in the KV cache)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        prepack: bool = True,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint lacks {name}")
            return weights[name].to(device=self.device, dtype=dtype).contiguous()

        def dense(weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False) -> Dense:
            return Dense(weight, bias, prepack, gated)

        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        self.lm_head = dense(self.embed if config.tie_word_embeddings else take("lm_head.weight"))
        self.layers: list[_Layer] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            bias = None
            if config.attention_bias:
                bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(
                _Layer(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=dense(qkv, bias),
                    o_proj=dense(take(p + "self_attn.o_proj.weight")),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=dense(
                        torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
                        gated=True,
                    ),
                    down=dense(take(p + "mlp.down_proj.weight")),
                )
            )
        if self.device.type == "cpu":
            cpu_kernels()  # build (or load) the compiled CPU kernels now, not inside the first request
        inv_freq = rope_inv_freq(config, weights.get("rope_freq_factors"))
        self.cos_sin = build_cos_sin_cache(inv_freq, config.max_position_embeddings).to(self.device)
        self.scale = config.head_dim**-0.5

    def weight_bytes(self) -> int:
        """Bytes a forward pass streams from memory for the weights (embedding rows aside)."""
        norms = [self.norm] + [t for layer in self.layers for t in (layer.input_norm, layer.post_norm)]
        dense = [self.lm_head] + [
            d for layer in self.layers for d in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        ]
        return sum(t.numel() * t.element_size() for t in norms) + sum(d.nbytes for d in dense)

    def flops_per_token(self) -> int:
        """Matmul FLOPs of one token through every layer and the LM head (attention excluded)."""
        first = self.layers[0]
        dense = (first.qkv, first.o_proj, first.gate_up, first.down)
        per_layer = sum(2 * d.out_features * d.in_features for d in dense)
        return per_layer * len(self.layers) + 2 * self.lm_head.out_features * self.lm_head.in_features

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Logits ``[len(batch.logits_indices), vocab]`` (fp32) for the requested rows."""
        cfg = self.config
        n = batch.input_ids.shape[0]
        lora = batch.lora
        h = F.embedding(batch.input_ids, self.embed)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = h
                h = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            else:
                h, residual = rms_norm(h, layer.input_norm, cfg.rms_norm_eps, residual)
            qkv = layer.qkv(h)
            if lora is not None:
                _add_lora(
                    lora,
                    i,
                    (
                        ("q_proj", 0, cfg.q_size),
                        ("k_proj", cfg.q_size, cfg.kv_size),
                        ("v_proj", cfg.q_size + cfg.kv_size, cfg.kv_size),
                    ),
                    h,
                    qkv,
                )
            q = qkv[:, : cfg.q_size].view(n, cfg.num_heads, cfg.head_dim)
            k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(n, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, cfg.q_size + cfg.kv_size :].view(n, cfg.num_kv_heads, cfg.head_dim)
            apply_rotary(batch.positions, q, k, self.cos_sin)
            write_kv(k, v, k_caches[i], v_caches[i], batch.slot_mapping)
            attn = paged_attention(q, k_caches[i], v_caches[i], batch.attention, self.scale)
            attn_flat = attn.view(n, cfg.q_size)
            h = layer.o_proj(attn_flat)
            if lora is not None:
                _add_lora(lora, i, (("o_proj", 0, cfg.hidden_size),), attn_flat, h)
            h, residual = rms_norm(h, layer.post_norm, cfg.rms_norm_eps, residual)
            if lora is None:
                act = layer.gate_up.silu_mul(h)  # the activation fused into the GEMM where it can be
            else:  # adapters add to gate and up before the activation
                gate_up = layer.gate_up(h)
                m = cfg.intermediate_size
                _add_lora(lora, i, (("gate_proj", 0, m), ("up_proj", m, m)), h, gate_up)
                act = silu_and_mul(gate_up)
            h = layer.down(act)
            if lora is not None:
                _add_lora(lora, i, (("down_proj", 0, cfg.hidden_size),), act, h)
        h = h[batch.logits_indices]
        assert residual is not None  # every model has at least one layer
        h, _ = rms_norm(h, self.norm, cfg.rms_norm_eps, residual[batch.logits_indices])
        return self.lm_head(h).float()


def _add_lora(
    lora: LoraStep, layer: int, targets: tuple[tuple[str, int, int], ...], x: torch.Tensor, y: torch.Tensor
) -> None:
    """Add each adapted target's LoRA term to its columns ``[start, start + width)`` of ``y``."""
    for target, start, width in targets:
        w = lora.weights.weights(layer, target)
        if w is not None:
            a, b = w
            lora_expand(
                y[:, start : start + width], lora_shrink(x, a, lora.batch), b, lora.weights.scales, lora.batch
            )
