"""The sampling intake: a worker's own thread that takes sample requests and hands them to the engine.

Training requests go through Celery, which runs one at a time per worker (ordered sessions need that).
A sample request queued there would wait behind every training request before it, and the engine could
only batch what Celery let through. So producers push sample requests to the worker's own Redis list
(``tinkerq:samples:<worker>``, :func:`tinkerq.keys.sample_queue`) and this thread pops them as they come,
checks them (size, msgpack, task id, envelope: the same refusals as Celery's intake, with dead letters)
and submits them to the running batch. Nothing is acknowledged: a worker that dies with requests in its
batch stops beating, and the producers send those requests to another worker (sampling has no side
effects).
"""

from __future__ import annotations

import logging
import threading

from tinkerq import keys
from tinkerq.errors import MalformedMessageError
from tinkerq.wire import messages
from worker.intake import DeadLetters
from worker.service import WorkerService

log = logging.getLogger("tinkerq.worker")


class SampleIntake:
    def __init__(self, service: WorkerService, dead_letters: DeadLetters | None) -> None:
        self.service = service
        self.queue = keys.sample_queue(service.worker_id)
        # Pops block at most a second, so stop() takes effect quickly; an outage is retried for that long.
        self.store = service.connection.store.with_retry(service.settings.heartbeat_s)
        self.dead_letters = dead_letters
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tinkerq-sample-intake", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                item = self.store.pop(self.queue, timeout_s=1.0)
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
            task_id, inbox, envelope = messages.read_sample_item(item, max_bytes=settings.max_inline_bytes)
        except MalformedMessageError as exc:
            if self.dead_letters is not None:
                self.dead_letters.refuse(exc.message, item, self.queue)
            else:
                log.warning("refused a sample request: %s", exc.message)
            return
        try:
            reply = self.service.handle("sample", envelope, task_id=task_id, inbox=inbox)
        except Exception:  # handle() answers every failure itself; this is a last resort
            log.exception("sampling intake failed on %s", task_id)
            return
        if reply is not None:  # refused at once (bad input, unknown snapshot...): answer now
            self.service.answer(task_id, inbox, reply)
