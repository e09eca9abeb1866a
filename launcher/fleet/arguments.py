"""`tinkerq fleet`'s command line: the subcommands and their flags, and the checks `up` makes on them before
it starts anything."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from tinkerq.errors import UserError
from tinkerq.launcher import flower as flower_cli
from tinkerq.launcher import processes

DEFAULT_REDIS_PORT = 6380
DEFAULT_FLOWER_PORT = 5555
NO_FLOWER = ", or pass --no-flower to start the fleet without it"

class _ServedName(argparse.Action):
    """--served-name NAME: the served name of the --model just before it, as `tinkerq worker --model DIR
    --served-name NAME` spells it. Kept as {index of that --model: NAME}."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        models = getattr(namespace, "model", None) or []
        served = dict(getattr(namespace, self.dest, None) or {})
        if not models:
            parser.error(f"--served-name {values} names the model of the --model before it: put it after that "
                         f"--model DIR")
        if not str(values).strip():
            parser.error(f"--served-name after --model {models[-1]} is empty: give the name users ask for, e.g. "
                         f"--served-name Qwen/Qwen3-8B")
        if len(models) - 1 in served:
            parser.error(f"--model {models[-1]} has two --served-name ({served[len(models) - 1]!r} and "
                         f"{values!r}): keep one")
        served[len(models) - 1] = values
        setattr(namespace, self.dest, served)


def _name_moved(hint: str) -> type[argparse.Action]:
    """An action for `--name` on the fleet subcommands: refused with a pointer to the flag meant (it used to be the
    fleet's name here, while `tinkerq worker --name` is a model's served name)."""

    class NameMoved(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                     option_string: str | None = None) -> None:
            parser.error(f"--name is not a `tinkerq fleet` option: the fleet's name is --fleet "
                         f"{values or 'NAME'}{hint}")

    return NameMoved


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="fleet_command", required=True)
    up = sub.add_parser("up", help="start redis-server, workers, Flower and gateways as local processes")
    up.add_argument("--model", action="append", required=True, metavar="DIR",
                    help="model directory (repeat for several models)")
    up.add_argument("--served-name", dest="served_names", action=_ServedName, metavar="NAME",
                    help="the name producers and SDK users ask for the --model just before it by, as on `tinkerq "
                         "worker --served-name`: --model /models/qwen3-8b --served-name Qwen/Qwen3-8B (default: "
                         "the directory's absolute path)")
    up.add_argument("--workers", type=int, default=1, help="workers per model (default 1)")
    up.add_argument("--samplers", type=int, default=0,
                    help="extra sampling-only workers per model (--role sampler; default 0)")
    up.add_argument("--shards", type=int, default=1,
                    help="processes per worker, each holding 1/N of the model (default 1; with --device cuda, "
                         "shard r uses cuda:r)")
    up.add_argument("--broker", help="use this Redis instead of starting one (a password here shows in `ps` while "
                                     "`up` runs: prefer --broker-from-env)")
    up.add_argument("--broker-from-env", action="store_true",
                    help="use the Redis at TINKERQ_BROKER_URL instead of starting one (keeps its password off every "
                         "command line)")
    up.add_argument("--redis-port", type=int,
                    help=f"port of the redis-server it starts (default {DEFAULT_REDIS_PORT}, or a free port when "
                         f"{DEFAULT_REDIS_PORT} is taken)")
    up.add_argument("--flower-port", type=int,
                    help=f"Flower's port (default {DEFAULT_FLOWER_PORT}, or a free port when it is taken; 0 = no "
                         f"Flower)")
    up.add_argument("--no-flower", action="store_true",
                    help="start no Flower (the same as --flower-port 0; Flower comes with tinkerq's ops extra)")
    up.add_argument("--flower-auth", help="user:password for Flower (default: FLOWER_BASIC_AUTH, else generated "
                                          "and printed once)")
    up.add_argument("--gateway-port", type=int, default=0,
                    help="also start the HTTP gateway for the official tinker SDK on this port (default 0 = none; "
                         "keys: tinkerq keys create NAME)")
    up.add_argument("--gateways", type=int,
                    help="gateway processes (default 1 with --gateway-port, else 0); with 2 or more, each listens "
                         "on a private port and a round-robin `tinkerq proxy` takes --gateway-port")
    up.add_argument("--threads", type=int,
                    help="torch CPU threads per worker process (default: the CPU cores split between the fleet's "
                         "worker, sampler and shard processes)")
    up.add_argument("--device", help="torch device of the workers (default cpu)")
    up.add_argument("--quantized-base", choices=["dequantize", "keep"],
                    help="the workers' quantized checkpoints: dequantized on load (default: TINKERQ_QUANTIZED_BASE, "
                         "else dequantize) or kept as stored, LoRA and sampling only; with --shards N "
                         "--expert-parallel each shard keeps its own experts (docs/quantized.md)")
    up.add_argument("--activation-checkpointing", choices=["auto", "on", "off"],
                    help="the workers' activation checkpointing per decoder layer (default: "
                         "TINKERQ_ACTIVATION_CHECKPOINTING, else auto: only for a batch that would not fit otherwise; "
                         "docs/planning.md)")
    up.add_argument("--expert-parallel", action="store_true",
                    help="with --shards N and a MoE model: each shard holds 1/N of the routed experts, tokens travel "
                         "to them by all-to-all (default: TINKERQ_EXPERT_PARALLEL, else off; docs/sharding.md)")
    up.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                    help="the workers' parameter dtype (default: TINKERQ_DTYPE, else auto: the checkpoint's own, "
                         "bfloat16 for published ones, on a GPU with bfloat16; float32 on the CPU)")
    up.add_argument("--timeout", type=float, default=180.0,
                    help="seconds to wait for every process to serve (workers registered, Flower and gateways "
                         "answering)")
    for name, help_ in (("status", "what runs, and what each worker is doing"), ("down", "stop what `up` started")):
        sub.add_parser(name, help=help_)
    for name, q in sub.choices.items():
        q.add_argument("--fleet", default="default", metavar="NAME",
                       help="the fleet's name (several fleets can coexist; default 'default')")
        hint = " (a model's served name: --served-name NAME after its --model)" if name == "up" else ""
        q.add_argument("--name", nargs="?", action=_name_moved(hint), help=argparse.SUPPRESS)
    sub.choices["down"].add_argument("--timeout", type=float, default=60.0,
                                     help="seconds a worker gets to finish its task before it is killed")

