"""The Celery tasks: one per operation, each a thin shell around :class:`worker.service.WorkerService`."""

from __future__ import annotations

from typing import Any

from celery import Celery, signals
from celery.exceptions import Ignore

from tinkerq.celery_app import OPS, TASK_NAMES
from tinkerq.errors import MalformedMessageError
from tinkerq.wire import messages
from tinkerq.wire.codec import CONTENT_TYPE
from worker.service import WorkerService


def register_tasks(app: Celery, service: WorkerService) -> None:
    for op in OPS:
        _register(app, service, op)
    _answer_rejected_messages(app)


def _answer_rejected_messages(app: Celery) -> None:
    """A message Celery refuses (e.g. pickle) is dropped unread; tell its sender why instead of silence."""

    def on_rejected(sender: Any = None, message: Any = None, exc: BaseException | None = None, **_: Any) -> None:
        headers = getattr(message, "headers", None) or {}
        task_id, task = headers.get("id"), str(headers.get("task", ""))
        if not isinstance(task_id, str) or not task.startswith("tinkerq."):
            return
        error = MalformedMessageError(
            f"{task} message refused without being decoded: content type {message.content_type!r} is not "
            f"accepted (tinkerq accepts only {CONTENT_TYPE!r}; use the tinkerq producer). {exc}"
        )
        app.backend.store_result(task_id, messages.error_reply(error), "SUCCESS")

    signals.task_rejected.connect(on_rejected, weak=False)


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
