"""Idle release: a training session nobody has used for ``TINKERQ_SESSION_RELEASE_IDLE_S`` leaves its worker's
memory, and comes back, with the same numbers, when its client does (docs/reliability.md, "Idle release").

* Release (:meth:`IdleRelease.park`, on the compute loop; the watchdog looks each second): the session's
  automatic snapshot is brought up to its last request (taken now unless it already holds it), the journal is
  cut to that request, the session record says *parked* (``SessionHome.parked_at``), and the session is dropped:
  its weights, AdamW state and pending gradients, and the sampling snapshots it made (published first, so its
  sampling clients keep sampling, loading them again like another worker's).
* Return (:meth:`IdleRelease.take`, on a transport thread): a request for a parked session restores it with the
  adoption code (``Recovery.adopt``: the snapshot loaded with its optimizer, on the compute loop), then the
  request is taken as usual. A ``close_model`` right after the last request is answered without restoring.
* A worker lost while it parks sessions: another worker of the model takes each record over, still parked
  (:meth:`IdleRelease.take_over`); the producer follows the record there, as for an adoption.
* With journaling off (``TINKERQ_JOURNAL_MAX_ENTRIES=0``) the session is released all the same, and its next
  request fails saying why it cannot come back.

A session at its kind's count limit is also released this way (not closed) to make room for a new one
(worker/training/sessions.py, ``TINKERQ_SESSION_IDLE_TTL_S``) when journaling is on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

from tinkerq import keys
from tinkerq.errors import CapacityError, TinkerqError, UnknownModelError, WorkerError
from tinkerq.records import JournalEntry, SessionHome
from tinkerq.wire import codec
from tinkerq.worker import checkpoints, memory
from tinkerq.worker.recovery.host import SessionsHost
from tinkerq.worker.training.sessions import Slot

if TYPE_CHECKING:
    from tinkerq.worker.core.service import Outcome
    from tinkerq.worker.recovery import Recovery

log = logging.getLogger("tinkerq.worker")

REMEMBERED = 4096  # sessions released here whose returning requests get the reason (journaling off)


class IdleHost(SessionsHost, Protocol):
    """What idle release uses of the worker that owns it (worker/core/service.py passes itself); nothing else."""

    recovery: Recovery


class IdleRelease:
    def __init__(self, service: IdleHost) -> None:
        self.service = service
        self.settings = service.settings
        self.worker_id = service.worker_id
        # Sessions released here: model id -> seconds idle. What a returning request is told when its session
        # cannot come back (journaling off, or its snapshot gone); bounded, oldest forgotten first.
        self.released: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    # -- release ---------------------------------------------------------------------------------------------

    def sweep(self) -> int:
        """Release every session idle longer than ``session_release_idle_s`` (watchdog thread); returns how many."""
        ttl = self.settings.session_release_idle_s
        if ttl <= 0:
            return 0
        service, now = self.service, time.monotonic()
        with service.cond:
            idle = [mid for mid, slot in service.slots.items() if self._idle(mid, slot, now, ttl)]
        return sum(bool(service.run_control(lambda m=mid: self.park(m, ttl))) for mid in idle)

    def make_room(self, model_id: str) -> None:
        """Free a session's place for a new one (worker/training/sessions.py, compute loop): released when it can come
        back, else closed as before."""
        if not (self.service.recovery.journaling and self.park(model_id, 0.0, why="to make room")):
            self.service.close_session(model_id)

    def park(self, model_id: str, idle_for: float, *, why: str = "") -> bool:
        """Release session ``model_id`` if it is still idle (for ``idle_for`` seconds, nothing waiting); compute
        loop. False: kept (busy again, or its snapshot or record could not be written: it stays in memory)."""
        service, recovery = self.service, self.service.recovery
        with service.cond:
            slot = service.slots.get(model_id)
            if slot is None or not self._idle(model_id, slot, time.monotonic(), idle_for):
                return False
            idle_s, seq_id = time.monotonic() - slot.session.last_used, service.scheduler.position(model_id)
        home = SessionHome(model_id, service.base_model, self.worker_id, slot.session.recipe(), slot.adopted_from)
        if recovery.journaling and not self._cover(slot, seq_id, home.parked_by(time.time(), idle_s, seq_id)):
            return False
        with service.cond:
            if service.slots.get(model_id) is not slot or not self._idle(model_id, slot, time.monotonic(), 0.0):
                kept = True  # a request came meanwhile: the session stays, and its record says so again
            else:
                kept = False
                del service.slots[model_id]
                service.scheduler.close(model_id)  # nothing waits in it (idle, under the lock)
        if kept:
            if recovery.journaling:
                self._write(home, self.settings.auto_snapshot_ttl_s)
            return False
        self._remember(model_id, idle_s)
        slot.session.close()
        service.snapshots.release_session(model_id)
        memory.release_memory()  # the allocators keep what the session freed; give it back to the OS now
        service.metrics.idle_releases.inc()
        service.metrics.sessions.set(len(service.slots))
        log.warning("released %s session %s from memory after %.0f s idle%s: %s", slot.session.kind, model_id,
                    idle_s, f" {why}" if why else "",
                    f"parked after request {seq_id}, restored on its next request" if recovery.journaling
                    else "it cannot come back (TINKERQ_JOURNAL_MAX_ENTRIES=0)")
        return True

    def _idle(self, model_id: str, slot: Slot, now: float, idle_for: float) -> bool:
        """The scheduler finds it idle (nothing runs, waits or is on its way out; not held through a shard group's
        outage; not broken: its requests must keep getting the reason), and it is unused for ``idle_for`` seconds."""
        return self.service.scheduler.idle(model_id) and now - slot.session.last_used >= idle_for

    def _cover(self, slot: Slot, seq_id: int, parked: SessionHome) -> bool:
        """Bring the automatic snapshot up to request ``seq_id`` and record the session as parked."""
        service, store = self.service, self.service.connection.store.with_retry(self.settings.heartbeat_s)
        model_id = parked.model_id
        if slot.snapshot_seq != seq_id:
            try:  # the journal's newest entry is that request's: the snapshot cuts the journal down to it
                head = store.list_range(keys.journal(model_id), 0, 0)
                entry = head[0] if head and JournalEntry.loads(head[0]).seq == seq_id else None
            except (TinkerqError, ValueError, KeyError, TypeError):
                entry = None
            service.recovery.snapshot(slot, seq_id, entry)
            if slot.snapshot_seq != seq_id:  # the write failed (logged): kept in memory, tried again later
                return False
        return self._write(parked, self._snapshot_ttl(model_id))

    def _write(self, home: SessionHome, ttl_s: float) -> bool:
        try:
            self.service.connection.store.set(keys.session_home(home.model_id), home.dumps(), ttl_s)
            return True
        except TinkerqError as exc:
            log.warning("could not record session %s: %s", home.model_id, exc.message)
            return False

    def _snapshot_ttl(self, model_id: str) -> float:
        """Seconds the session's automatic snapshot has left: its parked record lives no longer than it."""
        directory = checkpoints.state_path(self.settings.checkpoint_dir, model_id, checkpoints.AUTO_SNAPSHOT)
        when = checkpoints.expiry(directory)
        return self.settings.auto_snapshot_ttl_s if when is None else max(1.0, when - time.time())

    def _remember(self, model_id: str, idle_s: float) -> None:
        with self._lock:
            self.released[model_id] = idle_s
            self.released.move_to_end(model_id)
            while len(self.released) > REMEMBERED:
                self.released.popitem(last=False)

    # -- return ------------------------------------------------------------------------------------------------

    def take(self, op: str, model_id: str, seq_id: int) -> Outcome | None:
        """A request for a session not open here (transport thread). If it is parked here, restore it and return
        None: take the request again. A ``close_model`` of a parked session closes it as it lies (its answer).
        Else an UnknownModelError that says why the session is not here."""
        store = self.service.connection.store.with_retry(self.settings.heartbeat_s)
        home = SessionHome.loads(store.get(keys.session_home(model_id)))
        if home is not None and home.parked and home.worker == self.worker_id:
            if op == "close_model" and seq_id == home.seq_id + 1:  # nothing to restore for that
                self.service.run_control(lambda: self._close(model_id))
                return ("ok", codec.packb({}), {})
            self._restore(model_id, store)
            return None
        with self._lock:
            idle_s = self.released.get(model_id)
        if idle_s is not None:
            raise UnknownModelError(self.why_gone(model_id, idle_s), released_idle_s=round(idle_s, 1))
        held = f" (it is held by worker {home.worker} now)" if home is not None else ""
        raise UnknownModelError(f"training session {model_id} is not open on worker {self.worker_id}{held} (closed, "
                                f"evicted, or the worker restarted); create a new training client")

    def why_gone(self, model_id: str, idle_s: float) -> str:
        """Why a session released here cannot come back, and what to do."""
        head = (f"training session {model_id} was released from worker {self.worker_id}'s memory after {idle_s:.0f} "
                f"s idle (TINKERQ_SESSION_RELEASE_IDLE_S={self.settings.session_release_idle_s:g})")
        todo = ("create a new training client, or resume from your last save_state checkpoint "
                "(create_training_client_from_state_with_optimizer(path))")
        if not self.service.recovery.journaling:
            return (f"{head}, and it cannot come back: automatic snapshots and the journal are off on this worker "
                    f"(TINKERQ_JOURNAL_MAX_ENTRIES=0), so nothing was kept to restore it from. To go on, {todo}")
        return (f"{head}, and its automatic snapshot is gone (expired after TINKERQ_AUTO_SNAPSHOT_TTL_S="
                f"{self.settings.auto_snapshot_ttl_s} s, or deleted). To go on, {todo}")

    def _restore(self, model_id: str, store: Any) -> None:
        """Re-make a parked session here with the adoption code (transport thread: it reads Redis, then re-makes
        the session on the compute loop); nothing if another request did already. A refusal leaves it parked, and
        tells the caller."""
        with self.service.cond:
            if model_id in self.service.slots:
                return
        home = SessionHome.loads(store.get(keys.session_home(model_id)))
        if home is None or not home.parked or home.worker != self.worker_id:
            return  # closed or taken over meanwhile: the request is taken again and told
        directory = checkpoints.state_path(self.settings.checkpoint_dir, model_id, checkpoints.AUTO_SNAPSHOT)
        if not any((d / checkpoints.STATE_FILE).is_file() for d in (directory, checkpoints.previous_path(directory))):
            raise UnknownModelError(self.why_gone(model_id, home.idle_s), released_idle_s=round(home.idle_s, 1))
        try:
            self.service.recovery.adopt(home, store)
        except CapacityError as exc:
            raise CapacityError(
                f"training session {model_id} was released after {home.idle_s:.0f} s idle and there is no room to "
                f"restore it on worker {self.worker_id} now ({exc.message}). It stays parked and nothing was "
                f"applied: send the request again later", **exc.details) from None
        except TinkerqError:
            raise
        except Exception as exc:
            log.exception("restoring parked session %s failed", model_id)
            raise WorkerError(f"training session {model_id}, released after {home.idle_s:.0f} s idle, could not "
                              f"be restored ({type(exc).__name__}: {exc}); resume from your last save_state "
                              f"checkpoint") from None
        with self._lock:
            self.released.pop(model_id, None)

    def _close(self, model_id: str) -> None:
        """Close a parked session (compute loop): its snapshot, journal and record go, as at any close."""
        self.service.recovery.forget(model_id)
        self.service.snapshots.forget_session(model_id)
        with self._lock:
            self.released.pop(model_id, None)

    def take_over(self, home: SessionHome, store: Any) -> None:
        """The worker that parked a session is lost (watchdog, the session claimed): this one restores it when its
        client comes back. Nothing is loaded now; only the record moves (the producer follows it here)."""
        store.set(keys.session_home(home.model_id), home.moved_to(self.worker_id).dumps(),
                  self._snapshot_ttl(home.model_id))
        log.warning("took over parked session %s of lost worker %s: restored here on its next request",
                    home.model_id, home.worker)
