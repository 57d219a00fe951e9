"""The soak's memory verdict: a process whose resident memory still climbs after warm-up fails it."""

from __future__ import annotations

from loadtest.soak import memory_summary, still_growing


def _samples(gateway: list[float], replicas: dict[str, list[float]], every_s: float = 15.0) -> list[dict]:
    n = len(gateway)
    return [
        {
            "at_s": i * every_s,
            "gateway_mb": gateway[i],
            "replicas_mb": {pid: mbs[i] for pid, mbs in replicas.items() if i < len(mbs)},
        }
        for i in range(n)
    ]


def test_a_steady_climb_at_the_end_fails_and_a_plateau_or_a_short_life_does_not() -> None:
    minutes = 5
    n = minutes * 4 + 1  # a sample every 15 s
    flat = [350.0 + min(i, 4) * 2.0 for i in range(n)]  # warm-up, then a plateau
    leaking = [350.0 + i * 6.0 for i in range(n)]  # 24 MiB/min to the end
    short = [350.0 + i * 30.0 for i in range(8)]  # grows fast but lived under three minutes
    memory = memory_summary(_samples(flat, {"101": flat, "102": leaking, "103": short}))
    assert memory["replicas"]["102"]["mb_per_min_at_end"] == 24.0
    assert memory["replicas"]["101"]["mb_per_min_at_end"] == 0.0
    assert memory["replicas"]["103"]["mb_per_min_at_end"] is None
    assert still_growing(memory, 5.0) == ["replica 102"]
    assert still_growing(memory, 30.0) == []
    assert still_growing(memory_summary(_samples(leaking, {})), 5.0) == ["gateway"]
