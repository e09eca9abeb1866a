"""Starting the fleet's processes locally: redis-server, `tinkerq worker`, Flower, the gateways and their proxy.

One place builds these command lines, so `tinkerq fleet up`, the tests, the benchmarks and
docker-compose.yml (checked by tests/test_compose.py) run the same commands.

Secrets never go on a command line, where every local user reads them (`ps`, /proc/<pid>/cmdline): Redis
reads its password from an owner-only config file, workers and Flower get the broker URL and Flower's
login through their environment (``secret_env``), which only their owner can read. Children start with
umask 0o077, so the logs, the AOF and Flower's database they create are owner-only too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tinkerq.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
CHILD_UMASK = 0o077  # files the fleet's processes create: owner-only


def private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) if needed and make it owner-only (0o700)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def secret_env(broker: str | None = None, flower_auth: str | None = None) -> dict[str, str]:
    """Environment variables that carry secrets to a child (its environment is readable only by its owner)."""
    env = {}
    if broker:
        env["TINKERQ_BROKER_URL"] = broker
    if flower_auth:
        env["FLOWER_BASIC_AUTH"] = flower_auth
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen | None = None,
             log: Path | None = None) -> None:
    """Poll ``predicate`` until it holds; raise with the tail of ``log`` if it never does (or ``proc`` exits)."""
    deadline = time.monotonic() + timeout
    exited = False
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            exited = True
            break
        time.sleep(0.1)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise StartupError(f"{what} did not come up within {timeout:g} s\n{tail}", what, timeout, log, exited)


class StartupError(RuntimeError):
    """A process did not come up in time, or exited first; the message ends with the tail of its log."""

    def __init__(self, message: str, what: str, timeout: float, log: Path | None, exited: bool) -> None:
        super().__init__(message)
        self.what, self.timeout, self.log, self.exited = what, timeout, log, exited


def last_line(log: Path | None) -> str:
    """The last non-blank line of ``log`` (a traceback's last line is its error), or '' if there is none."""
    if log is None or not log.exists():
        return ""
    lines = [line.strip() for line in log.read_text(errors="replace")[-4000:].splitlines() if line.strip()]
    return lines[-1] if lines else ""


def port_problem(port: int, host: str = "127.0.0.1") -> str | None:
    """Why a server could not listen on ``host:port`` now ("taken", "Permission denied" ...), or None if it can.

    Binds with SO_REUSEADDR like the servers do, so a port left in TIME_WAIT by a stopped server counts as free.
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OverflowError:
            return "not a port number (1-65535)"
        except OSError as exc:
            return "taken" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return None


def write_redis_auth(workdir: Path, password: str) -> Path:
    """``<workdir>/redis-auth.conf`` holding ``requirepass``, mode 0600: redis-server reads it at start, so
    the password never appears on its command line."""
    if any(c in password for c in "\r\n\0"):
        raise ValueError("the Redis password must not contain line breaks or NUL")
    quoted = password.replace("\\", "\\\\").replace('"', '\\"')  # redis.conf's double-quoted string
    path = private_dir(workdir) / "redis-auth.conf"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # also when the file was left by an earlier run with other bits
    with os.fdopen(fd, "w") as f:
        f.write(f'requirepass "{quoted}"\n')
    return path


def redis_binary() -> str:
    """The redis-server executable on PATH."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise UserError("redis-server is not installed: apt-get install -y redis-server (or give a running Redis "
                        "with --broker redis://...)")
    return binary


def redis_command(port: int, workdir: Path, *, password: str | None = None, durable: bool = False) -> list[str]:
    """redis-server's command line; with ``password``, the owner-only config file that holds it comes first."""
    cmd = [redis_binary()]
    if password:
        cmd.append(str(write_redis_auth(workdir, password)))
    cmd += ["--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "yes", "--dir", str(workdir),
            "--logfile", str(workdir / "redis.log"), "--maxmemory-policy", "noeviction"]
    # Durable (the fleet): AOF, fsync every second. Throwaway (tests): nothing on disk.
    cmd += ["--appendonly", "yes", "--appendfsync", "everysec"] if durable else ["--save", "", "--appendonly", "no"]
    return cmd


def start_redis(port: int, workdir: Path, *, password: str | None = None, durable: bool = False,
                timeout: float = 20.0) -> subprocess.Popen:
    """A redis-server on 127.0.0.1:``port``, answering PING when this returns."""
    from tinkerq.redis_client import local_server_answers

    private_dir(workdir)  # the AOF holds every queued request: owner-only, like the files Redis creates
    proc = subprocess.Popen(redis_command(port, workdir, password=password, durable=durable),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            umask=CHILD_UMASK)
    wait_for(lambda: local_server_answers(port, password), timeout, "redis-server", proc, workdir / "redis.log")
    return proc


def worker_command(model: str, broker: str | None = None, *, threads: int | None = None,
                   extra: list[str] | None = None) -> list[str]:
    """`tinkerq worker`'s command line. Pass ``broker`` only when it holds no password (tests' private Redis);
    otherwise pass None and give the URL through ``secret_env(broker)``."""
    cmd = [sys.executable, "-m", "tinkerq.launcher.main", "worker", "--model", str(model)]
    if broker:
        cmd += ["--broker", broker]
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd + list(extra or [])


def start_process(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A child in its own session (so it can be stopped as a group), output appended to ``log``.

    The log (logs can hold request arguments) and whatever the child creates are owner-only."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "ab") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, umask=CHILD_UMASK)


def gateway_command(broker: str | None, port: int, *, host: str = "127.0.0.1") -> list[str]:
    """`tinkerq gateway`'s command line (``broker`` as for :func:`worker_command`)."""
    cmd = [sys.executable, "-m", "tinkerq.launcher.main", "gateway", "--host", host, "--port", str(port)]
    return cmd + (["--broker", broker] if broker else [])


def gateway_up(url: str) -> bool:
    """True once the gateway at ``url`` (or the proxy in front of gateways) answers its health check."""
    return http_ok(f"{url}/api/v1/healthz")


def flower_up(port: int) -> bool:
    """True once Flower on 127.0.0.1:``port`` answers HTTP (its /healthcheck needs no login)."""
    return http_ok(f"http://127.0.0.1:{port}/healthcheck")


def http_ok(url: str) -> bool:
    """True when GET ``url`` answers 200 within 2 s."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):  # ValueError: http.client's "bad status line"
        return False


GATEWAY_MODULES = ("fastapi", "uvicorn", "tinker")  # what the gateway extra brings (pyproject.toml)


def gateway_not_installed() -> str | None:
    """What to do (one line) when the gateway's extra is missing from this interpreter, or None."""
    import importlib.util

    missing = [m for m in GATEWAY_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"the gateway needs {', '.join(missing)}, which come with tinkerq's gateway extra: run `{sys.executable} "
            f"-m pip install -e '.[gateway]'` in the tinkerq checkout (or pip install 'tinkerq[gateway]')")


def proxy_command(listen_port: int, backend_ports: list[int], *, host: str = "127.0.0.1") -> list[str]:
    """`tinkerq proxy`'s command line: ``host:listen_port`` in front of the gateways on ``backend_ports``."""
    cmd = [sys.executable, "-m", "tinkerq.launcher.main", "proxy", "--listen", f"{host}:{listen_port}"]
    for port in backend_ports:
        cmd += ["--backend", f"127.0.0.1:{port}"]
    return cmd


def flower_command(broker: str | None, port: int, *, db: Path | None = None,
                   basic_auth: str | None = None) -> list[str]:
    """`tinkerq flower`'s command line. Secrets belong in ``secret_env(broker, flower_auth)``: pass ``broker``
    and ``basic_auth`` here only when they are not secret (tests)."""
    cmd = [sys.executable, "-m", "tinkerq.launcher.main", "flower", "--port", str(port)]
    if broker:
        cmd += ["--broker", broker]
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
