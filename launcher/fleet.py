"""`tinkerq fleet up | status | down`: the local fleet without Docker.

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
import functools
import json
import os
import secrets
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tinkerq.connection import redact_url
from tinkerq.errors import BrokerUnavailableError, TinkerqError, UserError
from tinkerq.launcher import flower as flower_cli
from tinkerq.launcher import processes
from tinkerq.settings import Settings

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
                         "else dequantize) or kept as stored, LoRA and sampling only (docs/quantized.md)")
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


def state_dir(name: str) -> Path:
    return Path(Settings.from_env().home) / "fleet" / name


def command(name: str, action: str) -> str:
    """The `tinkerq fleet ACTION` command line for fleet ``name`` (``--fleet`` only when it is not the default)."""
    return f"tinkerq fleet {action}" + ("" if name == "default" else f" --fleet {shlex.quote(name)}")


def _load(name: str) -> dict[str, Any]:
    path = state_dir(name) / "state.json"
    if not path.exists():
        raise UserError(f"no fleet named {name!r} is running (start one with `{command(name, 'up')} --model DIR`)")
    return json.loads(path.read_text())


def cpu_cores() -> int:
    """The cores this process may run on (its affinity, e.g. a container's cpuset), not the machine's."""
    return len(os.sched_getaffinity(0))


def default_threads(torch_processes: int) -> int:
    """Torch threads per process when --threads is not given: the cores split between the fleet's torch processes.

    Each torch process otherwise takes every core: on 2 cores two workers fought over them and a 0.04 s request
    took up to 4.6 s.
    """
    return max(1, cpu_cores() // max(1, torch_processes))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")


def describe_workers(models: int, workers: int, samplers: int, shards: int) -> str:
    """'2 workers (4 shard processes) and 1 sampler for 1 model': workers, not processes."""
    text = _plural(models * workers, "worker")
    if shards > 1 and workers:
        text += f" ({models * workers * shards} shard processes)"
    if samplers:
        text += f" and {_plural(models * samplers, 'sampler')}"
    return f"{text} for {_plural(models, 'model')}"


def served_models(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(absolute directory, served name) of each --model, in order; the name defaults to the directory, as on
    `tinkerq worker`."""
    names = args.served_names or {}
    return [(os.path.abspath(m), names.get(i) or os.path.abspath(m)) for i, m in enumerate(args.model)]


def _check_arguments(args: argparse.Namespace) -> None:
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


def _check_installed(args: argparse.Namespace) -> None:
    """What `up` would start but this interpreter lacks: said in one line before anything starts."""
    if not args.broker:
        processes.redis_binary()
    if args.flower_port != 0 and not flower_cli.installed():
        raise UserError(flower_cli.not_installed(NO_FLOWER))
    if args.gateways:
        missing = processes.gateway_not_installed()
        if missing:
            raise UserError(missing)


def _ports_of(state: dict[str, Any]) -> list[int]:
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
        if port in _ports_of(state):
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


def _broker_from_env(args: argparse.Namespace) -> None:
    """--broker-from-env: the operator's Redis from TINKERQ_BROKER_URL, so its password is on no command line."""
    if args.broker_from_env:
        if args.broker:
            raise UserError("--broker and --broker-from-env both name a Redis: drop one of them")
        args.broker = os.environ.get("TINKERQ_BROKER_URL")
        if not args.broker:
            raise UserError("--broker-from-env: TINKERQ_BROKER_URL is not set; export it "
                            "(redis://:PASSWORD@host:6379/0) or drop --broker-from-env to start a Redis")


def fleet_up(args: argparse.Namespace) -> int:
    folder = state_dir(args.fleet)
    if (folder / "state.json").exists():
        raise UserError(f"fleet {args.fleet!r} is already up (see `{command(args.fleet, 'status')}`; stop it with "
                        f"`{command(args.fleet, 'down')}`, or start another with --fleet OTHER)")
    _broker_from_env(args)
    _check_arguments(args)
    _check_installed(args)  # not installed: say so before starting anything
    ports, notes = choose_ports(args)
    torch_processes = len(args.model) * (args.workers * args.shards + args.samplers)
    threads = args.threads or default_threads(torch_processes)
    try:
        logs = processes.private_dir(folder / "logs")  # state.json holds the secrets; logs, request arguments
        processes.private_dir(folder)
    except OSError as exc:
        raise UserError(f"cannot create the fleet's folder {folder}: {exc.strerror}; set TINKERQ_HOME to a folder "
                        f"you can write") from None
    state: dict[str, Any] = {"name": args.fleet, "logs": str(logs), "started": time.time(), "workers": [],
                             "shards": args.shards, "threads": threads}
    try:
        _start(args, state, folder, ports, threads)
    except processes.StartupError as exc:
        _abandon(state, folder)
        raise UserError(_startup_failure(exc, logs)) from None
    except BrokerUnavailableError as exc:  # --broker unreachable, or refusing its password
        _abandon(state, folder)
        raise UserError(exc.message) from None
    except BaseException:
        _abandon(state, folder)
        raise
    if args.broker:  # the operator's Redis: what is unsafe about reaching it (a password in our argv, no TLS)
        from tinkerq.security import warn_about_broker

        warn_about_broker(None if args.broker_from_env else args.broker, args.broker)
    print(f"fleet {args.fleet!r} is up: {describe_workers(len(args.model), args.workers, args.samplers, args.shards)}"
          f"; logs in {logs}")
    why = "--threads" if args.threads else (f"{_plural(cpu_cores(), 'core')} shared by "
                                            f"{_plural(torch_processes, 'process')}; --threads N to change")
    if torch_processes:
        print(f"  torch threads per worker process: {threads} ({why})")
    for directory, name in served_models(args):
        if name != directory:
            print(f"  {directory} is served as {name!r}")
    for note in notes:
        print(f"  {note}")
    print(f"  export TINKERQ_BROKER_URL='{state['broker']}'")
    if "flower" in state:
        print(f"  Flower: http://127.0.0.1:{state['flower']['port']}/  (basic auth {state['flower']['auth']})")
    if state.get("gateways"):
        front = state.get("proxy") or state["gateways"][0]
        behind = (f"{len(state['gateways'])} gateways behind a round-robin tinkerq proxy; " if "proxy" in state
                  else "")
        print(f"  gateway: TINKER_BASE_URL=http://127.0.0.1:{front['port']}  "
              f"({behind}a key for the SDK: tinkerq keys create NAME)")
        print(f"  console for tenants: http://127.0.0.1:{front['port']}/console  (sign in with the API key)")
    print(f"  {command(args.fleet, 'status')} | {command(args.fleet, 'down')}")
    return 0


def _startup_failure(exc: processes.StartupError, logs: Path) -> str:
    """One line: what did not come up, the last line of its log (its error, mostly), and what to do."""
    line = processes.last_line(exc.log)
    if exc.exited:
        what, advice = f"{exc.what} exited during start-up", ""
        line = line or "no output"
    else:
        what, advice = f"{exc.what} did not come up within {exc.timeout:g} s", "; --timeout to wait longer"
    tail = exc.log.read_text(errors="replace")[-4000:] if exc.log and exc.log.exists() else ""
    if "No such command 'flower'" in tail:  # `celery flower` without Flower installed (click may add more lines)
        line = f"Error: No such command 'flower'. {flower_cli.not_installed(NO_FLOWER)}"
    where = f"its log {exc.log}" if exc.log else f"the logs in {logs}"
    return what + (f": {line}" if line else "") + f" (see {where}{advice})"


def _abandon(state: dict[str, Any], folder: Path) -> None:
    """A failed `up`: stop what it started and forget it, so the next `up` starts clean."""
    _stop_all(state, timeout=10)
    (folder / "state.json").unlink(missing_ok=True)


def _start(args: argparse.Namespace, state: dict[str, Any], folder: Path, ports: dict[str, int],
           threads: int) -> None:
    """Start Redis (unless --broker), the workers, Flower, the gateways and their proxy, recording each in ``state``
    as it starts (so a failure part-way stops exactly what started); return once every one of them serves."""
    logs = Path(state["logs"])
    if args.broker:
        broker = args.broker
    else:
        password = secrets.token_urlsafe(16)
        proc = processes.start_redis(ports["redis"], folder / "redis", password=password, durable=True,
                                     timeout=args.timeout)  # returns once it answers PING
        broker = f"redis://:{password}@127.0.0.1:{ports['redis']}/0"
        state["redis"] = {"pid": proc.pid, "port": ports["redis"], "log": str(folder / "redis" / "redis.log")}
    state["broker"] = broker
    _save(folder, state)
    from tinkerq.connection import Connection

    conn = Connection.open(Settings(broker_url=broker, connect_timeout_s=5))  # --broker unreachable: say so now
    try:
        _start_workers(args, state, folder, threads)
        if ports.get("flower"):
            auth = args.flower_auth or os.environ.get("FLOWER_BASIC_AUTH") or f"admin:{secrets.token_urlsafe(12)}"
            log = logs / "flower.log"
            cmd = processes.flower_command(None, ports["flower"], db=folder / "flower.db")
            proc = processes.start_process(cmd, log, processes.secret_env(broker, flower_auth=auth))
            state["flower"] = {"pid": proc.pid, "port": ports["flower"], "auth": auth, "log": str(log)}
            _save(folder, state)
        if ports.get("gateway"):
            _start_gateways(args.gateways, ports["gateway"], state, folder, set(ports.values()))
        _wait_serving(conn, state, args.timeout)
    finally:
        conn.close()


def _start_gateways(count: int, port: int, state: dict[str, Any], folder: Path, taken: set[int]) -> None:
    """One gateway on ``port``; or ``count`` gateways on private free ports and a `tinkerq proxy` on ``port``
    passing each connection to the next of them."""
    logs, env = Path(state["logs"]), processes.secret_env(state["broker"])
    private: list[int] = []
    while len(private) < count and count > 1:
        candidate = processes.free_port()
        if candidate not in taken and candidate not in private:
            private.append(candidate)
    state["gateways"] = []
    for i, gateway_port in enumerate(private or [port]):
        log = logs / (f"gateway-{i}.log" if private else "gateway.log")
        proc = processes.start_process(processes.gateway_command(None, gateway_port), log, env)
        state["gateways"].append({"pid": proc.pid, "port": gateway_port, "log": str(log)})
        _save(folder, state)
    if private:
        log = logs / "proxy.log"
        proc = processes.start_process(processes.proxy_command(port, private), log)  # no secret: no broker
        state["proxy"] = {"pid": proc.pid, "port": port, "log": str(log)}
        _save(folder, state)


def _start_workers(args: argparse.Namespace, state: dict[str, Any], folder: Path, threads: int) -> None:
    """Every worker process (each shard rank, each sampler), all with ``threads`` torch threads."""
    logs, env = Path(state["logs"]), processes.secret_env(state["broker"])
    for model, served in served_models(args):
        flags = [] if served == model else ["--served-name", served]  # every process of the model gets these
        if args.dtype:  # unset: the workers read TINKERQ_DTYPE (default auto)
            flags += ["--dtype", args.dtype]
        if args.quantized_base:  # unset: TINKERQ_QUANTIZED_BASE (default dequantize)
            flags += ["--quantized-base", args.quantized_base]
        for i in range(args.workers):
            for rank, extra in reversed(list(enumerate(shard_arguments(args.shards, args.device)))):
                suffix = f"-rank{rank}" if args.shards > 1 else ""
                log = logs / f"worker-{Path(model).name}-{i}{suffix}.log"
                proc = processes.start_process(
                    processes.worker_command(model, None, threads=threads, extra=[*flags, *extra]), log, env)
                state["workers"].append({"pid": proc.pid, "model": model, "served": served, "log": str(log),
                                         "rank": rank, "threads": threads})
                _save(folder, state)
        for i in range(args.samplers):
            log = logs / f"sampler-{Path(model).name}-{i}.log"
            extra = [*flags, "--role", "sampler", *(["--device", args.device] if args.device else [])]
            proc = processes.start_process(processes.worker_command(model, None, threads=threads, extra=extra),
                                           log, env)
            state["workers"].append({"pid": proc.pid, "model": model, "served": served, "log": str(log), "rank": 0,
                                     "role": "sampler", "threads": threads})
            _save(folder, state)


def shard_arguments(shards: int, device: str | None) -> list[list[str]]:
    """The worker flags of each rank of one (possibly sharded) worker; shard r of a CUDA worker gets cuda:r."""
    if shards == 1:
        return [["--device", device] if device else []]
    rendezvous = f"tcp://127.0.0.1:{processes.free_port()}"
    out = []
    for rank in range(shards):
        extra = ["--shards", str(shards), "--rank", str(rank), "--rendezvous", rendezvous]
        if device:
            extra += ["--device", f"cuda:{rank}" if device == "cuda" else device]
        out.append(extra)
    return out


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
    for what, entry in _gateway_processes(state):
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
    out += [(what, e["pid"], Path(e["log"])) for what, e in _gateway_processes(state)]
    return out


def _wait_serving(conn: Any, state: dict[str, Any], timeout: float) -> None:
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


def _gateway_processes(state: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(what, its state entry) of the gateways and their proxy; a state written before --gateways had one
    "gateway" entry."""
    gateways = state.get("gateways") or ([state["gateway"]] if "gateway" in state else [])
    out = [("the gateway" if len(gateways) == 1 else f"gateway {i + 1} of {len(gateways)}", g)
           for i, g in enumerate(gateways)]
    return out + ([("the gateways' proxy", state["proxy"])] if "proxy" in state else [])


def fleet_status(args: argparse.Namespace) -> int:
    state = _load(args.fleet)
    print(f"fleet {args.fleet!r}  broker {redact_url(state['broker'])}  logs {state['logs']}")
    if "redis" in state:
        print(f"  redis-server  pid {state['redis']['pid']:>7}  {_up(state['redis']['pid'])}  "
              f"port {state['redis']['port']}")
    for w in state["workers"]:
        sampler = w.get("role") == "sampler"
        shard = f"  (shard {w['rank']} of {state['shards']})" if state.get("shards", 1) > 1 and not sampler else ""
        kind = "sampler " if sampler else "worker  "
        threads = f"  {_plural(w['threads'], 'thread')}" if "threads" in w else ""
        served = w.get("served", w["model"])
        as_ = f" as {served!r}" if served != w["model"] else ""
        print(f"  {kind}      pid {w['pid']:>7}  {_up(w['pid'])}{threads}  {w['model']}{as_}{shard}")
    if "flower" in state:
        print(f"  flower        pid {state['flower']['pid']:>7}  {_up(state['flower']['pid'])}  "
              f"http://127.0.0.1:{state['flower']['port']}/")
    for _, entry in _gateway_processes(state):
        kind = "proxy  " if entry is state.get("proxy") else "gateway"
        behind = (f"  (round robin over {_plural(len(state['gateways']), 'gateway')})"
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
    """One line per adoptable training session (its session record in Redis): model id, the worker holding it,
    the age of its latest automatic snapshot, its journal's length, and the lost worker it was adopted from."""
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
        line = f"{home.model_id[:12]}  on {home.worker}  {snapshot}  journal {journal}"
        if home.adopted_from:
            line += f"  adopted from {home.adopted_from}"
        lines.append(line)
    return lines


def fleet_down(args: argparse.Namespace) -> int:
    state = _load(args.fleet)
    stopped = _stop_all(state, timeout=args.timeout)
    (state_dir(args.fleet) / "state.json").unlink(missing_ok=True)
    print(f"fleet {args.fleet!r} is down ({stopped} process(es) stopped; logs kept in {state['logs']})")
    return 0


def _stop_all(state: dict[str, Any], timeout: float) -> int:
    """The gateways' proxy, the gateways and Flower, then workers (warm shutdown), then Redis: the broker goes last
    so tasks can be acked.

    Rank 0 of a shard group stops before its other ranks: it finishes its task, then tells them to exit.
    """
    stopped = 0
    workers = sorted(state.get("workers", []), key=lambda w: w.get("rank", 0))
    pids = [entry["pid"] for _, entry in reversed(_gateway_processes(state))]  # the proxy first
    if "flower" in state:
        pids.append(state["flower"]["pid"])
    pids += [w["pid"] for w in workers]
    for pid in pids:
        stopped += processes.stop(pid, timeout=timeout)
    if "redis" in state:
        stopped += processes.stop(state["redis"]["pid"], timeout=10)
    return stopped


def _save(folder: Path, state: dict[str, Any]) -> None:
    tmp = folder / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    os.chmod(tmp, 0o600)  # holds the Redis password and Flower's credentials
    tmp.replace(folder / "state.json")


def _up(pid: int) -> str:
    return "running" if processes.alive(pid) else "STOPPED"


def main(args: argparse.Namespace) -> int:
    return {"up": fleet_up, "status": fleet_status, "down": fleet_down}[args.fleet_command](args)
