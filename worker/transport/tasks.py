"""The Celery tasks: one per operation, each a thin shell that hands its request to the worker's scheduler.

Every message reaching a task has passed :mod:`tinkerq.worker.transport.intake`. A task answers at once only what
needs no compute (a repeat from the kept replies, a refusal); otherwise it queues the request
(:meth:`worker.service.WorkerService.submit`) and returns :data:`QUEUED`: Celery acknowledges the message,
:class:`SummarisedRequest` keeps Celery's own task-succeeded from going out, and the compute loop answers the
request when it has run, reporting its real end and runtime to Celery's event stream (worker/transport/events.py).
Not ``Ignore``, which Celery ends the same way: it formats the exception's traceback twice (billiard's
``ExceptionInfo``, for the trace and for its log), ~0.5 ms of the GIL per request taken from the compute loop and
the outbox while they run it (docs/benchmarks.md section 22). The producer keeps every request until it is
answered and sends again what a lost worker owed (producer/dispatch.py), so acknowledging at hand-off loses
nothing.

What a task returns is only what Flower shows as its result: a one-line summary of the reply, never the
tensors. Likewise remote control (`celery inspect active`, `tinkerq fleet status`) describes a running request
by its summary, never by its body (:class:`SummarisedRequest`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery.worker.request import Request

from tinkerq.operations import OPERATIONS
from tinkerq.wire.messages import REPLY_HEADER
from tinkerq.worker.transport.events import SUMMARY_CHARS, describe, reply_summary

if TYPE_CHECKING:
    from tinkerq.worker.core.service import WorkerService

__all__ = ["QUEUED", "SUMMARY_CHARS", "SummarisedRequest", "describe", "register_tasks", "reply_summary"]


# What a task returns for a request it queued (the compute loop answers it); Celery hands the task's return to
# SummarisedRequest.on_success as its repr.
QUEUED = "queued: answered when it has run"
_QUEUED_REPR = repr(QUEUED)


def register_tasks(app: Celery, service: WorkerService) -> None:
    """A task for every operation of the registry (tinkerq/operations.py) that travels as one."""
    trace_log = logging.getLogger("celery.app.trace")
    if not any(isinstance(f, _QueuedLogFilter) for f in trace_log.filters):
        trace_log.addFilter(_QueuedLogFilter())
    for op in OPERATIONS.values():
        if op.celery_task:
            _register(app, service, op.name)


def _register(app: Celery, service: WorkerService, op: str) -> None:
    def run(task: Any, envelope: Any) -> str:
        request = task.request
        inbox = getattr(request, REPLY_HEADER, None)
        inbox = inbox if isinstance(inbox, str) else None
        label = getattr(request, "argsrepr", None)
        reply = service.submit(op, envelope, task_id=request.id, inbox=inbox,
                               label=label if isinstance(label, str) else "")
        if reply is None:  # queued: answered (and its end reported) by the compute loop
            return QUEUED
        service.answer(request.id, inbox, reply)
        return reply_summary(reply)

    run.__name__ = op
    run.__qualname__ = op
    # shared=False: the task is this app's alone. Celery's default (shared) also adds it to every app made later in
    # the process, so a second worker there (another embedded fleet) had the first's tasks, bound to the first
    # service, registered before its own, and the global list of shared tasks kept every service alive.
    app.task(name=OPERATIONS[op].task_name, bind=True, acks_late=True, ignore_result=True,
             Request=SummarisedRequest, shared=False)(run)


class SummarisedRequest(Request):
    """Celery's request, shown to remote control (inspect active, reserved, query_task) by its summary, and
    acknowledged without an event of Celery's own once its task queued it (:data:`QUEUED`).

    Celery would send the arguments themselves unless the caller asks for ``safe``: the envelope, whose body is
    the request's msgpack bytes (up to the claim-check threshold, base64 in the stock CLI's JSON)."""

    def info(self, safe: bool = False) -> dict[str, Any]:
        return dict(super().info(safe=True))

    def send_event(self, type: str, **fields: Any) -> None:
        # Celery's on_success (the class it derives from this one per task) acknowledges the message, then sends
        # task-succeeded: not for a request only queued, whose end the outbox reports when it has run.
        if type == "task-succeeded" and fields.get("result") == _QUEUED_REPR:
            return
        super().send_event(type, **fields)


class _QueuedLogFilter(logging.Filter):
    """Celery logs every task's return at INFO ("succeeded in 0.001s: 'queued ...'"): not for a hand-off, whose
    end the worker logs itself when the request has run."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, dict) and args.get("return_value") == _QUEUED_REPR)
