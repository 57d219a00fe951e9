"""Per-request checks the gateway runs after authentication and before admission.

They need no Redis: everything comes from the cached tenant config, so they are cheap and they keep
requests that could never be admitted (too large for the tenant's limits) from consuming quota.
"""

from __future__ import annotations

from tenancy.errors import (
    ModelNotAllowedError,
    RequestTooLargeError,
    TenancyArgumentError,
    TenantSuspendedError,
)
from tenancy.models import Tenant


def check_request(tenant: Tenant, *, model: str | None, prompt_tokens: int, max_tokens: int) -> None:
    """Raise if ``tenant`` may not send this request; return ``None`` if it may go to admission.

    Order: status (PERMISSION_DENIED), model access (PERMISSION_DENIED), then sizes
    (INVALID_ARGUMENT). A request whose prompt + max_tokens exceeds a per-minute or budget capacity is
    refused here too: no amount of waiting would admit it, so RESOURCE_EXHAUSTED would mislead.
    """
    if not tenant.is_active:
        raise TenantSuspendedError(tenant.id)
    if model is not None and not tenant.allows_model(model):
        raise ModelNotAllowedError(tenant.id, model)
    if prompt_tokens < 0 or max_tokens < 1:
        raise TenancyArgumentError(
            f"prompt_tokens must be >= 0 and max_tokens >= 1 (got {prompt_tokens}, {max_tokens})"
        )
    q = tenant.quotas
    if q.max_prompt_tokens is not None and prompt_tokens > q.max_prompt_tokens:
        raise RequestTooLargeError("prompt_tokens", prompt_tokens, q.max_prompt_tokens)
    if q.max_tokens_per_request is not None and max_tokens > q.max_tokens_per_request:
        raise RequestTooLargeError("max_tokens", max_tokens, q.max_tokens_per_request)
    cost = prompt_tokens + max_tokens
    for name, capacity in (
        ("tokens_per_minute", q.tokens_per_minute),
        ("daily_token_budget", q.daily_token_budget),
        ("monthly_token_budget", q.monthly_token_budget),
    ):
        if capacity is not None and cost > capacity:
            raise RequestTooLargeError(
                "prompt_tokens + max_tokens", cost, capacity, f"{name}; lower max_tokens"
            )
