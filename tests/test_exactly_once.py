"""Exactly once: one ``create_model`` builds one training session, fleet-wide, however often it is delivered.

``create_model`` has no sequence number: a copy of it that reaches a second worker of the model used to build a
second session there (docs/reliability.md, "Exactly once"). Now the first worker to claim the session
(``keys.session_claim``, SET NX) builds it and answers; a worker that finds another's claim builds nothing and
stays silent. Here the same message (same task id, session id and reply inbox) is pushed to two real workers'
own queues in one transaction, so both take it at the same moment; and the producer's dispatcher is checked to
post a new request once, even when its monitor looks while the submitting thread is still posting it.
"""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pytest
import redis

from tests.conftest import start_named_worker
from tests.helpers import make_batch
from tinkerq import errors, keys, types
from tinkerq.celery_app import TASK_NAMES
from tinkerq.launcher.processes import wait_for
from tinkerq.producer import ServiceClient
from tinkerq.producer.client import TrainingClient
from tinkerq.producer.futures import APIFuture
from tinkerq.wire import codec, messages

pytestmark = pytest.mark.timeout(600)
CREATE = TASK_NAMES["create_model"]


def _create_messages(sc: ServiceClient, r: redis.Redis, base_model: str, model_id: str, task_id: str,
                     inbox: str, copies: int) -> list[bytes]:
    """``copies`` raw Celery messages of one create_model, built as the producer's dispatcher posts it
    (Dispatcher._post: claim check, envelope, send_task with the reply header): the same task id, session id
    and inbox; each post gets its own kombu delivery tag, as two posts of the dispatcher would."""
    scratch = f"tinkerq.test.{uuid.uuid4().hex}"
    body = codec.packb({"base_model": base_model, "deadline": time.time() + 120})
    envelope = messages.make_envelope("create_model", model_id, 0, sc.connection.claim_check().wrap(body))
    for _ in range(copies):
        sc.connection.app.send_task(CREATE, args=(envelope,), queue=scratch, task_id=task_id,
                                    headers={messages.REPLY_HEADER: inbox},
                                    argsrepr=f"model_id={model_id[:8]} seq=0 base_model={base_model}",
                                    kwargsrepr="{}")
    raw = [r.rpop(scratch) for _ in range(copies)]
    assert all(raw) and r.llen(scratch) == 0
    assert {json.loads(m)["headers"]["id"] for m in raw} == {task_id}
    return raw


def _deliver(r: redis.Redis, items: list[tuple[str, bytes]]) -> None:
    """Push each message to its queue in one transaction: every worker blocked on its queue takes it at once."""
    with r.pipeline(transaction=True) as pipe:
        for queue, raw in items:
            pipe.lpush(queue, raw)
        pipe.execute()


def _taken_and_done(r: redis.Redis, queues: list[str], task_id: str) -> bool:
    """Every queue drained and no unacknowledged delivery of ``task_id`` left: each worker that took the
    message has finished with it (a worker answers before Celery acknowledges)."""
    if any(r.llen(q) for q in queues):
        return False
    return not any(json.loads(record)[0]["headers"]["id"] == task_id for record in r.hvals(keys.KOMBU_UNACKED))


def _settled(r: redis.Redis, queues: list[str], task_id: str) -> bool:
    """:func:`_taken_and_done`, still so a moment later (kombu records a delivery just after popping it)."""
    for check in range(3):
        if check:
            time.sleep(0.2)
        if not _taken_and_done(r, queues, task_id):
            return False
    return True


def _answers(r: redis.Redis, inbox: str, task_id: str) -> list:
    items = [messages.read_reply_item(raw) for raw in r.lrange(inbox, 0, -1)]
    assert {t for t, _ in items} <= {task_id}
    return [reply for _, reply in items]


def _model_info(sc: ServiceClient, task_id: str, reply) -> types.ModelInfo:
    future = APIFuture(messages.decode_model_info, claim_check=sc.connection.claim_check(), task_id=task_id,
                       describe="create_model")
    future._arrive(reply)
    return future.result(timeout=30)


