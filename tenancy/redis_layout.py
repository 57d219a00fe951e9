"""Names of every Redis key and channel the tenancy package uses, in one place.

Two hash-tag families, so that a Redis Cluster can run each script on one node:

* config: ``<prefix>:{cfg}:...`` — tenants, keys, versions, the audit stream. Admin writes touch several
  of these atomically in one script, so they share the ``{cfg}`` slot. Config is small and read rarely
  (gateways cache it), so one slot is no bottleneck.
* quota state of tenant T: ``<prefix>:t:{T}:...`` — token buckets, budgets, leases, request records,
  usage. The admission script touches only these, all in T's slot; tenants spread over the cluster.

Tenant ids cannot contain ``{``, ``}`` or ``:`` (see ``TENANT_ID_PATTERN``), so no id can break a tag.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RedisLayout:
    prefix: str = "loom"

    # -- config ({cfg} slot) -------------------------------------------------------------------
    @property
    def config_version(self) -> str:
        """Global config revision: INCR on every admin change; a resync compares it first."""
        return f"{self.prefix}:{{cfg}}:version"

    @property
    def tenant_versions(self) -> str:
        """Hash tenant id -> revision of that tenant (its record and its keys)."""
        return f"{self.prefix}:{{cfg}}:tenant_versions"

    def tenant(self, tenant_id: str) -> str:
        """String: the tenant record as JSON."""
        return f"{self.prefix}:{{cfg}}:tenant:{tenant_id}"

    def tenant_keys(self, tenant_id: str) -> str:
        """Hash key id -> API key record JSON (keyed hash only) for one tenant."""
        return f"{self.prefix}:{{cfg}}:keys:{tenant_id}"

    @property
    def key_index(self) -> str:
        """Hash key id -> tenant id, so a key can be revoked by its id alone."""
        return f"{self.prefix}:{{cfg}}:key_index"

    @property
    def audit(self) -> str:
        """Stream of admin changes (who, when, what)."""
        return f"{self.prefix}:{{cfg}}:audit"

    @property
    def changes_channel(self) -> str:
        """Pub/sub channel announcing ``{"tenant": id, "version": n, "op": ...}`` after each change."""
        return f"{self.prefix}:tenancy:changes"

    # -- quota state ({t:<tenant>} slot) ------------------------------------------------------
    def quota_state(self, tenant_id: str) -> str:
        """Hash: token buckets (requests, tokens) and the current day/month budget counters."""
        return f"{self.prefix}:t:{{{tenant_id}}}:state"

    def leases(self, tenant_id: str) -> str:
        """Sorted set request id -> lease expiry (server microseconds)."""
        return f"{self.prefix}:t:{{{tenant_id}}}:leases"

    def request(self, tenant_id: str, request_id: str) -> str:
        """Hash: one admitted request's reservation and the completion tokens its last renewal
        reported; after finish or settlement, a marker (with the outcome) that makes both idempotent."""
        return self.request_prefix(tenant_id) + request_id

    def request_prefix(self, tenant_id: str) -> str:
        """What every request key of the tenant starts with: the admission script settles a lapsed
        lease of request R through ``request_prefix + R`` (same hash tag, same slot)."""
        return f"{self.prefix}:t:{{{tenant_id}}}:req:"

    def usage(self, tenant_id: str) -> str:
        """Hash ``YYYY-MM-DD|field`` -> count: metered usage per UTC day."""
        return f"{self.prefix}:t:{{{tenant_id}}}:usage"

    def tenant_quota_keys(self, tenant_id: str) -> tuple[str, str]:
        """Keys dropped when a tenant is deleted (usage is kept: it is billing data)."""
        return self.quota_state(tenant_id), self.leases(tenant_id)
