"""The compute loop never waits on the network: bodies are fetched ahead by the transport, writes after compute
leave on the outbox (worker/core/outbox.py), in order, batched, and a store outage does not stop the compute."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tinkerq.worker.core.outbox import MAX_BATCH, Outbox, Parcel
from tinkerq.worker.core.scheduler import Caller, Request

ROOT = Path(__file__).resolve().parent.parent


def _parcel(n: int) -> Parcel:
    return Parcel(Request("forward", {}, [Caller(f"t{n}", None)], model_id="m", seq_id=n), ("ok", b"", {}))


@pytest.mark.timeout(30)
def test_outbox_delivers_in_order_and_batches_what_queued_behind_a_slow_write():
    delivered: list[list[int] | str] = []
    first_started, release = threading.Event(), threading.Event()

    def deliver(batch: list[Parcel]) -> None:
        first_started.set()
        release.wait(10)  # a slow write (a far Redis): everything put meanwhile waits behind it
        delivered.append([p.request.seq_id for p in batch])

    outbox = Outbox(deliver)
    outbox.start()
    first = _parcel(1)
    outbox.put(first)
    assert first_started.wait(5)
    for n in range(2, 5):
        outbox.put(_parcel(n))
    outbox.put(lambda: delivered.append("call"))  # a write that must follow those before it
    outbox.put(_parcel(5))
    assert outbox.pending() == 6  # the one being delivered and the five queued
    assert not outbox.flush(0.2)  # still held
    release.set()
    assert outbox.flush(5)
    assert delivered == [[1], [2, 3, 4], "call", [5]]
    assert first.sent.is_set()
    outbox.stop()


@pytest.mark.timeout(30)
def test_outbox_batches_are_bounded_and_a_failed_delivery_does_not_stop_it():
    batches: list[int] = []
    gate = threading.Event()

    def deliver(batch: list[Parcel]) -> None:
        gate.wait(10)
        batches.append(len(batch))
        if len(batches) == 1:
            raise RuntimeError("a bug in delivery")

    outbox = Outbox(deliver)
    outbox.start()
    parcels = [_parcel(n) for n in range(2 * MAX_BATCH + 2)]
    for p in parcels:
        outbox.put(p)
    gate.set()
    assert outbox.flush(10)
    assert sum(batches) == len(parcels) and max(batches) <= MAX_BATCH
    assert all(p.sent.is_set() for p in parcels)  # the failed batch's too: nobody waits on it forever
    outbox.stop()


def test_a_stopped_outbox_delivers_on_the_callers_thread():
    seen: list[str] = []
    outbox = Outbox(lambda batch: seen.append(threading.current_thread().name))
    outbox.put(_parcel(1))  # never started: delivered here and now
    outbox.start()
    outbox.stop()
    outbox.put(_parcel(2))
    assert seen == [threading.current_thread().name] * 2


@pytest.mark.timeout(300)
def test_the_compute_loop_makes_no_store_calls_and_computes_through_a_write_outage(model_dir, tmp_path):
    """A real embedded worker (the worker's own assembly) with claim-checked bodies and an automatic snapshot after
    every optimizer step: every store call is recorded with its thread. Opening and training LoRA and full sessions
    makes none on the compute loop; the transport fetched the bodies and claimed the sessions, the outbox wrote
    journal entries, answers and snapshot records. While the store's writes hang, requests already taken still run
    (their sessions' orders move on, past a due snapshot) and none is answered; once writes come back, all are, and
    each session's snapshot record names its last request, with the snapshot in place. A shard group's idle ping
    runs on the loop, and only when it is idle. A session released idle (its snapshot put in place and its record
    written by the outbox) and restored on its client's next request (the adoption code: its journal read and its
    record written by the transport's thread) makes no store call on the loop either, and answers as before."""
    proc = subprocess.run([sys.executable, "-m", "tests.outbox_driver", str(model_dir), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    calls = result["calls"]
    assert "tinkerq-compute" not in calls, calls
    assert calls["tinkerq-outbox"]["write_many"] >= 1  # journal entries and answers, batched
    assert any(made.get("set_if_absent") for made in calls.values())  # the creation claims, elsewhere
    fetchers = [name for name, made in calls.items() if made.get("get") and name not in ("MainThread",
                                                                                          "tinkerq-outbox")]
    assert fetchers, calls  # claim-checked bodies were fetched by the transport's thread
    assert all(loss > 0 for loss in result["losses"])
    assert all(n >= 2 for n in result["moved_during_outage"].values()), result
    assert result["answered_during_outage"] == 0
    assert all(loss > 0 for loss in result["after"][::2])
    assert result["snapshots"] and all(seq == position and in_place
                                       for position, seq, in_place in result["snapshots"].values()), result
    assert result["idle_ping"] == [True, ["tinkerq-compute"]]  # run_when_idle: on the loop, when it is idle
    assert result["busy_ping"] is False  # not while it runs something (and not run later either)
    restore = result["restore"]
    assert restore["parked"] and restore["back"], restore
    assert restore["losses"][0] == pytest.approx(restore["losses"][1], rel=1e-6), restore
    assert "tinkerq-compute" not in restore["calls"], restore["calls"]
    assert sum(made.get("list_range", 0) for made in restore["calls"].values()) >= 1  # the journal, read elsewhere
    assert sum(made.get("set", 0) for made in restore["calls"].values()) >= 1  # its record, live again


class _Message:
    def __init__(self, n: int) -> None:
        self._raw = {"body": f"m{n}", "headers": {"id": f"t{n}"}}
        self.delivery_info = {"exchange": "", "routing_key": "tinkerq.w.x"}


@pytest.mark.timeout(60)
def test_kombus_unacked_records_are_written_off_the_consumers_thread(redis_url):
    """kombu's ack emulation (worker/intake.DeferredQoS): the consumer's bookkeeping is immediate, the Redis
    records follow on a writer thread; a record acknowledged before it was written is never written; what
    reads the records (a requeue, the restore at shutdown) sees them all."""
    import redis
    from kombu import Connection

    from tinkerq import keys
    from tinkerq.worker.transport.intake import DeferredQoS, GuardedTransport

    r = redis.Redis.from_url(redis_url)
    r.delete(keys.KOMBU_UNACKED, keys.KOMBU_UNACKED_INDEX)
    with Connection(redis_url, transport=GuardedTransport) as conn:
        channel = conn.channel()
        qos = channel.qos
        assert isinstance(qos, DeferredQoS)
        with qos._cond:  # hold the writer: these wait together
            for n in range(3):
                qos.append(_Message(n), f"tag-{n}")
            qos.ack("tag-1")  # acknowledged before its record was written: never written
            assert len(qos._delivered) - len(qos._dirty) == 2  # the prefetch window already counts it
        assert qos.flush(10)
        assert set(r.hkeys(keys.KOMBU_UNACKED)) == {b"tag-0", b"tag-2"}
        assert set(r.zrange(keys.KOMBU_UNACKED_INDEX, 0, -1)) == {b"tag-0", b"tag-2"}
        assert json.loads(r.hget(keys.KOMBU_UNACKED, "tag-0"))[0] == {"body": "m0", "headers": {"id": "t0"}}
        qos.ack("tag-0")
        assert qos.flush(10)
        assert r.hkeys(keys.KOMBU_UNACKED) == [b"tag-2"]
        qos.append(_Message(3), "tag-3")
        qos.reject("tag-3", requeue=True)  # read back from Redis: written first, then put back on its queue
        assert r.llen("tinkerq.w.x") == 1 and r.hkeys(keys.KOMBU_UNACKED) == [b"tag-2"]
        qos.ack("tag-2")
        assert qos.flush(10) and not r.hkeys(keys.KOMBU_UNACKED)
        channel.close()
    r.delete("tinkerq.w.x")


def _drain_once(conn, got: list, timeout: float = 5.0) -> int:
    """One read of the consumer's connection (one BRPOP / BLMPOP answer): how many messages it delivered."""
    before = len(got)
    conn.drain_events(timeout=timeout)
    return len(got) - before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch", [4, 1])
def test_the_intake_takes_its_own_queue_in_batches_and_the_shared_queue_one_at_a_time(redis_url, batch):
    """worker/transport/intake.GuardedChannel: one pop takes up to TINKERQ_INTAKE_BATCH messages of the worker's own
    queue (one round trip, delivered in order); of the model's queue, shared with other workers, it delivers one
    and puts what else it took back, oldest next. Batch 1 is kombu's one message per pop. Every message arrives
    once, in its queue's order; Celery's prefetch of 1 holds the next pop until what was delivered is acked."""
    import redis
    from kombu import Connection, Consumer, Exchange, Producer, Queue

    from tinkerq.worker.transport.intake import GuardedTransport, IntakeBatch

    own, shared = "tinkerq.worker.batch-test", "tinkerq.model.batch-test"
    r = redis.Redis.from_url(redis_url)
    r.delete(own, shared)
    options = {"tinkerq_intake_batch": IntakeBatch(frozenset({own}), batch)}
    got: list[tuple[str, str]] = []
    with Connection(redis_url, transport=GuardedTransport, transport_options=options) as conn:
        channel = conn.channel()
        queues = [Queue(name, Exchange(name, type="direct"), routing_key=name) for name in (own, shared)]
        producer = Producer(channel)
        for n in range(6):
            producer.publish({"n": n}, exchange=queues[0].exchange, routing_key=own, declare=[queues[0]])
        for n in range(3):
            producer.publish({"n": n}, exchange=queues[1].exchange, routing_key=shared, declare=[queues[1]])

        def on_message(body, message):
            got.append((message.delivery_info["routing_key"], body["n"]))
            message.ack()

        consumer = Consumer(conn.channel(), queues=queues, callbacks=[on_message])
        consumer.qos(prefetch_count=1)  # as Celery's worker sets it (worker_prefetch_multiplier=1)
        with consumer:
            sizes = []
            while len(got) < 9:
                sizes.append(_drain_once(conn, got))
        by_queue = {q: [n for name, n in got if name == q] for q in (own, shared)}
        assert by_queue == {own: [0, 1, 2, 3, 4, 5], shared: [0, 1, 2]}  # each once, in order
        assert r.llen(own) == 0 and r.llen(shared) == 0
        # The reads: the own queue's six in ceil(6 / batch) of them, the shared queue's three in three.
        own_reads = [size for size in sizes if size > 1]
        assert sum(own_reads) + sizes.count(1) == 9
        if batch == 1:
            assert sizes == [1] * 9
        else:
            assert len(sizes) == 3 + -(-6 // batch) and max(sizes) == batch
        channel.close()


def test_the_intake_batch_setting_is_a_positive_count():
    from tinkerq.settings import Settings, SettingsError

    assert Settings.from_env({}).intake_batch == 16
    assert Settings.from_env({"TINKERQ_INTAKE_BATCH": "1"}).intake_batch == 1
    with pytest.raises(SettingsError, match="TINKERQ_INTAKE_BATCH must be positive"):
        Settings.from_env({"TINKERQ_INTAKE_BATCH": "0"})
