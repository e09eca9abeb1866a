"""`tinkerq fleet up | status | down`: the local fleet without Docker.

One module per job: the command line (``arguments``), the fleet's state file (``state``), its ports
(``ports``), starting (``start``) and waiting until everything serves (``readiness``), ``status`` and ``stop``.

`up` starts, as local processes with their logs in one folder: a redis-server (unless --broker names one),
N workers per model, Flower (unless --no-flower), and the HTTP gateway if asked (--gateway-port; with
--gateways N, N gateways behind a round-robin `tinkerq proxy` on that port); it records what it started in
``<home>/fleet/<fleet>/state.json``, and says the fleet is up only once every one of them serves: Redis
answers PING, each model's workers are registered, Flower and each gateway (and the proxy) answer HTTP.
`status` shows what runs and what each worker is doing; `down` stops exactly what `up` started (workers
get SIGTERM first: Celery's warm shutdown finishes the running task).

Flags mean what they mean on the other commands: --fleet NAME is the fleet's name on every `fleet`
subcommand, and --served-name NAME after a --model is the name that model is served under, as on
`tinkerq worker --served-name` (alias --name there). `--name` is refused here, with a pointer to both.

Each worker process (shard ranks and samplers included) gets an equal share of the CPU cores as torch threads
unless --threads says otherwise. A default port that is taken (another fleet's) is replaced by a free one; a port
the user gave must be free. Every failure of `up` is one line that says what to do, and stops what it started.

Secrets stay off command lines: Redis reads its password from an owner-only file, workers, Flower and the
gateways get the broker URL and Flower's login from their environment. The fleet's folder (state, logs, the
AOF) is owner-only; `status` never prints a password.
"""

from __future__ import annotations

import argparse

from tinkerq.launcher.fleet.arguments import DEFAULT_FLOWER_PORT, DEFAULT_REDIS_PORT, add_fleet_arguments
from tinkerq.launcher.fleet.start import cpu_cores, fleet_up
from tinkerq.launcher.fleet.status import fleet_status, session_lines
from tinkerq.launcher.fleet.stop import fleet_down

__all__ = ["DEFAULT_FLOWER_PORT", "DEFAULT_REDIS_PORT", "add_fleet_arguments", "cpu_cores", "main", "session_lines"]


def main(args: argparse.Namespace) -> int:
    return {"up": fleet_up, "status": fleet_status, "down": fleet_down}[args.fleet_command](args)
