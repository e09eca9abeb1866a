"""A local fleet's record of what `fleet up` started (``<home>/fleet/<fleet>/state.json``, owner-only: it holds
the Redis password and Flower's login), and the phrases its commands print."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from tinkerq.errors import UserError
from tinkerq.settings import Settings


def state_dir(name: str) -> Path:
    return Path(Settings.from_env().home) / "fleet" / name


def command(name: str, action: str) -> str:
    """The `tinkerq fleet ACTION` command line for fleet ``name`` (``--fleet`` only when it is not the default)."""
    return f"tinkerq fleet {action}" + ("" if name == "default" else f" --fleet {shlex.quote(name)}")


def load_state(name: str) -> dict[str, Any]:
    path = state_dir(name) / "state.json"
    if not path.exists():
        raise UserError(f"no fleet named {name!r} is running (start one with `{command(name, 'up')} --model DIR`)")
    return json.loads(path.read_text())

def save_state(folder: Path, state: dict[str, Any]) -> None:
    tmp = folder / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    os.chmod(tmp, 0o600)  # holds the Redis password and Flower's credentials
    tmp.replace(folder / "state.json")

def gateway_processes(state: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(what, its state entry) of the gateways and their proxy; a state written before --gateways had one
    "gateway" entry."""
    gateways = state.get("gateways") or ([state["gateway"]] if "gateway" in state else [])
    out = [("the gateway" if len(gateways) == 1 else f"gateway {i + 1} of {len(gateways)}", g)
           for i, g in enumerate(gateways)]
    return out + ([("the gateways' proxy", state["proxy"])] if "proxy" in state else [])

def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")
