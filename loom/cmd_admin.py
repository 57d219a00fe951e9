"""``loom admin``: manage tenants, API keys and usage in the tenant store.

    loom admin tenant create acme --rpm 600 --tpm 200000 --max-concurrent 16 --models 'llama-*'
    loom admin tenant list | show ID | update ID [flags] | suspend ID | activate ID | delete ID --yes
    loom admin key create acme --name ci --expires-in 90d      # prints the key once
    loom admin key list acme | revoke KEY_ID [--grace 1h] | rotate KEY_ID [--grace 1h]
    loom admin usage acme --days 7
    loom admin audit --limit 20

The store comes from ``LOOM_TENANCY_*`` settings (``--store``, ``--redis-url``, ``--prefix`` and
``--tenants-file`` override them). The server secret is read from ``LOOM_TENANCY_SECRET`` or the secret
file, never from a flag (flags end up in shell history and process listings). Every change is recorded
in the store's audit trail with ``--actor`` (default ``user@host``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from common import Priority
from tenancy.errors import StoreUnavailableError, TenancyError
from tenancy.models import AdapterRecord, ApiKey, Tenant, TenantStatus, parse_tenant, utcnow
from tenancy.settings import TenancySettings
from tenancy.store import TenantAdmin, default_actor
from tenancy.store_file import FileTenantStore
from tenancy.store_redis import RedisTenantStore

EXIT_OK, EXIT_ERROR, EXIT_UNAVAILABLE = 0, 1, 3

# flag -> quota field
_QUOTA_FLAGS = {
    "rpm": "requests_per_minute",
    "tpm": "tokens_per_minute",
    "max_concurrent": "max_concurrent",
    "max_tokens": "max_tokens_per_request",
    "max_prompt_tokens": "max_prompt_tokens",
    "daily_budget": "daily_token_budget",
    "monthly_budget": "monthly_token_budget",
}
_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw]?)$")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``90``, ``45s``, ``10m``, ``12h``, ``30d``, ``2w`` -> seconds."""
    match = _DURATION_RE.match(text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (examples: 90s, 10m, 12h, 30d)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def _limit(text: str) -> int | None:
    """A quota value: a positive integer, or ``none``/``unlimited``."""
    if text.strip().lower() in ("none", "unlimited", "-"):
        return None
    try:
        return int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'unlimited', got {text!r}") from None


def _slo(text: str) -> tuple[str, dict[str, Any] | None]:
    """``interactive:ttft_ms=500,tpot_ms=50`` -> (class, target); ``batch:none`` -> (class, None).
    The values are checked with the tenant (the store's validation names a bad one)."""
    cls, sep, rest = text.partition(":")
    if not sep or cls not in {p.value for p in Priority}:
        raise argparse.ArgumentTypeError(
            f"expected CLASS:key=value,... with CLASS one of interactive, standard, batch; got {text!r}"
        )
    if rest.strip().lower() == "none":
        return cls, None
    target: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in ("ttft_ms", "tpot_ms", "on_miss"):
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected ttft_ms=N, tpot_ms=N or on_miss=refuse|queue"
            )
        target[key] = value
    return cls, target


