"""The sampling intake: a worker's own thread that takes sample requests and hands them to the engine.

Training requests go through Celery, which runs one at a time per worker (ordered sessions need that). A
sample request queued there would wait behind every training request before it, and the engine could only
batch what Celery let through. So producers push sample requests to the worker's own Redis list
(``tinkerq:samples:<worker>``, :func:`tinkerq.keys.sample_queue`) and this thread pops them as they come,
checks them (size, msgpack, task id, envelope: the same refusals as Celery's intake, with dead letters) and
submits them to the running batch. Another worker that needs the weights of a snapshot made here asks for
them on a second list, ``tinkerq:publish:<worker>``, read by a second thread (worker/sampling/snapshots.py). Nothing
is acknowledged: a worker that dies with requests in its batch stops beating, and the producers send those
requests to another worker (sampling has no side effects).
"""

from __future__ import annotations

import logging
import threading

from tinkerq import keys
from tinkerq.errors import MalformedMessageError
from tinkerq.threads import NamedThread
from tinkerq.wire import messages
from tinkerq.worker.core.service import WorkerService
from tinkerq.worker.transport.intake import DeadLetters

log = logging.getLogger("tinkerq.worker")


class SampleIntake:
    def __init__(self, service: WorkerService, dead_letters: DeadLetters | None) -> None:
        self.service = service
        self.queue = keys.sample_queue(service.worker_id)
        self.publish_queue = keys.publish_queue(service.worker_id)
        # Pops block at most a second, so stop() takes effect quickly; an outage is retried for that long.
        self.store = service.connection.store.with_retry(service.settings.heartbeat_s)
        self.dead_letters = dead_letters
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        # Publishing has a thread of its own: an intake waiting for another worker's snapshot must not keep
        # this worker from publishing the one that other worker waits for.
        self._threads = [NamedThread(target=self._loop, args=(q,), name=f"tinkerq-{name}", daemon=True)
                         for q, name in ((self.queue, "sample-intake"), (self.publish_queue, "publisher"))]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)

    def _loop(self, queue: str) -> None:
        while not self._stop.is_set():
            try:
                item = self.store.pop(queue, timeout_s=1.0)
            except Exception as exc:  # Redis away: the heartbeat says so too; try again shortly
                log.warning("sampling intake: %s", exc)
                self._stop.wait(0.5)
                continue
            if item is not None:
                self.take(item)

    def take(self, item: bytes) -> None:
        """Check one intake item and start it (or answer its error); never raises."""
        settings = self.service.settings
        try:
            read = messages.read_intake_item(item, max_bytes=settings.max_inline_bytes)
        except MalformedMessageError as exc:
            if self.dead_letters is not None:
                self.dead_letters.refuse(exc.message, item, self.queue)
            else:
                log.warning("refused a sample request: %s", exc.message)
            return
        if isinstance(read, str):  # another worker needs the weights of a snapshot made here
            try:
                self.service.snapshots.publish(read)
            except Exception:
                log.exception("could not publish snapshot %s", read)
            return
        task_id, inbox, envelope = read
        try:
            reply = self.service.submit("sample", envelope, task_id=task_id, inbox=inbox)
        except Exception:  # submit() answers every failure itself; this is a last resort
            log.exception("sampling intake failed on %s", task_id)
            return
        if reply is not None:  # refused at once (bad input, unknown snapshot...): answer now
            self.service.answer(task_id, inbox, reply)
