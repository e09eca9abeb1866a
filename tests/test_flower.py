"""A real Flower against the real Redis and worker: the worker and its tasks, with readable arguments and results."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from tests.conftest import start_named_worker
from tests.helpers import make_batch
from tinkerq import types
from tinkerq.launcher.processes import ROOT, flower_command, free_port, start_process, stop, wait_for

pytestmark = pytest.mark.timeout(180)
AUTH = ("operator", "s3cret-for-tests")
MAX_TASKS = 20  # Flower's bound on the tasks it keeps (`tinkerq flower --max-tasks`), small to test it


@pytest.fixture(scope="module")
def flower(redis_url, worker, tmp_path_factory):
    folder = tmp_path_factory.mktemp("flower")
    port = free_port()
    log = folder / "flower.log"
    cmd = flower_command(redis_url, port, db=folder / "flower.db", basic_auth=":".join(AUTH))
    proc = start_process([*cmd, "--max-tasks", str(MAX_TASKS)], log)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return requests.get(f"{url}/healthcheck", timeout=1).ok
        except requests.RequestException:
            return False

    wait_for(healthy, 60, "flower", proc, log)
    yield url
    stop(proc.pid, timeout=10)


def _poll(fn, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_flower_shows_the_worker_and_readable_tasks(flower, training_client):
    assert requests.get(f"{flower}/api/workers", timeout=5).status_code == 401  # auth is on

    workers = _poll(lambda: requests.get(f"{flower}/api/workers", auth=AUTH, timeout=10).json())
    assert any(training_client.info.worker in name for name in workers), workers

    def our_tasks():
        tasks = requests.get(f"{flower}/api/tasks", auth=AUTH, timeout=10).json()
        return [t for t in tasks.values() if t.get("name") == "tinkerq.forward_backward"
                and training_client.model_id[:8] in str(t.get("args")) and t.get("state") == "SUCCESS"]

    # Flower's HTTP server answers before its event receiver has subscribed; events sent before that are
    # never delivered to it. So keep submitting until one of our tasks shows up (bounded).
    tasks, deadline = [], time.monotonic() + 60
    while not tasks and time.monotonic() < deadline:
        out = training_client.forward_backward(make_batch(np.random.default_rng(20), 3)).result(timeout=60)
        assert np.isfinite(out.metrics["loss:sum"])
        tasks = _poll(our_tasks, timeout=5)
    assert tasks, "no forward_backward task showed up in Flower within 60 s"
    args = str(tasks[0]["args"])
    assert "seq=" in args and "datums=3" in args and "loss_fn=cross_entropy" in args
    assert "array" not in args and "blob" not in args and len(args) < 300  # never tensor dumps
    # The result: the reply's metrics and shapes (worker/transport/tasks.py), never its bytes.
    result = str(tasks[0]["result"])
    assert result.startswith("'ok loss:sum=") and "datums=3" in result and "logprobs (3, " in result, result
    assert "\\x" not in result and len(result) < 300, result

    # Prometheus, behind the same login as the dashboard (Flower itself leaves it open).
    assert requests.get(f"{flower}/metrics", timeout=10).status_code == 401
    metrics = requests.get(f"{flower}/metrics", auth=AUTH, timeout=10).text
    assert "flower_events_total" in metrics and "tinkerq.forward_backward" in metrics


def test_flower_lists_a_worker_started_after_it_without_a_refresh(flower, model_dir, redis_url, tmp_path):
    # Flower itself inspects workers only at its start and on ?refresh=1 (launcher/flower_app.py).
    proc = start_named_worker(model_dir, redis_url, "late-for-flower", tmp_path / "late.log")
    try:
        workers = _poll(lambda: [n for n in requests.get(f"{flower}/api/workers", auth=AUTH, timeout=10).json()
                                 if f"-{proc.pid}-" in n], timeout=60)
        assert workers, "the worker started after Flower is not in /api/workers"
    finally:
        stop(proc.pid, timeout=30)


def test_flower_keeps_at_most_max_tasks(flower, training_client):
    data = make_batch(np.random.default_rng(23), 1)
    # One after another: each task's events (received, started, succeeded) come before the next task's, so the
    # tasks Flower drops at its bound are finished ones. Pipelined, a late task-succeeded event of a dropped task
    # re-created it without a name, and the newest 20 were not all this test's.
    for _ in range(MAX_TASKS + 5):
        training_client.forward(data).result(timeout=60)

    def tasks() -> dict:
        return requests.get(f"{flower}/api/tasks", auth=AUTH, timeout=10).json()

    def ours() -> int:  # this test's forward calls that Flower shows as done
        return sum(t.get("name") == "tinkerq.forward" and t.get("state") == "SUCCESS"
                   and training_client.model_id[:8] in str(t.get("args")) for t in tasks().values())

    assert _poll(lambda: ours() >= MAX_TASKS, timeout=60), [
        (t.get("name"), t.get("state"), str(t.get("args"))[:40]) for t in tasks().values()]
    assert len(tasks()) == MAX_TASKS  # the oldest went, this test's and the earlier tests'


def test_flower_on_a_taken_port_says_so_in_one_line(flower, redis_url, tmp_path):
    taken = int(flower.rsplit(":", 1)[1])
    cmd = flower_command(redis_url, taken, db=tmp_path / "flower.db", basic_auth=":".join(AUTH))
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert f"port {taken}" in lines[0] and "taken" in lines[0] and "--port" in lines[0], lines


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_dashboard_in_headless_chromium(flower, training_client, tmp_path):
    training_client.forward(make_batch(np.random.default_rng(21), 1)).result(timeout=60)
    # The page lists the workers Flower knows from events; wait until it knows ours.
    assert _poll(lambda: any(training_client.info.worker in name for name in
                             requests.get(f"{flower}/api/workers", auth=AUTH, timeout=10).json()), timeout=60)
    url = f"http://{AUTH[0]}:{AUTH[1]}@127.0.0.1:{flower.rsplit(':', 1)[1]}/workers"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,720"]
    dom = subprocess.run([CHROMIUM, *flags, "--virtual-time-budget=8000", "--dump-dom", url],
                         capture_output=True, text=True, timeout=90).stdout
    assert training_client.info.worker in dom, dom[-2000:]
    shot = tmp_path / "flower.png"
    subprocess.run([CHROMIUM, *flags, "--virtual-time-budget=8000", f"--screenshot={shot}", url],
                   capture_output=True, timeout=90)
    assert shot.read_bytes()[:4] == b"\x89PNG"
    keep = Path(__file__).resolve().parent.parent / "docs" / "img" / "flower-workers.png"
    if not keep.exists():  # the README's screenshot; refreshed by deleting it and running this test
        shutil.copy(shot, keep)


def test_worker_prometheus_metrics(worker, training_client):
    data = make_batch(np.random.default_rng(22), 2)
    training_client.forward_backward(data).result(timeout=60)
    text = requests.get(worker.metrics_url, timeout=10).text
    tokens = sum(d.model_input.length for d in data)
    assert 'tinkerq_requests_total{op="forward_backward",outcome="ok"}' in text
    assert 'tinkerq_tokens_per_second{op="forward_backward"}' in text
    assert "tinkerq_queue_wait_seconds_bucket" in text and "tinkerq_compute_seconds_count" in text
    counted = float(text.split('tinkerq_tokens_total{op="forward_backward"} ')[1].split()[0])
    assert counted >= tokens
    sampler = training_client.save_weights_and_get_sampling_client()
    sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2, types.SamplingParams(max_tokens=3)).result(timeout=60)
    text = requests.get(worker.metrics_url, timeout=10).text
    assert 'tinkerq_requests_total{op="sample",outcome="ok"}' in text and "tinkerq_sampling_rows 0.0" in text
    train_s = float(text.split('tinkerq_compute_turn_seconds{kind="train"} ')[1].split()[0])
    sample_s = float(text.split('tinkerq_compute_turn_seconds{kind="sample"} ')[1].split()[0])
    assert train_s > 0 and sample_s > 0


def test_lora_passes_and_samples_reach_their_real_end_in_flower(flower, service, model_dir):
    """A LoRA forward_backward and optim_step, and a sample request, end SUCCESS with a runtime in Flower; the
    result names the pass or decode batch the request shared (worker/transport/events.py). They used to stay STARTED
    (LoRA) or not appear at all (sampling)."""
    tc = service.create_lora_training_client(str(model_dir), rank=4, seed=3)
    try:
        sampler = None
        wanted = {"tinkerq.forward_backward", "tinkerq.optim_step", "tinkerq.sample"}

        def ours():
            tasks = requests.get(f"{flower}/api/tasks", auth=AUTH, timeout=10).json()
            return {t["name"]: t for t in tasks.values() if t.get("name") in wanted
                    and t.get("uuid") in sent and t.get("state") == "SUCCESS"}

        sent: set[str] = set()
        found: dict = {}
        deadline = time.monotonic() + 90
        while set(found) != wanted and time.monotonic() < deadline:
            fb = tc.forward_backward(make_batch(np.random.default_rng(30), 2))
            step = tc.optim_step(types.AdamParams(learning_rate=1e-3))
            sampler = sampler or tc.save_weights_and_get_sampling_client()
            sample = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2))
            for future in (fb, step, sample):
                future.result(timeout=60)
                sent.add(future.task_id)
            found = _poll(lambda: (lambda f: f if set(f) == wanted else None)(ours()), timeout=5) or {}
        assert set(found) == wanted, found
        for task in found.values():
            assert task.get("runtime") is not None and task["runtime"] >= 0, task
        assert "[pass " in str(found["tinkerq.forward_backward"]["result"]), found["tinkerq.forward_backward"]
        # its batch's rows (its own one at least): it said 0 for the request that finished a batch last
        assert re.search(r"\[decode batch of up to [1-9]\d* row\(s\)\]", str(found["tinkerq.sample"]["result"])), \
            found["tinkerq.sample"]
        assert str(found["tinkerq.optim_step"]["result"]).startswith("'ok"), found["tinkerq.optim_step"]
    finally:
        tc.close()


def test_task_events_a_failed_publish_leaves_behind_go_out_without_another_request():
    """A publish of the outbox's task events that fails (Redis gone for a moment) keeps them buffered; the events
    thread retries every second, so they reach Flower without waiting for the worker's next answer (before, they
    waited, and a run's last requests never showed their end)."""
    from tinkerq.worker.transport.events import TaskEvents

    class Dispatcher:  # Celery's EventDispatcher with buffer_while_offline=False, its publishes failing twice
        def __init__(self, failures: int) -> None:
            self.failures, self.buffered, self.published = failures, [], []

        def send(self, kind: str, **fields: object) -> None:
            self.buffered.append((kind, fields))

        def flush(self, errors: bool = True, groups: bool = True) -> None:
            if self.failures:
                self.failures -= 1
                raise ConnectionError("Error 111 connecting to redis")
            self.published += self.buffered
            self.buffered = []

        def close(self) -> None:
            pass

    class Consumers:  # the Celery consumer's own dispatcher, whose task events TaskEvents defers
        buffer_group: frozenset = frozenset()

        def flush(self, errors: bool = True, groups: bool = True) -> None:
            pass

    events, ours = TaskEvents(), Dispatcher(failures=2)
    events._dispatcher = ours
    events.defer(Consumers())
    try:
        events._send("task-succeeded", uuid="t1", result="'ok'", runtime=0.1)
        assert ours.published == [] and len(ours.buffered) == 1  # the first publish failed
        deadline = time.monotonic() + 10
        while not ours.published and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [fields["uuid"] for _, fields in ours.published] == ["t1"] and ours.buffered == []
    finally:
        events.stop()


