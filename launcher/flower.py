"""`tinkerq flower`: Flower on the fleet's Redis, with the fleet's Celery configuration."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tinkerq.errors import TinkerqError
from tinkerq.security import warn_about_broker
from tinkerq.settings import Settings


def add_flower_arguments(fl: argparse.ArgumentParser) -> None:
    fl.add_argument("--broker", help="redis://, rediss:// or sentinel:// URL (default: TINKERQ_BROKER_URL)")
    fl.add_argument("--port", type=int, default=5555)
    fl.add_argument("--address", default="127.0.0.1", help="address to listen on (0.0.0.0 in a container)")
    fl.add_argument("--db", default="flower.db", help="file where Flower keeps its state across restarts")
    fl.add_argument("--basic-auth", help="user:password; better: FLOWER_BASIC_AUTH, which stays off the process list")
    fl.add_argument("--no-auth", action="store_true", help="run Flower without a login (only on purpose)")


def run_flower(args: argparse.Namespace, settings: Settings) -> int:
    """Run Flower on the fleet's Redis with the fleet's Celery configuration (replaces this process).

    Flower can shut workers down and shows every task's arguments, so it needs a login unless --no-auth
    says otherwise. The broker URL and the login reach Flower through its environment (FLOWER_BASIC_AUTH),
    never its command line, where every local user could read them.
    """
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
    if args.no_auth:
        logging.warning("Flower runs WITHOUT a login (--no-auth): anyone who reaches %s:%s sees every task's "
                        "arguments and can shut workers down", args.address, args.port)
    if args.basic_auth:
        logging.warning("--basic-auth is visible in the process list until Flower starts; prefer FLOWER_BASIC_AUTH")
    # Flower 2.2 serves /metrics (Prometheus) and /healthcheck without asking for the login.
    logging.info("Flower's /metrics and /healthcheck answer without the login (docs/security.md)")
    warn_about_broker(getattr(args, "broker", None), settings.broker_url)
    os.umask(0o077)  # Flower's database (every task's arguments): owner-only
    env = {k: v for k, v in os.environ.items() if k != "FLOWER_BASIC_AUTH"}
    env["TINKERQ_BROKER_URL"] = settings.broker_url
    if auth:
        env["FLOWER_BASIC_AUTH"] = auth  # Flower reads FLOWER_<option> variables (flower/command.py)
    cmd = [sys.executable, "-m", "celery", "-A", "launcher.flower_app:app", "flower",
           f"--port={args.port}", f"--address={args.address}", "--persistent=True", f"--db={args.db}",
           "--state_save_interval=10000"]
    os.execve(sys.executable, cmd, env)
    return 0  # not reached
