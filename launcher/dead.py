"""`tinkerq dead`: the dead-letter queue, where workers put messages they could not read.

    tinkerq dead list [--limit N]     newest first: when, which queue, why, task id, size
    tinkerq dead show N [--out FILE]  one entry in full; its original bytes to FILE (or a preview)
    tinkerq dead clear                empty the queue
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import Any

from tinkerq import keys
from tinkerq.connection import Connection
from tinkerq.errors import TinkerqError, UserError
from tinkerq.recipes.sft_args import non_negative_int, positive_int
from tinkerq.settings import Settings
from tinkerq.wire import codec


def add_dead_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", help="redis://, rediss:// or sentinel:// URL (default: TINKERQ_BROKER_URL)")
    sub = p.add_subparsers(dest="dead_command", required=True)
    ls = sub.add_parser("list", help="dead letters, newest first")
    ls.add_argument("--limit", type=positive_int, default=20, help="how many to list, newest first (default 20)")
    show = sub.add_parser("show", help="one dead letter in full (0 = newest)")
    show.add_argument("index", type=non_negative_int, help="which one: 0 = the newest (see: tinkerq dead list)")
    show.add_argument("--out", help="write the message's original bytes to this file")
    sub.add_parser("clear", help="delete every dead letter")


def read_entries(conn: Connection, start: int, stop: int) -> list[dict[str, Any]]:
    entries = []
    for raw in conn.store.list_range(keys.DEAD_LETTERS, start, stop):
        try:
            entry = codec.unpackb(raw)
        except TinkerqError:
            entry = {"reason": "(unreadable entry)", "raw": raw}
        entries.append(entry if isinstance(entry, dict) else {"reason": "(unreadable entry)", "raw": raw})
    return entries


def _when(entry: dict[str, Any]) -> str:
    at = entry.get("at")
    if not isinstance(at, (int, float)):
        return "?"
    return datetime.datetime.fromtimestamp(at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def main(args: argparse.Namespace, settings: Settings) -> int:
    settings.require_broker()
    conn = Connection.open(settings.replace(redis_retry_s=settings.connect_timeout_s))
    try:
        total = conn.store.length(keys.DEAD_LETTERS)
        if args.dead_command == "clear":
            conn.store.delete(keys.DEAD_LETTERS)
            print(f"deleted {total} dead letter(s)")
        elif args.dead_command == "list":
            print(f"{total} dead letter(s) in {keys.DEAD_LETTERS} (kept: the newest {settings.dead_letter_max})")
            for i, e in enumerate(read_entries(conn, 0, args.limit - 1)):
                print(f"  [{i}] {_when(e)}  {e.get('queue', '?')}  task {e.get('task_id') or '-'}  "
                      f"{e.get('size', '?')} bytes  by {e.get('worker', '?')}\n      {str(e.get('reason'))[:300]}")
        else:
            found = read_entries(conn, args.index, args.index)
            if not found:
                raise UserError(f"no dead letter at index {args.index} (there are {total}; 0 is the newest)")
            e = found[0]
            raw = e.get("raw") if isinstance(e.get("raw"), bytes) else b""
            for name in ("at", "queue", "task_id", "worker", "host", "size", "reason"):
                print(f"{name:>8}: {_when(e) if name == 'at' else e.get(name)}")
            if args.out:
                Path(args.out).write_bytes(raw)
                print(f"     raw: {len(raw)} bytes written to {args.out}")
            else:
                print(f"     raw: {raw[:2000]!r}{' ...' if len(raw) > 2000 else ''}")
    finally:
        conn.close()
    return 0
