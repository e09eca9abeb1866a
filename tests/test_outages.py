"""Redis outages cost time, not sessions; a killed worker fails its futures at once (issue: hardening)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import start_named_worker
from tests.helpers import load_reference, make_batch, max_weight_diff, reference_step
from tinkerq import types
from tinkerq.launcher.processes import free_port, start_redis, stop, wait_for

pytestmark = pytest.mark.timeout(300)


class DurableRedis:
    """A private redis-server with AOF on a fixed port, to be killed, restarted and paused."""

    def __init__(self, workdir: Path) -> None:
        self.port, self.workdir = free_port(), workdir
        self.proc = start_redis(self.port, workdir, durable=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill_and_restart(self, down_s: float) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        time.sleep(down_s)
        self.proc = start_redis(self.port, self.workdir, durable=True)  # replays the AOF

    def pause(self, seconds: float) -> threading.Timer:
        os.kill(self.proc.pid, signal.SIGSTOP)
        timer = threading.Timer(seconds, lambda: os.kill(self.proc.pid, signal.SIGCONT))
        timer.start()
        return timer

    def stop(self) -> None:
        with_cont = self.proc.poll() is None
        if with_cont:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(10)


def test_redis_restart_and_pause_mid_run_cost_time_not_the_session(tmp_path, model_dir):
    from tinkerq.producer import ServiceClient
    from tinkerq.settings import Settings

    redis = DurableRedis(tmp_path / "redis")
    log = tmp_path / "worker.log"
    proc = start_named_worker(model_dir, redis.url, "outage-model", log)
    rng = np.random.default_rng(80)
    batches = [make_batch(rng, 24, min_len=20, max_len=40) for _ in range(30)]  # > 16 KiB: claim-checked
    adam = types.AdamParams(learning_rate=5e-3, weight_decay=0.01)
    try:
        with ServiceClient(settings=Settings(broker_url=redis.url, heartbeat_s=1.0)) as sc:
            tc = sc.create_training_client("outage-model")
            steps: list = []

            def submit(k: int) -> None:
                steps.append((tc.forward_backward(batches[k]), tc.optim_step(adam)))

            for k in range(12):
                submit(k)
            steps[3][1].result(timeout=60)
            # 1. SIGKILL: the last second of the AOF may be lost; requests submitted while Redis is down wait.
            killer = threading.Thread(target=redis.kill_and_restart, args=(3.0,))
            killer.start()
            time.sleep(0.5)
            for k in range(12, 20):
                submit(k)
            killer.join()
            steps[15][1].result(timeout=120)
            # 2. A pause longer than every client's socket timeout (30 s).
            timer = redis.pause(33.0)
            for k in range(20, 30):
                submit(k)
            timer.join()
            norms = [opt.result(timeout=120).metrics["grad_norm:mean"] for _, opt in steps]
            for fb, _ in steps:
                assert np.isfinite(fb.result(timeout=60).metrics["loss:sum"])
            saved = tc.save_weights_for_sampler("after-outages").result(timeout=60).path
            tc.close()
            # Requests running when the connection dropped could not be acknowledged; once answered, they do not
            # wait 12 h in kombu's unacked record to come back as repeats: the worker's cleanup drops them.
            import redis as redis_py

            from tinkerq import keys

            client = redis_py.Redis(port=redis.port)
            print(f"\nkombu's unacked record after the run: {client.hlen(keys.KOMBU_UNACKED)} message(s)")
            wait_for(lambda: client.hlen(keys.KOMBU_UNACKED) == 0, 30, "answered requests to leave kombu's record")
            client.close()
        assert proc.poll() is None
    finally:
        stop(proc.pid, timeout=10)
        redis.stop()

    ref = load_reference(model_dir)
    opt = torch.optim.AdamW(ref.parameters())
    for k, batch in enumerate(batches):
        assert norms[k] == pytest.approx(reference_step(ref, opt, [batch], adam), rel=1e-5), k
    assert max_weight_diff(ref, saved) < 1e-6  # every step applied exactly once, in order


def _heartbeat_silences(errors: list) -> set[float]:
    """The heartbeat ages that the producer's WorkerLostErrors name ("... stopped (no heartbeat for 1.6 s)"):
    each error must be the producer's own, noticed by LOST_AFTER_BEATS (1.5) periods of silence, not the
    reaper's ("stopped before taking this request"), which comes later."""
    import re

    from tinkerq.producer.dispatch import LOST_AFTER_BEATS

    found = [re.search(r"stopped \(no heartbeat for ([0-9.]+) s\)", e.message) for e in errors]
    assert all(found), [e.message for e, m in zip(errors, found, strict=True) if not m][:3]
    silences = {float(m.group(1)) for m in found if m}
    assert min(silences) >= LOST_AFTER_BEATS * 1.0  # the heartbeat rule fired (heartbeat 1 s)
    return silences


