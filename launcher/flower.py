"""`tinkerq flower`: Flower on the fleet's Redis, with the fleet's Celery configuration."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys

from tinkerq.errors import TinkerqError, UserError
from tinkerq.security import warn_about_broker
from tinkerq.settings import Settings

# Flower's own defaults (100000 tasks, 5000 workers) let a long run's dashboard reach ~0.5 GB of memory and
# pickle ~40 MB into --db every 10 s; 10000 tasks are hours of training steps.
MAX_TASKS = 10_000
MAX_WORKERS = 500


def add_flower_arguments(fl: argparse.ArgumentParser) -> None:
    fl.add_argument("--broker", help="redis://, rediss:// or sentinel:// URL (default: TINKERQ_BROKER_URL)")
    fl.add_argument("--port", type=int, default=5555, help="port to listen on (default 5555)")
    fl.add_argument("--address", default="127.0.0.1", help="address to listen on (0.0.0.0 in a container)")
    fl.add_argument("--db", default="flower.db", help="file where Flower keeps its state across restarts")
    fl.add_argument("--basic-auth", help="user:password; better: FLOWER_BASIC_AUTH, which stays off the process list")
    fl.add_argument("--no-auth", action="store_true", help="run Flower without a login (only on purpose)")
    fl.add_argument("--max-tasks", type=int, default=MAX_TASKS,
                    help=f"tasks Flower keeps, in memory and in --db; the oldest go first (default {MAX_TASKS}: "
                         f"about 5 KB of memory and 0.4 KB of database each)")
    fl.add_argument("--max-workers", type=int, default=MAX_WORKERS,
                    help=f"workers Flower keeps, the least recently heard from go first; every worker start is "
                         f"a new worker name (default {MAX_WORKERS})")


def installed() -> bool:
    """True when `celery flower` exists. Celery finds its subcommands through the ``celery.commands`` entry
    points, and Flower's distribution registers ``flower`` there; without it `celery flower` only logs
    "Error: No such command 'flower'"."""
    from importlib.metadata import entry_points

    return any(ep.name == "flower" for ep in entry_points(group="celery.commands"))


def not_installed(alternative: str = "") -> str:
    """What to do when Flower is missing (one line): install the extra it comes with into this interpreter."""
    return (f"Flower is not installed: it comes with tinkerq's ops extra, so run `{sys.executable} -m pip install "
            f"-e '.[ops]'` in the tinkerq checkout (or pip install 'tinkerq[ops]')" + alternative)


def run_flower(args: argparse.Namespace, settings: Settings) -> int:
    """Run Flower on the fleet's Redis with the fleet's Celery configuration (replaces this process).

    Flower can shut workers down and shows every task's arguments, so it needs a login unless --no-auth
    says otherwise. The broker URL and the login reach Flower through its environment (FLOWER_BASIC_AUTH),
    never its command line, where every local user could read them.
    """
    if not installed():
        raise UserError(not_installed())
    if settings.broker_url is None:
        raise TinkerqError("no broker: set TINKERQ_BROKER_URL=redis://:PASSWORD@host:6379/0 (or pass --broker)")
    auth = args.basic_auth or os.environ.get("FLOWER_BASIC_AUTH")
    if auth and args.no_auth:
        raise TinkerqError("--no-auth contradicts the login given (--basic-auth or FLOWER_BASIC_AUTH): drop one")
    if not auth and not args.no_auth:
        raise TinkerqError("Flower needs a login: set FLOWER_BASIC_AUTH=user:password (or pass --basic-auth "
                           "user:password, which other local users can see in the process list); pass --no-auth "
                           "only to run it open on purpose")
    if auth and ":" not in auth:
        raise TinkerqError("the Flower login must be user:password")
    if args.max_tasks < 1 or args.max_workers < 1:
        raise UserError("--max-tasks and --max-workers must be at least 1")
    check_port_free(args.address, args.port)
    if args.no_auth:
        logging.warning("Flower runs WITHOUT a login (--no-auth): anyone who reaches %s:%s sees every task's "
                        "arguments and can shut workers down", args.address, args.port)
    if args.basic_auth:
        logging.warning("--basic-auth is visible in the process list until Flower starts; prefer FLOWER_BASIC_AUTH")
    # Flower 2.2 serves /metrics and /healthcheck without its login; launcher/flower_app.py puts /metrics behind it.
    logging.info("Flower's /healthcheck answers without the login (docs/security.md)")
    warn_about_broker(getattr(args, "broker", None), settings.broker_url)
    os.umask(0o077)  # Flower's database (every task's arguments): owner-only
    env = {k: v for k, v in os.environ.items() if k != "FLOWER_BASIC_AUTH"}
    env["TINKERQ_BROKER_URL"] = settings.broker_url
    if auth:
        env["FLOWER_BASIC_AUTH"] = auth  # Flower reads FLOWER_<option> variables (flower/command.py)
    cmd = [sys.executable, "-m", "celery", "-A", "tinkerq.launcher.flower_app:app", "flower",
           f"--port={args.port}", f"--address={args.address}", "--persistent=True", f"--db={args.db}",
           "--state_save_interval=10000", f"--max_tasks={args.max_tasks}", f"--max_workers={args.max_workers}"]
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


def check_port_free(address: str, port: int) -> None:
    """Raise UserError, in one line, when Flower could not listen on ``address:port`` (Flower would exit with a
    traceback). It binds as Flower does (tornado: SO_REUSEADDR), so a port in TIME_WAIT is not taken."""
    try:
        infos = socket.getaddrinfo(address or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"cannot listen on {address}:{port}: {exc.strerror}; pass --address 127.0.0.1") from None
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise UserError(f"port {port} on {address} is taken (another Flower?): pass --port with a "
                                    f"free port, e.g. --port {port + 1}") from None
                raise UserError(f"cannot listen on {address}:{port}: {exc.strerror}") from None
