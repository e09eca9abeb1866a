"""`tinkerq fleet status`: what runs, what each worker is doing, and each adoptable training session."""

from __future__ import annotations

import argparse
import time
from typing import Any

from tinkerq.connection import redact_url
from tinkerq.errors import TinkerqError
from tinkerq.launcher import processes
from tinkerq.launcher.fleet.state import command, gateway_processes, load_state, plural
from tinkerq.settings import Settings


def fleet_status(args: argparse.Namespace) -> int:
    state = load_state(args.fleet)
    print(f"fleet {args.fleet!r}  broker {redact_url(state['broker'])}  logs {state['logs']}")
    if "redis" in state:
        print(f"  redis-server  pid {state['redis']['pid']:>7}  {_up(state['redis']['pid'])}  "
              f"port {state['redis']['port']}")
    for w in state["workers"]:
        sampler = w.get("role") == "sampler"
        shard = f"  (shard {w['rank']} of {state['shards']})" if state.get("shards", 1) > 1 and not sampler else ""
        kind = "sampler " if sampler else "worker  "
        threads = f"  {plural(w['threads'], 'thread')}" if "threads" in w else ""
        served = w.get("served", w["model"])
        as_ = f" as {served!r}" if served != w["model"] else ""
        print(f"  {kind}      pid {w['pid']:>7}  {_up(w['pid'])}{threads}  {w['model']}{as_}{shard}")
    if "flower" in state:
        print(f"  flower        pid {state['flower']['pid']:>7}  {_up(state['flower']['pid'])}  "
              f"http://127.0.0.1:{state['flower']['port']}/")
    for _, entry in gateway_processes(state):
        kind = "proxy  " if entry is state.get("proxy") else "gateway"
        behind = (f"  (round robin over {plural(len(state['gateways']), 'gateway')})"
                  if entry is state.get("proxy") else "")
        print(f"  {kind}       pid {entry['pid']:>7}  {_up(entry['pid'])}  http://127.0.0.1:{entry['port']}/{behind}")
    from tinkerq.connection import Connection

    try:
        conn = Connection.open(Settings(broker_url=state["broker"], connect_timeout_s=2))
    except TinkerqError as exc:
        print(f"  broker unreachable: {exc.message}")
        if "redis" in state and not processes.alive(state["redis"]["pid"]):
            print(f"  its redis-server stopped: `{command(args.fleet, 'down')}` stops the rest, then `fleet up` again")
        return 1
    try:
        registrations = conn.workers_serving()
        # What each worker's compute loop runs now (its `inspect stats` block): each request by its argsrepr (what
        # the producer wrote for people, as Flower shows it), never its raw arguments (blob keys, timestamps).
        stats = conn.app.control.inspect(timeout=1.0).stats() or {}
        print(f"  {len(registrations)} registered worker(s):")
        for r in sorted(registrations, key=lambda r: r["worker"]):
            node = next((n for n in stats if r["worker"] in n), None)
            running = ((stats.get(node) or {}).get("tinkerq") or {}).get("running") or [] if node else []
            doing = ", ".join(running_task(t) for t in running) or "idle"
            shards = f"  {r['shards']} shards" if r.get("shards", 1) > 1 else ""
            shards += " (expert parallel)" if shards and r.get("expert_parallel") else ""
            print(f"    {r['worker']}  {r['base_model']}{shards}  {r.get('dtype', '?')}  loss head "
                  f"{r.get('loss_backend', '?')}  -> {doing}")
        sessions = session_lines(conn.store)
        print(f"  {len(sessions)} training session(s):")
        for line in sessions:
            print(f"    {line}")
    finally:
        conn.close()
    return 0


def running_task(task: dict[str, Any]) -> str:
    """'forward_backward(model_id=1a2b3c4d seq=3 loss_fn=cross_entropy datums=8 tokens=512)' from a request of
    a worker's ``inspect().stats()["tinkerq"]["running"]``."""
    return f"{str(task.get('name', '?')).split('.')[-1]}({task.get('args') or ''})"


def session_lines(store: Any, now: float | None = None) -> list[str]:
    """One line per adoptable training session (its session record in Redis): model id, the worker holding it (or,
    for a session released idle, the worker it is parked on, since when and after how long idle), the age of its
    latest automatic snapshot, its journal's length, and the lost worker it was adopted from."""
    from tinkerq import keys
    from tinkerq.records import SessionHome, SnapshotRecord

    now = time.time() if now is None else now
    lines = []
    for key in sorted(store.scan(keys.SESSION_HOME_PATTERN)):
        home = SessionHome.loads(store.get(key))
        if home is None:
            continue
        record = SnapshotRecord.loads(store.get(keys.auto_snapshot(home.model_id)))
        snapshot = "no snapshot yet" if record is None else f"snapshot {max(0.0, now - record.time):.0f} s ago"
        journal = store.length(keys.journal(home.model_id))
        where = f"on {home.worker}"
        if home.parked and home.parked_at is not None:  # out of memory; restored on its next request
            where = (f"parked on {home.worker} {max(0.0, now - home.parked_at):.0f} s ago (released after "
                     f"{home.idle_s:.0f} s idle; back on its next request)")
        line = f"{home.model_id[:12]}  {where}  {snapshot}  journal {journal}"
        if home.adopted_from:
            line += f"  adopted from {home.adopted_from}"
        lines.append(line)
    return lines

def _up(pid: int) -> str:
    return "running" if processes.alive(pid) else "STOPPED"