def test_celerys_own_task_events_a_failed_publish_leaves_behind_go_out_later():
    """Celery's consumer dispatcher (buffer_while_offline) keeps the events of a publish that failed in its outbound
    buffer, which only a flush with errors=True sends; Celery's own hook did that on every buffered event, and the
    events thread that replaces it (TaskEvents.defer) must too, and retry without another event coming."""
    from celery import Celery

    from tinkerq.worker.transport.events import TaskEvents

    app = Celery(broker="memory://", set_as_current=False)
    celerys = app.events.Dispatcher(app.connection_for_write(), hostname="w@test", enabled=True,
                                    buffer_group=["task"], buffer_while_offline=True)
    published: list[object] = []
    failures = [1]

    def publish(body: object, **_: object) -> None:  # the first publish fails (Redis gone for a moment)
        if failures[0]:
            failures[0] -= 1
            raise ConnectionError("Error 111 connecting to redis")
        published.append(body)

    celerys.producer.publish = publish
    events = TaskEvents()
    events.defer(celerys)
    try:
        celerys.send("task-received", uuid="t1", name="tinkerq.forward_backward")
        deadline = time.monotonic() + 10
        while not published and time.monotonic() < deadline:
            time.sleep(0.05)
        sent = [e for body in published for e in (body if isinstance(body, list) else [body])]
        assert [e["uuid"] for e in sent] == ["t1"], (published, failures)
    finally:
        events.stop()
        celerys.close()
        app.close()