def _worker_stats(sc: ServiceClient, ids: list[str]) -> dict[str, dict]:
    """Celery's `inspect stats` of each worker, by tinkerq worker id (its `tinkerq` block names it)."""
    stats = sc.connection.app.control.inspect(timeout=5.0).stats() or {}
    by_id = {s["tinkerq"]["worker"]: s for s in stats.values() if "tinkerq" in s}
    assert set(ids) <= set(by_id), stats
    return {w: by_id[w] for w in ids}


def _sessions(stats: dict) -> list[str]:
    return [s["model_id"] for s in stats["tinkerq"]["sessions"]]


def test_one_create_model_delivered_to_two_workers_at_once_builds_one_session(model_dir, redis_url, tmp_path):
    name = f"once-{uuid.uuid4().hex[:8]}"
    env = {"TINKERQ_CHECKPOINT_DIR": str(tmp_path / "checkpoints")}
    r = redis.Redis.from_url(redis_url)
    procs = []
    sc = ServiceClient(broker_url=redis_url)
    try:
        for i in range(2):
            procs.append(start_named_worker(model_dir, redis_url, name, tmp_path / f"w{i}.log", env=env))
            pid = procs[-1].pid  # start_named_worker returns once *a* worker serves the name: wait for this one
            wait_for(lambda pid=pid: pid in _pids(r, name), 120, f"worker {pid}", procs[-1], tmp_path / f"w{i}.log")
        workers = sorted(_pids(r, name).values())
        assert len(workers) == 2
        queues = [keys.worker_queue(w) for w in workers]

        model_id, task_id = uuid.uuid4().hex, str(uuid.uuid4())
        inbox = keys.reply_list(uuid.uuid4().hex)  # read here, not by a dispatcher: every answer is counted
        raw = _create_messages(sc, r, name, model_id, task_id, inbox, copies=2)
        _deliver(r, list(zip(queues, raw, strict=True)))
        wait_for(lambda: _settled(r, queues, task_id), 120, "both workers to take the create_model")

        # Both workers ran it; one built the session and answered, once. (The other forwarded its copy to the
        # holder, which does not answer it again: its answer is stored.)
        stats = _worker_stats(sc, workers)
        holders = [w for w in workers if model_id in _sessions(stats[w])]
        assert len(holders) == 1, {w: _sessions(stats[w]) for w in workers}
        (holder,) = holders
        (other,) = set(workers) - {holder}
        assert stats[other]["total"].get(CREATE) == 1 and stats[holder]["total"].get(CREATE) in (1, 2), stats
        assert r.get(keys.session_claim(model_id)) == holder.encode()
        assert json.loads(r.get(keys.session_home(model_id)))["worker"] == holder
        (answer,) = _answers(r, inbox, task_id)
        info = _model_info(sc, task_id, answer)
        assert info.model_id == model_id and info.worker == holder

        # The same create_model again, to the worker that built the session: the same answer, nothing built.
        r.delete(inbox)
        (again,) = _create_messages(sc, r, name, model_id, task_id, inbox, copies=1)
        _deliver(r, [(keys.worker_queue(holder), again)])
        wait_for(lambda: _settled(r, queues, task_id) and r.llen(inbox) == 1, 120, "the repeat's answer")
        (repeat,) = _answers(r, inbox, task_id)
        assert _model_info(sc, task_id, repeat) == info
        # ... and to the other worker once more: it builds nothing and leaves the answer to the holder.
        r.delete(inbox)
        (again,) = _create_messages(sc, r, name, model_id, task_id, inbox, copies=1)
        _deliver(r, [(keys.worker_queue(other), again)])
        wait_for(lambda: _settled(r, queues, task_id), 120, "the other worker to take the repeat")
        assert _answers(r, inbox, task_id) == []
        stats = _worker_stats(sc, workers)
        assert [_sessions(stats[w]).count(model_id) for w in (holder, other)] == [1, 0]
        # ... unless the answer was lost (say, in a Redis outage) and the producer's re-post reached the other
        # worker: it forwards the copy to the holder, which answers it, the same.
        r.delete(inbox, keys.reply(task_id))
        (lost,) = _create_messages(sc, r, name, model_id, task_id, inbox, copies=1)
        _deliver(r, [(keys.worker_queue(other), lost)])
        wait_for(lambda: _settled(r, queues, task_id) and r.llen(inbox) == 1, 120, "the forwarded copy's answer")
        (forwarded,) = _answers(r, inbox, task_id)
        assert _model_info(sc, task_id, forwarded) == info
        stats = _worker_stats(sc, workers)
        assert [_sessions(stats[w]).count(model_id) for w in (holder, other)] == [1, 0]

        # The session works: one forward_backward on the holder.
        tc = TrainingClient(sc, info)
        out = tc.forward_backward(make_batch(np.random.default_rng(0), 2, max_len=16), "cross_entropy").result(
            timeout=120)
        assert np.isfinite(out.metrics["loss:sum"])
        tc.close()

        # Closed: a late copy of its create_model opens nothing again (the claim remembers the session).
        r.delete(inbox)
        (late,) = _create_messages(sc, r, name, model_id, task_id, inbox, copies=1)
        _deliver(r, [(keys.worker_queue(holder), late)])
        wait_for(lambda: r.llen(inbox) == 1, 120, "the late copy's answer")
        (error,) = _answers(r, inbox, task_id)
        with pytest.raises(errors.UnknownModelError):
            _model_info(sc, task_id, error)
        wait_for(lambda: _settled(r, queues, task_id), 120, "the late copy to be acknowledged")
        stats = _worker_stats(sc, workers)
        assert all(model_id not in _sessions(stats[w]) for w in workers)

        # Through the library, with a session id of the caller's (a gateway's, for a run whose create another
        # gateway may run again), twice: the same session, built once.
        chosen = uuid.uuid4().hex
        first = sc.open_training_client(name, session_id=chosen, timeout=120)
        second = sc.open_training_client(name, session_id=chosen, timeout=120)
        assert first.info == second.info and first.info.model_id == chosen
        stats = _worker_stats(sc, workers)
        assert sum(_sessions(stats[w]).count(chosen) for w in workers) == 1
        with pytest.raises(errors.ValidationError, match="32 lowercase hex digits"):
            sc.open_training_client(name, session_id="../../etc/passwd")
    finally:
        sc.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


