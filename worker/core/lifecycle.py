"""A worker's lifecycle: its parts as Celery bootsteps in one blueprint, started and stopped in the order their
``requires`` give, by ``tinkerq worker`` (worker/core/runtime.py: started once the Celery worker consumes, stopped
when it shuts down) and by the embedded fleet (worker/core/embedded.py) alike.

    Heartbeat -> ShardGroup -> Compute -> Watchdog -> Metrics -> SampleIntake          (start order)

Stopping runs the other way: the sample intake stops taking requests, the watchdog stops, the compute loop
finishes what is queued (bounded) and answers the rest, the shard group's followers are told to exit, and the
model is withdrawn last, so that producers see a live worker for as long as it still answers.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from celery import bootsteps

if TYPE_CHECKING:
    from tinkerq.worker.core.runtime import AssembledWorker

log = logging.getLogger("tinkerq.worker")

DRAIN_S = 30.0  # how long a stopping worker finishes queued work before answering the rest


class Heartbeat(bootsteps.StartStopStep):
    """Announces the model and beats (worker/recovery/registry.py); withdraws it when the worker stops, last."""

    name = "tinkerq.heartbeat"

    def start(self, w: AssembledWorker) -> None:
        w.registration.start()

    def stop(self, w: AssembledWorker) -> None:
        w.registration.stop()


class ShardGroup(bootsteps.StartStopStep):
    """Rank 0 of a shard group: pings idle followers (on the compute loop, when idle); tells them to exit once the
    compute loop has drained."""

    name = "tinkerq.shard-group"
    requires = ("tinkerq.worker.core.lifecycle:Heartbeat",)

    def include_if(self, w: AssembledWorker) -> bool:
        return w.service.shards is not None

    def start(self, w: AssembledWorker) -> None:
        assert w.service.shards is not None
        self._pings = w.service.shards.start_pings(w.service.run_when_idle)

    def stop(self, w: AssembledWorker) -> None:
        assert w.service.shards is not None
        self._pings.set()
        w.service.shards.shutdown()


class Compute(bootsteps.StartStopStep):
    """The compute loop and the outbox (worker/core/service.py); stopping drains them."""

    name = "tinkerq.compute"
    requires = ("tinkerq.worker.core.lifecycle:ShardGroup",)

    def start(self, w: AssembledWorker) -> None:
        w.service.start()

    def stop(self, w: AssembledWorker) -> None:
        w.service.close(DRAIN_S)


class Watchdog(bootsteps.StartStopStep):
    """Gap expiry, adoption of lost workers' sessions, idle release, reaping (worker/recovery/)."""

    name = "tinkerq.watchdog"
    requires = ("tinkerq.worker.core.lifecycle:Compute",)

    def start(self, w: AssembledWorker) -> None:
        self._stop = w.service.start_watchdog()

    def stop(self, w: AssembledWorker) -> None:
        self._stop.set()


class Metrics(bootsteps.StartStopStep):
    """Prometheus metrics on ``TINKERQ_METRICS_PORT`` (when set)."""

    name = "tinkerq.metrics"
    requires = ("tinkerq.worker.core.lifecycle:Compute",)

    def include_if(self, w: AssembledWorker) -> bool:
        return bool(w.service.settings.metrics_port)

    def start(self, w: AssembledWorker) -> None:
        port = w.service.settings.metrics_port
        self._server = w.service.metrics.serve(port)
        log.info("Prometheus metrics on :%d/metrics", port)

    def stop(self, w: AssembledWorker) -> None:
        if self._server is not None:
            self._server.shutdown()


class SampleIntake(bootsteps.StartStopStep):
    """The sample intake and the snapshot publisher (worker/transport/sample_intake.py): stopped first."""

    name = "tinkerq.sample-intake"
    requires = ("tinkerq.worker.core.lifecycle:Compute", "tinkerq.worker.core.lifecycle:Watchdog",
                "tinkerq.worker.core.lifecycle:Metrics")

    def start(self, w: AssembledWorker) -> None:
        w.sampling.start()

    def stop(self, w: AssembledWorker) -> None:
        w.sampling.stop()


STEPS = (Heartbeat, ShardGroup, Compute, Watchdog, Metrics, SampleIntake)


class Lifecycle:
    """The blueprint applied to one assembled worker: :meth:`start` once, :meth:`stop` once (idempotent)."""

    def __init__(self, worker: AssembledWorker) -> None:
        self.worker = worker
        self.blueprint = bootsteps.Blueprint(steps=STEPS, name="tinkerq")
        self._lock = threading.Lock()
        self._state = "new"

    @property
    def order(self) -> list[str]:
        """The steps' names in start order (those this worker includes)."""
        return [step.name for step in self.worker.steps]

    def start(self) -> None:
        with self._lock:
            if self._state != "new":
                return
            self._state = "started"
            self.blueprint.apply(self.worker)
            self.blueprint.start(self.worker)

    def stop(self) -> None:
        with self._lock:
            if self._state != "started":
                return
            self._state = "stopped"
        self.blueprint.stop(self.worker)
