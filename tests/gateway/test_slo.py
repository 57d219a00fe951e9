"""SLO-aware admission (gateway/slo.py): the TTFT prediction from the replicas' published load, the
refusal with its reason, the queue mode, the unpublished-burst correction, and goodput counting."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from common import Priority
from gateway.errors import ErrorKind, GatewayError
from gateway.slo import SloAdmission, record_outcome
from protocol.stats import EngineStats
from tenancy import SloTarget, Tenant


class FakePool:
    """What SLO admission reads of a pool: its name and its replicas' published stats."""

    def __init__(self, **replicas: EngineStats) -> None:
        self.name = "p"
        self.replicas = replicas

    def replica_stats(self) -> dict[str, EngineStats]:
        return self.replicas


def _stats(
    pending: dict[Priority, int], *, tokens: int = 10_000, seconds: float = 10.0, steps: int = 100
) -> EngineStats:
    # prompt tokens at 1,000 per second of full steps, 0.1 s a step on average
    return EngineStats(
        pending_prompt_tokens=pending,
        computed_tokens=tokens // 2,  # the average over all steps understates prompt work's pace
        step_seconds=seconds,
        num_steps=steps,
        full_step_prompt_tokens=tokens,
        full_step_seconds=seconds,
    )


def _tenant(**slo: SloTarget) -> Tenant:
    return Tenant(id="acme", slo={Priority(k): v for k, v in slo.items()})


def _count(outcome: str, priority: str = "interactive") -> float:
    labels = {"tenant": "acme", "priority": priority, "outcome": outcome}
    return REGISTRY.get_sample_value("loom:slo_requests_total", labels) or 0.0


def test_prediction_is_the_queue_ahead_at_the_replicas_rate_on_the_least_loaded_replica() -> None:
    pool = FakePool(
        a=_stats({Priority.INTERACTIVE: 2000, Priority.STANDARD: 50_000}),
        b=_stats({Priority.INTERACTIVE: 500, Priority.BATCH: 90_000}),
    )
    slo = SloAdmission()
    guess = slo.predict(pool.name, pool.replica_stats(), Priority.INTERACTIVE, 500, now=0.0)
    assert guess is not None
    # b: 500 interactive tokens ahead + its own 500 at 1,000 tokens/s, plus a 0.1 s step in flight;
    # lower classes do not count (they are served after).
    assert guess.tokens_ahead == 1000
    assert guess.ttft_s == pytest.approx(1.1)
    # for a standard request, the interactive and standard queues are both ahead
    standard = slo.predict(pool.name, pool.replica_stats(), Priority.STANDARD, 0, now=0.0)
    assert standard is not None and standard.tokens_ahead == 500


def test_a_predicted_miss_is_refused_with_the_prediction_and_the_target() -> None:
    pool = FakePool(a=_stats({Priority.INTERACTIVE: 4000}))
    tenant = _tenant(interactive=SloTarget(ttft_ms=500))
    before = _count("refused")
    with pytest.raises(GatewayError) as info:
        SloAdmission().admit(tenant, Priority.INTERACTIVE, 1000, pool.name, pool.replica_stats, now=0.0)
    err = info.value
    assert err.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert (
        "predicted time to first token 5.10 s" in err.message
        and "interactive target of 0.50 s" in err.message
    )
    assert err.retry_after_s == pytest.approx(4.6)
    assert err.limit == "slo_interactive_ttft"
    assert _count("refused") == before + 1


def test_light_load_no_target_and_queue_mode_are_admitted() -> None:
    loaded = FakePool(a=_stats({Priority.INTERACTIVE: 4000}))
    light = FakePool(a=_stats({Priority.INTERACTIVE: 100}))
    SloAdmission().admit(
        _tenant(interactive=SloTarget(ttft_ms=500)),
        Priority.INTERACTIVE,
        100,
        light.name,
        light.replica_stats,
        now=0.0,
    )
    SloAdmission().admit(_tenant(), Priority.INTERACTIVE, 100, loaded.name, loaded.replica_stats, now=0.0)

    def unread() -> dict[str, EngineStats]:
        raise AssertionError("a request with no target must not read the pool's stats")

    SloAdmission().admit(_tenant(), Priority.INTERACTIVE, 100, loaded.name, unread)
    SloAdmission().admit(
        _tenant(interactive=SloTarget(tpot_ms=10)),
        Priority.INTERACTIVE,
        100,
        loaded.name,
        loaded.replica_stats,
        now=0.0,
    )
    queued = _count("queued")
    SloAdmission().admit(
        _tenant(interactive=SloTarget(ttft_ms=500, on_miss="queue")),
        Priority.INTERACTIVE,
        100,
        loaded.name,
        loaded.replica_stats,
        now=0.0,
    )
    assert _count("queued") == queued + 1


