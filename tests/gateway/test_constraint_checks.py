"""The gateway's check of output constraints before admission (gateway/constraints.py), without a
server: verdicts are kept per tenant and constraint but name the field each request used, and a
check's deadline counts only its own time."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway import constraints
from gateway.constraints import ConstraintChecks
from gateway.errors import ErrorKind, GatewayError
from loadtest.tiny_model import random_checkpoint
from protocol.structured import Constraint, ConstraintKind

TOKENIZER = random_checkpoint().tokenizer


async def _refusal(checks: ConstraintChecks, tenant: str, c: Constraint) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        await checks.check(tenant, TOKENIZER, c)
    assert info.value.kind is ErrorKind.INVALID_ARGUMENT
    return info.value


async def test_a_kept_verdict_names_the_field_each_request_used() -> None:
    checks = ConstraintChecks(2.0)
    broken = "start: undefined_rule"
    for source in ("guided_grammar", "structured_outputs.grammar", "grammar"):
        refused = await _refusal(checks, "t1", Constraint(ConstraintKind.GRAMMAR, broken, source=source))
        assert refused.violations == ((source, 'at 1(8): unknown name: "undefined_rule"'),)
    assert len(checks._verdicts) == 1  # checked once, kept for the tenant


async def test_a_check_waiting_for_a_thread_is_not_taken_for_a_slow_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both check threads busy with another tenant's work for longer than the deadline: a simple
    constraint queued behind them still passes (the deadline starts when its own check starts)."""
    checks = ConstraintChecks(0.3)
    loop = asyncio.get_running_loop()
    blockers = [loop.run_in_executor(constraints._CHECK_THREADS, time.sleep, 0.8) for _ in range(2)]
    await checks.check("t2", TOKENIZER, Constraint(ConstraintKind.REGEX, "[a-z]{3}", source="regex"))
    await asyncio.gather(*blockers)
    slow_grammar = Constraint(ConstraintKind.REGEX, "[0-9]{4}", source="regex")
    real = constraints.grammar_violations

    def slow(c: Constraint, tok: object) -> list[tuple[str, str]]:
        time.sleep(0.6)
        return real(c, tok)

    monkeypatch.setattr(constraints, "grammar_violations", slow)
    refused = await _refusal(checks, "t2", slow_grammar)
    assert "takes longer than 0.3 s" in refused.message