def test_a_queued_request_has_one_task_succeeded_event_at_its_real_end(service, model_dir, redis_url, worker):
    """A task that hands its request to the scheduler returns QUEUED (worker/transport/tasks.py): Celery acknowledges
    the message, but its own task-succeeded at the hand-off (result "queued ...") must not go out. Each request's
    one task-succeeded is the outbox's, sent when it has run, naming its reply."""
    from kombu import Connection

    from tinkerq.celery_app import make_celery
    from tinkerq.settings import Settings
    from tinkerq.worker.transport.tasks import QUEUED

    app = make_celery(Settings(broker_url=redis_url))
    events: list[dict] = []
    conn = Connection(redis_url)
    listening = threading.Event()  # set by the first other event received (the workers' heartbeats, every 2 s)
    others: list[dict] = []  # every other event, for the diagnosis of a failure

    def other(event: dict) -> None:
        others.append(event)
        listening.set()

    receiver = app.events.Receiver(conn, handlers={"task-succeeded": events.append, "*": other})
    listener = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=None, wakeup=False), daemon=True)
    listener.start()
    # The receiver's queue must be bound before anything is sent: a fixed sleep was too short once in CI (the first
    # two requests' events went out before it was).
    assert listening.wait(30), "no event reached the receiver in 30 s"
    tc = service.create_training_client(str(model_dir))
    try:
        futures = [tc.forward_backward(make_batch(np.random.default_rng(31), 2)),
                   tc.optim_step(types.AdamParams(learning_rate=1e-3)), tc.echo({"x": 1})]
        ids = set()
        for future in futures:
            future.result(timeout=60)
            ids.add(future.task_id)
        deadline = time.monotonic() + 20
        # ids <= seen, not seen < ids: the events of other tasks (the create_model before) arrive here too, and
        # once one had, "seen < ids" was false at once and the wait ended before the last requests' events came
        # (the flake of 4 of 10 CI runs)
        while not ids <= {e["uuid"] for e in events} and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        receiver.should_stop = True
        tc.close()
    listener.join(5)
    conn.release()
    ours = [e for e in events if e["uuid"] in ids]
    # say what did arrive, should this fail
    ordered = [f.task_id for f in futures]
    seen = [(e["type"], e.get("uuid"), e.get("clock"), str(e.get("result", ""))[:60]) for e in events + others
            if e.get("uuid") in ids or e["type"] == "task-succeeded"]
    log = worker.log_path.read_text()
    assert sorted(e["uuid"] for e in ours) == sorted(ids), (ordered, seen, [
        line for line in log.splitlines() if "task events" in line or any(i in line for i in ids)][-20:])
    assert not any(QUEUED in str(e.get("result")) for e in ours), ours
    assert all(str(e.get("result")).startswith("'ok") for e in ours), ours
