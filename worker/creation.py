"""Exactly one session per create_model (docs/reliability.md, "Exactly once"): a ``create_model`` can reach two
workers of the model; the first to claim the session builds it, and a copy reaching another worker is forwarded to
the holder, which answers it (worker/compute.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tinkerq import keys
from tinkerq.celery_app import TASK_NAMES
from tinkerq.errors import UnknownModelError
from tinkerq.wire import messages
from tinkerq.worker.scheduler import Request

if TYPE_CHECKING:
    from tinkerq.worker.service import WorkerService


def claim_creation(service: WorkerService, model_id: str) -> str:
    """Claim the right to build session ``model_id`` (SET NX); the worker that holds the claim.

    A ``create_model`` can reach two workers (docs/reliability.md, "Exactly once"); only the first to claim
    builds the session. A claim held here for a session no longer open means it was built and closed."""
    store = service.connection.store.with_retry(service.settings.heartbeat_s)
    ttl_s = service.settings.auto_snapshot_ttl_s
    if store.set_if_absent(keys.session_claim(model_id), service.worker_id.encode(), ttl_s):
        return service.worker_id
    raw = store.get(keys.session_claim(model_id))
    holder = raw.decode(errors="replace") if raw else service.worker_id
    if holder == service.worker_id:
        raise UnknownModelError(f"training session {model_id} was already created here and closed; "
                                f"create a new training client")
    return holder


def release_creation(service: WorkerService, model_id: str) -> None:
    """Give up this worker's claim on ``model_id``, whose session it claimed but could not build (no memory, a
    failed load): a later create_model of the same id (a gateway trying again while the fleet is full) may
    build it, here or anywhere, instead of being told the session was built and closed."""
    service.connection.store.with_retry(service.settings.heartbeat_s).delete(keys.session_claim(model_id))


def forward_create(service: WorkerService, request: Request, holder: str) -> None:
    """Send a copy of a create_model to the worker that holds its session (same task id and inbox): that one
    answers it, whichever worker the producer's copy reached."""
    envelope = {**request.envelope, "forwarded_by": service.worker_id}
    for caller in request.callers:
        service.connection.app.send_task(
            TASK_NAMES["create_model"], args=(envelope,), queue=keys.worker_queue(holder), task_id=caller.task_id,
            headers={messages.REPLY_HEADER: caller.inbox}, argsrepr=request.label, kwargsrepr="{}")


def answered(service: WorkerService, request: Request) -> bool:
    """Whether every caller of ``request`` has an answer stored already."""
    store = service.connection.store.with_retry(service.settings.heartbeat_s)
    return all(store.get(keys.reply(c.task_id)) is not None for c in request.callers)
