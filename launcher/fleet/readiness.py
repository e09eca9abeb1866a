"""When `fleet up` may say the fleet is up: every process it started serves (Redis answers, each model's workers
are registered, Flower, the gateways and their proxy answer HTTP), and none exited meanwhile."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tinkerq.launcher import processes
from tinkerq.launcher.fleet.state import gateway_processes


def _readiness(conn: Any, state: dict[str, Any]) -> list[tuple[str, Callable[[], bool], Path | None]]:
    """(what, is it serving?, its log) for each thing `up` waits for: each served name's workers registered
    (rank 0 of a shard group registers once the group has formed), Flower and each gateway answering HTTP, and the
    proxy answering the gateways' health check through itself."""
    expected: dict[str, int] = {}
    first_log: dict[str, Path] = {}
    for w in state["workers"]:
        if w.get("rank", 0) == 0:
            served = w.get("served", w["model"])
            expected[served] = expected.get(served, 0) + 1
            first_log.setdefault(served, Path(w["log"]))
    checks: list[tuple[str, Callable[[], bool], Path | None]] = [
        (f"the workers serving {served!r}", functools.partial(_registered, conn, served, n), first_log[served])
        for served, n in expected.items()]
    if "flower" in state:
        flower = state["flower"]
        checks.append(("Flower", functools.partial(processes.flower_up, flower["port"]), Path(flower["log"])))
    for what, entry in gateway_processes(state):
        url = f"http://127.0.0.1:{entry['port']}"
        checks.append((what, functools.partial(processes.gateway_up, url), Path(entry["log"])))
    return checks


def _registered(conn: Any, served: str, workers: int) -> bool:
    return len(conn.workers_serving(served)) >= workers


def _watched(state: dict[str, Any]) -> list[tuple[str, int, Path | None]]:
    """(what, pid, log) of every process `up` started: one that exits during start-up fails `up`."""
    out: list[tuple[str, int, Path | None]] = []
    if "redis" in state:
        out.append(("redis-server", state["redis"]["pid"], Path(state["redis"]["log"])))
    for w in state["workers"]:
        kind = "the sampler" if w.get("role") == "sampler" else "the worker"
        out.append((f"{kind} for {w['model']}", w["pid"], Path(w["log"])))
    if "flower" in state:
        out.append(("Flower", state["flower"]["pid"], Path(state["flower"]["log"])))
    out += [(what, e["pid"], Path(e["log"])) for what, e in gateway_processes(state)]
    return out


def wait_serving(conn: Any, state: dict[str, Any], timeout: float) -> None:
    """Return once everything `up` started serves; a StartupError naming the first process that exited, or what
    still did not serve after ``timeout`` seconds."""
    pending = _readiness(conn, state)
    deadline = time.monotonic() + timeout
    while True:
        for what, pid, log in _watched(state):
            if not processes.alive(pid):
                raise processes.StartupError(f"{what} exited during start-up", what, timeout, log, exited=True)
        pending = [check for check in pending if not check[1]()]
        if not pending:
            return
        if time.monotonic() > deadline:
            what, _, log = pending[0]
            raise processes.StartupError(f"{what} did not come up within {timeout:g} s", what, timeout, log,
                                         exited=False)
        time.sleep(0.2)
