"""Starting the fleet's processes locally: redis-server, `tinkerq worker`, Flower.

One place builds these command lines, so `tinkerq fleet up`, the tests, the benchmarks and
docker-compose.yml (checked by tests/test_compose.py) run the same commands.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen | None = None,
             log: Path | None = None) -> None:
    """Poll ``predicate`` until it holds; raise with the tail of ``log`` if it never does (or ``proc`` exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise RuntimeError(f"{what} did not come up within {timeout:g} s\n{tail}")


def redis_command(port: int, workdir: Path, *, password: str | None = None, durable: bool = False) -> list[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: apt-get install -y redis-server")
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
           "--logfile", str(workdir / "redis.log"), "--maxmemory-policy", "noeviction"]
    # Durable (the fleet): AOF, fsync every second. Throwaway (tests): nothing on disk.
    cmd += ["--appendonly", "yes", "--appendfsync", "everysec"] if durable else ["--save", "", "--appendonly", "no"]
    if password:
        cmd += ["--requirepass", password]
    return cmd


def start_redis(port: int, workdir: Path, *, password: str | None = None, durable: bool = False,
                timeout: float = 20.0) -> subprocess.Popen:
    """A redis-server on 127.0.0.1:``port``, answering PING when this returns."""
    import redis

    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(redis_command(port, workdir, password=password, durable=durable),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    client = redis.Redis(port=port, password=password)

    def up() -> bool:
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.AuthenticationError, redis.ResponseError):
            return False

    try:
        wait_for(up, timeout, "redis-server", proc, workdir / "redis.log")
    finally:
        client.close()
    return proc


def worker_command(model: str, broker: str, *, threads: int | None = None,
                   extra: list[str] | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "launcher.main", "worker", "--model", str(model), "--broker", broker]
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd + list(extra or [])


def start_process(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A child in its own session (so it can be stopped as a group), output appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log.open("ab") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def flower_command(broker: str, port: int, *, db: Path | None = None, basic_auth: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "launcher.main", "flower", "--broker", broker, "--port", str(port)]
    if db is not None:
        cmd += ["--db", str(db)]
    if basic_auth:
        cmd += ["--basic-auth", basic_auth]
    return cmd


def stop(pid: int, timeout: float = 30.0) -> bool:
    """SIGTERM (a worker finishes its current task first), then SIGKILL after ``timeout``. True if it ran."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return True


def alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # reap our own children
        if done == pid:
            return False
    except ChildProcessError:
        pass  # not our child: fall back to a signal probe
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
