"""The ports of the servers `fleet up` starts: the ones given must be free; a default that is taken (another
fleet's) is replaced by a free one, and the note names the fleet holding it."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tinkerq.errors import UserError
from tinkerq.launcher import processes
from tinkerq.launcher.fleet.arguments import DEFAULT_FLOWER_PORT, DEFAULT_REDIS_PORT
from tinkerq.launcher.fleet.state import command, state_dir


def ports_of(state: dict[str, Any]) -> list[int]:
    """Every port a fleet's state says its servers listen on."""
    entries = [state.get(k) for k in ("redis", "flower", "gateway", "proxy")] + list(state.get("gateways") or [])
    return [e["port"] for e in entries if isinstance(e, dict) and "port" in e]


def _fleet_holding(port: int) -> str | None:
    """The name of the local fleet whose state lists ``port`` (its Redis, Flower, gateways or proxy), if any."""
    for path in state_dir("default").parent.glob("*/state.json"):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if port in ports_of(state):
            return str(state.get("name", path.parent.name))
    return None


def _taken_because(port: int, problem: str) -> str:
    holder = _fleet_holding(port) if problem == "taken" else None
    return f"{problem} by fleet {holder!r} (stop it with `{command(holder, 'down')}`)" if holder else problem


def choose_ports(args: argparse.Namespace) -> tuple[dict[str, int], list[str]]:
    """The ports of the servers `up` starts, by role ("redis", "flower", "gateway": the gateway's, or with
    --gateways 2+ their proxy's), and notes.

    A port the user gave must be free (else a UserError naming its flag); a default that is taken is replaced by
    a free port, and a note says so.
    """
    wanted: list[tuple[str, str, str, int | None, int | None]] = []  # (role, what, flag, given, default)
    if not args.broker:
        wanted.append(("redis", "redis-server", "--redis-port", args.redis_port, DEFAULT_REDIS_PORT))
    if args.flower_port != 0:
        wanted.append(("flower", "Flower", "--flower-port", args.flower_port, DEFAULT_FLOWER_PORT))
    if args.gateway_port:
        what = "the gateway" if args.gateways == 1 else "the gateways' proxy"
        wanted.append(("gateway", what, "--gateway-port", args.gateway_port, None))
    chosen: dict[str, int] = {}
    notes = []
    for role, what, flag, given, default in sorted(wanted, key=lambda w: w[3] is None):  # given ones first
        if given is not None:
            problem = "given twice" if given in chosen.values() else processes.port_problem(given)
            if problem:
                raise UserError(f"port {given} ({flag}) for {what} is {_taken_because(given, problem)}: pass "
                                f"{flag} with a free port (e.g. {flag} {processes.free_port()})")
            chosen[role] = given
            continue
        assert default is not None
        problem = "taken" if default in chosen.values() else processes.port_problem(default)
        port = default
        if problem:
            while port in chosen.values() or processes.port_problem(port):
                port = processes.free_port()
            notes.append(f"port {default} is {_taken_because(default, problem)}: {what} listens on {port} instead "
                         f"({flag} to choose)")
        chosen[role] = port
    return chosen, notes
