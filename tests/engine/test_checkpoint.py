"""Checkpoint loading: the GGUF path against transformers' own GGUF loader, the Hugging Face directory
path by round trip, and clear errors for what cannot be served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loadtest.tiny_model import save_hf_dir
from protocol.engine_config import EngineConfig
from protocol.model_config import UnsupportedModelError
from protocol.model_files import CheckpointError, embedded_model_path, load_tokenizer
from protocol.requests import GenerationRequest, SamplingParams
from worker.checkpoint import Checkpoint, load_checkpoint
from worker.engine import LLMEngine


def test_gguf_weights_and_tokenizer_match_transformers(smollm: Checkpoint) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path = embedded_model_path()
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    state = theirs.state_dict()
    for name, ours in smollm.weights.items():
        assert torch.equal(ours, state[name]), name  # q/k un-permuted exactly as transformers does
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in [
        "Hello world 12345!",
        "  spaces\n\nand\ttabs",
        "émojis 🙂 and 中文",
        "<|im_start|>user\nhi<|im_end|>",
    ]:
        assert smollm.tokenizer.encode(text, add_special_tokens=False) == hf_tok.encode(
            text, add_special_tokens=False
        )


def test_hf_directory_round_trip_serves_the_same_tokens(tiny: Checkpoint, tmp_path: Path) -> None:
    path = save_hf_dir(tiny, tmp_path / "tiny-hf")
    loaded = load_checkpoint(path)
    assert loaded.config == tiny.config
    assert all(torch.equal(loaded.weights[k], v) for k, v in tiny.weights.items())
    assert load_tokenizer(path).encode("abc") == tiny.tokenizer.encode("abc")

    def greedy(ckpt: Checkpoint) -> list[int]:
        engine = LLMEngine(EngineConfig(num_blocks=32, block_size=8), ckpt)
        req = GenerationRequest(
            "r", ckpt.tokenizer.encode("loom"), SamplingParams(max_tokens=12, ignore_eos=True)
        )
        return engine.run_to_completion([req])["r"].token_ids

    assert greedy(loaded) == greedy(tiny)


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no model at"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"neither a \.gguf file nor"):
        load_checkpoint(tmp_path / "weights.bin")


def test_unsupported_architecture_is_named(tiny: Checkpoint, tmp_path: Path) -> None:
    path = save_hf_dir(tiny, tmp_path / "gpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_checkpoint(path)


def test_directory_without_weights_is_a_clear_error(tiny: Checkpoint, tmp_path: Path) -> None:
    path = save_hf_dir(tiny, tmp_path / "empty")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_checkpoint(path)


def test_corrupt_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(CheckpointError, match="cannot read GGUF"):
        load_checkpoint(bad)