def _add_tenant_fields(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", dest="display_name", help="display name")
    p.add_argument("--priority-ceiling", choices=[x.value for x in Priority])
    p.add_argument("--default-priority", choices=[x.value for x in Priority])
    p.add_argument("--weight", type=float, help="fair-share weight inside a priority class")
    p.add_argument(
        "--kv-floor", type=float, help="share of each replica's KV blocks kept whatever others do (0-1)"
    )
    p.add_argument("--kv-cap", type=float, help="most of each replica's KV blocks the tenant may hold (0-1)")
    p.add_argument(
        "--speculative",
        action=argparse.BooleanOptionalAction,
        help="requests speculate by default (prompt lookup; a request may say otherwise)",
    )
    p.add_argument(
        "--slo",
        type=_slo,
        action="append",
        metavar="CLASS:ttft_ms=N[,tpot_ms=N][,on_miss=refuse|queue]",
        help="latency target of a priority class (repeatable); CLASS:none removes it",
    )
    p.add_argument("--models", help="comma-separated allowed models or patterns ('*' = all)")
    p.add_argument("--pool", choices=["shared", "dedicated"])
    p.add_argument("--dedicated-pool", help="name of the tenant's dedicated pool (with --pool dedicated)")
    q = p.add_argument_group("quotas (integer, or 'unlimited')")
    q.add_argument("--rpm", type=_limit, default=argparse.SUPPRESS, help="requests per minute")
    q.add_argument(
        "--tpm",
        type=_limit,
        default=argparse.SUPPRESS,
        help="tokens per minute (prompt + max_tokens reserved)",
    )
    q.add_argument("--max-concurrent", type=_limit, default=argparse.SUPPRESS, help="concurrent streams")
    q.add_argument("--max-tokens", type=_limit, default=argparse.SUPPRESS, help="max_tokens cap per request")
    q.add_argument(
        "--max-prompt-tokens", type=_limit, default=argparse.SUPPRESS, help="prompt tokens cap per request"
    )
    q.add_argument("--daily-budget", type=_limit, default=argparse.SUPPRESS, help="tokens per UTC day")
    q.add_argument("--monthly-budget", type=_limit, default=argparse.SUPPRESS, help="tokens per UTC month")


def _tenant_changes(args: argparse.Namespace) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for field in (
        "display_name",
        "priority_ceiling",
        "default_priority",
        "weight",
        "kv_floor",
        "kv_cap",
        "speculative",
        "pool",
        "dedicated_pool",
    ):
        value = getattr(args, field, None)
        if value is not None:
            changes[field] = value
    if getattr(args, "slo", None):
        changes["slo"] = dict(args.slo)
    if getattr(args, "models", None) is not None:
        changes["allowed_models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    # Quota flags default to SUPPRESS: present on the namespace only when given (None = unlimited).
    quotas = {field: getattr(args, flag) for flag, field in _QUOTA_FLAGS.items() if hasattr(args, flag)}
    if quotas:
        changes["quotas"] = quotas
    return changes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", choices=["redis", "file"], help="tenant store (default: settings)")
    parser.add_argument("--redis-url", help="Redis URL (default: LOOM_TENANCY_REDIS_URL)")
    parser.add_argument("--prefix", dest="key_prefix", help="Redis key prefix (default: loom)")
    parser.add_argument("--tenants-file", type=Path, help="tenants file of the embedded store")
    parser.add_argument("--actor", help="who is making the change (audit trail; default user@host)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    groups = parser.add_subparsers(dest="group", required=True)

    tenant = groups.add_parser("tenant", help="tenants").add_subparsers(dest="action", required=True)
    p = tenant.add_parser("create", help="create a tenant")
    p.add_argument("tenant_id")
    _add_tenant_fields(p)
    p.add_argument("--suspended", action="store_true", help="create it suspended")
    tenant.add_parser("list", help="list tenants")
    tenant.add_parser("show", help="a tenant, its keys and live quota state").add_argument("tenant_id")
    p = tenant.add_parser("update", help="change a tenant (only the given fields)")
    p.add_argument("tenant_id")
    _add_tenant_fields(p)
    tenant.add_parser("suspend", help="refuse the tenant's requests").add_argument("tenant_id")
    tenant.add_parser("activate", help="lift a suspension").add_argument("tenant_id")
    p = tenant.add_parser("delete", help="delete a tenant and its keys (usage is kept)")
    p.add_argument("tenant_id")
    p.add_argument("--yes", action="store_true", help="confirm")

    key = groups.add_parser("key", help="API keys").add_subparsers(dest="action", required=True)
    p = key.add_parser("create", help="create a key; it is printed once")
    p.add_argument("tenant_id")
    p.add_argument("--name", default="")
    p.add_argument("--expires-in", type=parse_duration, help="e.g. 90d")
    key.add_parser("list", help="a tenant's keys").add_argument("tenant_id")
    p = key.add_parser("revoke", help="revoke a key (now, or after --grace)")
    p.add_argument("key_id")
    p.add_argument("--grace", type=parse_duration, default=0.0, help="keep it valid this long")
    p = key.add_parser("rotate", help="new key for the same tenant; the old one lives --grace longer")
    p.add_argument("key_id")
    p.add_argument("--grace", type=parse_duration, default=3600.0)

    adapter = groups.add_parser("adapter", help="a tenant's LoRA adapters").add_subparsers(
        dest="action", required=True
    )
    p = adapter.add_parser("add", help="register a PEFT adapter; checked against the base model first")
    p.add_argument("tenant_id")
    p.add_argument("name", help="requests name it <base model>:<name>")
    p.add_argument("path", type=Path, help="the adapter directory (adapter_config.json + safetensors)")
    p.add_argument(
        "--base-model", default=None, help="the served model's .gguf or HF directory (default: embedded)"
    )
    p.add_argument(
        "--model-name", default=None, help="the name clients use for the base model (default: its own)"
    )
    p.add_argument("--replace", action="store_true", help="replace an adapter of the same name")
    adapter.add_parser("list", help="a tenant's adapters").add_argument("tenant_id")
    p = adapter.add_parser("remove", help="unregister an adapter (its files are left alone)")
    p.add_argument("tenant_id")
    p.add_argument("name")

    p = groups.add_parser("usage", help="metered usage per UTC day")
    p.add_argument("tenant_id")
    p.add_argument("--days", type=int, default=7)
    p = groups.add_parser("audit", help="recent admin changes")
    p.add_argument("--limit", type=int, default=20)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "admin",
        help="manage tenants, API keys and usage",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loom admin", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``loom admin ...`` (also callable directly, e.g. from tests)."""
    args = build_parser().parse_args(argv)
    return run(args)


def open_store(args: argparse.Namespace) -> TenantAdmin:
    overrides = {
        k: v
        for k in ("store", "redis_url", "key_prefix", "tenants_file")
        if (v := getattr(args, k, None)) is not None
    }
    settings = TenancySettings(**overrides)
    if settings.store == "file":
        return FileTenantStore(settings.tenants_file, settings.hasher())
    return RedisTenantStore.from_settings(settings)


def run(args: argparse.Namespace) -> int:
    out = _Output(args.json)
    try:
        store = open_store(args)
    except TenancyError as exc:
        return out.error(exc)
    actor = args.actor or default_actor()
    try:
        return _dispatch(store, args, actor, out)
    except StoreUnavailableError as exc:
        out.error(exc)
        return EXIT_UNAVAILABLE
    except TenancyError as exc:
        return out.error(exc)
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()


def _dispatch(store: TenantAdmin, args: argparse.Namespace, actor: str, out: _Output) -> int:
    group, action = args.group, getattr(args, "action", None)
    if group == "tenant":
        if action == "create":
            data: dict[str, Any] = {"id": args.tenant_id, **_tenant_changes(args)}
            if "slo" in data:
                data["slo"] = {k: v for k, v in data["slo"].items() if v is not None}
            if args.suspended:
                data["status"] = TenantStatus.SUSPENDED.value
            tenant = store.create_tenant(parse_tenant(data), actor=actor)
            return out.tenant(tenant, "created")
        if action == "list":
            return out.tenants(store.list_tenants())
        if action == "show":
            tenant = store.get_tenant(args.tenant_id)
            keys = store.list_keys(args.tenant_id)
            status = store.quota_status(args.tenant_id) if isinstance(store, RedisTenantStore) else None
            return out.show(tenant, keys, status)
        if action == "update":
            changes = _tenant_changes(args)
            if not changes:
                return out.error(TenancyError("nothing to update: give at least one field flag"))
            return out.tenant(store.update_tenant(args.tenant_id, changes, actor=actor), "updated")
        if action == "suspend":
            return out.tenant(
                store.set_status(args.tenant_id, TenantStatus.SUSPENDED, actor=actor), "suspended"
            )
        if action == "activate":
            return out.tenant(store.set_status(args.tenant_id, TenantStatus.ACTIVE, actor=actor), "activated")
        if action == "delete":
            if not args.yes:
                return out.error(TenancyError(f"refusing to delete {args.tenant_id!r} without --yes"))
            store.delete_tenant(args.tenant_id, actor=actor)
            return out.message({"deleted": args.tenant_id}, f"deleted tenant {args.tenant_id}")
    if group == "key":
        if action == "create":
            expires = utcnow() + timedelta(seconds=args.expires_in) if args.expires_in else None
            issued = store.create_key(args.tenant_id, actor=actor, name=args.name, expires_at=expires)
            return out.issued(issued.record, issued.plaintext.get_secret_value())
        if action == "list":
            return out.keys(store.list_keys(args.tenant_id))
        if action == "revoke":
            key = store.revoke_key(args.key_id, actor=actor, grace_s=args.grace)
            return out.message(
                _key_json(key), f"key {key.key_id} revoked (effective {key.revoked_at:%Y-%m-%d %H:%M:%S} UTC)"
            )
        if action == "rotate":
            issued = store.rotate_key(args.key_id, actor=actor, grace_s=args.grace)
            return out.issued(issued.record, issued.plaintext.get_secret_value(), replaces=args.key_id)
    if group == "adapter":
        return _adapter(store, args, actor, out)
    if group == "usage":
        return out.usage(store.usage(args.tenant_id, args.days))
    if group == "audit":
        return out.audit(store.audit_log(args.limit))
    return out.error(TenancyError(f"unknown command {group} {action}"))


def _adapter(store: TenantAdmin, args: argparse.Namespace, actor: str, out: _Output) -> int:
    tenant = store.get_tenant(args.tenant_id)
    adapters = {name: rec.model_dump(mode="json") for name, rec in tenant.adapters.items()}
    if args.action == "list":
        return out.adapters(tenant.adapters)
    if args.action == "remove":
        if args.name not in adapters:
            return out.error(TenancyError(f"tenant {tenant.id!r} has no adapter {args.name!r}"))
        del adapters[args.name]
        store.update_tenant(tenant.id, {"adapters": adapters}, actor=actor)
        return out.message({"removed": args.name}, f"adapter {args.name} removed from {tenant.id}")
    if args.name in adapters and not args.replace:
        return out.error(
            TenancyError(f"tenant {tenant.id!r} already has an adapter {args.name!r} (--replace)")
        )
    from protocol.adapters import AdapterError, inspect_adapter
    from protocol.model_files import CheckpointError, load_model_config

    try:
        base, config = load_model_config(args.base_model, args.model_name)
        info = inspect_adapter(args.path, config)
    except (AdapterError, CheckpointError) as exc:
        return out.error(exc)
    record = AdapterRecord(
        base_model=base,
        path=str(args.path.resolve()),
        digest=info.digest,
        rank=info.rank,
        targets=info.targets,
        added_at=utcnow(),
    )
    adapters[args.name] = record.model_dump(mode="json")
    store.update_tenant(tenant.id, {"adapters": adapters}, actor=actor)
    return out.message(
        {"tenant": tenant.id, "name": args.name, **record.model_dump(mode="json")},
        f"adapter {args.name} added to {tenant.id}: request it as model {base}:{args.name} "
        f"(rank {info.rank}, {', '.join(info.targets)})",
    )


def _key_json(key: ApiKey) -> dict[str, Any]:
    now = utcnow()
    data: dict[str, Any] = key.model_dump(mode="json", exclude={"digest", "secret_id"})
    data["state"] = key.state_at(now)
    return data


class _Output:
    """Human-readable tables (rich) or ``--json``; errors to stderr."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def _print_json(self, data: Any) -> int:
        print(json.dumps(data, indent=2, sort_keys=True, default=str))
        return EXIT_OK

    def _table(self, title: str, columns: list[str], rows: list[list[Any]]) -> int:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(title=title)
        for c in columns:
            table.add_column(c)
        for r in rows:
            table.add_row(*(Text("" if v is None else str(v)) for v in r))  # Text: no markup parsing
        Console().print(table)
        return EXIT_OK

    def error(self, exc: BaseException) -> int:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR

    def message(self, data: Any, text: str) -> int:
        return self._print_json(data) if self.as_json else (print(text), EXIT_OK)[1]

    def tenant(self, tenant: Tenant, verb: str) -> int:
        if self.as_json:
            return self._print_json(tenant.model_dump(mode="json"))
        print(f"tenant {tenant.id} {verb} (version {tenant.version})")
        print(json.dumps(tenant.model_dump(mode="json"), indent=2))
        return EXIT_OK

    def tenants(self, tenants: list[Tenant]) -> int:
        if self.as_json:
            return self._print_json([t.model_dump(mode="json") for t in tenants])
        rows = [
            [
                t.id,
                t.status.value,
                t.pool_name,
                f"{t.default_priority.value}/{t.priority_ceiling.value}",
                t.weight,
                t.quotas.requests_per_minute or "-",
                t.quotas.tokens_per_minute or "-",
                t.quotas.max_concurrent or "-",
            ]
            for t in tenants
        ]
        cols = ["tenant", "status", "pool", "priority", "weight", "rpm", "tpm", "concurrent"]
        return self._table("tenants", cols, rows)

    def show(self, tenant: Tenant, keys: list[Any], status: dict[str, int] | None) -> int:
        data = {"tenant": tenant.model_dump(mode="json"), "keys": [_key_json(k) for k in keys]}
        if status is not None:
            data["quota_state"] = status
        if self.as_json:
            return self._print_json(data)
        print(json.dumps(data, indent=2, default=str))
        return EXIT_OK

    def keys(self, keys: list[Any]) -> int:
        if self.as_json:
            return self._print_json([_key_json(k) for k in keys])
        rows = [
            [k.key_id, k.name, k.state_at(utcnow()), f"{k.created_at:%Y-%m-%d}", k.expires_at, k.revoked_at]
            for k in keys
        ]
        return self._table("keys", ["key id", "name", "state", "created", "expires", "revoked"], rows)

    def issued(self, record: Any, plaintext: str, replaces: str | None = None) -> int:
        if self.as_json:
            data = {**_key_json(record), "key": plaintext}
            if replaces:
                data["replaces"] = replaces
            return self._print_json(data)
        print(f"API key for tenant {record.tenant_id} (key id {record.key_id}):")
        print(f"  {plaintext}")
        print("Store it now: only its keyed hash is kept, it cannot be shown again.", file=sys.stderr)
        if replaces:
            print(f"Key {replaces} stays valid until its grace period ends.", file=sys.stderr)
        return EXIT_OK

    def adapters(self, adapters: dict[str, AdapterRecord]) -> int:
        if self.as_json:
            return self._print_json({n: r.model_dump(mode="json") for n, r in adapters.items()})
        rows = [
            [f"{r.base_model}:{n}", r.rank, ", ".join(r.targets), r.path] for n, r in sorted(adapters.items())
        ]
        return self._table("adapters", ["model", "rank", "targets", "path"], rows)

    def usage(self, rows: list[Any]) -> int:
        if self.as_json:
            return self._print_json([r.model_dump(mode="json") for r in rows])
        cols = ["day", "requests", "prompt tokens", "completion tokens", "cancelled", "errors"]
        table_rows = [
            [r.day, r.requests, r.prompt_tokens, r.completion_tokens, r.cancelled, r.errors] for r in rows
        ]
        total = [
            "total",
            sum(r.requests for r in rows),
            sum(r.prompt_tokens for r in rows),
            sum(r.completion_tokens for r in rows),
            sum(r.cancelled for r in rows),
            sum(r.errors for r in rows),
        ]
        title = f"usage of {rows[0].tenant_id}" if rows else "usage"
        return self._table(title, cols, [*table_rows, total])

    def audit(self, entries: list[Any]) -> int:
        if self.as_json:
            return self._print_json([e.model_dump(mode="json") for e in entries])
        rows = [
            [f"{e.at:%Y-%m-%d %H:%M:%S}", e.actor, e.action, e.tenant_id, e.key_id, json.dumps(e.changes)]
            for e in entries
        ]
        return self._table("audit", ["when (UTC)", "who", "action", "tenant", "key", "changes"], rows)


if __name__ == "__main__":
    sys.exit(main())
