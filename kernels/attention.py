"""Unified paged attention over a flat varlen batch: prefill chunks and decode tokens in one call.

Each sequence ``s`` contributes the query rows ``query_start_loc[s]:query_start_loc[s+1]``; its
``seq_lens[s]`` counts every token it has, cached context included, so the new chunk occupies the
last ``q_len`` positions and is causal inside itself. Keys and values are read from the paged cache
``[num_blocks, block_size, num_kv_heads, head_dim]`` through ``block_tables[s]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels.cpu_kernels import cpu_kernels
from kernels.dispatch import use_triton


@dataclass
class PagedAttentionMetadata:
    """Everything attention needs to know about one step's flat batch (built once per step)."""

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1], on the compute device
    seq_lens: torch.Tensor  # int32 [num_seqs], on the compute device
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks], on the compute device
    max_query_len: int
    max_seq_len: int
    # Host copies, so the CPU reference can plan without a device sync per layer.
    query_start_loc_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    # Triton split-KV override: None lets choose_num_kv_splits decide, 1 forces the single pass.
    kv_splits: int | None = None
    _plan: _ReferencePlan | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        device: torch.device | str = "cpu",
    ) -> PagedAttentionMetadata:
        """Build the metadata from host lists; block tables are padded with 0 (never read)."""
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        width = max((len(t) for t in block_tables), default=0) or 1
        table = torch.zeros((len(block_tables), width), dtype=torch.int32)
        for i, t in enumerate(block_tables):
            if t:
                table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_host=qsl,
            seq_lens_host=list(seq_lens),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    def reference_plan(self, block_size: int) -> _ReferencePlan:
        if self._plan is None or self._plan.block_size != block_size:
            self._plan = _ReferencePlan.build(self, block_size)
        return self._plan


@dataclass
class _ReferencePlan:
    """Per-step work of the CPU reference, shared by every layer.

    Decodes are batched: their keys are gathered by slot into one ``[D, L]`` grid (L the longest
    decode), positions past a sequence's end point at its first slot (finite data, so no NaN can
    enter) and get a -inf score bias. Chunks are attended one by one. Gather buffers are allocated
    once per step, not per layer: fresh multi-megabyte tensors cost page faults on every call.
    """

    block_size: int
    decode_seqs: torch.Tensor  # long [D]: sequences with a single query token
    decode_rows: torch.Tensor  # long [D]: their query rows
    decode_slots: torch.Tensor  # long [D * L]
    decode_bias: torch.Tensor  # fp32 [D, 1, L]: 0 where a key exists, -inf past the end
    chunks: list[tuple[int, int, torch.Tensor]]  # (first row, q_len, slots [seq_len]) per chunk
    _scratch: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, m: PagedAttentionMetadata, block_size: int) -> _ReferencePlan:
        qsl, lens = m.query_start_loc_host, m.seq_lens_host
        device = m.block_tables.device
        tables = m.block_tables.long()
        dec_s, dec_r, chunks = [], [], []
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
            decode_seqs=seqs,
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


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [num_tokens, num_heads, head_dim]`` over the paged cache; same shape out.

    ``out`` (optional, ``[num_tokens, num_heads, head_dim]`` in q's dtype) receives the result
    instead of a fresh tensor; rows of tokens outside every sequence are left untouched.
    """
    if use_triton(q):
        from kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale, out)
    if q.device.type == "cpu" and q.dtype == torch.float32 and (compiled := cpu_kernels()) is not None:
        return _paged_attention_cpu(compiled, q, k_cache, v_cache, meta, scale, out)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, out)


def _paged_attention_cpu(
    compiled: ModuleType,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Decodes through the compiled CPU kernel (KV read in place, once); chunks as in the reference."""
    plan = meta.reference_plan(k_cache.shape[1])
    result = torch.empty(q.shape, dtype=torch.float32) if out is None or not out.is_contiguous() else out
    if plan.decode_rows.numel():
        compiled.paged_decode(
            q.contiguous(),
            k_cache.contiguous(),
            v_cache.contiguous(),
            meta.block_tables.contiguous(),
            meta.seq_lens.contiguous(),
            plan.decode_seqs,
            plan.decode_rows,
            result,
            scale,
        )
    _chunks_ref(q, k_cache, v_cache, plan, scale, result)
    if out is not None and out is not result:
        rows = torch.cat([plan.decode_rows, *(torch.arange(r, r + n) for r, n, _ in plan.chunks)])
        out[rows] = result[rows]
        return out
    return result


# Split-KV heuristic (used by the Triton path). A decode program streams one sequence's keys for
# one KV head; with fewer such programs than the GPU holds in flight, bandwidth sits idle, so long
# contexts are cut into splits (merged afterwards). Mixed/prefill batches have query tiles enough.
_SPLIT_TARGET_PROGRAMS_PER_SM = 8  # resident 4-warp programs per SM needed to saturate HBM
_SPLIT_MIN_KEYS = 256  # below this a split costs more in launch/merge than it saves
_SPLIT_MAX = 32


def choose_num_kv_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int
) -> int:
    """Number of KV splits for a batch: 1 (single pass) unless a decode batch underfills the GPU."""
    if max_query_len != 1 or num_seqs == 0:
        return 1
    programs = num_seqs * num_kv_heads
    want = -(-(_SPLIT_TARGET_PROGRAMS_PER_SM * num_sms) // programs)
    return max(1, min(want, max_seq_len // _SPLIT_MIN_KEYS, _SPLIT_MAX))


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: fp32 math whatever the cache dtype; decodes batched, chunks one by one.

    Cache slots past a sequence's length (the tail of its last block, padded table entries) may
    hold anything, NaN included: they are never read (see _ReferencePlan).
    """
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    plan = meta.reference_plan(k_cache.shape[1])

    _decodes_ref(q, k_cache, v_cache, plan, scale, out)
    _chunks_ref(q, k_cache, v_cache, plan, scale, out)
    return out


def _head_layout(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(query heads, head dim, KV heads, query heads per KV head)."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    return num_heads, q.shape[2], num_kv_heads, num_heads // num_kv_heads


def _decodes_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _ReferencePlan,
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


def _chunks_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _ReferencePlan,
    scale: float,
    out: torch.Tensor,
) -> None:
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
