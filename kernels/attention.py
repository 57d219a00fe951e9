"""Unified paged attention over a flat varlen batch: prefill chunks and decode tokens in one call.

Each sequence ``s`` contributes the query rows ``query_start_loc[s]:query_start_loc[s+1]``; its
``seq_lens[s]`` counts every token it has, cached context included, so the new chunk occupies the
last ``q_len`` positions and is causal inside itself. Keys and values are read from the paged cache
``[num_blocks, block_size, num_kv_heads, head_dim]`` through ``block_tables[s]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

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

    def reference_plan(self) -> _ReferencePlan:
        if self._plan is None:
            self._plan = _ReferencePlan.from_metadata(self)
        return self._plan


@dataclass
class _ReferencePlan:
    """Host-side split of the batch into decodes (batched together) and chunks (one by one)."""

    decode_seqs: torch.Tensor  # long [D]: sequence indices with a single query token
    decode_rows: torch.Tensor  # long [D]: their query rows
    decode_max_len: int
    chunk_seqs: list[tuple[int, int, int, int]]  # (seq, first row, q_len, seq_len)

    @classmethod
    def from_metadata(cls, m: PagedAttentionMetadata) -> _ReferencePlan:
        qsl, lens = m.query_start_loc_host, m.seq_lens_host
        dec_s, dec_r, chunks = [], [], []
        for s, seq_len in enumerate(lens):
            q_len = qsl[s + 1] - qsl[s]
            if q_len == 1:
                dec_s.append(s)
                dec_r.append(qsl[s])
            elif q_len > 1:
                chunks.append((s, qsl[s], q_len, seq_len))
        device = m.block_tables.device
        return cls(
            decode_seqs=torch.tensor(dec_s, dtype=torch.long, device=device),
            decode_rows=torch.tensor(dec_r, dtype=torch.long, device=device),
            decode_max_len=max((lens[s] for s in dec_s), default=0),
            chunk_seqs=chunks,
        )


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
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, out)


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


def _gather_kv(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Cache rows of ``blocks [..., nb]`` as ``[..., nb * block_size, kv_heads, head_dim]`` in fp32."""
    g = cache[blocks]
    return g.reshape(*blocks.shape[:-1], -1, cache.shape[-2], cache.shape[-1]).float()


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
    hold anything, NaN included: they are masked out of the scores and zeroed in V.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    plan = meta.reference_plan()
    tables = meta.block_tables.long()

    if plan.decode_seqs.numel():
        nb = -(-plan.decode_max_len // block_size)
        blocks = tables[plan.decode_seqs, :nb]
        k = _gather_kv(k_cache, blocks).permute(0, 2, 3, 1)  # [D, kvh, hd, L]
        v = _gather_kv(v_cache, blocks).permute(0, 2, 1, 3)  # [D, kvh, L, hd]
        qd = q[plan.decode_rows].float().view(-1, num_kv_heads, group, head_dim)
        scores = torch.matmul(qd, k) * scale  # [D, kvh, G, L]
        lens = meta.seq_lens[plan.decode_seqs].long()
        pad = torch.arange(scores.shape[-1], device=q.device)[None, :] >= lens[:, None]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        v.masked_fill_(pad[:, None, :, None], 0.0)  # 0 * NaN would poison the product
        probs = torch.softmax(scores, dim=-1)
        od = torch.matmul(probs, v).view(-1, num_heads, head_dim)
        out[plan.decode_rows] = od.to(q.dtype)

    for s, row, q_len, seq_len in plan.chunk_seqs:
        nb = -(-seq_len // block_size)
        k = _gather_kv(k_cache, tables[s, :nb])[:seq_len]  # [L, kvh, hd]
        v = _gather_kv(v_cache, tables[s, :nb])[:seq_len]
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
    return out
