"""Exactly one session per create_model (docs/reliability.md, "Exactly once"): a ``create_model`` can reach two
workers of the model; the first to claim the session builds it, and a copy reaching another worker is forwarded to
the holder, which answers it. All of it (:func:`admit`) runs on the transport's thread before the request is
queued, so the compute loop (worker/core/compute.py) only builds the session."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tinkerq import keys
from tinkerq.celery_app import TASK_NAMES
from tinkerq.errors import RequestTimeoutError, UnknownModelError
from tinkerq.wire import messages
from tinkerq.worker.core.scheduler import Request

log = logging.getLogger("tinkerq.worker")

if TYPE_CHECKING:
    from tinkerq.worker.core.service import WorkerService


def admit(service: WorkerService, request: Request) -> str | None:
    """Check a create_model and decide what becomes of it, on the transport's thread; raises its refusal.

    None: queue it for the compute loop (``request.plan`` = (LoRA config, optimizer config, claimed): build the
    session claimed here, or answer from the one already open). Otherwise why it is not answered here: a copy whose
    session another worker claimed is forwarded to that worker, which answers it (the answer may have been lost, say
    in a Redis outage); a forwarded copy whose answer is stored already is dropped."""
    model_id = request.model_id
    assert model_id is not None
    _, body = service.take_body(request)
    requested = body.get("base_model") if isinstance(body, dict) else None
    if requested != service.base_model:
        raise UnknownModelError(f"this worker serves {service.base_model!r}, not {requested!r}")
    if service.settings.role == "sampler":
        raise UnknownModelError(f"worker {service.worker_id} only samples (--role sampler); training sessions "
                                f"open on workers started without it")
    deadline = body.get("deadline")
    if isinstance(deadline, (int, float)) and time.time() > deadline:
        # The producer stopped waiting long ago (a message that sat in a queue without workers): opening
        # a session nobody will use would only take a slot.
        raise RequestTimeoutError(f"create_model for {requested!r} arrived after its caller stopped waiting")
    lora = messages.decode_lora(body.get("lora"))
    optimizer = messages.decode_optimizer(body.get("optimizer"))  # an optimizer not served: refused here
    forwarded = isinstance(request.envelope.get("forwarded_by"), str)
    if model_id in service.slots:
        if forwarded and answered(service, request):  # the holder's own copy was answered: once is enough
            return "a duplicate delivery: another worker built the session"
        request.plan = (lora, optimizer, False)
        return None
    holder = claim_creation(service, model_id)
    if holder != service.worker_id:
        log.warning("create_model of %s not applied here: worker %s built it", model_id, holder)
        if forwarded:  # never forwarded twice
            return "a duplicate delivery: another worker built the session"
        # Sent from the outbox: from this task's own thread, Celery would make the copy a child of this task
        # (a parent_id header, which the holder's intake refuses).
        service.outbox.put(lambda: forward_create(service, request, holder))
        return f"forwarded to worker {holder}, which holds the session"
    request.plan = (lora, optimizer, True)
    return None


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
