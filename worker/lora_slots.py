"""A replica's adapter slots: a bounded set of LoRA adapters resident on the device, loaded on demand.

Weights live stacked per adapted projection, ``A [slots, max_rank, in]`` and ``B [slots, out,
max_rank]`` (allocated the first time an adapter needs that projection), so one step can mix every
resident adapter (kernels/lora.py). The scheduler asks this table, through its admission gate, whether
a sequence may run: a resident adapter is pinned while sequences use it; a missing one is read from
disk on a background thread while its requests wait (they never fail for waiting); once read it takes a
free slot, or the least recently used slot no running sequence pins. An adapter whose files cannot be
read fails its requests with the reason.

Shared by tenants, so bounded for each: a tenant's adapters may pin at most ``max_loras - 1`` slots
(other tenants' adapters always find one; the tenant's own further adapters wait their turn); a load
that failed is tried again after ``FAILED_RETRY_S`` (a file fixed in place is served without a
restart), and weights read for requests that all went away are dropped after ``UNCLAIMED_S``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from kernels import LoraBatch
from protocol.adapters import LoraRequest, target_shape
from protocol.model_config import ModelConfig
from worker.lora import LoadedAdapter, load_adapter
from worker.scheduler import Gate
from worker.sequence import Sequence

log = logging.getLogger(__name__)

# A load that failed answers its adapter's requests with its reason for this long, then is tried again.
FAILED_RETRY_S = 30.0
# Weights read for requests that all left (no request asked for them since) are dropped after this.
UNCLAIMED_S = 10.0


class LoraSlots:
    def __init__(
        self,
        config: ModelConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self._a: dict[tuple[int, str], torch.Tensor] = {}
        self._b: dict[tuple[int, str], torch.Tensor] = {}
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self._slot_of: dict[str, int] = {}
        self._resident: list[str | None] = [None] * max_loras
        self._covers: list[set[tuple[int, str]]] = [set() for _ in range(max_loras)]
        self._ranks = [0] * max_loras
        self._pins = [0] * max_loras
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # unpinned
        self._holder: dict[str, int] = {}  # request id -> the slot it pins
        self._loads: dict[str, concurrent.futures.Future[LoadedAdapter]] = {}
        self._asked: dict[str, float] = {}  # adapter id -> when a request last waited on its load
        self._failed_at: dict[str, float] = {}  # adapter id -> when its load was seen failing
        self._tenant_of_slot: list[str | None] = [None] * max_loras  # who pins it (while pinned)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-lora-load")
        self.load_seconds: list[float] = []  # how long each adapter took to read, for benchmarks
        self.on_loaded: Callable[[], None] = lambda: None  # wakes an engine that waits on a load

    # ---- the scheduler's gate ------------------------------------------------------------------

    def admit(self, seq: Sequence) -> Gate:
        adapter = seq.adapter
        if adapter is None:
            return Gate.READY
        slot = self._slot_of.get(adapter.id)
        if slot is None or self._pins[slot] == 0:
            # Pinning another slot: not past the tenant's share, so one tenant cannot hold them all.
            pinned = sum(1 for s, t in enumerate(self._tenant_of_slot) if t == seq.tenant and self._pins[s])
            if self.max_loras > 1 and pinned >= self.max_loras - 1:
                return Gate.WAIT
        if slot is None:
            slot_or_gate = self._install(adapter)
            if isinstance(slot_or_gate, Gate):
                return slot_or_gate
            slot = slot_or_gate
        if self._pins[slot] == 0:
            self._lru.pop(slot, None)
            self._tenant_of_slot[slot] = seq.tenant
        self._pins[slot] += 1
        self._holder[seq.request_id] = slot
        return Gate.READY

    def release(self, seq: Sequence) -> None:
        slot = self._holder.pop(seq.request_id, None)
        if slot is None:
            return
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._lru[slot] = None  # most recently used: evicted last
            self._tenant_of_slot[slot] = None
        self._drop_stale_loads(time.monotonic())

    def failure(self, seq: Sequence) -> str | None:
        """Why ``seq``'s adapter could not be loaded (after ``admit`` returned FAILED)."""
        load = self._loads.get(seq.adapter.id) if seq.adapter is not None else None
        if load is None or not load.done() or load.exception() is None:
            return None
        return f"adapter could not be loaded: {load.exception()}"

    def _install(self, adapter: LoraRequest) -> int | Gate:
        now = time.monotonic()
        self._drop_stale_loads(now)
        self._asked[adapter.id] = now
        load = self._loads.get(adapter.id)
        if load is None:
            started = now
            load = self._pool.submit(
                load_adapter, adapter.path, self.config, self.max_rank, expected_digest=adapter.digest
            )

            def done(_f: concurrent.futures.Future[LoadedAdapter]) -> None:
                self.load_seconds.append(time.monotonic() - started)
                self.on_loaded()

            load.add_done_callback(done)
            self._loads[adapter.id] = load
            return Gate.WAIT
        if not load.done():
            return Gate.WAIT
        if load.exception() is not None:
            self._failed_at.setdefault(adapter.id, now)
            return Gate.FAILED
        if not self._lru:  # every slot is pinned by running sequences: wait for one to finish
            return Gate.WAIT
        slot, _ = self._lru.popitem(last=False)
        self._lru[slot] = None  # admit() takes it off again as it pins
        self._put(slot, adapter.id, load.result())
        del self._loads[adapter.id]  # read once; the resident copy is the one that counts now
        self._asked.pop(adapter.id, None)
        return slot

    def _drop_stale_loads(self, now: float) -> None:
        """Forget failed loads past their retry delay, and weights no waiting request asked for lately
        (their requests were cancelled): neither may hold memory, or a verdict, for good."""
        for adapter_id, load in list(self._loads.items()):
            if not load.done():
                continue
            if load.exception() is not None:
                failed = self._failed_at.get(adapter_id)
                if failed is not None and now - failed >= FAILED_RETRY_S:
                    del self._loads[adapter_id], self._failed_at[adapter_id]
                    self._asked.pop(adapter_id, None)
            elif now - self._asked.get(adapter_id, now) >= UNCLAIMED_S:
                del self._loads[adapter_id]
                self._asked.pop(adapter_id, None)
                log.info("adapter %s was read for requests that left; its weights are dropped", adapter_id)

    def _put(self, slot: int, adapter_id: str, loaded: LoadedAdapter) -> None:
        old = self._resident[slot]
        if old is not None:
            del self._slot_of[old]
            log.info("adapter %s evicted from slot %d", old, slot)
        for key in self._covers[slot]:  # a smaller adapter must not inherit the old one's rows
            self._a[key][slot].zero_()
            self._b[key][slot].zero_()
        for (layer, target), (a, b) in loaded.weights.items():
            sa, sb = self._stacks(layer, target)
            sa[slot, : loaded.rank].copy_(a.to(self.dtype))
            sb[slot, :, : loaded.rank].copy_(b.to(self.dtype))
        self._covers[slot] = set(loaded.weights)
        self._ranks[slot] = loaded.rank
        self.scales[slot] = loaded.scale
        self._resident[slot] = adapter_id
        self._slot_of[adapter_id] = slot

    def _stacks(self, layer: int, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, target)
        if key not in self._a:
            out_f, in_f = target_shape(self.config, target)
            shape_a, shape_b = (self.max_loras, self.max_rank, in_f), (self.max_loras, out_f, self.max_rank)
            self._a[key] = torch.zeros(shape_a, dtype=self.dtype, device=self.device)
            self._b[key] = torch.zeros(shape_b, dtype=self.dtype, device=self.device)
        return self._a[key], self._b[key]

    # ---- the forward pass ----------------------------------------------------------------------

    def batch(self, seqs: list[Sequence], num_tokens: list[int]) -> LoraBatch | None:
        """Each token's slot for one step; None when no sequence of the step uses an adapter."""
        if not self._holder:
            return None
        slots: list[int] = []
        for seq, n in zip(seqs, num_tokens, strict=True):
            slots += [self._holder.get(seq.request_id, -1)] * n
        batch = LoraBatch.build(slots, self._ranks, self.device)
        return batch if batch.active else None

    def weights(self, layer: int, target: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = (layer, target)
        return (self._a[key], self._b[key]) if key in self._a else None

    # ---- what replicas publish -----------------------------------------------------------------

    def resident(self) -> tuple[str, ...]:
        return tuple(a for a in self._resident if a is not None)

    def running(self) -> tuple[str, ...]:
        return tuple(a for s, a in enumerate(self._resident) if a is not None and self._pins[s] > 0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
