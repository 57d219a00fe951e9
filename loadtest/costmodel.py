"""How long one engine step takes on a given accelerator: bytes over bandwidth, FLOPs over the matrix rate.

A decoder step reads every weight once and the KV of every scheduled sequence once, and does about
2 FLOPs per weight per token plus attention's 4 x context x q_size per token and layer. On a GPU the
step costs the larger of the two (roofline), plus the tensor-parallel all-reduces, plus the host's
share: the engine's Python (schedule, input preparation, sampling, output) runs between steps and
does not overlap with them, and the kernels of a step are launched from Python one by one (no CUDA
graphs), so a small model is bound by launches, not by the GPU.

    t_step = max(t_mem, t_compute, t_launch) + t_allreduce + t_host
    t_mem      = (weights/tp + KV read + KV written) / bandwidth
    t_compute  = (2 * layer params * tokens + 2 * lm_head params * sampled rows + attention) / tp / rate
    t_launch   = layers * launch_per_layer_s              (Python issuing the kernels of a step)
    t_allreduce= 2 * layers * (latency + 2 (tp-1)/tp * tokens * hidden * dtype / bus bandwidth)  (tp > 1)
    t_host     = host_step_s + host_per_seq_s * seqs + host_per_token_s * tokens

Activations, norms, rotary and sampling's own GPU time are left out: at these shapes they are a few
percent of the weight and KV traffic. Every number below is a stated input, so a better measurement
replaces one line; the CPU variant's efficiencies and host costs are fitted on this machine
(loadtest/calibrate.py) and its error is reported with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

GiB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder's shape: all the cost model needs to know about a model."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    max_context: int

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        h = self.hidden
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = 3 * h * self.intermediate
        return attn + mlp + 2 * h  # + the two RMSNorm weights

    @property
    def layer_params(self) -> int:
        return self.layers * self.params_per_layer

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden  # the tied embedding matrix is read as the head all the same

    @property
    def total_params(self) -> int:
        embed = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else self.lm_head_params
        return self.layer_params + embed + head + self.hidden

    def weight_bytes_read(self, dtype_bytes: int) -> int:
        """Bytes of weights a step reads: every layer and the head (embedding rows are negligible)."""
        return (self.layer_params + self.lm_head_params + self.hidden) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_size * dtype_bytes

    @classmethod
    def from_config(cls, name: str, cfg: Any) -> ModelShape:
        """From a worker ModelConfig (duck-typed: loadtest imports only worker.api)."""
        return cls(
            name=name,
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            layers=cfg.num_layers,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            vocab=cfg.vocab_size,
            tied_embeddings=cfg.tie_word_embeddings,
            max_context=cfg.max_position_embeddings,
        )


# Shapes from the models' config.json files.
SMOLLM2_135M = ModelShape("smollm2-135m", 576, 1536, 30, 9, 3, 64, 49152, True, 8192)
LLAMA3_8B = ModelShape("llama-3-8b", 4096, 14336, 32, 32, 8, 128, 128256, False, 8192)
LLAMA3_70B = ModelShape("llama-3-70b", 8192, 28672, 80, 64, 8, 128, 128256, False, 8192)
MODELS = {m.name: m for m in (SMOLLM2_135M, LLAMA3_8B, LLAMA3_70B)}


@dataclass(frozen=True)
class Hardware:
    """One accelerator (and the host driving it), as achieved rates, not datasheet peaks."""

    name: str
    mem_bw: float  # bytes/s a large copy achieves
    matmul_rate: float  # FLOP/s a large GEMM achieves in the serving dtype
    memory_bytes: int
    dtype_bytes: int
    allreduce_bus_bw: float = 0.0  # bytes/s NCCL-style bus bandwidth of an all-reduce (per GPU)
    allreduce_latency_s: float = 0.0  # fixed cost of one all-reduce
    launch_per_layer_s: float = 0.0  # host time to issue one layer's kernels
    host_step_s: float = 0.0  # engine Python per step (schedule, inputs, sampling, outputs)
    host_per_seq_s: float = 0.0
    host_per_token_s: float = 0.0
    mem_efficiency: float = 1.0  # fitted on CPU: achieved fraction of mem_bw inside a step
    compute_efficiency: float = 1.0
    overlap: bool = True  # GPU: memory and compute overlap (roofline max); False: they add (a CPU core)
    # CPU engine only (calibrate.py): GEMMs of fewer rows than this take the engine's plain-weight path
    # (worker/dense.py), measured several times slower than its prepacked one; a fitted extra per step.
    small_gemm_rows: int = 0
    small_gemm_extra_s: float = 0.0
    memory_utilization: float = 0.90  # share of device memory the engine may use
    activation_reserve_bytes: int = 3 * GiB  # activations and workspace, not KV
    price_per_hour: float = 0.0  # USD per device-hour (stated assumption, for cost tables)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "mem_bw_tb_s": round(self.mem_bw / 1e12, 3),
            "matmul_tflop_s": round(self.matmul_rate / 1e12, 1),
            "memory_gb": round(self.memory_bytes / 1e9, 1),
            "dtype_bytes": self.dtype_bytes,
            "allreduce_bus_bw_gb_s": round(self.allreduce_bus_bw / 1e9, 1),
            "allreduce_latency_us": round(self.allreduce_latency_s * 1e6, 1),
            "launch_per_layer_us": round(self.launch_per_layer_s * 1e6, 1),
            "host_step_ms": round(self.host_step_s * 1e3, 3),
            "host_per_seq_us": round(self.host_per_seq_s * 1e6, 2),
            "host_per_token_us": round(self.host_per_token_s * 1e6, 3),
            "mem_efficiency": self.mem_efficiency,
            "compute_efficiency": self.compute_efficiency,
            "overlap": self.overlap,
            "small_gemm_rows": self.small_gemm_rows,
            "small_gemm_extra_ms": round(self.small_gemm_extra_s * 1e3, 3),
            "price_per_hour_usd": self.price_per_hour,
        }


# Hopper: H200 measured (about 4.3 TB/s copy, about 790 TFLOP/s bf16 GEMM); H100 SXM's datasheet
# (3.35 TB/s, 989 TFLOP/s dense bf16) scaled by the same achieved fractions (0.90 and 0.80), the
# two parts sharing one compute die. NVLink 4: 450 GB/s per direction; NCCL all-reduce reaches about
# 360 GB/s bus bandwidth, about 10 us for the small messages of decode. Host costs: this engine's
# Python on a server CPU (stated, not measured on a GPU host; the CPU calibration measures their
# analogue here): 1 ms per step, 10 us per sequence, 60 us to launch one layer's ~10 kernels.
_HOPPER_HOST = dict(
    allreduce_bus_bw=360e9,
    allreduce_latency_s=10e-6,
    launch_per_layer_s=60e-6,
    host_step_s=1.0e-3,
    host_per_seq_s=10e-6,
)
H200 = Hardware("h200", 4.3e12, 790e12, 141 * 10**9, 2, price_per_hour=3.50, **_HOPPER_HOST)  # type: ignore[arg-type]
H100 = Hardware(
    "h100",
    3.35e12 * 0.896,
    989e12 * 0.80,
    80 * GiB,
    2,
    price_per_hour=2.50,
    **_HOPPER_HOST,  # type: ignore[arg-type]
)
HARDWARE = {h.name: h for h in (H100, H200)}


@dataclass(frozen=True)
class Deployment:
    """A model on ``tp`` devices (tensor parallel: weights, KV heads and FLOPs split evenly)."""

    model: ModelShape
    hw: Hardware
    tp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or (self.model.kv_heads % self.tp and self.tp % self.model.kv_heads):
            raise ValueError(
                f"tp={self.tp} does not divide {self.model.name}'s {self.model.kv_heads} KV heads"
            )
        if self.kv_budget_bytes_per_device <= 0:
            raise ValueError(
                f"{self.model.name} ({self.weight_bytes_per_device / 1e9:.0f} GB per device) does not fit "
                f"on {self.tp} x {self.hw.name}"
            )

    @property
    def name(self) -> str:
        return (
            f"{self.model.name} on {self.tp}x{self.hw.name}"
            if self.tp > 1
            else f"{self.model.name} on {self.hw.name}"
        )

    @property
    def devices(self) -> int:
        return self.tp

    @property
    def weight_bytes_per_device(self) -> float:
        return self.model.weight_bytes_read(self.hw.dtype_bytes) / self.tp

    @property
    def kv_bytes_per_token_per_device(self) -> float:
        # With more devices than KV heads, heads are replicated: each device still holds one head.
        heads = max(1, self.model.kv_heads // self.tp)
        return 2 * self.model.layers * heads * self.model.head_dim * self.hw.dtype_bytes

    @property
    def kv_budget_bytes_per_device(self) -> float:
        hw = self.hw
        return (
            hw.memory_bytes * hw.memory_utilization
            - self.weight_bytes_per_device
            - hw.activation_reserve_bytes
        )

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV one replica holds (every device holds its share of every token)."""
        return int(self.kv_budget_bytes_per_device // self.kv_bytes_per_token_per_device)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "hardware": self.hw.name,
            "tp": self.tp,
            "params_b": round(self.model.total_params / 1e9, 3),
            "weight_gb_per_device": round(self.weight_bytes_per_device / 1e9, 2),
            "kv_kib_per_token": round(self.model.kv_bytes_per_token(self.hw.dtype_bytes) / 1024, 2),
            "kv_budget_gb_per_device": round(self.kv_budget_bytes_per_device / 1e9, 2),
            "kv_capacity_tokens": self.kv_capacity_tokens,
        }


