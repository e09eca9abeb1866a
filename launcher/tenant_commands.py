"""``tinkerq keys`` and the other commands an operator runs about tenants (their API keys).

Kept apart from :mod:`tinkerq.launcher.main` so the tenant commands grow in one place.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from tinkerq.security import warn_about_broker
from tinkerq.settings import Settings

SettingsOf = Callable[[argparse.Namespace], Settings]


def _when(epoch: float | None) -> str:
    import datetime

    if not epoch:
        return "-"
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def cmd_keys(args: argparse.Namespace) -> int:
    """API keys of the gateway's tenants (tinkerq/tenants.py): only their SHA-256 is kept in Redis."""
    from tinkerq.tenants import ApiKeys

    settings = args.settings_of(args)
    warn_about_broker(getattr(args, "broker", None), settings.require_broker())
    api_keys = ApiKeys.open(settings)
    try:
        if args.keys_command == "create":
            key = api_keys.create(args.name)
            print(f"API key for tenant {args.name} (shown only this once; the fleet keeps only its SHA-256):")
            print(key)  # alone on the last line: scripts take it with `tail -1`
        elif args.keys_command == "list":
            tenants = api_keys.list()
            if not tenants:
                print("no API keys; create one with: tinkerq keys create NAME")
            else:
                width = max(len("NAME"), *(len(t["name"]) for t in tenants))
                print(f"{'NAME':<{width}}  {'CREATED':<20}  LAST USED")
                for t in tenants:
                    print(f"{t['name']:<{width}}  {_when(t['created_at']):<20}  {_when(t['last_used_at'])}")
        elif not api_keys.revoke(args.name):
            print(f"tinkerq keys revoke: tenant {args.name!r} has no API key (see: tinkerq keys list)",
                  file=sys.stderr)
            return 1
        else:
            print(f"revoked the API key of tenant {args.name}")
    finally:
        api_keys.close()
    return 0



def add_tenant_commands(sub: Any, *, settings_of: SettingsOf, broker_help: str) -> None:
    """Register ``keys`` on the ``tinkerq`` parser's subcommands."""
    k = sub.add_parser("keys", help="API keys of the gateway's tenants: create, list, revoke")
    k.add_argument("--broker", help=broker_help)
    ksub = k.add_subparsers(dest="keys_command", required=True)
    kc = ksub.add_parser("create", help="a new API key for a tenant, printed once (alone on the last line)")
    kc.add_argument("name", help="tenant name: 1-64 of letters, digits, '_', '.', '-'")
    kl = ksub.add_parser("list", help="tenants that have a key, when it was created and last used")
    kr = ksub.add_parser("revoke", help="remove a tenant's key (exit 1 if it has none)")
    kr.add_argument("name", help="the tenant whose key to remove (see: tinkerq keys list)")
    for leaf in (kc, kl, kr):  # --broker after the subcommand too; SUPPRESS keeps one given before it
        leaf.add_argument("--broker", default=argparse.SUPPRESS, help=broker_help)
    k.set_defaults(func=cmd_keys, settings_of=settings_of)