def _pids(r: redis.Redis, name: str) -> dict[int, str]:
    """pid -> worker id of the workers registered for ``name``."""
    records = [json.loads(r.get(k) or b"{}") for k in r.scan_iter(keys.serving_pattern(name))]
    return {rec["pid"]: rec["worker"] for rec in records if "pid" in rec and "worker" in rec}


def test_a_request_is_posted_once_while_the_monitor_looks_during_its_post(redis_url, monkeypatch):
    """The dispatcher's monitor posts requests still marked unposted (Redis was away at submit). It must not
    post one whose submitting thread is posting it right now: a create_model posted twice can reach two
    workers of the model. The post is made slow here (longer than two monitor periods), so the monitor looks
    while it runs; no worker serves the queue, so every copy posted stays in it to be counted."""
    sc = ServiceClient(broker_url=redis_url)
    r = redis.Redis.from_url(redis_url)
    queue = keys.model_queue(f"nobody-{uuid.uuid4().hex[:8]}")
    period = max(0.05, min(0.5, sc.settings.heartbeat_s / 4))  # Dispatcher._monitor's
    send_task = sc.connection.app.send_task

    def slow_send_task(*args, **kwargs):
        result = send_task(*args, **kwargs)
        time.sleep(3 * period)
        return result

    monkeypatch.setattr(sc.connection.app, "send_task", slow_send_task)
    try:
        body = codec.packb({"base_model": "nobody", "deadline": time.time() + 120})
        future = sc._dispatch.submit("create_model", body, model_id=uuid.uuid4().hex, seq_id=0, queue=queue,
                                     decode=messages.decode_model_info, argsrepr="base_model=nobody")
        time.sleep(3 * period)  # a monitor post, if one was started, has finished too
        ids = [json.loads(m)["headers"]["id"] for m in r.lrange(queue, 0, -1)]
        assert ids == [future.task_id]
        sc._dispatch.abandon(future)
    finally:
        r.delete(queue)
        sc.close()
