"""A replica's adapter slots under tenants that share them: no tenant pins them all, a failed load is
tried again, weights read for requests that left are dropped, and files swapped in place are refused."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import worker.lora_slots as lora_slots
from loadtest.tiny_model import save_random_adapter, tiny_config
from protocol.adapters import LoraRequest, inspect_adapter
from worker.lora_slots import LoraSlots
from worker.scheduler import Gate

CONFIG = tiny_config()


def _slots(max_loras: int) -> LoraSlots:
    return LoraSlots(CONFIG, max_loras, 8, torch.float32, torch.device("cpu"))


def _adapter(root: Path, name: str, seed: int = 0) -> LoraRequest:
    path = save_random_adapter(CONFIG, root / name, seed=seed)
    return LoraRequest(f"t/{name}", str(path), inspect_adapter(path, CONFIG).digest)


def _seq(tenant: str, rid: str, adapter: LoraRequest) -> Any:
    return SimpleNamespace(tenant=tenant, request_id=rid, adapter=adapter)


def _settle(slots: LoraSlots, seq: Any, timeout_s: float = 10.0) -> Gate:
    """Ask until the answer is not "wait for the load"."""
    deadline = time.monotonic() + timeout_s
    while True:
        gate = slots.admit(seq)
        if gate is not Gate.WAIT or time.monotonic() > deadline:
            return gate
        time.sleep(0.01)


def test_one_tenant_cannot_pin_every_slot(tmp_path: Path) -> None:
    slots = _slots(2)
    a1, a2, b1 = (_adapter(tmp_path, n, i) for i, n in enumerate(("a1", "a2", "b1")))
    first = _seq("a", "r1", a1)
    assert _settle(slots, first) is Gate.READY
    assert _settle(slots, _seq("a", "r2", a2), timeout_s=0.5) is Gate.WAIT  # a's share is one slot
    assert _settle(slots, _seq("b", "r3", b1)) is Gate.READY  # the other tenant found the free one
    assert _settle(slots, _seq("a", "r4", a1)) is Gate.READY  # a's resident adapter: no new slot
    slots.release(first)
    slots.release(_seq("a", "r4", a1))
    slots.release(_seq("b", "r3", b1))
    assert _settle(slots, _seq("a", "r2", a2)) is Gate.READY  # a slot came free: a's turn


def test_a_failed_load_is_tried_again_after_its_delay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lora_slots, "FAILED_RETRY_S", 0.2)
    slots = _slots(2)
    good = _adapter(tmp_path, "good")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    adapter = LoraRequest("t/broken", str(broken), good.digest)
    assert _settle(slots, _seq("t", "r1", adapter)) is Gate.FAILED
    assert "could not be loaded" in (slots.failure(_seq("t", "r1", adapter)) or "")
    shutil.rmtree(broken)
    shutil.copytree(Path(good.path), broken)  # fixed in place (the registered files)
    assert slots.admit(_seq("t", "r2", adapter)) is Gate.FAILED  # within the delay: the same answer
    time.sleep(0.25)
    assert _settle(slots, _seq("t", "r3", adapter)) is Gate.READY


def test_files_swapped_in_place_are_refused(tmp_path: Path) -> None:
    slots = _slots(2)
    adapter = _adapter(tmp_path, "mine", seed=1)
    save_random_adapter(CONFIG, Path(adapter.path), seed=2)  # other weights, same path
    seq = _seq("t", "r1", adapter)
    assert _settle(slots, seq) is Gate.FAILED
    assert "changed since it was registered" in (slots.failure(seq) or "")


def test_weights_read_for_requests_that_left_are_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lora_slots, "UNCLAIMED_S", 0.2)
    slots = _slots(2)
    held = [_seq("a", "r1", _adapter(tmp_path, "a1", 1)), _seq("b", "r2", _adapter(tmp_path, "b1", 2))]
    for seq in held:
        assert _settle(slots, seq) is Gate.READY  # every slot pinned
    waiting = _seq("c", "r3", _adapter(tmp_path, "c1", 3))
    assert slots.admit(waiting) is Gate.WAIT
    deadline = time.monotonic() + 10
    while not slots._loads[waiting.adapter.id].done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert slots.admit(waiting) is Gate.WAIT  # read, but no slot: its request then goes away
    time.sleep(0.25)
    slots.release(held[0])  # any later activity sweeps
    assert waiting.adapter.id not in slots._loads
