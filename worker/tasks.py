"""The Celery tasks: one per operation, each a thin shell around :class:`worker.service.WorkerService`.

Every message reaching a task has passed :mod:`worker.intake`. The task answers through the service (the
reply goes to the request's reply key and the sender's inbox, retried through Redis outages) before it
returns, so Celery acknowledges a message only once its answer is stored; Celery stores no result.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.exceptions import Ignore

from tinkerq.celery_app import OPS, TASK_NAMES
from tinkerq.wire.messages import REPLY_HEADER
from worker.service import WorkerService


def register_tasks(app: Celery, service: WorkerService) -> None:
    for op in OPS:
        _register(app, service, op)


def _register(app: Celery, service: WorkerService, op: str) -> None:
    def run(task: Any, envelope: Any) -> str:
        request = task.request
        inbox = getattr(request, REPLY_HEADER, None)
        reply = service.handle(op, envelope, task_id=request.id, inbox=inbox if isinstance(inbox, str) else None)
        if reply is None:
            # Buffered until its predecessors arrive; it is answered when it runs.
            raise Ignore()
        service.answer(request.id, inbox, reply)
        # What Flower shows as the result: the outcome, never tensors.
        return "ok" if reply.get("ok") else f"{reply['error'].get('category')} error: {reply['error'].get('type')}"

    run.__name__ = op
    run.__qualname__ = op
    app.task(name=TASK_NAMES[op], bind=True, acks_late=True, ignore_result=True)(run)
