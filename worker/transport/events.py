"""What Celery's monitoring (Flower, ``celery events``) sees of a request: its real end and runtime.

The Celery task of a request only hands it to the scheduler (worker/transport/tasks.py), so Celery itself reports
no end for it; the compute loop reports it here once the request is answered: ``task-succeeded`` with the
runtime of the work that ran it and a one-line summary of the reply that names the LoRA pass or the decode
batch it shared. Sample requests do not travel as Celery tasks (they come from the worker's own sampling
queue): they are reported as ``tinkerq.sample`` tasks, received, started and succeeded.

Events go out on a dispatcher of our own (its own connection, one lock), with the worker's hostname, so
they can be sent from the outbox's thread (worker/core/outbox.py) without touching the consumer's connection.
Inside :meth:`TaskEvents.batch` they are buffered and leave as one message (Celery's receivers, Flower's
included, take a list of events), so a batch of answers costs one publish.

Celery's own ``task-received``, which its consumer would publish before it reads the next message (a round trip
per request on a far Redis), is deferred too (:meth:`TaskEvents.defer`): buffered, and published by a flusher
thread of ours, always before our own events, so a request's ``task-received`` still precedes its end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from tinkerq.threads import NamedThread
from tinkerq.wire import codec

log = logging.getLogger("tinkerq.worker")

SUMMARY_CHARS = 300  # Flower's result column; Celery cuts the repr at 1024 characters anyway
_METRICS_SHOWN = 8


class TaskEvents:
    """Sends task events for requests Celery does not see end; does nothing until :meth:`start`."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._dispatcher: Any = None
        self._batching = 0  # depth of batch() contexts open (held by one thread: the lock is held throughout)
        self._celery: Any = None  # the consumer's own dispatcher, its task events deferred (defer())
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._flusher: threading.Thread | None = None
        self._unsent = False  # a publish of ours failed: its events wait in the dispatcher, retried by the flusher

    def defer(self, dispatcher: Any) -> None:
        """Buffer the task events of Celery's consumer ``dispatcher`` and publish them from a thread of ours, so
        its consumer goes on to the next message at once (called at every consumer start: a reconnect makes a
        new dispatcher)."""
        dispatcher.buffer_group = frozenset({"task", *dispatcher.buffer_group})
        dispatcher.buffer_limit = 1 << 30
        dispatcher.on_send_buffered = self._wake.set
        self._celery = dispatcher
        if self._flusher is None:
            self._stopped.clear()
            self._flusher = NamedThread(target=self._flush_loop, name="tinkerq-events", daemon=True)
            self._flusher.start()

    def _flush_loop(self) -> None:
        while not self._stopped.is_set():
            if self._wake.wait(1.0):
                self._wake.clear()
            # Every wake, and every second: a publish of Celery's that failed left its events in the dispatcher's
            # outbound buffer, which only the next flush sends (Celery's own hook flushed on every event).
            self._flush_celery()
            if self._unsent:  # without this they would wait for the next request's end, however long that is
                with self._lock:
                    if not self._batching:
                        self._flush_ours()

    def _flush_celery(self) -> None:
        dispatcher = self._celery
        if dispatcher is None:
            return
        try:
            # thread-safe: it publishes under its own lock. errors=True: also what a failed publish left behind
            # (buffer_while_offline), as Celery's consumer flushes
            dispatcher.flush(errors=True, groups=True)
        except Exception as exc:  # monitoring must never fail a request
            log.debug("could not send Celery's task events: %s", exc)

    def start(self, app: Any, hostname: str) -> None:
        """Called by the worker's consumer bootstep (worker/core/runtime.py) once Celery's own events are on."""
        with self._lock:
            if self._dispatcher is None:
                # buffer_while_offline=False: a failed publish raises (its events stay buffered) instead of
                # waiting silently for the next flush, so that _flush_ours knows to retry it.
                self._dispatcher = app.events.Dispatcher(app.connection_for_write(), hostname=hostname,
                                                         enabled=True, groups=["task"], buffer_group=["task"],
                                                         buffer_limit=1 << 30, buffer_while_offline=False)

    def stop(self) -> None:
        self._stopped.set()
        if self._flusher is not None:
            self._flusher.join(5.0)
            self._flusher = None
        self._flush_celery()
        self._celery = None
        with self._lock:
            self._flush_ours()  # a last try for events a failed publish left behind
            dispatcher, self._dispatcher = self._dispatcher, None
        if dispatcher is not None:
            try:
                dispatcher.close()
            except Exception as exc:
                log.debug("closing the task event dispatcher: %s", exc)

    def _flush_ours(self) -> None:
        """Publish our buffered events (the lock held), Celery's task-received first; a failure leaves them buffered
        for the flusher thread to retry every second, and is logged once until a publish succeeds again."""
        if self._dispatcher is None:
            return
        self._flush_celery()  # Celery's task-received of the same request goes first
        try:
            self._dispatcher.flush()
        except Exception as exc:  # monitoring must never fail a request
            if not self._unsent:
                log.warning("could not send task events (Flower will show them late; retrying every second): %s",
                            exc)
            self._unsent = True
            return
        if self._unsent:
            log.info("task events sent again")
        self._unsent = False

    def _send(self, kind: str, **fields: Any) -> None:
        with self._lock:
            if self._dispatcher is None:
                return
            try:
                self._dispatcher.send(kind, **fields)  # buffered ("task" group): flushed now, or by batch()
            except Exception as exc:  # monitoring must never fail a request
                log.debug("could not send %s: %s", kind, exc)
                return
            if not self._batching:
                self._flush_ours()

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Events sent inside leave together, as one message, at its end."""
        with self._lock:
            self._batching += 1
            try:
                yield
            finally:
                self._batching -= 1
                if not self._batching:
                    self._flush_ours()

    def taken(self, request: Any) -> None:
        """A request was queued: a sample request is announced (Celery announced the others itself)."""
        if request.op != "sample" or self._dispatcher is None:
            return
        with self.batch():  # one publish
            for caller in request.callers:
                self._send("task-received", uuid=caller.task_id, name="tinkerq.sample", args="(sample request)",
                           kwargs="{}", retries=0, eta=None, expires=None, root_id=caller.task_id, parent_id=None)
                self._send("task-started", uuid=caller.task_id, pid=os.getpid())

    def finished(self, request: Any, reply: dict[str, Any], runtime: float, shared: str = "") -> None:
        if self._dispatcher is None:
            return
        summary = reply_summary(reply)
        if shared:  # what the request shared, kept whole at the end of the line
            summary = f"{summary[:SUMMARY_CHARS - len(shared) - 3]} [{shared}]"
        for caller in request.callers:  # as Celery reports a task's return value: its repr
            self._send("task-succeeded", uuid=caller.task_id, result=repr(summary), runtime=runtime)

    def dropped(self, request: Any, why: str) -> None:
        """A request this worker does not answer (another does): ended here, as Celery would show a revoke."""
        for caller in request.callers:
            self._send("task-succeeded", uuid=caller.task_id, result=repr(f"not applied here: {why}"), runtime=0.0)


def reply_summary(reply: dict[str, Any]) -> str:
    """A reply in one short line, e.g. ``ok loss:sum=3.2 datums=4 logprobs (4, 17)`` or ``user error: ...``."""
    if not reply.get("ok"):
        error = reply.get("error") or {}
        return (f"{error.get('category')} error: {error.get('type')}: {error.get('message')}")[:SUMMARY_CHARS]
    ref = reply.get("payload")
    if isinstance(ref, dict) and isinstance(ref.get("inline"), bytes):
        try:
            described = describe(codec.unpackb(ref["inline"]))
        except Exception:  # a summary must never fail the request it describes (the answer is already stored)
            described = f"{len(ref['inline'])}-byte result"
        return f"ok {described}".strip()[:SUMMARY_CHARS]
    if isinstance(ref, dict) and "blob" in ref:  # not fetched back from Redis just to describe it
        return f"ok {ref.get('size')}-byte result (claim check)"
    return "ok"


def describe(value: Any) -> str:
    """Metrics as ``name=value``, arrays by shape, lists by length: what a result is, never its tensors."""
    if not isinstance(value, dict):
        return _brief(value)
    parts = []
    metrics = value.get("metrics")
    if isinstance(metrics, dict):
        parts += [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={_brief(v)}"
                  for k, v in list(metrics.items())[:_METRICS_SHOWN]]
    for key, item in value.items():
        if key in ("metrics", "loss_fn_output_type"):  # metrics come first; the output type says little
            continue
        if key in ("outputs", "sequences") and isinstance(item, list):
            parts.append(_describe_rows("datums" if key == "outputs" else key, item))
        else:
            parts.append(f"{key}={_brief(item)}")
    return " ".join(parts)


def _describe_rows(name: str, rows: list[Any]) -> str:
    """``datums=4 logprobs (4, 17)``: per-datum arrays by their stacked shape; ``(4, 12..17)`` when ragged."""
    parts = [f"{name}={len(rows)}"]
    first = rows[0] if rows and isinstance(rows[0], dict) else {}
    for key, item in first.items():
        if not isinstance(item, np.ndarray):
            continue
        shapes = [r[key].shape for r in rows if isinstance(r, dict) and isinstance(r.get(key), np.ndarray)]
        if len(set(shapes)) == 1:
            parts.append(f"{key} {(len(shapes), *shapes[0])}")
        elif all(len(s) == 1 for s in shapes):  # one value per token, datums of different lengths
            parts.append(f"{key} ({len(shapes)}, {min(shapes)[0]}..{max(shapes)[0]})")
        else:
            sizes = [int(np.prod(s)) for s in shapes]
            parts.append(f"{key} {len(shapes)} arrays of {min(sizes)}..{max(sizes)} values")
    return " ".join(parts)


def _brief(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{value.shape}"
    if isinstance(value, (list, tuple)):
        return f"[{len(value)} items]"
    if isinstance(value, dict):
        return f"{{{len(value)} keys}}"
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return str(value)[:80]


def events_step(events: TaskEvents) -> type:
    """A consumer bootstep (Celery's extension point) that starts ``events`` once the worker's own event
    dispatcher is up, with the worker's hostname, and only when task events are on (``--task-events``)."""
    from celery import bootsteps

    class TaskEventsStep(bootsteps.StartStopStep):
        requires = ("celery.worker.consumer.events:Events",)

        def start(self, c: Any) -> None:
            dispatcher = getattr(c, "event_dispatcher", None)
            if dispatcher is not None and dispatcher.enabled and c.app.conf.worker_send_task_events:
                events.defer(dispatcher)
                events.start(c.app, c.hostname)

        def shutdown(self, c: Any) -> None:
            events.stop()

    return TaskEventsStep
