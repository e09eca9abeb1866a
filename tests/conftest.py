"""Fixtures: a private redis-server, a tiny Hugging Face model on disk, and a real worker process."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.helpers import build_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
# Small micro-batches in the test worker, so batch splitting inside the worker is exercised too.
WORKER_MICROBATCH_TOKENS = 96
WORKER_MAX_MESSAGE_BYTES = 2 * 1024 * 1024
WORKER_GAP_TIMEOUT_S = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    detail = log.read_text()[-3000:] if log and log.exists() else ""
    raise RuntimeError(f"{what} did not come up within {timeout} s\n{detail}")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server on a free port for this test session."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run `apt-get install -y redis-server` (.ci/run does)")
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--logfile", str(workdir / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)

    def up() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    _wait(up, 20, "redis-server", proc, workdir / "redis.log")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


def start_worker_process(model_dir: Path, redis_url: str, log: Path, env: dict[str, str] | None = None,
                         extra: list[str] | None = None) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "launcher.main", "worker", "--model", str(model_dir), "--broker", redis_url,
           "--threads", "1", "--max-sessions", "16", *(extra or [])]
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log.open("w"), stderr=subprocess.STDOUT)


@pytest.fixture(scope="session")
def worker(model_dir: Path, redis_url: str, checkpoint_dir: Path, tmp_path_factory) -> Iterator[subprocess.Popen]:
    """A real `tinkerq worker` process serving the tiny model from the private Redis."""
    from tinkerq.connection import Connection
    from tinkerq.settings import Settings

    log = tmp_path_factory.mktemp("logs") / "worker.log"
    proc = start_worker_process(model_dir, redis_url, log, env={
        "TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir),
        "TINKERQ_MICROBATCH_TOKENS": str(WORKER_MICROBATCH_TOKENS),
        "TINKERQ_MAX_MESSAGE_BYTES": str(WORKER_MAX_MESSAGE_BYTES),
        "TINKERQ_HEARTBEAT_S": "1",
        "TINKERQ_GAP_TIMEOUT_S": str(WORKER_GAP_TIMEOUT_S),
    })
    conn = Connection.open(Settings(broker_url=redis_url))
    _wait(lambda: bool(conn.workers_serving(str(model_dir))), 90, "tinkerq worker", proc, log)
    proc.log_path = log  # type: ignore[attr-defined]
    yield proc
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    conn.close()


@pytest.fixture
def service(redis_url: str, worker) -> Iterator:
    from producer import ServiceClient

    sc = ServiceClient(broker_url=redis_url)
    yield sc
    sc.close()


@pytest.fixture
def training_client(service, model_dir: Path) -> Iterator:
    tc = service.create_training_client(str(model_dir))
    yield tc
    tc.close()
