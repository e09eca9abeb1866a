"""`tinkerq fleet up | status | down`: the local fleet without Docker.

`up` starts, as local processes with their logs in one folder: a redis-server (unless --broker names one),
N workers per model, Flower, and the HTTP gateway if asked; it records what it started in
``<home>/fleet/<name>/state.json``.
`status` shows what runs and what each worker is doing; `down` stops exactly what `up` started (workers
get SIGTERM first: Celery's warm shutdown finishes the running task).

Secrets stay off command lines: Redis reads its password from an owner-only file, workers and Flower get
the broker URL and Flower's login from their environment. The fleet's folder (state, logs, the AOF) is
owner-only; `status` never prints a password.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from launcher import processes
from tinkerq.connection import redact_url
from tinkerq.errors import UserError
from tinkerq.settings import Settings


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
    up.add_argument("--broker", help="use this Redis instead of starting one")
    up.add_argument("--redis-port", type=int, default=6380, help="port of the redis-server it starts (default 6380)")
    up.add_argument("--flower-port", type=int, default=5555, help="Flower's port (default 5555; 0 = no Flower)")
    up.add_argument("--flower-auth", help="user:password for Flower (default: FLOWER_BASIC_AUTH, else generated "
                                          "and printed once)")
    up.add_argument("--gateway-port", type=int, default=0,
                    help="also start the HTTP gateway for the official tinker SDK on this port (default 0 = none; "
                         "keys: tinkerq keys create NAME)")
    up.add_argument("--threads", type=int, help="torch CPU threads per worker")
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


def _load(name: str) -> dict[str, Any]:
    path = state_dir(name) / "state.json"
    if not path.exists():
        raise UserError(f"no fleet named {name!r} is running (start one with `tinkerq fleet up --model DIR`)")
    return json.loads(path.read_text())


def fleet_up(args: argparse.Namespace) -> int:
    folder = state_dir(args.name)
    if (folder / "state.json").exists():
        raise UserError(f"fleet {args.name!r} is already up (see `tinkerq fleet status`; stop it with "
                        f"`tinkerq fleet down`)")
    for model in args.model:
        if not Path(model).is_dir():
            raise UserError(f"model path {model!r} is not a directory")
    logs = processes.private_dir(folder / "logs")  # state.json holds the secrets; logs, request arguments
    processes.private_dir(folder)
    state: dict[str, Any] = {"name": args.name, "logs": str(logs), "started": time.time(), "workers": []}
    try:
        if args.broker:
            broker = args.broker
        else:
            password = secrets.token_urlsafe(16)
            proc = processes.start_redis(args.redis_port, folder / "redis", password=password, durable=True)
            broker = f"redis://:{password}@127.0.0.1:{args.redis_port}/0"
            state["redis"] = {"pid": proc.pid, "port": args.redis_port}
        state["broker"] = broker
        _save(folder, state)
        if args.shards < 1:
            raise UserError(f"--shards must be at least 1, got {args.shards}")
        state["shards"] = args.shards
        for model in args.model:
            for i in range(args.workers):
                for rank, extra in reversed(list(enumerate(shard_arguments(args.shards, args.device)))):
                    suffix = f"-rank{rank}" if args.shards > 1 else ""
                    log = logs / f"worker-{Path(model).name}-{i}{suffix}.log"
                    cmd = processes.worker_command(os.path.abspath(model), None, threads=args.threads,
                                                   extra=extra)
                    proc = processes.start_process(cmd, log, processes.secret_env(broker))
                    state["workers"].append({"pid": proc.pid, "model": os.path.abspath(model), "log": str(log),
                                             "rank": rank})
                    _save(folder, state)
            for i in range(args.samplers):
                log = logs / f"sampler-{Path(model).name}-{i}.log"
                extra = ["--role", "sampler", *(["--device", args.device] if args.device else [])]
                cmd = processes.worker_command(os.path.abspath(model), None, threads=args.threads, extra=extra)
                proc = processes.start_process(cmd, log, processes.secret_env(broker))
                state["workers"].append({"pid": proc.pid, "model": os.path.abspath(model), "log": str(log),
                                         "rank": 0, "role": "sampler"})
                _save(folder, state)
        if args.flower_port:
            auth = args.flower_auth or os.environ.get("FLOWER_BASIC_AUTH") or f"admin:{secrets.token_urlsafe(12)}"
            log = logs / "flower.log"
            cmd = processes.flower_command(None, args.flower_port, db=folder / "flower.db")
            proc = processes.start_process(cmd, log, processes.secret_env(broker, flower_auth=auth))
            state["flower"] = {"pid": proc.pid, "port": args.flower_port, "auth": auth, "log": str(log)}
            _save(folder, state)
        if args.gateway_port:
            log = logs / "gateway.log"
            proc = processes.start_process(processes.gateway_command(None, args.gateway_port), log,
                                           processes.secret_env(broker))
            state["gateway"] = {"pid": proc.pid, "port": args.gateway_port, "log": str(log)}
            _save(folder, state)
        _wait_registered(state, args.timeout)
        if "gateway" in state:
            url = f"http://127.0.0.1:{state['gateway']['port']}"
            processes.wait_for(lambda: processes.gateway_up(url), args.timeout, "the gateway", proc,
                               Path(state["gateway"]["log"]))
    except BaseException:
        _stop_all(state, timeout=10)
        (folder / "state.json").unlink(missing_ok=True)
        raise
    print(f"fleet {args.name!r} is up: {len(state['workers'])} worker(s); logs in {logs}")
    print(f"  export TINKERQ_BROKER_URL='{broker}'")
    if "flower" in state:
        print(f"  Flower: http://127.0.0.1:{state['flower']['port']}/  (basic auth {state['flower']['auth']})")
    if "gateway" in state:
        print(f"  gateway: TINKER_BASE_URL=http://127.0.0.1:{state['gateway']['port']}  "
              f"(a key for the SDK: tinkerq keys create NAME)")
    print("  tinkerq fleet status | tinkerq fleet down")
    return 0


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


def _wait_registered(state: dict[str, Any], timeout: float) -> None:
    from tinkerq.connection import Connection

    conn = Connection.open(Settings(broker_url=state["broker"]))
    try:
        expected: dict[str, int] = {}
        for w in state["workers"]:
            if w.get("rank", 0) == 0:  # only rank 0 of a shard group registers; it forms the group first
                expected[w["model"]] = expected.get(w["model"], 0) + 1

        def ready() -> bool:
            dead = [w for w in state["workers"] if not processes.alive(w["pid"])]
            if dead:
                tail = Path(dead[0]["log"]).read_text()[-2000:] if Path(dead[0]["log"]).exists() else ""
                raise UserError(f"worker for {dead[0]['model']} exited during start-up; its log ends:\n{tail}")
            return all(len(conn.workers_serving(m)) >= n for m, n in expected.items())

        processes.wait_for(ready, timeout, "the fleet's workers")
    finally:
        conn.close()


def fleet_status(args: argparse.Namespace) -> int:
    state = _load(args.name)
    print(f"fleet {args.name!r}  broker {redact_url(state['broker'])}  logs {state['logs']}")
    if "redis" in state:
        print(f"  redis-server  pid {state['redis']['pid']:>7}  {_up(state['redis']['pid'])}  "
              f"port {state['redis']['port']}")
    for w in state["workers"]:
        shard = f"  (shard {w['rank']} of {state['shards']})" if state.get("shards", 1) > 1 else ""
        kind = "sampler " if w.get("role") == "sampler" else "worker  "
        print(f"  {kind}      pid {w['pid']:>7}  {_up(w['pid'])}  {w['model']}{shard}")
    if "flower" in state:
        print(f"  flower        pid {state['flower']['pid']:>7}  {_up(state['flower']['pid'])}  "
              f"http://127.0.0.1:{state['flower']['port']}/")
    if "gateway" in state:
        print(f"  gateway       pid {state['gateway']['pid']:>7}  {_up(state['gateway']['pid'])}  "
              f"http://127.0.0.1:{state['gateway']['port']}/")
    try:
        from tinkerq.connection import Connection

        conn = Connection.open(Settings(broker_url=state["broker"], connect_timeout_s=2))
    except UserError as exc:
        print(f"  broker unreachable: {exc}")
        return 1
    except Exception as exc:
        print(f"  broker unreachable: {exc}")
        return 1
    try:
        registrations = conn.workers_serving()
        active = conn.app.control.inspect(timeout=1.0).active() or {}
        print(f"  {len(registrations)} registered worker(s):")
        for r in sorted(registrations, key=lambda r: r["worker"]):
            node = next((n for n in active if r["worker"] in n), None)
            tasks = active.get(node, []) if node else []
            doing = ", ".join(f"{t['name'].split('.')[-1]}({t.get('args', '')})" for t in tasks) or "idle"
            shards = f"  {r['shards']} shards" if r.get("shards", 1) > 1 else ""
            print(f"    {r['worker']}  {r['base_model']}{shards}  loss head {r.get('loss_backend', '?')}  -> {doing}")
        sessions = session_lines(conn.store)
        print(f"  {len(sessions)} training session(s):")
        for line in sessions:
            print(f"    {line}")
    finally:
        conn.close()
    return 0


def session_lines(store: Any, now: float | None = None) -> list[str]:
    """One line per adoptable training session (its session record in Redis): model id, the worker holding it,
    the age of its latest automatic snapshot, its journal's length, and the lost worker it was adopted from."""
    from tinkerq import keys

    now = time.time() if now is None else now
    lines = []
    for key in sorted(store.scan(keys.SESSION_HOME_PATTERN)):
        try:
            home = json.loads(store.get(key) or b"null")
            model_id, holder = str(home["model_id"]), str(home["worker"])
        except (ValueError, TypeError, KeyError):
            continue
        try:
            record = json.loads(store.get(keys.auto_snapshot(model_id)) or b"null")
            snapshot = f"snapshot {max(0.0, now - float(record['time'])):.0f} s ago"
        except (ValueError, TypeError, KeyError):
            snapshot = "no snapshot yet"
        line = f"{model_id[:12]}  on {holder}  {snapshot}  journal {store.length(keys.journal(model_id))}"
        if home.get("adopted_from"):
            line += f"  adopted from {home['adopted_from']}"
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