def test_a_fresh_replica_that_cannot_tell_yet_admits() -> None:
    pool = FakePool(a=EngineStats(pending_prompt_tokens={Priority.INTERACTIVE: 10**6}))
    SloAdmission().admit(
        _tenant(interactive=SloTarget(ttft_ms=1)), Priority.INTERACTIVE, 100, pool.name, pool.replica_stats
    )


def test_a_burst_between_two_readings_counts_what_it_admitted() -> None:
    pool = FakePool(a=_stats({}), b=_stats({}))
    slo = SloAdmission()
    tenant = _tenant(interactive=SloTarget(ttft_ms=1000))
    admitted = 0
    with pytest.raises(GatewayError):
        for _ in range(100):  # stats never move: the gateway's own admissions must fill the queue
            slo.admit(tenant, Priority.INTERACTIVE, 200, pool.name, pool.replica_stats, now=0.0)
            admitted += 1
    # 0.9 s of room at 1,000 tokens/s on each of two replicas: about 9 requests of 200 tokens
    assert 5 <= admitted <= 10
    pool.replicas = {n: _stats({}, steps=101) for n in ("a", "b")}  # a new reading: the burst is in it
    slo.admit(tenant, Priority.INTERACTIVE, 200, pool.name, pool.replica_stats, now=0.0)


def test_what_a_replica_worked_off_since_its_reading_is_not_counted_again() -> None:
    pool = FakePool(a=_stats({Priority.INTERACTIVE: 3000}))
    slo = SloAdmission()
    fresh = slo.predict(pool.name, pool.replica_stats(), Priority.INTERACTIVE, 100, now=50.0)
    # the same reading 2 s later: 2,000 of the 3,000 tokens are done by now at 1,000 tokens/s
    stale = slo.predict(pool.name, pool.replica_stats(), Priority.INTERACTIVE, 100, now=52.0)
    assert fresh is not None and stale is not None
    assert (fresh.tokens_ahead, stale.tokens_ahead) == (3100, 1100)


def test_the_rate_follows_the_latest_readings() -> None:
    pool = FakePool(a=_stats({Priority.INTERACTIVE: 1000}))
    slo = SloAdmission()
    first = slo.predict(pool.name, pool.replica_stats(), Priority.INTERACTIVE, 0, now=0.0)
    # the replica slowed down: 1,000 more tokens in the next 10 busy seconds (100 tokens/s)
    pool.replicas = {"a": _stats({Priority.INTERACTIVE: 1000}, tokens=11_000, seconds=20.0, steps=200)}
    later = slo.predict(pool.name, pool.replica_stats(), Priority.INTERACTIVE, 0, now=0.0)
    assert first is not None and later is not None
    assert first.ttft_s == pytest.approx(1.1) and later.ttft_s == pytest.approx(10.1)


def test_goodput_counts_each_ended_request_against_both_targets() -> None:
    tenant = _tenant(standard=SloTarget(ttft_ms=500, tpot_ms=50))
    met, missed = _count("met", "standard"), _count("missed", "standard")
    record_outcome(tenant, Priority.STANDARD, 0.2, 0.04)
    record_outcome(tenant, Priority.STANDARD, 0.6, 0.04)  # late first token
    record_outcome(tenant, Priority.STANDARD, 0.2, 0.06)  # slow tokens
    record_outcome(tenant, Priority.STANDARD, None, None)  # no token at all
    record_outcome(tenant, Priority.BATCH, 9.0, 1.0)  # no target for the class: not counted
    assert _count("met", "standard") == met + 1
    assert _count("missed", "standard") == missed + 3
    assert _count("met", "batch") + _count("missed", "batch") == 0


@pytest.mark.parametrize(
    ("slo", "fragment"),
    [({"interactive": {"ttft_ms": 0}}, "ttft_ms"), ({"interactive": {"tpot_ms": -1}}, "tpot_ms"),
     ({"urgent": {"ttft_ms": 100}}, "slo"), ({"batch": {"on_miss": "drop"}}, "on_miss"),
     ({"interactive": {"ttft_ms": float("inf")}}, "ttft_ms")],
)  # fmt: skip
def test_bad_slo_targets_are_refused_naming_the_field(slo: dict, fragment: str) -> None:
    from tenancy.errors import TenantValidationError
    from tenancy.models import parse_tenant

    with pytest.raises(TenantValidationError) as info:
        parse_tenant({"id": "acme", "slo": slo})
    assert fragment in str(info.value)