@dataclass(frozen=True)
class StepItem:
    """One sequence's share of a step: ``new_tokens`` computed after ``context`` cached ones."""

    new_tokens: int
    context: int
    samples: bool  # this row's logits are wanted (the last prompt chunk, or a decode)


@dataclass(frozen=True)
class StepCost:
    seconds: float
    bytes: float  # per device
    flops: float  # per device
    t_mem: float
    t_compute: float
    t_launch: float
    t_allreduce: float
    t_host: float

    @property
    def bound(self) -> str:
        """What sets the step's GPU-side time: memory, compute or launch."""
        m = max(self.t_mem, self.t_compute, self.t_launch)
        return "memory" if m == self.t_mem else ("compute" if m == self.t_compute else "launch")


def attention_positions(new_tokens: int, context: int) -> int:
    """Key positions all new tokens of one sequence attend to (causal): n*c + n(n+1)/2."""
    return new_tokens * context + new_tokens * (new_tokens + 1) // 2


def step_cost(dep: Deployment, items: Iterable[StepItem]) -> StepCost:
    """The cost of one step of the given batch on ``dep`` (see the module docstring for the terms)."""
    m, hw, tp = dep.model, dep.hw, dep.tp
    tokens = seqs = sampled = kv_tokens_read = attended = 0
    for it in items:
        tokens += it.new_tokens
        seqs += 1
        sampled += it.samples
        kv_tokens_read += it.context  # cached K/V read once per sequence (flash-style tiling)
        attended += attention_positions(it.new_tokens, it.context)
    kv_tok = dep.kv_bytes_per_token_per_device
    nbytes = dep.weight_bytes_per_device + (kv_tokens_read + tokens) * kv_tok  # read + newly written
    flops = (
        2 * m.layer_params * tokens + 2 * m.lm_head_params * sampled + 4 * m.q_size * m.layers * attended
    ) / tp
    t_mem = nbytes / (hw.mem_bw * hw.mem_efficiency)
    t_compute = flops / (hw.matmul_rate * hw.compute_efficiency)
    t_launch = m.layers * hw.launch_per_layer_s
    t_ar = 0.0
    if tp > 1:
        msg = tokens * m.hidden * hw.dtype_bytes
        t_ar = 2 * m.layers * (hw.allreduce_latency_s + 2 * (tp - 1) / tp * msg / hw.allreduce_bus_bw)
    t_host = hw.host_step_s + hw.host_per_seq_s * seqs + hw.host_per_token_s * tokens
    if hw.small_gemm_rows and (tokens < hw.small_gemm_rows or 0 < sampled < hw.small_gemm_rows):
        t_host += hw.small_gemm_extra_s
    gpu = max(t_mem, t_compute) if hw.overlap else t_mem + t_compute
    seconds = max(gpu, t_launch) + t_ar + t_host
    return StepCost(seconds, nbytes, flops, t_mem, t_compute, t_launch, t_ar, t_host)


def cpu_hardware(mem_bw: float, matmul_rate: float, **fitted: float) -> Hardware:
    """This machine as the cost model sees it: measured copy bandwidth and fp32 GEMM rate, plus the
    efficiencies and host costs fitted by the calibration."""
    base = Hardware("cpu", mem_bw, matmul_rate, 64 * GiB, 4, activation_reserve_bytes=0)
    return replace(base, **fitted)
