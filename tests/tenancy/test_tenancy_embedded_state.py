"""The embedded store's quota state survives a restart of the serving process (``usage.json``)."""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime
from pathlib import Path

import pytest
from tenancy_testlib import eventually, rid

from tenancy.admission import Limit
from tenancy.models import Tenant
from tenancy.runtime import Tenancy, bootstrap_embedded
from tenancy.settings import TenancySettings
from tenancy.store_file import FileTenantStore, read_state_file, state_path_for


def embedded(tmp_path: Path, **overrides) -> TenancySettings:
    values = {
        "store": "file",
        "tenants_file": tmp_path / "tenants.yaml",
        "secret_file": tmp_path / "secret",
        "state_flush_interval_s": 0.05,
    }
    values.update(overrides)
    settings = TenancySettings(**values)
    bootstrap_embedded(settings)
    return settings


def budgeted(settings: TenancySettings) -> Tenant:
    store = FileTenantStore(settings.tenants_file, settings.hasher())
    quotas = {
        "daily_token_budget": 1000,
        "monthly_token_budget": 5000,
        "max_tokens_per_request": 800,
        "max_prompt_tokens": 200,
    }
    return store.create_tenant(Tenant(id="acme", quotas=quotas), actor="test")


async def started(settings: TenancySettings) -> Tenancy:
    tenancy = Tenancy.from_settings(settings)
    await tenancy.start()
    return tenancy


async def crash(tenancy: Tenancy) -> None:
    """The process dies: its tasks stop, nothing is flushed or finished."""
    for task in (tenancy._flush_task, tenancy._sweep_task):
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await tenancy.watcher.stop()


async def test_restart_keeps_daily_and_monthly_budgets(tmp_path: Path):
    settings = embedded(tmp_path)
    tenant = budgeted(settings)
    first = await started(settings)
    try:
        done = await first.admission.admit(tenant, rid(), 100, 200)
        async with first.admission.hold(tenant, done) as lease:
            lease.completion_tokens = 50  # charged 150
        running = await first.admission.admit(tenant, "still-running", 10, 500)  # reserves 510
        assert (await first.admission.renew(tenant, running.request_id, completion_tokens=30)).renewed
        assert first.admission.quota_status("acme")["day_tokens_used"] == 660
    finally:
        await first.stop()  # the stream of "still-running" did not end before the stop

    second = await started(settings)
    try:
        # 150 + the running request settled from its last renewal (10 + 30)
        status = second.admission.quota_status("acme")
        assert status == {"active_leases": 0, "day_tokens_used": 190, "month_tokens_used": 190}
        usage = second.admission.usage("acme", 1)[-1]
        assert (usage.requests, usage.prompt_tokens, usage.completion_tokens) == (2, 110, 80)
        assert usage.expired == 1
        assert (await second.admission.admit(tenant, rid(), 10, 800)).granted  # 190 + 810 = 1000
        refused = await second.admission.admit(tenant, rid(), 1, 1)
        assert refused.limit is Limit.DAILY_BUDGET  # the restored budget is enforced
    finally:
        await second.stop()
    admin_usage = FileTenantStore(settings.tenants_file, settings.hasher()).usage("acme", 1)[-1]
    assert (admin_usage.requests, admin_usage.expired) == (2, 1)  # `loom admin usage` reads it too


async def test_state_is_written_on_an_interval_and_survives_a_crash(tmp_path: Path):
    settings = embedded(tmp_path)
    tenant = budgeted(settings)
    path = state_path_for(settings.tenants_file)
    first = await started(settings)
    running = await first.admission.admit(tenant, "running", 20, 700)
    assert (await first.admission.renew(tenant, "running", completion_tokens=5)).renewed

    def written() -> bool:
        state = read_state_file(path)
        return (
            state["budgets"].get("acme", {}).get("day_used") == 720
            and state["running"].get("acme", {}).get("running", {}).get("completion") == 5
        )

    await eventually(written)  # without any stop
    await crash(first)
    assert running.granted

    second = await started(settings)
    try:
        assert second.admission.quota_status("acme")["day_tokens_used"] == 25
        assert second.admission.usage("acme", 1)[-1].expired == 1
    finally:
        await second.stop()


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"format": 2, "budgets": {"acme": {"day": "2025-13-40", "day_used": 5}}}),
        json.dumps({"format": 2, "usage": {"acme": {"2025-01-01": {"requests": -3}}}}),
        json.dumps({"format": 99}),
    ],
    ids=["not-json", "bad-day", "negative-count", "unknown-format"],
)
async def test_corrupt_state_file_starts_from_zero_loudly(tmp_path: Path, caplog, content: str):
    settings = embedded(tmp_path)
    tenant = budgeted(settings)
    path = state_path_for(settings.tenants_file)
    path.write_text(content)
    caplog.set_level(logging.WARNING, logger="tenancy")
    tenancy = await started(settings)
    try:
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors and "QUOTA STATE NOT RESTORED" in errors[0].getMessage()
        assert "start from ZERO" in errors[0].getMessage()
        kept = list(tmp_path.glob("usage.json.corrupt-*"))
        assert len(kept) == 1 and kept[0].read_text() == content  # kept for inspection, not overwritten
        assert tenancy.admission.quota_status("acme")["day_tokens_used"] == 0
        assert (await tenancy.admission.admit(tenant, rid(), 100, 800)).granted
    finally:
        await tenancy.stop()
    assert read_state_file(path)["budgets"]["acme"]["day_used"] == 900  # a fresh, valid file


async def test_usage_file_of_the_previous_format_is_read(tmp_path: Path):
    settings = embedded(tmp_path)
    path = state_path_for(settings.tenants_file)
    today = datetime.now(UTC).date().isoformat()
    path.write_text(json.dumps({"acme": {today: {"requests": 3, "prompt_tokens": 30}}}))  # format 1
    tenancy = await started(settings)
    try:
        assert tenancy.admission.usage("acme", 1)[-1].requests == 3
    finally:
        await tenancy.stop()