def test_kill_9_fails_every_pending_future_within_two_heartbeats(tmp_path, model_dir, redis_url, worker):
    from tinkerq.errors import WorkerLostError
    from tinkerq.producer import ServiceClient
    from tinkerq.settings import Settings

    log = tmp_path / "worker.log"
    # Adoption off (no journal, no session record): no other worker could take the session over, so
    # its requests fail as soon as the worker is seen lost (with adoption they wait TINKERQ_ADOPT_TIMEOUT_S
    # for an adopter first: tests/test_adoption.py).
    proc = start_named_worker(model_dir, redis_url, "kill9-model", log, env={"TINKERQ_JOURNAL_MAX_ENTRIES": "0"})
    try:
        with ServiceClient(settings=Settings(broker_url=redis_url, heartbeat_s=1.0)) as sc:
            tc = sc.create_training_client("kill9-model")
            big = make_batch(np.random.default_rng(81), 200, min_len=100, max_len=150)
            tc.forward(big[:2]).result(timeout=60)
            futures = [tc.forward_backward(big)]
            wait_for(lambda: "forward_backward" in log.read_text(), 30, "the first request to start")
            # A worker takes every message off its queue into its scheduler at once: frozen first, it leaves the
            # next 41 in its queue, where the reaper finds them once it is dead. They are small: they only have to
            # be posted before the producer takes the frozen worker for lost (1.5 heartbeats); 41 of the 200-datum
            # batch took longer than that to encode and post under a loaded CI run (all failed before the kill).
            os.kill(proc.pid, signal.SIGSTOP)
            futures += [tc.forward_backward(big[:2]) for _ in range(41)]
            os.kill(proc.pid, signal.SIGKILL)
            pending = [f for f in futures if not f.done()]
            assert len(pending) >= 40
            errors = [f.exception(timeout=60) for f in pending]  # the timeout is a hang guard only
            assert all(isinstance(e, WorkerLostError) for e in errors), errors[:3]
            silences = _heartbeat_silences(errors)
            print(f"\n{len(pending)} futures failed after kill -9, at {silences} s without a heartbeat (1 s)")
            # All together: one check of the producer's failed them all (the heartbeat age it names is the same in
            # every error), and that check came first: before the reaper, which answers what is left in a dead
            # worker's queue after REAP_AFTER_BEATS (4) periods with another message, had answered any of them.
            assert len(silences) == 1, silences
        # What was left in the dead worker's queue is answered (WorkerLostError) and the queue removed by the
        # reaper, which any live worker runs (here the suite's own worker).
        import redis as redis_py

        from tinkerq import keys
        from tinkerq.wire import codec

        r = redis_py.Redis.from_url(redis_url)
        dead_queue = keys.worker_queue(tc.info.worker)
        wait_for(lambda: r.llen(dead_queue) == 0 and r.zscore(keys.HEARTBEATS, tc.info.worker) is None, 30,
                 "the reaper to clear the dead worker's queue")
        answers = [r.get(keys.reply(f.task_id)) for f in pending]
        reaped = [codec.unpackb(a) for a in answers if a is not None]
        # All but the one it was running and, at most, the next: a BRPOP the worker had waiting when it was frozen
        # still gets it (Redis hands the element to a stopped client's socket).
        assert len(reaped) >= len(pending) - 2
        assert all(a["error"]["type"] == "WorkerLostError" for a in reaped)
    finally:
        stop(proc.pid, timeout=10)


