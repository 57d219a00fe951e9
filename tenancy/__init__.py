"""Tenancy: tenants, API keys, tenant stores, quota admission and usage metering.

The gateway's entry points:

* :class:`Tenancy` (``runtime``): everything wired from :class:`TenancySettings`;
* :class:`TenantDirectory` (``directory``): ``authenticate(token) -> Principal`` from a local cache;
* :func:`check_request` (``policy``): status, model access, per-request limits;
* :class:`QuotaEnforcer` (``admission``): ``admit`` / ``renew`` / ``finish`` / ``hold``, implemented by
  :class:`RedisAdmission` (cluster) and :class:`LocalAdmission` (single node, and fail-static).

Admin: :class:`RedisTenantStore` / :class:`FileTenantStore` (``TenantAdmin``), used by ``loom admin``.
This package imports only the standard library, redis, pydantic, yaml and prometheus-client.
"""

from tenancy.admission import (
    ActiveLease,
    Admission,
    FinishResult,
    Limit,
    Outcome,
    QuotaEnforcer,
    QuotaMode,
    Renewal,
)
from tenancy.admission_local import LocalAdmission
from tenancy.admission_redis import RedisAdmission
from tenancy.directory import TenantCatalog, TenantDirectory, TenantEntry
from tenancy.errors import (
    AuthenticationError,
    ModelNotAllowedError,
    PermissionDeniedError,
    RequestTooLargeError,
    StoreUnavailableError,
    TenancyArgumentError,
    TenancyError,
    TenantNotFoundError,
    TenantSuspendedError,
    TenantValidationError,
)
from tenancy.keys import KeyHasher
from tenancy.models import (
    AdapterRecord,
    ApiKey,
    AuditEntry,
    DailyUsage,
    IssuedKey,
    Principal,
    Quotas,
    SloTarget,
    Tenant,
    TenantStatus,
)
from tenancy.policy import check_request
from tenancy.runtime import Tenancy, bootstrap_embedded
from tenancy.settings import FailureMode, TenancySettings
from tenancy.store import TenantAdmin
from tenancy.store_file import FileTenantStore, ensure_default_tenants_file
from tenancy.store_redis import RedisTenantStore
from tenancy.watch_file import FileTenantWatcher
from tenancy.watch_redis import RedisTenantWatcher

__all__ = [
    "ActiveLease",
    "AdapterRecord",
    "Admission",
    "ApiKey",
    "AuditEntry",
    "AuthenticationError",
    "DailyUsage",
    "FailureMode",
    "FileTenantStore",
    "FileTenantWatcher",
    "FinishResult",
    "IssuedKey",
    "KeyHasher",
    "Limit",
    "LocalAdmission",
    "ModelNotAllowedError",
    "Outcome",
    "PermissionDeniedError",
    "Principal",
    "QuotaEnforcer",
    "QuotaMode",
    "Quotas",
    "RedisAdmission",
    "RedisTenantStore",
    "RedisTenantWatcher",
    "Renewal",
    "RequestTooLargeError",
    "SloTarget",
    "StoreUnavailableError",
    "Tenancy",
    "TenancyArgumentError",
    "TenancyError",
    "TenancySettings",
    "Tenant",
    "TenantAdmin",
    "TenantCatalog",
    "TenantDirectory",
    "TenantEntry",
    "TenantNotFoundError",
    "TenantStatus",
    "TenantSuspendedError",
    "TenantValidationError",
    "bootstrap_embedded",
    "check_request",
    "ensure_default_tenants_file",
]
