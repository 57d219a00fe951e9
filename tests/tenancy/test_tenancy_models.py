"""Tenant model validation, priorities, policy checks."""

from __future__ import annotations

import pytest

from common import Priority
from tenancy.errors import (
    ModelNotAllowedError,
    RequestTooLargeError,
    TenancyArgumentError,
    TenantSuspendedError,
    TenantValidationError,
)
from tenancy.models import Tenant, TenantStatus, parse_tenant
from tenancy.policy import check_request
from tenancy.store import apply_changes, diff


def test_defaults_are_valid_and_shared_pool():
    t = Tenant(id="acme")
    assert t.is_active and not t.is_dedicated and t.pool_name == "shared"
    assert t.effective_priority() is Priority.STANDARD
    assert t.allows_model("anything")


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"id": "Bad Id"}, "id: String should match pattern"),
        ({"id": "a{b}"}, "id: String should match pattern"),
        ({"id": "acme", "quotas": {"requests_per_minute": 0}}, "quotas.requests_per_minute"),
        ({"id": "acme", "weight": 0}, "weight"),
        ({"id": "acme", "default_priority": "interactive"}, "default_priority (interactive) is above"),
        ({"id": "acme", "pool": "dedicated"}, "needs dedicated_pool"),
        ({"id": "acme", "dedicated_pool": "gpu-a"}, "pool is 'shared'"),
        ({"id": "acme", "quotas": {"tokens_per_minute": 100}}, "tokens_per_minute (100) is below"),
        (
            {"id": "acme", "quotas": {"daily_token_budget": 90_000, "monthly_token_budget": 50_000}},
            "daily_token_budget (90000) is above monthly_token_budget",
        ),
        ({"id": "acme", "bogus": 1}, "bogus: Extra inputs are not permitted"),
        ({"id": "acme", "allowed_models": [" "]}, "allowed_models"),
        ({"id": "acme", "kv_floor": 1.5}, "kv_floor"),
        ({"id": "acme", "kv_floor": -0.1}, "kv_floor"),
        ({"id": "acme", "kv_cap": 0}, "kv_cap"),
        ({"id": "acme", "kv_cap": float("nan")}, "kv_cap"),
        ({"id": "acme", "kv_floor": 0.5, "kv_cap": 0.25}, "kv_floor (0.5) is above kv_cap (0.25)"),
    ],
)
def test_validation_messages_name_the_problem(data, fragment):
    with pytest.raises(TenantValidationError) as info:
        parse_tenant(data)
    assert fragment in str(info.value)
    assert str(info.value).startswith("invalid tenant: ")


def test_several_problems_are_reported_together():
    with pytest.raises(TenantValidationError) as info:
        parse_tenant({"id": "acme", "weight": -1, "quotas": {"max_concurrent": 0}})
    assert "weight" in str(info.value) and "quotas.max_concurrent" in str(info.value)


def test_priorities_are_capped_by_the_ceiling():
    t = Tenant(id="acme", priority_ceiling=Priority.STANDARD, default_priority=Priority.BATCH)
    assert t.effective_priority() is Priority.BATCH
    assert t.effective_priority("interactive") is Priority.STANDARD
    assert t.effective_priority(Priority.BATCH) is Priority.BATCH
    assert t.effective_priority("no-such-class") is Priority.BATCH  # unknown hint: default
    assert Priority.INTERACTIVE < Priority.STANDARD < Priority.BATCH  # served first is smallest
    assert sorted([Priority.BATCH, Priority.INTERACTIVE, Priority.STANDARD]) == list(Priority)


def test_dedicated_pool():
    t = Tenant(id="acme", pool="dedicated", dedicated_pool="acme-h100")
    assert t.is_dedicated and t.pool_name == "acme-h100"


def test_policy_checks():
    t = Tenant(
        id="acme",
        allowed_models=("llama-*", "smollm2-135m"),
        quotas={"max_prompt_tokens": 100, "max_tokens_per_request": 50, "tokens_per_minute": 1000},
    )
    check_request(t, model="llama-3-8b", prompt_tokens=100, max_tokens=50)
    with pytest.raises(ModelNotAllowedError):
        check_request(t, model="mistral-7b", prompt_tokens=1, max_tokens=1)
    with pytest.raises(RequestTooLargeError) as info:
        check_request(t, model="smollm2-135m", prompt_tokens=101, max_tokens=1)
    assert info.value.status == "INVALID_ARGUMENT" and info.value.field == "prompt_tokens"
    with pytest.raises(RequestTooLargeError):
        check_request(t, model=None, prompt_tokens=1, max_tokens=51)
    with pytest.raises(TenancyArgumentError):
        check_request(t, model=None, prompt_tokens=1, max_tokens=0)
    suspended = t.model_copy(update={"status": TenantStatus.SUSPENDED})
    with pytest.raises(TenantSuspendedError) as denied:
        check_request(suspended, model="llama-3-8b", prompt_tokens=1, max_tokens=1)
    assert denied.value.status == "PERMISSION_DENIED"


def test_policy_refuses_requests_no_wait_could_admit():
    t = Tenant(
        id="acme",
        quotas={"max_prompt_tokens": None, "max_tokens_per_request": None, "tokens_per_minute": 500},
    )
    with pytest.raises(RequestTooLargeError) as info:
        check_request(t, model=None, prompt_tokens=400, max_tokens=200)
    assert "tokens_per_minute" in str(info.value)


def test_apply_changes_merges_quotas_and_validates():
    t = Tenant(id="acme")
    updated = apply_changes(t, {"quotas": {"max_concurrent": 3}, "weight": 2.5})
    assert updated.quotas.max_concurrent == 3 and updated.quotas.requests_per_minute == 60
    assert diff(t, updated) == {"quotas.max_concurrent": [8, 3], "weight": [1.0, 2.5]}
    with pytest.raises(TenantValidationError, match="cannot update id"):
        apply_changes(t, {"id": "other"})
    with pytest.raises(TenantValidationError, match=r"quotas\.max_concurrent"):
        apply_changes(t, {"quotas": {"max_concurrent": -1}})
