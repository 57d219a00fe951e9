"""LoRA adapters in the PEFT format: what one is, how it is checked against a base model, and loaded.

A PEFT adapter directory holds ``adapter_config.json`` (rank ``r``, ``lora_alpha``, ``target_modules``)
and ``adapter_model.safetensors`` with ``...layers.{i}.{self_attn|mlp}.{target}.lora_A.weight``
``[r, in]`` and ``...lora_B.weight`` ``[out, r]`` per adapted projection. The adapted projection
computes ``x @ W.T + scale * (x @ A.T) @ B.T`` with ``scale = alpha / r`` (``alpha / sqrt(r)`` with
rsLoRA).

Registration (``loom admin adapter add``) inspects an adapter without loading its weights (nor
torch): every refusal names what is wrong. A replica loads the weights when a request needs them
(worker/lora.py, worker/lora_slots.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_RANK = 64
WEIGHT_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter Loom cannot serve on this base model; the message says what and where."""


@dataclass(frozen=True)
class LoraRequest:
    """The adapter a request runs with, as the engine sees it.

    ``id`` is unique across tenants and versions (the gateway makes it from the tenant, the adapter's
    name and its files' digest): it keys a replica's slots and the prefix cache.
    """

    id: str
    path: str
    digest: str | None = None  # of its files at registration: a replica refuses files that differ


@dataclass(frozen=True)
class AdapterInfo:
    """What registration records about an adapter."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    digest: str  # of the config and weights: a changed file is a different adapter
    base_model: str | None  # as the adapter's config names it (informational)


def target_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """(out, in) of a base projection."""
    return {
        "q_proj": (config.q_size, config.hidden_size),
        "k_proj": (config.kv_size, config.hidden_size),
        "v_proj": (config.kv_size, config.hidden_size),
        "o_proj": (config.hidden_size, config.q_size),
        "gate_proj": (config.intermediate_size, config.hidden_size),
        "up_proj": (config.intermediate_size, config.hidden_size),
        "down_proj": (config.hidden_size, config.intermediate_size),
    }[target]


def read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG_FILE
    try:
        cfg = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path} is not a PEFT adapter: {CONFIG_FILE} is missing") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read {file}: {exc}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{file} is not a JSON object")
    return cfg


def check_config(cfg: dict[str, Any], file: Path, max_rank: int) -> tuple[int, float, bool]:
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type is {cfg.get('peft_type')!r}; only LORA adapters are served")
    rank = cfg.get("r")
    if not isinstance(rank, int) or not (1 <= rank <= max_rank):
        problems.append(f"rank r={rank!r} is outside 1..{max_rank}")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or alpha <= 0:
        problems.append(f"lora_alpha={alpha!r} must be a positive number")
    for name, bad in (
        ("use_dora", bool(cfg.get("use_dora"))),
        ("fan_in_fan_out", bool(cfg.get("fan_in_fan_out"))),
        ("bias", cfg.get("bias", "none") != "none"),
        ("modules_to_save", bool(cfg.get("modules_to_save"))),
        ("rank_pattern", bool(cfg.get("rank_pattern"))),
        ("alpha_pattern", bool(cfg.get("alpha_pattern"))),
    ):
        if bad:
            problems.append(f"{name}={cfg.get(name)!r} is not supported")
    if problems:
        raise AdapterError(f"{file}: " + "; ".join(problems))
    assert isinstance(rank, int) and isinstance(alpha, int | float)  # checked above
    return rank, float(alpha), bool(cfg.get("use_rslora"))


def _weight_shapes(path: Path) -> dict[tuple[int, str, str], tuple[int, ...]]:
    """(layer, target, A|B) -> shape, from the safetensors header (no weights read)."""
    from safetensors import safe_open

    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise AdapterError(f"{path} is not a PEFT adapter: {WEIGHTS_FILE} is missing")
    shapes: dict[tuple[int, str, str], tuple[int, ...]] = {}
    try:
        with safe_open(str(file), framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                m = WEIGHT_KEY.search(key)
                if m is None:
                    raise AdapterError(
                        f"{file}: unexpected tensor {key!r} (only LoRA A/B weights of projections)"
                    )
                shapes[(int(m.group(1)), m.group(2), m.group(3))] = tuple(f.get_slice(key).get_shape())
    except AdapterError:
        raise
    except Exception as exc:  # a truncated or foreign file: safetensors raises its own errors
        raise AdapterError(f"cannot read {file}: {exc}") from None
    return shapes


def inspect_adapter(path: str | Path, config: ModelConfig, max_rank: int = MAX_RANK) -> AdapterInfo:
    """Check an adapter directory against a base model without loading its weights.

    Raises AdapterError naming every problem: missing or unreadable files, an unsupported variant,
    a rank out of range, a target Loom cannot adapt, a layer the base model lacks, shapes that do not
    fit the base model's projections.
    """
    path = Path(path)
    cfg = read_config(path)
    rank, alpha, _ = check_config(cfg, path / CONFIG_FILE, max_rank)
    shapes = _weight_shapes(path)
    if not shapes:
        raise AdapterError(f"{path / WEIGHTS_FILE} holds no LoRA weights")
    problems = []
    targets = sorted({t for _, t, _ in shapes})
    for target in targets:
        if target not in TARGETS:
            problems.append(f"target {target!r} is not one of {', '.join(TARGETS)}")
    for (layer, target, ab), shape in sorted(shapes.items()):
        if target not in TARGETS:
            continue
        if layer >= config.num_layers:
            problems.append(f"layer {layer} does not exist (the base model has {config.num_layers})")
            continue
        out_f, in_f = target_shape(config, target)
        want = (rank, in_f) if ab == "A" else (out_f, rank)
        if shape != want:
            problems.append(
                f"layers.{layer}.{target}.lora_{ab} is {list(shape)}, the base model needs {list(want)}"
            )
        if (layer, target, "B" if ab == "A" else "A") not in shapes:
            problems.append(f"layers.{layer}.{target} has lora_{ab} but not its pair")
    if problems:
        raise AdapterError(f"{path} does not fit this base model: " + "; ".join(problems[:8]))
    digest = files_digest((path / CONFIG_FILE).read_bytes(), (path / WEIGHTS_FILE).read_bytes())
    base = cfg.get("base_model_name_or_path")
    return AdapterInfo(rank, alpha, tuple(targets), digest, base if isinstance(base, str) else None)


def files_digest(config: bytes, weights: bytes) -> str:
    """An adapter's identity: its config's and weights' bytes (a changed file is another adapter)."""
    return hashlib.sha256(config + weights).hexdigest()[:16]
