"""The outbox: the worker's network writes after compute, on a thread of their own, in the order they were put.

The compute loop must never wait on Redis: on a GPU each round trip is device time lost, and during an outage the
device would stop. So once a request has run, the compute loop records it in its session's order (memory only)
and puts a :class:`Parcel` here; the outbox thread then journals it (worker/recovery/), answers its callers
(reply store + inbox push, Celery's task event), drops its claim-checked body and gives large buffers back to the
OS. One thread and one FIFO: a session's journal entries and answers leave in its order, and a request is
answered only with or after its journal entry (a lost worker's adopter then knows every answered request).
Parcels that queued up while a write was on its way leave together: their journal entries and answers in one
Redis transaction, their task events in one message, so a slow link costs one round trip per batch, not three
per request. A Redis outage stalls this thread (its writes retry through the outage), not the compute.

Memory stays bounded: a parcel holds one answer, and the compute loop runs only requests already taken off the
broker, which the scheduler's lanes bound in count and bytes.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tinkerq.threads import NamedThread

if TYPE_CHECKING:
    from tinkerq.worker.core.scheduler import Request
    from tinkerq.worker.training.sessions import Slot

log = logging.getLogger("tinkerq.worker")

MAX_BATCH = 64  # parcels delivered together at most (one transaction, one events message)


@dataclass
class Parcel:
    """What is left to do for one answered request, off the compute loop."""

    request: Request
    outcome: Any  # worker/service.Outcome
    runtime: float = 0.0
    shared: str = ""  # what the request ran in (a LoRA pass, a decode batch): Celery's event stream
    slot: Slot | None = None  # with ``entry``: the session whose journal gets it
    entry: bytes | None = None  # its journal entry (worker/recovery/), written before the answer
    discard: Any = None  # a claim-check reference whose body is no longer needed
    sent: threading.Event = field(default_factory=threading.Event)


class Outbox:
    def __init__(self, deliver: Callable[[list[Parcel]], None], name: str = "tinkerq-outbox") -> None:
        self._deliver = deliver
        self._name = name
        self._queue: deque[Parcel | Callable[[], object]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = NamedThread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def put(self, parcel: Parcel | Callable[[], object]) -> None:
        """Queue ``parcel`` (or a function to call in its turn: a write that must follow those queued before it);
        delivered here and now when the outbox is not running (stopped, or never started)."""
        with self._cond:
            if self.alive and not self._stopping:
                self._queue.append(parcel)
                self._cond.notify_all()
                return
        self._deliver_one([parcel] if isinstance(parcel, Parcel) else parcel)

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._busy

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything put so far was delivered; False if ``timeout_s`` passed first."""
        if threading.current_thread() is self._thread:
            return not self._queue
        with self._cond:
            return self._cond.wait_for(lambda: (not self._queue and not self._busy) or not self.alive, timeout_s)

    def stop(self, drain_s: float = 30.0) -> None:
        """Deliver what is queued (for up to ``drain_s``), then stop; what is left is delivered on this thread."""
        self.flush(drain_s)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        with self._cond:
            left = list(self._queue)
            self._queue.clear()
        for parcel in left:
            self._deliver_one([parcel] if isinstance(parcel, Parcel) else parcel)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                head = self._queue.popleft()
                batch: list[Parcel] | Callable[[], object]
                if isinstance(head, Parcel):  # and the parcels queued right behind it
                    parcels = [head]
                    while self._queue and isinstance(self._queue[0], Parcel) and len(parcels) < MAX_BATCH:
                        parcels.append(self._queue.popleft())  # type: ignore[arg-type]
                    batch = parcels
                else:
                    batch = head
                self._busy = True
            self._deliver_one(batch)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _deliver_one(self, batch: list[Parcel] | Callable[[], object]) -> None:
        if not isinstance(batch, list):
            try:
                batch()
            except Exception:
                log.exception("a write on the outbox failed")
            return
        try:
            self._deliver(batch)
        except Exception:  # delivery answers its own failures; this is a last resort: the thread keeps going
            log.exception("the outbox failed to deliver the answers of %d request(s)", len(batch))
        finally:
            for parcel in batch:
                parcel.sent.set()
