"""Assembling a worker: load the model, connect, register tasks, announce the model; then run it.

The same assembly serves the ``tinkerq worker`` process (:func:`run_worker`) and the embedded fleet
(:mod:`tinkerq.worker.core.embedded`), so both run identical serialisation and request-handling code.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from celery import signals
from celery.worker.consumer import Consumer

from tinkerq import keys
from tinkerq.connection import Connection
from tinkerq.settings import Settings
from tinkerq.worker.core.lifecycle import Lifecycle
from tinkerq.worker.core.metrics import stats_step
from tinkerq.worker.core.service import WorkerService
from tinkerq.worker.loading import support
from tinkerq.worker.loading.dtypes import served_dtype
from tinkerq.worker.loading.models import configure_torch, load_causal_lm
from tinkerq.worker.loading.quantized_base import KEEP, keep_checkpoint_quantized
from tinkerq.worker.recovery.registry import ConsumerLiveness, Registration, consumer_liveness_step
from tinkerq.worker.sharding.follower import build_host
from tinkerq.worker.sharding.group import ShardSpec
from tinkerq.worker.transport.events import events_step
from tinkerq.worker.transport.intake import DeadLetters, IntakeBatch, transport_for
from tinkerq.worker.transport.sample_intake import SampleIntake
from tinkerq.worker.transport.tasks import register_tasks

log = logging.getLogger("tinkerq.worker")

GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass
class AssembledWorker:
    connection: Connection
    service: WorkerService
    registration: Registration
    worker_id: str
    sampling: SampleIntake
    steps: list[Any] = field(default_factory=list)  # the lifecycle's steps, in start order (worker/core/lifecycle.py)

    @property
    def queues(self) -> list[str]:
        own = keys.worker_queue(self.worker_id)
        if self.service.settings.role == "sampler":  # takes no training sessions: only its own queue
            return [own]
        return [keys.model_queue(self.service.base_model), own]


def served_name(model_path: str, name: str | None = None) -> str:
    """The name producers use for this model: ``--name``, or the directory's absolute path."""
    return name or os.path.abspath(model_path)


def assemble(model_path: str, settings: Settings, *, name: str | None = None) -> AssembledWorker:
    """Load and connect everything; raises UserError / BrokerUnavailableError with a clear message."""
    # "auto" becomes the dtype served, once, here: the model, sampling snapshots (worker/sampling/snapshots.py), the
    # registration and each session's info all read settings.dtype.
    settings = settings.replace(dtype=served_dtype(model_path, settings.dtype, settings.device))
    shards = None
    if ShardSpec.from_settings(settings) is None:
        model = load_causal_lm(model_path, device=settings.device, dtype=settings.dtype)
        if settings.quantized_base == KEEP:  # LoRA and sampling over the stored weights (docs/quantized.md)
            keep_checkpoint_quantized(model, model_path)
    else:  # rank 0 of a shard group: wait (bounded) for the other ranks before taking requests
        shards = build_host(model_path, settings)
        model = shards.base_model
        shards.group.form()
    # A worker retries Redis through an outage as long as a request may run: after the visibility timeout it
    # would be delivered again anyway.
    connection = Connection.open(settings, retry_s=settings.visibility_timeout_s)
    worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    base_model = served_name(model_path, name)
    service = WorkerService(connection, base_model, os.path.abspath(model_path), model, worker_id, shards=shards)
    register_tasks(connection.app, service)
    connection.app.steps["consumer"].add(stats_step(service.stats))  # `inspect stats` / Flower: sessions, adoptions
    liveness = ConsumerLiveness(settings.heartbeat_s)
    if not settings.is_embedded:
        service.dead_letters = guard_intake(connection, worker_id, liveness)
        connection.app.steps["consumer"].add(events_step(service.events))  # requests' real ends (Flower)
    sampling = SampleIntake(service, service.dead_letters)

    def redis_back() -> None:
        service.redis_back_at = time.monotonic()

    registration = Registration(
        connection.store, base_model, worker_id, settings.heartbeat_s,
        info={"num_parameters": service.num_parameters, "device": settings.device, "dtype": settings.dtype,
              "loss_backend": service.logprobs.backend, "shards": settings.shards, "role": settings.role,
              "expert_parallel": settings.expert_parallel, "vocab_size": service.vocab_size,
              "max_seq_len": service.max_seq_len},
        consuming=liveness, on_redis_back=redis_back,
    )
    if shards is not None:
        # While the group re-forms, producers see no worker for the model instead of a silent queue; the worker
        # still beats, so the requests of the sessions it holds wait for it (worker/recovery/).
        def group_failed(reason: str) -> None:
            registration.withdraw()
            service.shard_group_failed(reason)
            service.metrics.shard_group_up.set(0)
            service.metrics.shard_group_failures.inc()

        def group_formed() -> None:
            try:  # the held sessions are re-made before the model is announced again
                service.shard_group_formed()
            except Exception:
                log.exception("re-making the sessions held through the shard group's outage failed")
            service.metrics.shard_group_up.set(1)
            registration.resume()

        shards.on_failure = group_failed
        shards.on_formed = group_formed
        # A group that does not re-form in time hands its sessions to the model's other workers by going silent.
        service.recovery.on_hand_off = registration.silence
        service.metrics.shard_group_up.set(1)
    log.info("serving %s (%.1fM parameters, %s on %s) as worker %s; loss head: %s", base_model,
             service.num_parameters / 1e6, settings.dtype, settings.device, worker_id, service.logprobs.backend)
    for path in ("full", "lora", "sampling"):  # said once at start: each such session is refused when it is made
        refused = support.message(type(service.model).__name__, path)
        if refused is not None:
            log.warning("%s", refused)
    return AssembledWorker(connection, service, registration, worker_id, sampling)


