"""The Celery tasks: one per operation, each a thin shell around :class:`worker.service.WorkerService`."""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.exceptions import Ignore

from tinkerq.celery_app import OPS, TASK_NAMES
from worker.service import WorkerService


def register_tasks(app: Celery, service: WorkerService) -> None:
    for op in OPS:
        _register(app, service, op)


def _register(app: Celery, service: WorkerService, op: str) -> None:
    def run(task: Any, envelope: Any) -> dict[str, Any]:
        reply = service.handle(op, envelope, task_id=task.request.id)
        if reply is None:
            # Buffered until its predecessors arrive; the answer is stored under this task id then.
            raise Ignore()
        return reply

    run.__name__ = op
    run.__qualname__ = op
    app.task(name=TASK_NAMES[op], bind=True, acks_late=True, ignore_result=False)(run)
