"""`tinkerq fleet up`: start Redis (unless --broker), the workers, Flower, the gateways and their proxy as local
processes, each recorded in the fleet's state as it starts, and return once every one of them serves."""

from __future__ import annotations

import argparse
import os
import secrets
import time
from pathlib import Path
from typing import Any

from tinkerq.errors import BrokerUnavailableError, UserError
from tinkerq.launcher import flower as flower_cli
from tinkerq.launcher import processes
from tinkerq.launcher.fleet.arguments import NO_FLOWER, broker_from_env, check_arguments, check_installed, served_models
from tinkerq.launcher.fleet.ports import choose_ports
from tinkerq.launcher.fleet.readiness import wait_serving
from tinkerq.launcher.fleet.state import command, plural, save_state, state_dir
from tinkerq.launcher.fleet.stop import stop_all
from tinkerq.settings import Settings


def cpu_cores() -> int:
    """The cores this process may run on (its affinity, e.g. a container's cpuset), not the machine's."""
    return len(os.sched_getaffinity(0))


def default_threads(torch_processes: int) -> int:
    """Torch threads per process when --threads is not given: the cores split between the fleet's torch processes.

    Each torch process otherwise takes every core: on 2 cores two workers fought over them and a 0.04 s request
    took up to 4.6 s.
    """
    return max(1, cpu_cores() // max(1, torch_processes))

def describe_workers(models: int, workers: int, samplers: int, shards: int) -> str:
    """'2 workers (4 shard processes) and 1 sampler for 1 model': workers, not processes."""
    text = plural(models * workers, "worker")
    if shards > 1 and workers:
        text += f" ({models * workers * shards} shard processes)"
    if samplers:
        text += f" and {plural(models * samplers, 'sampler')}"
    return f"{text} for {plural(models, 'model')}"

def fleet_up(args: argparse.Namespace) -> int:
    folder = state_dir(args.fleet)
    if (folder / "state.json").exists():
        raise UserError(f"fleet {args.fleet!r} is already up (see `{command(args.fleet, 'status')}`; stop it with "
                        f"`{command(args.fleet, 'down')}`, or start another with --fleet OTHER)")
    broker_from_env(args)
    check_arguments(args)
    check_installed(args)  # not installed: say so before starting anything
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
        start_all(args, state, folder, ports, threads)
    except processes.StartupError as exc:
        abandon(state, folder)
        raise UserError(startup_failure(exc, logs)) from None
    except BrokerUnavailableError as exc:  # --broker unreachable, or refusing its password
        abandon(state, folder)
        raise UserError(exc.message) from None
    except BaseException:
        abandon(state, folder)
        raise
    if args.broker:  # the operator's Redis: what is unsafe about reaching it (a password in our argv, no TLS)
        from tinkerq.security import warn_about_broker

        warn_about_broker(None if args.broker_from_env else args.broker, args.broker)
    print(f"fleet {args.fleet!r} is up: {describe_workers(len(args.model), args.workers, args.samplers, args.shards)}"
          f"; logs in {logs}")
    why = "--threads" if args.threads else (f"{plural(cpu_cores(), 'core')} shared by "
                                            f"{plural(torch_processes, 'process')}; --threads N to change")
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


def startup_failure(exc: processes.StartupError, logs: Path) -> str:
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


def abandon(state: dict[str, Any], folder: Path) -> None:
    """A failed `up`: stop what it started and forget it, so the next `up` starts clean."""
    stop_all(state, timeout=10)
    (folder / "state.json").unlink(missing_ok=True)


def start_all(args: argparse.Namespace, state: dict[str, Any], folder: Path, ports: dict[str, int],
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
    save_state(folder, state)
    from tinkerq.connection import Connection

    conn = Connection.open(Settings(broker_url=broker, connect_timeout_s=5))  # --broker unreachable: say so now
    try:
        start_workers(args, state, folder, threads)
        if ports.get("flower"):
            auth = args.flower_auth or os.environ.get("FLOWER_BASIC_AUTH") or f"admin:{secrets.token_urlsafe(12)}"
            log = logs / "flower.log"
            cmd = processes.flower_command(None, ports["flower"], db=folder / "flower.db")
            proc = processes.start_process(cmd, log, processes.secret_env(broker, flower_auth=auth))
            state["flower"] = {"pid": proc.pid, "port": ports["flower"], "auth": auth, "log": str(log)}
            save_state(folder, state)
        if ports.get("gateway"):
            start_gateways(args.gateways, ports["gateway"], state, folder, set(ports.values()))
        wait_serving(conn, state, args.timeout)
    finally:
        conn.close()


def start_gateways(count: int, port: int, state: dict[str, Any], folder: Path, taken: set[int]) -> None:
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
        save_state(folder, state)
    if private:
        log = logs / "proxy.log"
        proc = processes.start_process(processes.proxy_command(port, private), log)  # no secret: no broker
        state["proxy"] = {"pid": proc.pid, "port": port, "log": str(log)}
        save_state(folder, state)


def start_workers(args: argparse.Namespace, state: dict[str, Any], folder: Path, threads: int) -> None:
    """Every worker process (each shard rank, each sampler), all with ``threads`` torch threads."""
    logs, env = Path(state["logs"]), processes.secret_env(state["broker"])
    for model, served in served_models(args):
        flags = [] if served == model else ["--served-name", served]  # every process of the model gets these
        if args.dtype:  # unset: the workers read TINKERQ_DTYPE (default auto)
            flags += ["--dtype", args.dtype]
        if args.quantized_base:  # unset: TINKERQ_QUANTIZED_BASE (default dequantize)
            flags += ["--quantized-base", args.quantized_base]
        if args.activation_checkpointing:  # unset: TINKERQ_ACTIVATION_CHECKPOINTING (default auto)
            flags += ["--activation-checkpointing", args.activation_checkpointing]
        if args.expert_parallel:  # unset: TINKERQ_EXPERT_PARALLEL (default off)
            flags += ["--expert-parallel"]
        for i in range(args.workers):
            for rank, extra in reversed(list(enumerate(shard_arguments(args.shards, args.device)))):
                suffix = f"-rank{rank}" if args.shards > 1 else ""
                log = logs / f"worker-{Path(model).name}-{i}{suffix}.log"
                proc = processes.start_process(
                    processes.worker_command(model, None, threads=threads, extra=[*flags, *extra]), log, env)
                state["workers"].append({"pid": proc.pid, "model": model, "served": served, "log": str(log),
                                         "rank": rank, "threads": threads})
                save_state(folder, state)
        for i in range(args.samplers):
            log = logs / f"sampler-{Path(model).name}-{i}.log"
            extra = [*flags, "--role", "sampler", *(["--device", args.device] if args.device else [])]
            proc = processes.start_process(processes.worker_command(model, None, threads=threads, extra=extra),
                                           log, env)
            state["workers"].append({"pid": proc.pid, "model": model, "served": served, "log": str(log), "rank": 0,
                                     "role": "sampler", "threads": threads})
            save_state(folder, state)


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