def test_a_frozen_worker_is_lost_too(tmp_path, model_dir, redis_url):
    """SIGSTOP: the process exists but does nothing; its heartbeat stops and its futures fail (then SIGCONT:
    it beats again and serves new sessions)."""
    from tinkerq.errors import WorkerLostError
    from tinkerq.producer import ServiceClient
    from tinkerq.settings import Settings

    log = tmp_path / "worker.log"
    # Adoption off (no journal, no session record): no other worker could take the session over, so
    # its requests fail as soon as the worker is seen lost (with adoption they wait TINKERQ_ADOPT_TIMEOUT_S
    # for an adopter first: tests/test_adoption.py).
    proc = start_named_worker(model_dir, redis_url, "frozen-model", log, env={"TINKERQ_JOURNAL_MAX_ENTRIES": "0"})
    try:
        with ServiceClient(settings=Settings(broker_url=redis_url, heartbeat_s=1.0)) as sc:
            tc = sc.create_training_client("frozen-model")
            tc.forward(make_batch(np.random.default_rng(82), 2)).result(timeout=60)
            os.kill(proc.pid, signal.SIGSTOP)
            futures = [tc.forward(make_batch(np.random.default_rng(83), 2)) for _ in range(5)]
            errors = [f.exception(timeout=60) for f in futures]  # the timeout is a hang guard only
            assert all(isinstance(e, WorkerLostError) for e in errors), errors
            # Failed by the producer's heartbeat check while the worker is still frozen (it is resumed below),
            # before the reaper's answer (4 periods) could come.
            _heartbeat_silences(errors)
            os.kill(proc.pid, signal.SIGCONT)
            wait_for(lambda: bool(sc.connection.workers_serving("frozen-model")), 10, "the worker to beat again")
            fresh = sc.create_training_client("frozen-model")
            assert np.isfinite(fresh.forward(make_batch(np.random.default_rng(84), 2)).result(timeout=60)
                               .metrics["loss:sum"])
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        stop(proc.pid, timeout=10)


def test_answered_requests_leave_kombus_unacked_record(redis_url):
    """A request answered but never acknowledged (the connection dropped) is dropped from kombu's record;
    one not answered yet stays, for kombu to deliver again after the visibility timeout."""
    import json

    import redis as redis_py

    from tinkerq import keys
    from tinkerq.store import RedisStore
    from tinkerq.worker.recovery.registry import drop_answered_unacked

    client = redis_py.Redis.from_url(redis_url)
    store = RedisStore(client, retry_s=5)
    records = {}
    for name in ("answered", "running"):
        message = {"headers": {"id": f"task-{name}-1234"}, "properties": {"delivery_tag": f"tag-{name}"}}
        records[name] = f"tag-{name}"
        client.hset(keys.KOMBU_UNACKED, f"tag-{name}", json.dumps([message, "", "tinkerq.worker.x"]))
        client.zadd(keys.KOMBU_UNACKED_INDEX, {f"tag-{name}": time.time()})
    store.set(keys.reply("task-answered-1234"), b"\x80", ttl_s=60)
    assert drop_answered_unacked(store) == 1
    assert not client.hexists(keys.KOMBU_UNACKED, "tag-answered")
    assert client.zscore(keys.KOMBU_UNACKED_INDEX, "tag-answered") is None
    assert client.hexists(keys.KOMBU_UNACKED, "tag-running")
    client.hdel(keys.KOMBU_UNACKED, "tag-running")
    client.zrem(keys.KOMBU_UNACKED_INDEX, "tag-running")
