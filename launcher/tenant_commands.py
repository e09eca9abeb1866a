"""``tinkerq keys`` and ``tinkerq usage``: the commands an operator runs about tenants (API keys, limits, usage).

Kept apart from :mod:`tinkerq.launcher.main` so the tenant commands grow in one place.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from tinkerq.quotas import LIMIT_NAMES, NO_LIMIT, Limits, option_of, parse_limit
from tinkerq.security import warn_about_broker
from tinkerq.settings import Settings

if TYPE_CHECKING:
    from tinkerq.usage import UsageRow

SettingsOf = Callable[[argparse.Namespace], Settings]

_LIMIT_HELP = {
    "max_training_clients": "training clients (training runs) the key may hold open at once",
    "max_sampling_inflight": "sample requests the key may have in flight at once",
    "max_tokens_per_minute": "training tokens per minute; requests over the rate wait (they are never refused)",
    "keep_checkpoints": "checkpoints kept per training run and kind: older ones are deleted",
}
_LIMIT_COLUMNS = {"max_training_clients": "TRAINING", "max_sampling_inflight": "SAMPLING",
                  "max_tokens_per_minute": "TOKENS/MIN", "keep_checkpoints": "KEEP"}


def _when(epoch: float | None) -> str:
    import datetime

    if not epoch:
        return "-"
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _limit_changes(args: argparse.Namespace) -> dict[str, int | None]:
    """The limits given on the command line (None: 'none', no limit), checked before Redis is reached."""
    return {name: parse_limit(name, getattr(args, name)) for name in LIMIT_NAMES
            if getattr(args, name, None) is not None}


def _table(header: list[str], rows: Iterable[list[str]], right_from: int) -> list[str]:
    """Aligned columns: text left-aligned, the columns from ``right_from`` on (numbers) right-aligned."""
    every = [header, *rows]
    widths = [max(len(row[i]) for row in every) for i in range(len(header))]
    return ["  ".join(cell.rjust(w) if i >= right_from else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip() for row in every]


def _print_tenants(tenants: list[Any]) -> None:
    if not tenants:
        print("no API keys; create one with: tinkerq keys create NAME")
        return
    header = ["NAME", "CREATED", "LAST USED", *_LIMIT_COLUMNS.values()]
    rows = [[t["name"], _when(t["created_at"]), _when(t["last_used_at"]),
             *("-" if v is None else str(v) for v in t["limits"].as_dict().values())] for t in tenants]
    print("\n".join(_table(header, rows, right_from=3)))


def cmd_keys(args: argparse.Namespace) -> int:
    """API keys of the gateway's tenants (tinkerq/tenants.py): only their SHA-256 is kept in Redis."""
    from tinkerq.tenants import ApiKeys, check_tenant_name

    changes = _limit_changes(args) if args.keys_command in ("create", "update") else {}
    if args.keys_command in ("create", "update"):
        check_tenant_name(args.name)
    settings = args.settings_of(args)
    warn_about_broker(getattr(args, "broker", None), settings.require_broker())
    api_keys = ApiKeys.open(settings)
    try:
        if args.keys_command == "create":
            limits = Limits().updated(changes)
            key = api_keys.create(args.name, limits)
            print(f"tenant {args.name}: {limits.describe()}")
            print(f"API key for tenant {args.name} (shown only this once; the fleet keeps only its SHA-256):")
            print(key)  # alone on the last line: scripts take it with `tail -1`
        elif args.keys_command == "update":
            limits = api_keys.update_limits(args.name, changes)
            print(f"tenant {args.name}: {limits.describe()} (gateways apply it within a second)")
        elif args.keys_command == "list":
            _print_tenants(api_keys.list())
        elif not api_keys.revoke(args.name):
            print(f"tinkerq keys revoke: tenant {args.name!r} has no API key (see: tinkerq keys list)",
                  file=sys.stderr)
            return 1
        else:
            sessions, runs = _end_tenant(settings, args.name)
            print(f"revoked the API key of tenant {args.name}; ended its {sessions} open session(s) and closed "
                  f"{runs} training run(s) on the workers (checkpoints stay)")
    finally:
        api_keys.close()
    return 0


def _end_tenant(settings: Settings, tenant: str) -> tuple[int, int]:
    """Free the workers' memory a revoked tenant held: its training runs are closed, its sessions finished."""
    from tinkerq.gateway.lifecycle import end_tenant
    from tinkerq.gateway.records import Records
    from tinkerq.producer import ServiceClient
    from tinkerq.quotas import Quotas

    service = ServiceClient(settings=settings)
    try:
        store = service.connection.store
        return end_tenant(service, Records(store), Quotas(store), tenant)
    finally:
        service.close()


# -- tinkerq usage ------------------------------------------------------------------------------------------------

_USAGE_COLUMNS = {"training_tokens": "TRAINING", "prefill_tokens": "PREFILL", "cached_prefill_tokens": "CACHED",
                  "sampled_tokens": "SAMPLED", "checkpoints": "CHECKPOINTS", "checkpoint_bytes": "CKPT_BYTES",
                  "requests": "REQUESTS"}
_GROUP_COLUMNS = {"key": ["KEY"], "session": ["KEY", "SESSION"], "hour": ["HOUR", "KEY"]}


