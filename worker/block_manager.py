"""KV block bookkeeping: free list, reference counts, per-sequence block tables and the prefix cache.

A full block whose K/V are computed is registered under a chained hash over (parent hash, its token
ids), where the first block's parent is the tenant's cache salt, so equal prompts from different
tenants never share a block. Freed blocks that carry a hash stay findable in an LRU pool and are
evicted (oldest first) only when no clean block is left.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from worker.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Collision-resistant chained hash: a collision would hand one prompt another's K/V."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free_clean: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached

    # ---- capacity ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_clean) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_prefix_blocks: int = 0) -> int:
        have = len(seq.block_table) + num_prefix_blocks
        total = seq.num_computed_tokens + num_prefix_blocks * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - have)

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] | None = None
    ) -> bool:
        prefix_blocks = prefix_blocks or []
        reviving = sum(1 for b in prefix_blocks if self._ref[b] == 0)
        need = self.blocks_needed(seq, num_new_tokens, len(prefix_blocks))
        return need + reviving <= self.num_free_blocks

    # ---- prefix cache --------------------------------------------------------------------------

    def _hashes(self, seq: Sequence, upto_blocks: int) -> list[bytes]:
        """The sequence's chained full-block hashes, computed once and kept on the sequence."""
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < upto_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else b"salt:" + seq.cache_salt
            hashes.append(block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of ``seq``, leaving at least its last token to compute."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._hashes(seq, max_blocks):
            b = self._cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def register_full_blocks(self, seq: Sequence) -> None:
        """Make the sequence's newly completed blocks findable by later prompts."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        done = seq.num_registered_blocks
        if full <= done:
            return
        hashes = self._hashes(seq, full)
        for i in range(done, full):
            b, h = seq.block_table[i], hashes[i]
            if self._hash[b] is None and h not in self._cached:
                self._cached[h] = b
                self._hash[b] = h
        seq.num_registered_blocks = full

    # ---- allocation ----------------------------------------------------------------------------

    def _take_free(self) -> int:
        if self._free_clean:
            b = self._free_clean.popleft()
        else:
            b, _ = self._free_cached.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                del self._cached[h]
                self._hash[b] = None
        self._ref[b] = 1
        return b

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] | None = None) -> None:
        """Extend ``seq``'s block table for ``num_new_tokens`` more tokens after any prefix-cache hits.

        The hit blocks hold computed K/V: the scheduler advances the sequence past them.
        """
        if not self.can_allocate(seq, num_new_tokens, prefix_blocks):
            raise RuntimeError("allocate called without capacity; check can_allocate first")
        hits = prefix_blocks or []
        need = self.blocks_needed(seq, num_new_tokens, len(hits))
        for b in hits:
            if self._ref[b] == 0:
                del self._free_cached[b]
            self._ref[b] += 1
        seq.block_table.extend(hits)
        if hits:
            seq.num_registered_blocks = len(hits)
        if prefix_blocks is not None and self.enable_prefix_caching:  # an admission, not a top-up
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += len(hits) * self.block_size
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def free(self, seq: Sequence) -> None:
        """Return every block of ``seq``; tail blocks become the first to be evicted."""
        for b in reversed(seq.block_table):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is not None:
                    self._free_cached[b] = None
                else:
                    self._free_clean.append(b)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def check_consistency(self) -> None:
        """Invariant check for tests: every block is either referenced or in exactly one free pool."""
        free = set(self._free_clean) | set(self._free_cached)
        assert len(free) == len(self._free_clean) + len(self._free_cached), "a block is free twice"
        for b in range(self.num_blocks):
            assert (self._ref[b] == 0) == (b in free), f"block {b}: ref {self._ref[b]} vs free {b in free}"
        for h, b in self._cached.items():
            assert self._hash[b] == h, f"block {b} hash mismatch"
