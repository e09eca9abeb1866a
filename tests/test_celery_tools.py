"""The stock `celery` command against a real worker: remote control in JSON works, tasks in JSON are refused.

Remote control carries no tensors, so workers take it in JSON, the only content the stock CLI sends and reads
(tinkerq.celery_app.JsonControl); a task still has to be tinkerq's msgpack. Whatever a worker refuses is one
line in its log, not Celery's CRITICAL with the body and a traceback.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from celery import Celery

from tests.helpers import make_batch
from tinkerq import keys

pytestmark = pytest.mark.timeout(180)
CELERY = str(Path(sys.executable).with_name("celery"))


def celery(redis_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CELERY, "-b", redis_url, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def worker_id(redis_url, worker, model_dir) -> Iterator[str]:
    from tinkerq.connection import Connection
    from tinkerq.settings import Settings

    conn = Connection.open(Settings(broker_url=redis_url))
    try:
        yield conn.workers_serving(str(model_dir))[0]["worker"]
    finally:
        conn.close()


class LogTail:
    """What the worker writes to its log from now on."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.start = path.stat().st_size

    def text(self) -> str:
        with self.path.open("rb") as f:
            f.seek(self.start)
            return f.read().decode(errors="replace")

    def wait_for(self, needle: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while needle not in self.text() and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.text()


def test_stock_celery_commands_see_the_worker(redis_url, worker, worker_id):
    log = LogTail(worker.log_path)
    for command in (["inspect", "ping"], ["inspect", "active"], ["inspect", "stats"], ["status"]):
        out = celery(redis_url, *command)
        assert out.returncode == 0, (command, out.stdout, out.stderr)
        assert f"tinkerq-{worker_id}@" in out.stdout and "OK" in out.stdout, (command, out.stdout)
    stats = celery(redis_url, "inspect", "stats").stdout
    assert '"tinkerq"' in stats and '"adoptions"' in stats  # the worker's own block, readable by the CLI
    # The commands were taken: nothing refused, no CRITICAL flood in the worker's log.
    text = log.text()
    assert "ContentDisallowed" not in text and "CRITICAL" not in text and "refused" not in text, text[-3000:]


def test_tinkerq_reads_the_json_replies(redis_url, worker, worker_id):
    """`tinkerq fleet status` and Flower inspect through the fleet's app: they read the workers' JSON replies."""
    from tinkerq.connection import Connection
    from tinkerq.settings import Settings

    conn = Connection.open(Settings(broker_url=redis_url))
    try:
        inspect = conn.app.control.inspect(timeout=2.0)
        active, stats = inspect.active() or {}, inspect.stats() or {}
    finally:
        conn.close()
    node = next(n for n in stats if worker_id in n)
    assert isinstance(active.get(node), list)
    assert stats[node]["tinkerq"]["worker"] == worker_id


def test_a_running_request_is_shown_by_its_summary(redis_url, worker, training_client):
    """`inspect active` (the stock CLI, `tinkerq fleet status`) describes a request, never sends its body."""
    from tinkerq.connection import Connection
    from tinkerq.settings import Settings

    conn = Connection.open(Settings(broker_url=redis_url))
    data = make_batch(np.random.default_rng(30), 8)
    running: list[dict] = []
    deadline = time.monotonic() + 60
    try:  # keep the worker busy until an inspection catches a request running (bounded)
        while not running and time.monotonic() < deadline:
            futures = [training_client.forward_backward(data) for _ in range(10)]
            ours = {f.task_id for f in futures}  # not the session's create_model, which may still show as active
            while not running and not all(f.done() for f in futures):
                active = conn.app.control.inspect(timeout=0.5).active() or {}
                running = [t for tasks in active.values() for t in tasks if t.get("id") in ours]
            for f in futures:
                f.result(timeout=60)
    finally:
        conn.close()
    assert running, "no inspection caught a running request within 60 s"
    args = running[0]["args"]
    assert isinstance(args, str) and "seq=" in args and "datums=8" in args and len(args) < 300, args


def test_a_json_task_is_refused_in_one_line(redis_url, worker, worker_id, model_dir):
    log = LogTail(worker.log_path)
    out = celery(redis_url, "call", "tinkerq.echo", "--queue", keys.model_queue(str(model_dir)), "--args", "[1]")
    assert out.returncode == 0, out.stderr
    task_id = out.stdout.strip()
    text = log.wait_for(task_id)
    lines = [line for line in text.splitlines() if task_id in line]
    assert len(lines) == 1, text[-3000:]
    assert "dead-lettered" in lines[0] and "'application/json' is not accepted" in lines[0]
    assert "CRITICAL" not in text and "Traceback" not in text, text[-3000:]
    assert celery(redis_url, "inspect", "ping").returncode == 0  # and the worker still answers


def test_a_pickle_control_command_is_refused_in_one_line(redis_url, worker, worker_id):
    log = LogTail(worker.log_path)
    app = Celery(broker=redis_url, set_as_current=False)
    app.conf.accept_content = ["json"]  # this hostile sender never unpickles anything either (no reply comes)
    app.control.mailbox.serializer = "pickle"  # sends a command the workers must not unpickle
    try:
        assert app.control.broadcast("ping", reply=True, timeout=1.0) == []
    finally:
        app.close()
    text = log.wait_for("refused a message")
    lines = [line for line in text.splitlines() if "refused a message" in line]
    assert len(lines) == 1 and "application/x-python-serialize" in lines[0], text[-3000:]
    assert "CRITICAL" not in text and "Traceback" not in text, text[-3000:]