class PromptConsumer(Consumer):
    """Celery's consumer, reconnecting promptly after a broker outage.

    kombu retries a lost connection at 2, 4, 6 ... up to 30 s apart: after a 3 s Redis restart the worker
    would sit idle for seconds more. Retries here start at once and are at most 1 s apart.
    """

    def ensure_connected(self, conn: Any) -> Any:
        conn.ensure_connection = functools.partial(conn.ensure_connection, interval_start=0.1, interval_step=0.3,
                                                   interval_max=1.0)
        return super().ensure_connected(conn)

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        """A message this worker will not decode (a remote-control command in pickle, say): one line, acked.

        Celery logs it as a CRITICAL with the body and a traceback (16 lines for each refused command). Task
        messages seldom get here: the intake (worker/transport/intake.py) refuses them first and dead-letters them."""
        delivery = getattr(message, "delivery_info", None) or {}
        where = delivery.get("routing_key") or delivery.get("exchange") or "?"
        log.warning("refused a message on %s: %s (content type %r, %d bytes)", where, str(exc)[:200],
                    message.content_type, len(message.body or b""))
        message.ack()


def guard_intake(connection: Connection, worker_id: str, liveness: ConsumerLiveness) -> DeadLetters:
    """Check every message before kombu and Celery see it (worker/transport/intake.py); tick liveness from the loop."""
    app, settings = connection.app, connection.settings
    assert settings.broker_url is not None
    dead_letters = DeadLetters(connection.store, settings, worker_id)
    app.conf.broker_transport = transport_for(settings.broker_url)
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        "tinkerq_dead_letters": dead_letters,
        "tinkerq_intake_batch": IntakeBatch(frozenset({keys.worker_queue(worker_id)}), settings.intake_batch),
    }
    # Through an outage the consumer reconnects for as long as it takes (Celery's default gives up).
    app.conf.broker_connection_max_retries = None
    app.conf.worker_consumer = "tinkerq.worker.core.runtime:PromptConsumer"
    app.steps["consumer"].add(consumer_liveness_step(liveness))
    return dead_letters


def run_worker(model_path: str, settings: Settings, *, name: str | None = None, loglevel: str = "INFO",
               threads: int | None = None) -> None:
    """Run a Celery worker process serving ``model_path`` until it is stopped (blocks)."""
    configure_torch(settings, threads)
    # The compute loop holds the GIL between torch calls; the consumer and the task thread need it to take a
    # message off the broker (several thread switches each). At Python's default 5 ms interval a long backlog
    # of one tenant would take long to pass into the scheduler, and with it another tenant's request (fairness).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    w = assemble(model_path, settings, name=name)
    app = w.connection.app
    # The worker's parts start once it consumes its queues (the model is announced then), and stop in the reverse
    # order when it shuts down: queued work is finished while it still beats, then it is withdrawn.
    lifecycle = Lifecycle(w)
    signals.worker_ready.connect(lambda **_: lifecycle.start(), weak=False)
    signals.worker_shutdown.connect(lambda **_: lifecycle.stop(), weak=False)
    app.worker_main([
        "worker",
        # One request at a time, in a thread: the model is not shared across processes, CUDA is never
        # initialised before a fork, and remote control (Flower, inspect) still answers during a task.
        "--pool", "threads", "--concurrency", "1",
        "--queues", ",".join(w.queues),
        "--hostname", f"tinkerq-{w.worker_id}@%h",
        "--task-events",
        "--without-mingle", "--without-gossip",
        "--loglevel", loglevel,
    ])
