"""A worker's presence in the fleet: its registration, its heartbeat, and the cleanup of dead workers' queues.

* The *registration* (``tinkerq:serving:<model>:<worker>``, JSON with a TTL) says which model a worker
  serves; producers read it to fail fast on a model nobody serves.
* The *heartbeat* is the worker's score in the sorted set ``tinkerq:heartbeats``: the Redis server's time
  of its last beat, so a producer learns the age of every worker in one call, on one clock. A worker beats
  only while its consumer loop runs (``consuming``): a process that is alive but no longer takes messages
  is not alive for the fleet.
* The *reaper* (:func:`reap_dead_workers`) answers the messages left in a dead worker's queue with
  ``WorkerLostError`` and deletes the queue, so nothing waits there forever (rq's cleanup pass, in Redis);
  messages of sessions with a session record are dropped unanswered: another worker adopts those sessions and
  their producers send the messages there (worker/core/service.py, docs/reliability.md).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from tinkerq import keys
from tinkerq.errors import TinkerqError, WorkerLostError
from tinkerq.settings import Settings
from tinkerq.store import HashDelete, KeyValueStore, ZRemove
from tinkerq.threads import NamedThread
from tinkerq.wire import codec, messages
from tinkerq.worker.transport.intake import store_reply

log = logging.getLogger("tinkerq.worker")

LOST_AFTER_BEATS = 1.5  # a worker whose heartbeat is older than this many periods is gone (producers)
REAP_AFTER_BEATS = 4.0  # the reaper waits longer: the producers have failed the futures already


class Registration:
    def __init__(self, store: KeyValueStore, base_model: str, worker_id: str, period_s: float,
                 info: dict | None = None, consuming: Callable[[], bool] | None = None,
                 on_redis_back: Callable[[], None] | None = None) -> None:
        # A beat never waits out an outage: the next one comes soon.
        self.store = store.with_retry(period_s / 2)
        self.worker_id = worker_id
        self.key = keys.serving(base_model, worker_id)
        self.period_s = period_s
        self.consuming = consuming or (lambda: True)
        self.on_redis_back = on_redis_back or (lambda: None)
        self.record = {
            "base_model": base_model,
            "worker": worker_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "heartbeat_s": period_s,
            **(info or {}),
        }
        self._stop = threading.Event()
        self._withdrawn = threading.Event()
        self._silent = threading.Event()  # no beats either (silence(), until resume())
        self._thread: threading.Thread | None = None
        self._failing = False
        self._wedged = False

    def beat(self) -> None:
        if self._silent.is_set():
            return
        if not self._withdrawn.is_set():
            self.store.set(self.key, json.dumps(self.record).encode(), ttl_s=3 * self.period_s)
        if self._withdrawn.is_set():
            # Withdrawn while that set waited out a Redis outage, or withdrawn during one (its delete failed):
            # the model must not stay announced until the record's TTL (a shard group still re-forming).
            self.store.delete(self.key)
        self.store.beat(keys.HEARTBEATS, self.worker_id)

    def start(self) -> None:
        self.beat()
        self._thread = NamedThread(target=self._loop, name="tinkerq-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        # Twice per period: a producer declares a worker lost after 1.5 periods without a beat.
        while not self._stop.wait(self.period_s / 2):
            if not self.consuming():
                if not self._wedged:
                    log.error("the worker's consumer loop has stopped taking messages: heartbeats stop, so "
                              "producers fail this worker's requests instead of waiting on it")
                    self._wedged = True
                continue
            self._wedged = False
            started = time.monotonic()
            try:
                self.beat()
            except Exception as exc:  # Redis is away: the producers' monitors account for outages
                if not self._failing:
                    log.warning("heartbeat failed: %s", exc)
                self._failing = True
                continue
            # A beat that failed, or that Redis took long to answer (paused), ends an outage.
            if self._failing or time.monotonic() - started > self.period_s / 2:
                self._failing = False
                self.on_redis_back()

    def withdraw(self) -> None:
        """Stop announcing the model for now (e.g. while a shard group re-forms); :meth:`resume` undoes it.

        The heartbeat goes on: the worker still answers what it owes (with the group's error).
        """
        self._withdrawn.set()
        self._delete(heartbeat=False)

    def silence(self) -> None:
        """Stop announcing the model and stop beating until :meth:`resume`: the fleet takes this worker for lost,
        so other workers of the model adopt its sessions and producers send their requests there (a shard group
        that did not re-form in time hands its sessions over this way, worker/recovery/)."""
        self._silent.set()
        self._withdrawn.set()
        self._delete(heartbeat=True)

    def resume(self) -> None:
        self._silent.clear()
        self._withdrawn.clear()
        if self._thread is not None:  # announced only once the worker consumes its queues
            self.beat()

    def stop(self) -> None:
        self._stop.set()
        self._delete()

    def _delete(self, heartbeat: bool = True) -> None:
        try:
            self.store.delete(self.key)
            if heartbeat:
                self.store.forget(keys.HEARTBEATS, self.worker_id)
        except Exception as exc:  # the TTL removes the registration anyway; the reaper the heartbeat
            log.warning("could not remove registration %s: %s", self.key, exc)


def adopters(store: KeyValueStore, base_model: str, me: str, lost_after_s: float) -> list[str]:
    """Live workers other than ``me`` that serve ``base_model`` and take training sessions (so they adopt the
    sessions of a lost worker of it): registered, not samplers, beating within ``lost_after_s``."""
    ages = store.ages(keys.HEARTBEATS)
    found = []
    for key in store.scan(keys.serving_pattern(base_model)):
        try:
            record = json.loads(store.get(key) or b"{}")
        except ValueError:
            continue
        worker = record.get("worker") if isinstance(record, dict) else None
        if (isinstance(worker, str) and worker != me and record.get("role", "trainer") != "sampler"
                and ages.get(worker, float("inf")) <= lost_after_s):
            found.append(worker)
    return found


def reap_dead_workers(store: KeyValueStore, settings: Settings, me: str) -> int:
    """Answer and delete what waits in dead workers' queues; returns how many messages were answered.

    A worker is dead when its heartbeat is older than ``REAP_AFTER_BEATS`` periods (or absent while its queue
    exists). One worker at a time does this (a lock key), and only a worker that has itself been beating
    for longer than that, so an outage that stopped every heartbeat does not make live workers look dead.
    """
    period = settings.heartbeat_s
    if not store.set_if_absent(keys.REAPER_LOCK, me.encode(), ttl_s=REAP_AFTER_BEATS * period):
        return 0
    ages = store.ages(keys.HEARTBEATS)
    prefix = keys.worker_queue("")
    answered = 0
    # A dead worker's sampling intake is only deleted: the producers send its requests to other workers
    # themselves (sampling/reroute), and an error answered here could reach a request already moved.
    for prefix_of in (keys.sample_queue, keys.publish_queue):
        lists = prefix_of("")
        for queue in store.scan(lists + "*"):
            worker = queue[len(lists):]
            if worker != me and ages.get(worker, float("inf")) > REAP_AFTER_BEATS * period:
                store.delete(queue)
                log.warning("worker %s is gone: removed its list %s", worker, queue)
    for queue in store.scan(prefix + "*"):
        worker = queue[len(prefix):]
        if worker == me or ages.get(worker, float("inf")) <= REAP_AFTER_BEATS * period:
            continue
        while (item := store.pop_tail(queue)) is not None:
            task_id, inbox = _sender(item)
            if task_id is None:
                continue
            model_id = _model_of(item)
            if model_id is not None and store.get(keys.session_home(model_id)) is not None:
                continue  # an adoptable session: its producer posts the request again to the adopter
            error = WorkerLostError(f"worker {worker} stopped before taking this request; create a new training "
                                    f"client, or resume from your last checkpoint (create_training_client_from_state)")
            try:
                store_reply(store, settings, task_id, inbox, messages.error_reply(error))
                answered += 1
            except TinkerqError as exc:
                log.warning("could not answer %s left on %s: %s", task_id, queue, exc)
        store.delete(queue)
        store.forget(keys.HEARTBEATS, worker)
        log.warning("worker %s is gone: answered %d request(s) left in its queue and removed it", worker, answered)
    for worker, age in ages.items():  # heartbeats of workers gone long ago, whose queues never existed
        if worker != me and age > 100 * REAP_AFTER_BEATS * period:
            store.forget(keys.HEARTBEATS, worker)
    drop_answered_unacked(store)
    return answered


def drop_answered_unacked(store: KeyValueStore) -> int:
    """Forget kombu's unacknowledged records of requests that were answered.

    When the connection drops while a request runs (a Redis restart), the worker answers it but cannot
    acknowledge it: kombu keeps the message in its ``unacked`` hash and would put it back in the queue
    only after the visibility timeout (12 h). A stored reply proves it was answered, so the record goes.
    """
    records = store.hash_items(keys.KOMBU_UNACKED)
    task_ids = {tag: _sender(_unacked_message(raw))[0] for tag, raw in records.items()}
    known = {tag: task_id for tag, task_id in task_ids.items() if task_id is not None}
    if not known:
        return 0
    replies = store.get_many([keys.reply(t) for t in known.values()])
    answered = [tag for tag, reply in zip(known, replies, strict=True) if reply is not None]
    store.write_many([HashDelete(keys.KOMBU_UNACKED, answered), ZRemove(keys.KOMBU_UNACKED_INDEX, answered)])
    if answered:
        log.info("dropped %d answered request(s) from kombu's unacked record", len(answered))
    return len(answered)


def _unacked_message(raw: bytes) -> bytes:
    """The message inside kombu's unacked record ``[message, exchange, routing_key]`` (JSON)."""
    try:
        record = json.loads(raw)
        return json.dumps(record[0]).encode() if isinstance(record, list) and record else b""
    except (ValueError, UnicodeDecodeError):
        return b""


def _model_of(item: bytes) -> str | None:
    """The training session a raw queue entry (kombu's JSON, the body our msgpack ``[args, kwargs, embed]``
    in base64) belongs to, when it can be read."""
    try:
        message = json.loads(item)
        args = codec.unpackb(base64.b64decode(message["body"]))[0]
        model_id = args[0]["model_id"]
    except Exception:  # anything unreadable is answered as before
        return None
    return model_id if isinstance(model_id, str) and 0 < len(model_id) <= 128 else None


def _sender(item: bytes) -> tuple[str | None, str | None]:
    """Task id and reply inbox of a raw queue entry, when they can be read (anything else is dropped)."""
    try:
        headers = json.loads(item).get("headers") or {}
        task_id, inbox = headers.get("id"), headers.get("tinkerq_reply")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return None, None
    if not isinstance(task_id, str) or len(task_id) > 64:
        return None, None
    return task_id, inbox if isinstance(inbox, str) and keys.REPLY_LIST_RE.match(inbox) else None


def consumer_liveness_step(liveness: ConsumerLiveness) -> type:
    """A Celery consumer bootstep that ticks ``liveness`` from the consumer's own event loop."""
    from celery import bootsteps

    class LoopTick(bootsteps.StartStopStep):
        requires = ("celery.worker.consumer.tasks:Tasks",)

        def start(self, c) -> None:
            liveness.tick()
            self._timer = c.hub.call_repeatedly(liveness.period_s / 4, liveness.tick) if c.hub is not None else None
            liveness.enabled = c.hub is not None

        def stop(self, c) -> None:
            timer = getattr(self, "_timer", None)
            if timer is not None:
                timer.cancel()
            # Stopped by Celery itself (reconnecting after a broker outage, or a warm shutdown): the worker is
            # not wedged, it waits for the broker or finishes its task. Judged again once the loop restarts.
            liveness.enabled = False

    return LoopTick


class ConsumerLiveness:
    """Whether the Celery consumer's event loop still runs: it ticks this from a timer in that loop."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.enabled = False  # until the consumer starts (and only with an event loop)
        self._last = time.monotonic()

    def tick(self) -> None:
        self._last = time.monotonic()

    def __call__(self) -> bool:
        from celery.worker import state

        # A task running in the pool is progress too: during a warm shutdown the loop has stopped, but the
        # running request will still be answered.
        return (not self.enabled or time.monotonic() - self._last < 2 * self.period_s
                or bool(state.active_requests))
