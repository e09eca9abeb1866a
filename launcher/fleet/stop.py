"""`tinkerq fleet down`: stop exactly what `up` started, in an order that lets running tasks finish."""

from __future__ import annotations

import argparse
from typing import Any

from tinkerq.launcher import processes
from tinkerq.launcher.fleet.state import gateway_processes, load_state, state_dir


def fleet_down(args: argparse.Namespace) -> int:
    state = load_state(args.fleet)
    stopped = stop_all(state, timeout=args.timeout)
    (state_dir(args.fleet) / "state.json").unlink(missing_ok=True)
    print(f"fleet {args.fleet!r} is down ({stopped} process(es) stopped; logs kept in {state['logs']})")
    return 0


def stop_all(state: dict[str, Any], timeout: float) -> int:
    """The gateways' proxy, the gateways and Flower, then workers (warm shutdown), then Redis: the broker goes last
    so tasks can be acked.

    Rank 0 of a shard group stops before its other ranks: it finishes its task, then tells them to exit.
    """
    stopped = 0
    workers = sorted(state.get("workers", []), key=lambda w: w.get("rank", 0))
    pids = [entry["pid"] for _, entry in reversed(gateway_processes(state))]  # the proxy first
    if "flower" in state:
        pids.append(state["flower"]["pid"])
    pids += [w["pid"] for w in workers]
    for pid in pids:
        stopped += processes.stop(pid, timeout=timeout)
    if "redis" in state:
        stopped += processes.stop(state["redis"]["pid"], timeout=10)
    return stopped