def _grouped(rows: list[UsageRow], by: str) -> list[tuple[tuple[Any, ...], dict[str, int]]]:
    """Rows summed per key, per (key, session) or per (hour, key); sorted by those."""
    from tinkerq.usage import sum_counts

    groups: dict[tuple[Any, ...], list[dict[str, int]]] = {}
    for row in rows:
        label = {"key": (row.tenant,), "session": (row.tenant, row.session_id), "hour": (row.hour, row.tenant)}[by]
        groups.setdefault(label, []).append(row.counts)
    return [(label, sum_counts(groups[label])) for label in sorted(groups)]


def _requests(counts: dict[str, int]) -> int:
    from tinkerq.usage import REQUEST_PREFIX

    return sum(v for name, v in counts.items() if name.startswith(REQUEST_PREFIX))


def _usage_cells(counts: dict[str, int]) -> list[str]:
    return [str(_requests(counts) if name == "requests" else counts.get(name, 0)) for name in _USAGE_COLUMNS]


def cmd_usage(args: argparse.Namespace) -> int:
    """Usage per API key from the fleet's Redis (tinkerq/usage.py): a table with a totals row, or JSON."""
    from tinkerq.tenants import ApiKeys, check_tenant_name
    from tinkerq.usage import Usage, iso_time, parse_since, sum_counts

    since = parse_since(args.since)  # a bad --since is refused before Redis is reached
    if args.key is not None:
        check_tenant_name(args.key)
    settings = args.settings_of(args)
    warn_about_broker(getattr(args, "broker", None), settings.require_broker())
    api_keys = ApiKeys.open(settings)  # the fleet's Redis, opened (and refused for memory://) as for `keys`
    try:
        rows = Usage(api_keys.store).rows(args.key, since)
    finally:
        api_keys.close()
    groups = _grouped(rows, args.by)
    totals = sum_counts(row.counts for row in rows)
    if args.json:
        names = _GROUP_COLUMNS[args.by]
        out_rows = []
        for label, counts in groups:
            entry: dict[str, Any] = {}
            for name, value in zip(names, label, strict=True):
                entry[name.lower()] = iso_time(value) if name == "HOUR" else value
            out_rows.append({**entry, "counts": counts})
        print(json.dumps({"since": iso_time(since), "by": args.by, "key": args.key, "rows": out_rows,
                          "totals": totals}, indent=2))
        return 0
    if not rows:
        print(f"no usage recorded since {_when(since)}" + (f" for key {args.key}" if args.key else ""))
        return 0
    labels = _GROUP_COLUMNS[args.by]
    lines = [[iso_time(v) if name == "HOUR" else (v or "-") for name, v in zip(labels, label, strict=True)]
             + _usage_cells(counts) for label, counts in groups]
    lines.append(["TOTAL"] + [""] * (len(labels) - 1) + _usage_cells(totals))
    print("\n".join(_table(labels + list(_USAGE_COLUMNS.values()), lines, right_from=len(labels))))
    return 0


def add_tenant_commands(sub: Any, *, settings_of: SettingsOf, broker_help: str) -> None:
    """Register ``keys`` and ``usage`` on the ``tinkerq`` parser's subcommands."""
    k = sub.add_parser("keys", help="API keys of the gateway's tenants: create, update (limits), list, revoke")
    k.add_argument("--broker", help=broker_help)
    ksub = k.add_subparsers(dest="keys_command", required=True)
    kc = ksub.add_parser("create", help="a new API key for a tenant, printed once (alone on the last line)")
    kc.add_argument("name", help="tenant name: 1-64 of letters, digits, '_', '.', '-'")
    ku = ksub.add_parser("update", help="change a tenant's limits (the flags given; the others stay)")
    ku.add_argument("name", help="the tenant whose limits to change (see: tinkerq keys list)")
    for leaf, tail in ((kc, f"N >= 1, or '{NO_LIMIT}': no limit (the default)"),
                       (ku, f"N >= 1, or '{NO_LIMIT}' to remove the limit; not given: unchanged")):
        for name in LIMIT_NAMES:
            leaf.add_argument(option_of(name), dest=name, metavar="N", help=f"{_LIMIT_HELP[name]} ({tail})")
    kl = ksub.add_parser("list", help="tenants that have a key: when it was created and last used, its limits")
    kr = ksub.add_parser("revoke", help="remove a tenant's key (exit 1 if it has none)")
    kr.add_argument("name", help="the tenant whose key to remove (see: tinkerq keys list)")
    for leaf in (kc, ku, kl, kr):  # --broker after the subcommand too; SUPPRESS keeps one given before it
        leaf.add_argument("--broker", default=argparse.SUPPRESS, help=broker_help)
    k.set_defaults(func=cmd_keys, settings_of=settings_of)

    u = sub.add_parser("usage", help="tokens, checkpoints and requests used per API key (hourly, from Redis)")
    u.add_argument("--broker", help=broker_help)
    u.add_argument("--key", metavar="NAME", help="only this tenant's usage (default: every tenant)")
    u.add_argument("--since", default="24h", help="a duration back from now (90m, 24h, 7d, 2w) or an ISO-8601 "
                                                  "date or time, UTC unless it says otherwise (default 24h); "
                                                  "whole UTC hours are counted")
    u.add_argument("--by", choices=list(_GROUP_COLUMNS), default="key",
                   help="one row per key (default), per key and session, or per hour and key")
    u.add_argument("--json", action="store_true", help="machine-readable output (every counter, epoch and ISO "
                                                      "times)")
    u.set_defaults(func=cmd_usage, settings_of=settings_of)
