"""The step-cost model on cases small enough to compute by hand, and on the real shapes' sizes."""

from __future__ import annotations

import pytest

from loadtest.costmodel import (
    H100,
    H200,
    LLAMA3_8B,
    LLAMA3_70B,
    SMOLLM2_135M,
    Deployment,
    Hardware,
    ModelShape,
    StepItem,
    attention_positions,
    step_cost,
)

# hidden 8, intermediate 16, 2 layers, 2 query heads and 1 KV head of 4 dims, vocabulary 10.
TOY = ModelShape("toy", hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=10,
                 tied_embeddings=False, max_context=64)  # fmt: skip
TOY_HW = Hardware(
    "toy", mem_bw=1000.0, matmul_rate=10000.0, memory_bytes=10**9, dtype_bytes=2,
    host_step_s=0.5, host_per_seq_s=0.1, activation_reserve_bytes=0,
)  # fmt: skip


def test_toy_shape_sizes_by_hand() -> None:
    # per layer: q,k,v 8*(8+4+4) + o 8*8 + mlp 3*8*16 + norms 2*8 = 128 + 64 + 384 + 16
    assert TOY.params_per_layer == 592
    assert TOY.layer_params == 1184
    assert TOY.weight_bytes_read(2) == (1184 + 80 + 8) * 2  # layers + head + final norm
    assert TOY.kv_bytes_per_token(2) == 2 * 2 * 4 * 2  # K and V, 2 layers, 1 head of 4, bf16
    assert attention_positions(1, 3) == 4  # one decode token sees 3 cached + itself
    assert attention_positions(4, 2) == 4 * 2 + 10  # a 4-token chunk after 2 cached: 2+3, 2+4, ...


def test_a_decode_step_by_hand() -> None:
    dep = Deployment(TOY, TOY_HW)
    c = step_cost(dep, [StepItem(1, 3, True), StepItem(1, 5, True)])
    weights = (1184 + 80 + 8) * 2
    assert c.bytes == weights + (3 + 5 + 2) * 32  # weights + cached KV read + 2 new tokens written
    # 2 FLOPs per layer weight per token, the head for the 2 sampled rows, attention 4*q*layers*positions
    assert c.flops == 2 * 1184 * 2 + 2 * 80 * 2 + 4 * 8 * 2 * (4 + 6)
    assert c.t_mem == pytest.approx(c.bytes / 1000.0)
    assert c.t_compute == pytest.approx(c.flops / 10000.0)
    assert c.bound == "memory"
    assert c.seconds == pytest.approx(c.bytes / 1000.0 + 0.5 + 0.1 * 2)


def test_a_prefill_chunk_is_compute_heavy_and_samples_nothing() -> None:
    dep = Deployment(TOY, TOY_HW)
    c = step_cost(dep, [StepItem(4, 2, False)])
    assert c.flops == 2 * 1184 * 4 + 4 * 8 * 2 * 18  # no lm_head: the prompt is not finished
    assert c.bytes == (1184 + 80 + 8) * 2 + (2 + 4) * 32


def test_without_overlap_memory_and_compute_add() -> None:
    from dataclasses import replace

    dep = Deployment(TOY, replace(TOY_HW, overlap=False))
    c = step_cost(dep, [StepItem(1, 3, True)])
    assert c.seconds == pytest.approx(c.t_mem + c.t_compute + 0.5 + 0.1)


def test_tensor_parallel_splits_weights_kv_and_flops_and_adds_all_reduces() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        Deployment(LLAMA3_70B, H100, 1)
    tp4 = Deployment(LLAMA3_70B, H100, 4)
    items = [StepItem(1, 1000, True)] * 8
    c = step_cost(tp4, items)
    m = LLAMA3_70B
    assert c.bytes == pytest.approx(m.weight_bytes_read(2) / 4 + 8 * 1001 * m.kv_bytes_per_token(2) / 4)
    msg = 8 * m.hidden * 2  # 8 tokens of hidden activations in bf16
    expected_ar = 2 * m.layers * (H100.allreduce_latency_s + 2 * 3 / 4 * msg / H100.allreduce_bus_bw)
    assert c.t_allreduce == pytest.approx(expected_ar)
    assert Deployment(LLAMA3_8B, H100, 1).kv_bytes_per_token_per_device == 131072  # 128 KiB per token


def test_the_real_shapes_have_their_published_sizes() -> None:
    assert SMOLLM2_135M.total_params == pytest.approx(134.5e6, rel=0.01)
    assert LLAMA3_8B.total_params == pytest.approx(8.03e9, rel=0.01)
    assert LLAMA3_70B.total_params == pytest.approx(70.55e9, rel=0.01)
    assert LLAMA3_70B.kv_bytes_per_token(2) == 327680  # 320 KiB
    # 70B on 4 H100: weights 35 GB per GPU, so 72 - 35 - 3.2 = 33.7 GB of KV at 80 KiB per token.
    dep = Deployment(LLAMA3_70B, H100, 4)
    assert dep.kv_capacity_tokens == int(
        (80 * 2**30 * 0.9 - LLAMA3_70B.weight_bytes_read(2) / 4 - 3 * 2**30) // (327680 / 4)
    )


def test_a_big_decode_batch_on_hopper_is_bounded_by_what_it_moves() -> None:
    # Llama-3-8B, batch 64 at 1000 tokens of context, on an H200: 15 GB of weights read (not the
    # embedding table: only its rows are looked up) + 8.4 GB of KV, at 4.3 TB/s.
    dep = Deployment(LLAMA3_8B, H200)
    c = step_cost(dep, [StepItem(1, 1000, True)] * 64)
    assert c.bound == "memory"
    assert c.t_mem == pytest.approx((15.01e9 + 64 * 1001 * 131072) / 4.3e12, rel=0.01)
    assert c.seconds == pytest.approx(c.t_mem + 1e-3 + 64 * 10e-6, rel=1e-6)