def served_models(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(absolute directory, served name) of each --model, in order; the name defaults to the directory, as on
    `tinkerq worker`."""
    names = args.served_names or {}
    return [(os.path.abspath(m), names.get(i) or os.path.abspath(m)) for i, m in enumerate(args.model)]


def check_arguments(args: argparse.Namespace) -> None:
    for model in args.model:
        if not Path(model).is_dir():
            raise UserError(f"model path {model!r} is not a directory: pass --model with a local Hugging Face model "
                            f"folder (config.json and weights)")
    served = [name for _, name in served_models(args)]
    twice = next((name for name in served if served.count(name) > 1), None)
    if twice is not None:
        raise UserError(f"two --model are served as {twice!r}: give each its own --served-name (more workers of one "
                        f"model: --workers N)")
    for flag, value, least in (("--workers", args.workers, 0), ("--samplers", args.samplers, 0),
                               ("--shards", args.shards, 1), ("--threads", args.threads, 1),
                               ("--gateways", args.gateways, 0)):
        if value is not None and value < least:
            raise UserError(f"{flag} must be at least {least}, got {value}")
    if args.redis_port == 0:
        raise UserError("--redis-port 0 is no port: pass one of 1-65535, or leave it out (6380, or a free port)")
    if args.broker and args.redis_port is not None:
        raise UserError("--redis-port is the port of the redis-server `fleet up` starts, and with --broker it starts "
                        "none: drop one of them")
    if args.no_flower:
        if args.flower_port:
            raise UserError(f"--no-flower and --flower-port {args.flower_port} contradict each other: drop one")
        args.flower_port = 0
    if args.gateways is None:
        args.gateways = 1 if args.gateway_port else 0
    elif args.gateways and not args.gateway_port:
        raise UserError(f"--gateways {args.gateways} needs --gateway-port PORT, where SDK users reach them (e.g. "
                        f"--gateway-port 8000)")
    elif args.gateway_port and not args.gateways:
        raise UserError(f"--gateways 0 starts no gateway, but --gateway-port {args.gateway_port} asks for one: drop "
                        f"one of them")


def check_installed(args: argparse.Namespace) -> None:
    """What `up` would start but this interpreter lacks: said in one line before anything starts."""
    if not args.broker:
        processes.redis_binary()
    no_flower = args.flower_port != 0 and not flower_cli.installed()
    no_gateway = processes.gateway_not_installed() if args.gateways else None
    if no_flower and no_gateway:  # one install for both, not one error after the other
        raise UserError(f"Flower and the gateway are not installed: they come with tinkerq's ops and gateway "
                        f"extras, so run `{sys.executable} -m pip install -e '.[ops,gateway]'` in the tinkerq checkout "
                        f"(or pip install 'tinkerq[ops,gateway]'), or start the fleet without them (--no-flower, no "
                        f"--gateway-port)")
    if no_flower:
        raise UserError(flower_cli.not_installed(NO_FLOWER))
    if no_gateway:
        raise UserError(no_gateway)


def broker_from_env(args: argparse.Namespace) -> None:
    """--broker-from-env: the operator's Redis from TINKERQ_BROKER_URL, so its password is on no command line."""
    if args.broker_from_env:
        if args.broker:
            raise UserError("--broker and --broker-from-env both name a Redis: drop one of them")
        args.broker = os.environ.get("TINKERQ_BROKER_URL")
        if not args.broker:
            raise UserError("--broker-from-env: TINKERQ_BROKER_URL is not set; export it "
                            "(redis://:PASSWORD@host:6379/0) or drop --broker-from-env to start a Redis")
