"""`tinkerq fleet up | status | down`: the local fleet without Docker.

`up` starts, as local processes with their logs in one folder: a redis-server (unless --broker names one),
N workers per model, Flower, and the HTTP gateway if asked; it records what it started in
``<home>/fleet/<name>/state.json``.
`status` shows what runs and what each worker is doing; `down` stops exactly what `up` started (workers
get SIGTERM first: Celery's warm shutdown finishes the running task).

Each worker process (shard ranks and samplers included) gets an equal share of the CPU cores as torch threads
unless --threads says otherwise. A default port that is taken (another fleet's) is replaced by a free one; a port
the user gave must be free. Every failure of `up` is one line that says what to do, and stops what it started.

Secrets stay off command lines: Redis reads its password from an owner-only file, workers and Flower get
the broker URL and Flower's login from their environment. The fleet's folder (state, logs, the AOF) is
owner-only; `status` never prints a password.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import time
from pathlib import Path
from typing import Any

from tinkerq.connection import redact_url
from tinkerq.errors import BrokerUnavailableError, TinkerqError, UserError
from tinkerq.launcher import processes
from tinkerq.settings import Settings

DEFAULT_REDIS_PORT = 6380
DEFAULT_FLOWER_PORT = 5555


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="fleet_command", required=True)
    up = sub.add_parser("up", help="start redis-server, workers and Flower as local processes")
    up.add_argument("--model", action="append", required=True, help="model directory (repeat for several models)")
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
    up.add_argument("--flower-auth", help="user:password for Flower (default: FLOWER_BASIC_AUTH, else generated "
                                          "and printed once)")
    up.add_argument("--gateway-port", type=int, default=0,
                    help="also start the HTTP gateway for the official tinker SDK on this port (default 0 = none; "
                         "keys: tinkerq keys create NAME)")
    up.add_argument("--threads", type=int,
                    help="torch CPU threads per worker process (default: the CPU cores split between the fleet's "
                         "worker, sampler and shard processes)")
    up.add_argument("--device", help="torch device of the workers (default cpu)")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for every worker to register")
    for name, help_ in (("status", "what runs, and what each worker is doing"), ("down", "stop what `up` started")):
        q = sub.add_parser(name, help=help_)
        q.set_defaults()
    for q in sub.choices.values():
        q.add_argument("--name", default="default", help="fleet name (several fleets can coexist)")
    sub.choices["down"].add_argument("--timeout", type=float, default=60.0,
                                     help="seconds a worker gets to finish its task before it is killed")


def state_dir(name: str) -> Path:
    return Path(Settings.from_env().home) / "fleet" / name


def command(name: str, action: str) -> str:
    """The `tinkerq fleet ACTION` command line for fleet ``name`` (``--name`` only when it is not the default)."""
    return f"tinkerq fleet {action}" + ("" if name == "default" else f" --name {shlex.quote(name)}")


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


def _check_arguments(args: argparse.Namespace) -> None:
    for model in args.model:
        if not Path(model).is_dir():
            raise UserError(f"model path {model!r} is not a directory: pass --model with a local Hugging Face model "
                            f"folder (config.json and weights)")
    for flag, value, least in (("--workers", args.workers, 0), ("--samplers", args.samplers, 0),
                               ("--shards", args.shards, 1), ("--threads", args.threads, 1)):
        if value is not None and value < least:
            raise UserError(f"{flag} must be at least {least}, got {value}")
    if args.broker and args.redis_port is not None:
        raise UserError("--redis-port is the port of the redis-server `fleet up` starts, and with --broker it starts "
                        "none: drop one of them")


def _fleet_holding(port: int) -> str | None:
    """The name of the local fleet whose state lists ``port`` (its Redis, Flower or gateway), if any."""
    for path in state_dir("default").parent.glob("*/state.json"):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if any(isinstance(state.get(k), dict) and state[k].get("port") == port for k in ("redis", "flower", "gateway")):
            return str(state.get("name", path.parent.name))
    return None


def _taken_because(port: int, problem: str) -> str:
    holder = _fleet_holding(port) if problem == "taken" else None
    return f"{problem} by fleet {holder!r} (stop it with `{command(holder, 'down')}`)" if holder else problem


def choose_ports(args: argparse.Namespace) -> tuple[dict[str, int], list[str]]:
    """The ports of the servers `up` starts, by what they are ("redis-server", "Flower", "the gateway"), and notes.

    A port the user gave must be free (else a UserError naming its flag); a default that is taken is replaced by
    a free port, and a note says so.
    """
    wanted: list[tuple[str, str, int | None, int | None]] = []  # (what, flag, given, default)
    if not args.broker:
        wanted.append(("redis-server", "--redis-port", args.redis_port, DEFAULT_REDIS_PORT))
    if args.flower_port != 0:
        wanted.append(("Flower", "--flower-port", args.flower_port, DEFAULT_FLOWER_PORT))
    if args.gateway_port:
        wanted.append(("the gateway", "--gateway-port", args.gateway_port, None))
    chosen: dict[str, int] = {}
    notes = []
    for what, flag, given, default in sorted(wanted, key=lambda w: w[2] is None):  # given ones first
        if given is not None:
            problem = "given twice" if given in chosen.values() else processes.port_problem(given)
            if problem:
                raise UserError(f"port {given} ({flag}) for {what} is {_taken_because(given, problem)}: pass "
                                f"{flag} with a free port (e.g. {flag} {processes.free_port()})")
            chosen[what] = given
            continue
        assert default is not None
        problem = "taken" if default in chosen.values() else processes.port_problem(default)
        port = default
        if problem:
            while port in chosen.values() or processes.port_problem(port):
                port = processes.free_port()
            notes.append(f"port {default} is {_taken_because(default, problem)}: {what} listens on {port} instead "
                         f"({flag} to choose)")
        chosen[what] = port
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
    folder = state_dir(args.name)
    if (folder / "state.json").exists():
        raise UserError(f"fleet {args.name!r} is already up (see `{command(args.name, 'status')}`; stop it with "
                        f"`{command(args.name, 'down')}`, or start another with --name OTHER)")
    _broker_from_env(args)
    _check_arguments(args)
    if not args.broker:
        processes.redis_binary()  # not installed: say so before starting anything
    ports, notes = choose_ports(args)
    torch_processes = len(args.model) * (args.workers * args.shards + args.samplers)
    threads = args.threads or default_threads(torch_processes)
    try:
        logs = processes.private_dir(folder / "logs")  # state.json holds the secrets; logs, request arguments
        processes.private_dir(folder)
    except OSError as exc:
        raise UserError(f"cannot create the fleet's folder {folder}: {exc.strerror}; set TINKERQ_HOME to a folder "
                        f"you can write") from None
    state: dict[str, Any] = {"name": args.name, "logs": str(logs), "started": time.time(), "workers": [],
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
    print(f"fleet {args.name!r} is up: {describe_workers(len(args.model), args.workers, args.samplers, args.shards)}"
          f"; logs in {logs}")
    why = "--threads" if args.threads else (f"{_plural(cpu_cores(), 'core')} shared by "
                                            f"{_plural(torch_processes, 'process')}; --threads N to change")
    if torch_processes:
        print(f"  torch threads per worker process: {threads} ({why})")
    for note in notes:
        print(f"  {note}")
    print(f"  export TINKERQ_BROKER_URL='{state['broker']}'")
    if "flower" in state:
        print(f"  Flower: http://127.0.0.1:{state['flower']['port']}/  (basic auth {state['flower']['auth']})")
    if "gateway" in state:
        print(f"  gateway: TINKER_BASE_URL=http://127.0.0.1:{state['gateway']['port']}  "
              f"(a key for the SDK: tinkerq keys create NAME)")
    print(f"  {command(args.name, 'status')} | {command(args.name, 'down')}")
    return 0


def _startup_failure(exc: processes.StartupError, logs: Path) -> str:
    """One line: what did not come up, the last line of its log (its error, mostly), and what to do."""
    line = processes.last_line(exc.log)
    if exc.exited:
        what, advice = f"{exc.what} exited during start-up", ""
    else:
        what, advice = f"{exc.what} did not come up within {exc.timeout:g} s", "; --timeout to wait longer"
    where = f"its log {exc.log}" if exc.log else f"the logs in {logs}"
    return what + (f": {line}" if line else "") + f" (see {where}{advice})"


def _abandon(state: dict[str, Any], folder: Path) -> None:
    """A failed `up`: stop what it started and forget it, so the next `up` starts clean."""
    _stop_all(state, timeout=10)
    (folder / "state.json").unlink(missing_ok=True)


def _start(args: argparse.Namespace, state: dict[str, Any], folder: Path, ports: dict[str, int],
           threads: int) -> None:
    """Start Redis (unless --broker), the workers, Flower and the gateway, recording each in ``state`` as it starts
    (so a failure part-way stops exactly what started); return once every worker is registered."""
    logs = Path(state["logs"])
    if args.broker:
        broker = args.broker
    else:
        password = secrets.token_urlsafe(16)
        proc = processes.start_redis(ports["redis-server"], folder / "redis", password=password, durable=True,
                                     timeout=args.timeout)
        broker = f"redis://:{password}@127.0.0.1:{ports['redis-server']}/0"
        state["redis"] = {"pid": proc.pid, "port": ports["redis-server"]}
    state["broker"] = broker
    _save(folder, state)
    from tinkerq.connection import Connection

    conn = Connection.open(Settings(broker_url=broker, connect_timeout_s=5))  # --broker unreachable: say so now
    try:
        _start_workers(args, state, folder, threads)
        if ports.get("Flower"):
            auth = args.flower_auth or os.environ.get("FLOWER_BASIC_AUTH") or f"admin:{secrets.token_urlsafe(12)}"
            log = logs / "flower.log"
            cmd = processes.flower_command(None, ports["Flower"], db=folder / "flower.db")
            proc = processes.start_process(cmd, log, processes.secret_env(broker, flower_auth=auth))
            state["flower"] = {"pid": proc.pid, "port": ports["Flower"], "auth": auth, "log": str(log)}
            _save(folder, state)
        if ports.get("the gateway"):
            log = logs / "gateway.log"
            gateway = processes.start_process(processes.gateway_command(None, ports["the gateway"]), log,
                                              processes.secret_env(broker))
            state["gateway"] = {"pid": gateway.pid, "port": ports["the gateway"], "log": str(log)}
            _save(folder, state)
        _wait_registered(conn, state, args.timeout)
        if "gateway" in state:
            url = f"http://127.0.0.1:{state['gateway']['port']}"
            processes.wait_for(lambda: processes.gateway_up(url), args.timeout, "the gateway", gateway,
                               Path(state["gateway"]["log"]))
    finally:
        conn.close()


def _start_workers(args: argparse.Namespace, state: dict[str, Any], folder: Path, threads: int) -> None:
    """Every worker process (each shard rank, each sampler), all with ``threads`` torch threads."""
    logs, env = Path(state["logs"]), processes.secret_env(state["broker"])
    for model in map(os.path.abspath, args.model):
        for i in range(args.workers):
            for rank, extra in reversed(list(enumerate(shard_arguments(args.shards, args.device)))):
                suffix = f"-rank{rank}" if args.shards > 1 else ""
                log = logs / f"worker-{Path(model).name}-{i}{suffix}.log"
                proc = processes.start_process(processes.worker_command(model, None, threads=threads, extra=extra),
                                               log, env)
                state["workers"].append({"pid": proc.pid, "model": model, "log": str(log), "rank": rank,
                                         "threads": threads})
                _save(folder, state)
        for i in range(args.samplers):
            log = logs / f"sampler-{Path(model).name}-{i}.log"
            extra = ["--role", "sampler", *(["--device", args.device] if args.device else [])]
            proc = processes.start_process(processes.worker_command(model, None, threads=threads, extra=extra),
                                           log, env)
            state["workers"].append({"pid": proc.pid, "model": model, "log": str(log), "rank": 0,
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


def _wait_registered(conn: Any, state: dict[str, Any], timeout: float) -> None:
    expected: dict[str, int] = {}
    for w in state["workers"]:
        if w.get("rank", 0) == 0:  # only rank 0 of a shard group registers; it forms the group first
            expected[w["model"]] = expected.get(w["model"], 0) + 1

    def ready() -> bool:
        dead = [w for w in state["workers"] if not processes.alive(w["pid"])]
        if dead:
            log = Path(dead[0]["log"])
            raise UserError(f"the worker for {dead[0]['model']} exited during start-up: "
                            f"{processes.last_line(log) or 'no output'} (see its log {log})")
        return all(len(conn.workers_serving(m)) >= n for m, n in expected.items())

    processes.wait_for(ready, timeout, "the fleet's workers")


def fleet_status(args: argparse.Namespace) -> int:
    state = _load(args.name)
    print(f"fleet {args.name!r}  broker {redact_url(state['broker'])}  logs {state['logs']}")
    if "redis" in state:
        print(f"  redis-server  pid {state['redis']['pid']:>7}  {_up(state['redis']['pid'])}  "
              f"port {state['redis']['port']}")
    for w in state["workers"]:
        sampler = w.get("role") == "sampler"
        shard = f"  (shard {w['rank']} of {state['shards']})" if state.get("shards", 1) > 1 and not sampler else ""
        kind = "sampler " if sampler else "worker  "
        threads = f"  {_plural(w['threads'], 'thread')}" if "threads" in w else ""
        print(f"  {kind}      pid {w['pid']:>7}  {_up(w['pid'])}{threads}  {w['model']}{shard}")
    if "flower" in state:
        print(f"  flower        pid {state['flower']['pid']:>7}  {_up(state['flower']['pid'])}  "
              f"http://127.0.0.1:{state['flower']['port']}/")
    if "gateway" in state:
        print(f"  gateway       pid {state['gateway']['pid']:>7}  {_up(state['gateway']['pid'])}  "
              f"http://127.0.0.1:{state['gateway']['port']}/")
    from tinkerq.connection import Connection

    try:
        conn = Connection.open(Settings(broker_url=state["broker"], connect_timeout_s=2))
    except TinkerqError as exc:
        print(f"  broker unreachable: {exc.message}")
        if "redis" in state and not processes.alive(state["redis"]["pid"]):
            print(f"  its redis-server stopped: `{command(args.name, 'down')}` stops the rest, then `fleet up` again")
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
            print(f"    {r['worker']}  {r['base_model']}{shards}  loss head {r.get('loss_backend', '?')}  -> {doing}")
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
    state = _load(args.name)
    stopped = _stop_all(state, timeout=args.timeout)
    (state_dir(args.name) / "state.json").unlink(missing_ok=True)
    print(f"fleet {args.name!r} is down ({stopped} process(es) stopped; logs kept in {state['logs']})")
    return 0


def _stop_all(state: dict[str, Any], timeout: float) -> int:
    """Flower and the gateway, then workers (warm shutdown), then Redis: the broker goes last so tasks can be
    acked.

    Rank 0 of a shard group stops before its other ranks: it finishes its task, then tells them to exit.
    """
    stopped = 0
    workers = sorted(state.get("workers", []), key=lambda w: w.get("rank", 0))
    pids = [state[k]["pid"] for k in ("flower", "gateway") if k in state] + [w["pid"] for w in workers]
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
