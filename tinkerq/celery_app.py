"""The Celery app both sides share: task names, the only accepted serializer, queue behaviour."""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.app.control import Control

from tinkerq import operations
from tinkerq.redis_client import celery_redis_options
from tinkerq.settings import Settings
from tinkerq.wire.codec import CONTENT_TYPE, SERIALIZER_NAME, register_kombu_serializer

# The Celery task name of every operation that travels as one (not sample: each worker reads sample requests from
# its own sampling queue). The registry (tinkerq/operations.py) owns them; this name stays for its importers.
TASK_NAMES = operations.TASK_NAMES

# Remote control (`celery inspect`, `celery status`, Flower's worker pages) carries commands and worker
# metadata, never tensors: it speaks JSON, the only content the stock `celery` command sends and accepts.
# Our msgpack is accepted there too (a client from before this change still reaches the workers).
CONTROL_SERIALIZER = "json"
CONTROL_ACCEPT = ("application/json", CONTENT_TYPE)


class JsonControl(Control):
    """Celery's remote control with a JSON mailbox; Celery's own would use the task serializer and accept only
    what tasks accept (our msgpack), so the stock CLI's commands were refused by every worker."""

    def __init__(self, app: Any = None) -> None:
        super().__init__(app)
        self.mailbox.accept = list(CONTROL_ACCEPT)  # commands (worker side) and replies (client side)
        self.mailbox.serializer = CONTROL_SERIALIZER  # commands sent, and replies: the CLI reads only JSON


def make_celery(settings: Settings, main: str = "tinkerq") -> Celery:
    """A Celery app configured for tinkerq; workers register task bodies on it, producers send by name."""
    register_kombu_serializer()
    embedded = settings.is_embedded
    broker = "memory://" if embedded else settings.broker_url
    # No Celery result backend: workers answer through tinkerq's own reply inboxes (tinkerq.wire.messages),
    # which survive a Redis restart where Celery's pub/sub results would be lost.
    app = Celery(main, broker=broker, backend=None, set_as_current=False, control=JsonControl)
    app.conf.update(
        # Tasks: only our msgpack; a pickle (or JSON) task is rejected before its body is decoded.
        task_serializer=SERIALIZER_NAME,
        result_serializer=SERIALIZER_NAME,
        event_serializer="json",  # events are metadata for Flower; they never carry tensors
        accept_content=[CONTENT_TYPE],
        result_accept_content=[CONTENT_TYPE],
        # A request is acknowledged only once it has been answered, and requeued if the worker dies.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        # Long forward_backward calls must not be redelivered while they run.
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout_s,
            **({"polling_interval": 0.002} if embedded else {}),
        },
        task_ignore_result=True,
        # A producer posts once and, if Redis is away, leaves re-posting to its dispatcher thread
        # (producer/dispatch.py): a submit call never blocks on an outage.
        task_publish_retry=False,
        broker_connection_timeout=settings.connect_timeout_s,
        broker_connection_retry_on_startup=False,
        redis_socket_connect_timeout=settings.connect_timeout_s,
        task_default_queue="tinkerq.default",
        task_create_missing_queues=True,
        # Operators see what each worker does (Flower needs task events).
        worker_send_task_events=True,
        # Flower reads task arguments from the worker's task-received event; a producer-side "sent" event
        # would add a PUBLISH to every request for nothing.
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        enable_utc=True,
    )
    # Sentinel master name, TLS certificates: merged into the option dicts set above, not replacing them.
    for key, extra in celery_redis_options(settings).items():
        app.conf[key] = {**(app.conf.get(key) or {}), **extra}
    return app
