"""Torch reference for paged attention: fp32 math, the twin every faster path is checked against.

It is also what runs on CPU when neither the Triton path (forced) nor the compiled CPU decode kernel
(:mod:`kernels.attention_cpu`) applies. The batch layout is described in
:mod:`kernels.attention_metadata`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.attention_metadata import PagedAttentionMetadata


@dataclass
class ReferencePlan:
    """Per-step work of the CPU reference, shared by every layer.

    Decodes are batched: their keys are gathered by slot into one ``[D, L]`` grid (L the longest
    decode), positions past a sequence's end point at its first slot (finite data, so no NaN can
    enter) and get a -inf score bias. Chunks are attended one by one. Gather buffers are allocated
    once per step, not per layer: fresh multi-megabyte tensors cost page faults on every call.
    """

    block_size: int
    decode_rows: torch.Tensor  # long [D]: query rows of the sequences with a single query token
    decode_slots: torch.Tensor  # long [D * L]
    decode_bias: torch.Tensor  # fp32 [D, 1, L]: 0 where a key exists, -inf past the end
    chunks: list[tuple[int, int, torch.Tensor]]  # (first row, q_len, slots [seq_len]) per chunk
    _scratch: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, m: PagedAttentionMetadata, block_size: int) -> ReferencePlan:
        qsl, lens = m.query_start_loc_host, m.seq_lens_host
        device = m.block_tables.device
        tables = m.block_tables.long()
        dec_s: list[int] = []
        dec_r: list[int] = []
        chunks: list[tuple[int, int, torch.Tensor]] = []
        for s, seq_len in enumerate(lens):
            q_len = qsl[s + 1] - qsl[s]
            if q_len == 1:
                dec_s.append(s)
                dec_r.append(qsl[s])
            elif q_len > 1:
                pos = torch.arange(seq_len, device=device)
                chunks.append((qsl[s], q_len, tables[s, pos // block_size] * block_size + pos % block_size))
        width = max((lens[s] for s in dec_s), default=0)
        pos = torch.arange(width, device=device)
        seqs = torch.tensor(dec_s, dtype=torch.long, device=device)
        slots = tables[seqs][:, pos // block_size] * block_size + pos % block_size  # [D, L]
        valid = pos[None, :] < torch.tensor([lens[s] for s in dec_s], device=device)[:, None]
        slots = torch.where(valid, slots, slots[:, :1])
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=device).masked_fill_(
            ~valid, float("-inf")
        )
        return cls(
            block_size=block_size,
            decode_rows=torch.tensor(dec_r, dtype=torch.long, device=device),
            decode_slots=slots.reshape(-1),
            decode_bias=bias[:, None, :],
            chunks=chunks,
        )

    def gather(self, name: str, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Rows ``slots`` of ``cache`` as fp32 ``[len(slots), kv_heads * head_dim]``, into a reused buffer."""
        flat = cache.view(-1, cache.shape[-2] * cache.shape[-1])
        if cache.dtype != torch.float32:
            return flat.index_select(0, slots).float()
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] != slots.shape[0]:
            buf = self._scratch[name] = torch.empty((slots.shape[0], flat.shape[1]), device=cache.device)
        return torch.index_select(flat, 0, slots, out=buf)


def reference_plan(meta: PagedAttentionMetadata, block_size: int) -> ReferencePlan:
    """The step's :class:`ReferencePlan`, built by the first layer and reused by the others."""
    return meta.cached_plan(("reference", block_size), lambda: ReferencePlan.build(meta, block_size))


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: fp32 math whatever the cache dtype; decodes batched, chunks one by one.

    Same contract as :func:`kernels.attention.paged_attention`. Cache slots past a sequence's
    length (the tail of its last block, padded table entries) may hold anything, NaN included: they
    are never read (see :class:`ReferencePlan`).
    """
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    plan = reference_plan(meta, k_cache.shape[1])

    _decodes_ref(q, k_cache, v_cache, plan, scale, out)
    chunks_ref(q, k_cache, v_cache, plan, scale, out)
    return out


def _head_layout(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(query heads, head dim, KV heads, query heads per KV head)."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    return num_heads, q.shape[2], num_kv_heads, num_heads // num_kv_heads


def _decodes_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: ReferencePlan,
    scale: float,
    out: torch.Tensor,
) -> None:
    num_heads, head_dim, num_kv_heads, group = _head_layout(q, k_cache)
    num_decodes = plan.decode_rows.numel()
    if num_decodes:
        k = plan.gather("k", k_cache, plan.decode_slots).view(num_decodes, -1, num_kv_heads, head_dim)
        v = plan.gather("v", v_cache, plan.decode_slots).view(num_decodes, -1, num_kv_heads, head_dim)
        qd = (q[plan.decode_rows].float() * scale).view(num_decodes, num_kv_heads, group, head_dim)
        od = torch.empty((num_decodes, num_kv_heads, group, head_dim), device=q.device)
        # One KV head at a time: strided views feed the GEMMs directly, with no transposed copies.
        for h in range(num_kv_heads):
            scores = torch.matmul(qd[:, h], k[:, :, h].transpose(1, 2))  # [D, G, L]
            scores += plan.decode_bias
            od[:, h] = torch.matmul(torch.softmax(scores, dim=-1), v[:, :, h])
        out[plan.decode_rows] = od.view(num_decodes, num_heads, head_dim).to(q.dtype)


def chunks_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: ReferencePlan,
    scale: float,
    out: torch.Tensor,
) -> None:
    """The plan's prefill chunks (query rows > 1), one SDPA call each, into ``out``."""
    num_heads, head_dim, num_kv_heads, group = _head_layout(q, k_cache)
    for row, q_len, slots in plan.chunks:
        seq_len = slots.shape[0]
        k = plan.gather("ck", k_cache, slots).view(seq_len, num_kv_heads, head_dim)
        v = plan.gather("cv", v_cache, slots).view(seq_len, num_kv_heads, head_dim)
        qs = q[row : row + q_len].float().view(q_len, num_kv_heads, group, head_dim)
        qs = qs.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
        ctx = seq_len - q_len
        key_pos = torch.arange(seq_len, device=q.device)
        query_pos = ctx + torch.arange(q_len, device=q.device)
        allowed = (key_pos[None, :] <= query_pos[:, None]).repeat(group, 1)  # [G*q_len, L]
        o = F.scaled_dot_product_attention(
            qs, k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale
        )  # [kvh, G*q_len, hd]
        o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[row : row + q_len] = o.reshape(q_len, num_heads, head_dim).to(q.dtype)
