"""KV block bookkeeping: free list, reference counts, per-sequence block tables and the prefix cache.

A full block whose K/V are computed is registered under a chained hash over (parent hash, its token
ids), where the first block's parent is the tenant's cache salt, so equal prompts from different
tenants never share a block. Freed blocks that carry a hash stay findable in an LRU pool and are
evicted (oldest first) only when no clean block is left.

Every block in use or in that pool belongs to the tenant that computed it (equal prompts of two
tenants never share a block, so ownership is plain), and what a tenant holds counts against its
share (kv_shares.py): cached blocks of a tenant at or under its floor are evicted only by that
tenant itself, a tenant at its cap recycles its own cached blocks before taking any other, and a
tenant's live sequences may not grow past its cap (bar its only one).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, defaultdict, deque

from protocol.stats import TenantKv
from worker.kv_shares import KvShares
from worker.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Collision-resistant chained hash: a collision would hand one prompt another's K/V."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.shares = KvShares(num_blocks)
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._owner: list[str | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free_clean: deque[int] = deque(range(num_blocks))
        # Free blocks that still hold a cached prefix, per owner, least recently freed first; the
        # value orders them across owners.
        self._parked: dict[str, OrderedDict[int, int]] = defaultdict(OrderedDict)
        self._num_parked = 0
        self._clock = 0
        self._held: dict[str, int] = defaultdict(int)  # blocks in use or parked, per owner
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached

    # ---- capacity ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_clean) + self._num_parked

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

    def held(self, tenant: str) -> int:
        """Blocks ``tenant`` holds: in use by its sequences, or caching its prefixes."""
        return self._held.get(tenant, 0)

    def over_floor(self, tenant: str) -> bool:
        """Whether ``tenant`` holds more than its floor (what others may take from it)."""
        return self.held(tenant) > self.shares.floor(tenant)

    def by_tenant(self) -> dict[str, TenantKv]:
        tenants = set(self.shares.tenants()) | {t for t, n in self._held.items() if n}
        return {t: TenantKv(self.held(t), self.shares.floor(t), self.shares.cap(t)) for t in sorted(tenants)}

    def _evictable(self, owner: str, for_tenant: str) -> int:
        parked = len(self._parked.get(owner, ()))
        if owner == for_tenant:
            return parked
        return min(parked, max(0, self._held[owner] - self.shares.floor(owner)))

    def available(self, tenant: str) -> int:
        """Free blocks ``tenant`` may take: clean ones, its own cached ones, and other tenants'
        cached ones beyond their floors."""
        return len(self._free_clean) + sum(self._evictable(o, tenant) for o in self._parked)

    def cap_bound(self, seq: Sequence, num_new_blocks: int) -> bool:
        """Whether ``num_new_blocks`` more blocks in use would take ``seq``'s tenant past its cap
        (never for the tenant's only sequence holding blocks: a cap limits how many contexts a
        tenant keeps, not how long one may grow)."""
        tenant = seq.tenant
        in_use = self._held.get(tenant, 0) - len(self._parked.get(tenant, ()))
        if in_use <= len(seq.block_table):
            return False
        return in_use + num_new_blocks > self.shares.cap(tenant)

    def new_blocks(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] | None = None) -> int:
        """Blocks ``seq`` would newly put in use: fresh ones, and cached hits nobody is using."""
        prefix_blocks = prefix_blocks or []
        reviving = sum(1 for b in prefix_blocks if self._ref[b] == 0)
        return self.blocks_needed(seq, num_new_tokens, len(prefix_blocks)) + reviving

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] | None = None
    ) -> bool:
        new = self.new_blocks(seq, num_new_tokens, prefix_blocks)
        if self.cap_bound(seq, new):
            return False
        return new <= len(self._free_clean) or new <= self.available(seq.tenant)

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

    def _unpark(self, b: int) -> None:
        owner = self._owner[b]
        assert owner is not None
        del self._parked[owner][b]
        self._num_parked -= 1

    def _victim_owner(self, tenant: str) -> str:
        """Whose cached block ``tenant`` evicts: the least recently freed among those it may take."""
        owners = [o for o in self._parked if self._evictable(o, tenant) > 0]
        return min(owners, key=lambda o: next(iter(self._parked[o].values())))

    def _take_free(self, tenant: str) -> int:
        if self._parked.get(tenant) and self._held[tenant] >= self.shares.cap(tenant):
            b = next(iter(self._parked[tenant]))  # at its cap: recycle its own cached block
        elif self._free_clean:
            b = self._free_clean.popleft()
        else:
            b = next(iter(self._parked[self._victim_owner(tenant)]))
        evicted = self._owner[b]
        if self._ref[b] == 0 and evicted is not None:  # a cached block: evict its prefix
            self._unpark(b)
            self._held[evicted] -= 1
            h = self._hash[b]
            if h is not None:
                del self._cached[h]
                self._hash[b] = None
        self._owner[b] = tenant
        self._held[tenant] += 1
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
                self._unpark(b)
            self._ref[b] += 1
        seq.block_table.extend(hits)
        if hits:
            seq.num_registered_blocks = len(hits)
        if prefix_blocks is not None and self.enable_prefix_caching:  # an admission, not a top-up
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += len(hits) * self.block_size
        for _ in range(need):
            seq.block_table.append(self._take_free(seq.tenant))

    def trim(self, seq: Sequence) -> None:
        """Return the blocks past what ``seq``'s tokens need: those taken for proposed tokens that
        were rejected (never registered: their positions were not computed)."""
        keep = -(-seq.num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            b = seq.block_table.pop()
            self._ref[b] -= 1
            assert self._ref[b] == 0 and self._hash[b] is None, "a trimmed block is shared or cached"
            owner = self._owner[b]
            assert owner is not None
            self._free_clean.append(b)
            self._owner[b] = None
            self._held[owner] -= 1

    def free(self, seq: Sequence) -> None:
        """Return every block of ``seq``; tail blocks become the first to be evicted."""
        for b in reversed(seq.block_table):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                owner = self._owner[b]
                assert owner is not None
                if self._hash[b] is not None:
                    self._parked[owner][b] = self._clock
                    self._clock += 1
                    self._num_parked += 1
                else:
                    self._free_clean.append(b)
                    self._owner[b] = None
                    self._held[owner] -= 1
        seq.block_table = []
        seq.num_registered_blocks = 0

    def check_consistency(self) -> None:
        """Invariant check for tests: every block is either referenced or in exactly one free pool."""
        parked = [b for pool in self._parked.values() for b in pool]
        free = set(self._free_clean) | set(parked)
        assert len(free) == len(self._free_clean) + len(parked) == len(self._free_clean) + self._num_parked, (
            "a block is free twice"
        )
        for b in range(self.num_blocks):
            assert (self._ref[b] == 0) == (b in free), f"block {b}: ref {self._ref[b]} vs free {b in free}"
            assert (self._owner[b] is None) == (b in self._free_clean), f"block {b}: owner {self._owner[b]}"
        for tenant, pool in self._parked.items():
            assert all(self._owner[b] == tenant for b in pool), f"a block parked under {tenant} is not its"
        held: dict[str, int] = defaultdict(int)
        for owner in self._owner:
            if owner is not None:
                held[owner] += 1
        assert {t: n for t, n in self._held.items() if n} == dict(held), "blocks held per tenant miscounted"
        for h, b in self._cached.items():
            assert self._hash[b] == h, f"block {b} hash mismatch"
