"""Random-weight checkpoints of any Llama-family shape: for benchmarks that must measure what is not
the model (the gateway's overhead, scheduling) with model time small and constant, and for tests.

Nothing here is part of the engine: the worker only ever loads checkpoints from disk. The tokenizer is
byte-level with no merges (one token per byte, plus an end-of-sequence token), so any text
round-trips and the vocabulary stays tiny.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from protocol.model_config import ModelConfig
from protocol.tokenizer import Tokenizer
from worker.api import Checkpoint

BYTE_VOCAB = 256
EOS_TEXT = "<eos>"


def byte_tokenizer() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(EOS_TEXT, special=True, normalized=False)])
    eos = backend.token_to_id(EOS_TEXT)
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return Tokenizer(
        backend=backend, eos_token_ids=(eos,), chat_template=template, special_tokens={"eos_token": EOS_TEXT}
    )


def tiny_config(**overrides: object) -> ModelConfig:
    base: dict[str, object] = dict(
        model_type="llama",
        vocab_size=BYTE_VOCAB + 1,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_ids=(BYTE_VOCAB,),
    )
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights scaled so activations stay O(1) through the layers (logits then vary by token)."""
    g = torch.Generator().manual_seed(seed)

    def mat(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / in_f**0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    c = config
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(c.vocab_size, c.hidden_size, generator=g),
        "model.norm.weight": norm(c.hidden_size),
    }
    if not c.tie_word_embeddings:
        head = mat(c.vocab_size, c.hidden_size) * 4.0
        for eos in c.eos_token_ids:  # a zero logit is never the argmax of 256 random ones: greedy
            head[eos] = 0.0  # runs go on until max_tokens, like a real model asked for a long answer
        w["lm_head.weight"] = head
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(c.hidden_size)
        w[p + "post_attention_layernorm.weight"] = norm(c.hidden_size)
        w[p + "self_attn.q_proj.weight"] = mat(c.q_size, c.hidden_size)
        w[p + "self_attn.k_proj.weight"] = mat(c.kv_size, c.hidden_size)
        w[p + "self_attn.v_proj.weight"] = mat(c.kv_size, c.hidden_size)
        w[p + "self_attn.o_proj.weight"] = mat(c.hidden_size, c.q_size)
        w[p + "mlp.gate_proj.weight"] = mat(c.intermediate_size, c.hidden_size)
        w[p + "mlp.up_proj.weight"] = mat(c.intermediate_size, c.hidden_size)
        w[p + "mlp.down_proj.weight"] = mat(c.hidden_size, c.intermediate_size)
        if c.attention_bias:
            for n, size in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
                w[p + f"self_attn.{n}_proj.bias"] = 0.1 * torch.randn(size, generator=g)
    return w


def random_checkpoint(
    config: ModelConfig | None = None, seed: int = 0, name: str = "tiny-random"
) -> Checkpoint:
    config = config or tiny_config()
    return Checkpoint(name, Path("<random>"), config, random_weights(config, seed), byte_tokenizer())


def save_hf_dir(ckpt: Checkpoint, path: Path) -> Path:
    """Write ``ckpt`` as a Hugging Face model directory (config, safetensors, tokenizer files)."""
    import json

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    hf = ckpt.config.to_hf_dict()
    hf["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    save_file({k: v.contiguous() for k, v in ckpt.weights.items()}, str(path / "model.safetensors"))
    ckpt.tokenizer.backend.save(str(path / "tokenizer.json"))
    tok_cfg = {"chat_template": ckpt.tokenizer.chat_template, **ckpt.tokenizer.special_tokens}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return path


def save_random_adapter(
    config: ModelConfig,
    path: Path,
    *,
    rank: int = 8,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
    alpha: float | None = None,
    magnitude: float = 1.0,
) -> Path:
    """Write a random LoRA adapter for ``config`` in the PEFT format (``adapter_config.json`` and
    ``adapter_model.safetensors`` with PEFT's tensor names), with non-zero A and B so it changes the
    model's output. ``magnitude`` scales B: larger departs further from the base model."""
    import json

    from safetensors.torch import save_file

    from protocol.adapters import target_shape

    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_layers):
        for target in targets:
            out_f, in_f = target_shape(config, target)
            group = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) / in_f**0.5
            tensors[f"{prefix}.lora_B.weight"] = magnitude * torch.randn(out_f, rank, generator=g) / rank**0.5
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha if alpha is not None else rank,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": "tiny-random",
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return path
