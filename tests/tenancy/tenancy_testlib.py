"""Helpers shared by the tenancy tests (a uniquely named module: tests/ dirs are not packages)."""

from __future__ import annotations

import uuid
from typing import Any

from tenancy.models import Quotas, Tenant

TEST_SECRET = "test-server-secret-0123456789abcdef"


def make_tenant(tenant_id: str | None = None, **quota_overrides: Any) -> Tenant:
    """A tenant with generous limits except the ones given (``None`` = unlimited)."""
    quotas: dict[str, Any] = {
        "requests_per_minute": None,
        "tokens_per_minute": None,
        "max_concurrent": None,
        "max_tokens_per_request": None,
        "max_prompt_tokens": None,
        "daily_token_budget": None,
        "monthly_token_budget": None,
    }
    quotas.update(quota_overrides)
    return Tenant(id=tenant_id or f"t-{uuid.uuid4().hex[:8]}", quotas=Quotas(**quotas))


def rid() -> str:
    return f"req-{uuid.uuid4().hex}"
