"""Idle release: a training session nobody has used for ``TINKERQ_SESSION_RELEASE_IDLE_S`` leaves its worker's
memory, and comes back, with the same numbers, when its client does (docs/reliability.md, "Idle release").

* Release (:meth:`IdleRelease.release`; the watchdog looks each second): the session's automatic snapshot is
  brought up to its last request (taken now, files only, on the compute loop, unless it already holds it); the
  outbox puts it in place, cuts the journal to that request and records the session *parked*
  (``SessionHome.parked_at``); then, on the loop again, the session is dropped unless a request came meanwhile:
  its weights, AdamW state and pending gradients, and the sampling snapshots it made (published first, so its
  sampling clients keep sampling, loading them again like another worker's).
* Return (:meth:`IdleRelease.take`, on a transport thread): a request for a parked session restores it with the
  adoption code (``Recovery.adopt``: its journal read here, the snapshot loaded with its optimizer on the compute
  loop), then the request is taken as usual. A ``close_model`` right after the last request is answered without
  restoring.
* A worker lost while it parks sessions: another worker of the model takes each record over, still parked
  (:meth:`IdleRelease.take_over`); the producer follows the record there, as for an adoption.
* With journaling off (``TINKERQ_JOURNAL_MAX_ENTRIES=0``) the session is released all the same, and its next
  request fails saying why it cannot come back.

A session at its kind's count limit is also released this way (not closed) to make room for a new one
(worker/training/sessions.py, ``TINKERQ_SESSION_IDLE_TTL_S``) when journaling is on (:meth:`IdleRelease.make_room`):
the compute loop starts the release and goes on; the new session waits (``RoomComing``) until the outbox has
recorded the old one parked, and is made once it is out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tinkerq import keys, optimizers
from tinkerq.errors import CapacityError, TinkerqError, UnknownModelError, WorkerError
from tinkerq.records import JournalEntry, SessionHome
from tinkerq.wire import codec
from tinkerq.worker import checkpoints, memory
from tinkerq.worker.recovery.host import SessionsHost
from tinkerq.worker.training.sessions import RoomComing, Slot

if TYPE_CHECKING:
    from tinkerq.worker.core.outbox import Outbox
    from tinkerq.worker.core.service import Outcome
    from tinkerq.worker.recovery import Recovery

log = logging.getLogger("tinkerq.worker")

# How long a release waits for the outbox to put its snapshot in place and record the session parked (writes queued
# before them go first; a Redis outage holds them all): past it, the session stays in memory, and is tried again.
RELEASE_WAIT_S = 30.0
REMEMBERED = 4096  # sessions released here whose returning requests get the reason (journaling off)


class IdleHost(SessionsHost, Protocol):
    """What idle release uses of the worker that owns it (worker/core/service.py passes itself); nothing else."""

    recovery: Recovery
    outbox: Outbox

    def post_control(self, fn: Any) -> None: ...


@dataclass
class _Parking:
    """A release on its way (:meth:`IdleRelease.release`): what the compute loop found, and how far the outbox got
    with the parked record: queued → writing → written or failed; abandoned when the release ended first."""

    slot: Slot
    seq_id: int
    idle_s: float
    home: SessionHome  # the session's record, live
    record: str = "queued"
    lock: threading.Lock = field(default_factory=threading.Lock)
    deadline: float = 0.0  # a release to make room: past it (monotonic), it settles as the outbox left it

    def recording(self) -> bool:
        """The outbox has not finished with the parked record yet."""
        with self.lock:
            return self.record in ("queued", "writing")


class IdleRelease:
    def __init__(self, service: IdleHost) -> None:
        self.service = service
        self.settings = service.settings
        self.worker_id = service.worker_id
        # Sessions released here: model id -> seconds idle. What a returning request is told when its session
        # cannot come back (journaling off, or its snapshot gone); bounded, oldest forgotten first.
        self.released: OrderedDict[str, float] = OrderedDict()
        # Sessions closed here to make room for a new one (they could not be parked): model id -> what their
        # client's next request is told; bounded the same way.
        self.closed_for_room: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        # Releases under way to make room for a new session (compute loop only): model id -> its parking.
        self._making_room: dict[str, _Parking] = {}

    # -- release ---------------------------------------------------------------------------------------------

    def sweep(self) -> int:
        """Release every session idle longer than ``session_release_idle_s`` (watchdog thread); returns how many."""
        ttl = self.settings.session_release_idle_s
        if ttl <= 0:
            return 0
        service, now = self.service, time.monotonic()
        with service.cond:
            idle = [mid for mid, slot in service.slots.items() if self._idle(mid, slot, now, ttl)]
        return sum(self.release(mid, ttl) for mid in idle)

    def release(self, model_id: str, idle_for: float, *, why: str = "") -> bool:
        """Release session ``model_id`` if it is still idle for ``idle_for`` seconds, nothing waiting (any thread
        but the compute loop's). The loop writes the snapshot's files; the outbox puts it in place and records the
        session parked, after every write queued before; this thread waits for that; then the loop drops the
        session unless a request came meanwhile. False: kept (busy again, or a write failed: it stays in memory)."""
        parking = self.service.run_control(lambda: self._begin(model_id, idle_for))
        if parking is None:
            return False
        self.service.outbox.flush(RELEASE_WAIT_S)  # past it (Redis away), the session stays
        return bool(self.service.run_control(lambda: self._finish(parking, why)))

    def make_room(self, model_id: str) -> None:
        """Free session ``model_id``'s place for a new one (worker/training/sessions.py, compute loop; the scheduler
        chose it: broken, or idle): released when it can come back, else closed. Never waits for the outbox: once
        the release is started (its snapshot staged, the parked record queued) this raises :class:`RoomComing` and
        the loop goes on; the new session waits (worker/core/compute.py defers its creation, an adopter's thread
        waits for the outbox) and asks again. Once the record is written the session is dropped (the outbox wakes
        the loop: :meth:`_room_recorded`). If the release cannot finish (a write failed, or the outbox did not get
        to it within ``RELEASE_WAIT_S``: Redis away), the session is closed, as a session without journaling is.
        Returns with the session kept when a request came for it since it was chosen (the caller picks again)."""
        service = self.service
        with service.cond:
            slot = service.slots.get(model_id)
            broken = service.scheduler.broken(model_id) is not None
            idle = slot is not None and self._idle(model_id, slot, time.monotonic(), 0.0)
        if slot is None:
            return
        if broken or not service.recovery.journaling:
            self._close_for_room(model_id, "it was broken" if broken else
                                 "it was idle and could not be parked: automatic snapshots and the journal are off "
                                 "on this worker (TINKERQ_JOURNAL_MAX_ENTRIES=0)")
            return
        parking = self._making_room.get(model_id)
        if parking is None:
            if not idle:  # a request came for it since it was chosen
                return
            if slot.snapshot_staged:  # its last automatic snapshot is still on its way: after it
                service.outbox.put(lambda: service.post_control(lambda: self._room_recorded(model_id)))
                raise RoomComing(model_id)
            parking = self._begin(model_id, 0.0)
            if parking is None:  # its snapshot could not be written: closed
                self._close_for_room(model_id, "it was idle and its automatic snapshot could not be written (is "
                                               "the checkpoint directory writable and not full?)")
                return
            log.warning("releasing idle session %s to make room for a new one", model_id)
            parking.deadline = time.monotonic() + RELEASE_WAIT_S
            self._making_room[model_id] = parking
            # After the parked record (the outbox is FIFO): the loop settles the release, and the creation goes.
            service.outbox.put(lambda: service.post_control(lambda: self._room_recorded(model_id)))
            raise RoomComing(model_id)
        if parking.recording() and time.monotonic() < parking.deadline:
            raise RoomComing(model_id)
        if not self._settle_room(parking):  # kept: a request came for it meanwhile
            with service.cond:
                idle = model_id in service.slots and self._idle(model_id, service.slots[model_id],
                                                                 time.monotonic(), 0.0)
            if idle:  # and went: released again, from where it is now
                self.make_room(model_id)

    def wait_for_room(self) -> None:
        """Wait (any thread but the compute loop's) until the outbox has recorded the releases started to make room,
        or ``RELEASE_WAIT_S`` passed; the session that waits for the room then asks again."""
        self.service.outbox.flush(RELEASE_WAIT_S)

    def _room_recorded(self, model_id: str) -> None:
        """The outbox got past a release to make room (compute loop, control work): settle it, and let the new
        session that waits for it be made."""
        parking = self._making_room.get(model_id)
        if parking is not None and not parking.recording():
            self._settle_room(parking)
        with self.service.cond:
            self.service.scheduler.memory_freed()  # a deferred creation is offered again
            self.service.cond.notify_all()

    def _settle_room(self, parking: _Parking) -> bool:
        """End a release to make room (compute loop). True: the session is out (dropped, parked; or closed, as
        before, when its snapshot or record could not be written). False: kept, a request came meanwhile."""
        model_id = parking.home.model_id
        self._making_room.pop(model_id, None)
        if self._finish(parking, "to make room"):
            return True
        with self.service.cond:
            slot = self.service.slots.get(model_id)
            idle = slot is not None and self._idle(model_id, slot, time.monotonic(), 0.0)
        if slot is None:
            return True
        if parking.record != "written" and idle:
            self._close_for_room(model_id, f"it was idle and its release could not be recorded within "
                                           f"{RELEASE_WAIT_S:g} s (is Redis reachable from the worker?)")
            return True
        return False

    def _close_for_room(self, model_id: str, why: str) -> None:
        """Close session ``model_id`` to make room for a new one (compute loop), and remember ``why`` for its
        client's next request."""
        log.warning("closing session %s to make room for a new one: %s", model_id, why)
        self.service.close_session(model_id)
        with self._lock:
            self.closed_for_room[model_id] = (
                f"training session {model_id} was closed on worker {self.worker_id} to make room for a new session "
                f"(the worker was at its session limit, TINKERQ_MAX_LORA_SESSIONS / TINKERQ_MAX_SESSIONS): {why}. "
                f"To go on, create a new training client, or resume from your last save_state checkpoint "
                f"(create_training_client_from_state_with_optimizer(path))")
            _bound(self.closed_for_room)

    def _begin(self, model_id: str, idle_for: float) -> _Parking | None:
        """The compute loop's first part of a release (files only): check the session is idle, bring its automatic
        snapshot up to its last request, and queue on the outbox putting it in place and the parked record."""
        service, recovery = self.service, self.service.recovery
        with service.cond:
            slot = service.slots.get(model_id)
            if slot is None or not self._idle(model_id, slot, time.monotonic(), idle_for):
                return None
            idle_s, seq_id = time.monotonic() - slot.session.last_used, service.scheduler.position(model_id)
        home = SessionHome(model_id, service.base_model, self.worker_id, slot.session.recipe(), slot.adopted_from,
                           optimizer=optimizers.encode_config(slot.session.optimizer_config))
        parking = _Parking(slot, seq_id, idle_s, home)
        if not recovery.journaling:
            return parking
        if slot.snapshot_seq != seq_id:
            if slot.snapshot_staged:  # the previous one is still on its way to its place: the next sweep
                return None
            started = time.perf_counter()
            if not recovery.stage_snapshot(slot, seq_id):
                return None
            with service.cond:
                slot.journal_planned = 1  # cut to the newest entry: that request's
            service.outbox.put(lambda: self._install(slot, seq_id, started))
        service.outbox.put(lambda: self._record(parking))
        return parking

    def _install(self, slot: Slot, seq_id: int, started: float) -> None:
        """On the outbox, after every journal entry queued before: put the snapshot of request ``seq_id`` in place;
        the journal is cut to that request's entry, its newest."""
        store = self.service.connection.store.with_retry(self.settings.heartbeat_s)
        try:
            head = store.list_range(keys.journal(slot.session.model_id), 0, 0)
            entry = head[0] if head and JournalEntry.loads(head[0]).seq == seq_id else None
        except (TinkerqError, ValueError, KeyError, TypeError):
            entry = None
        self.service.recovery.install_snapshot(slot, seq_id, entry, started)

    def _record(self, parking: _Parking) -> None:
        """On the outbox: the session's record says parked, once its snapshot holds its last request."""
        slot, seq_id = parking.slot, parking.seq_id
        with parking.lock:
            if parking.record == "abandoned":
                return
            parking.record = "writing"
        parked = parking.home.parked_by(time.time(), parking.idle_s, seq_id)
        written = slot.snapshot_seq == seq_id and self._write(parked, self._snapshot_ttl(parking.home.model_id))
        with parking.lock:
            parking.record = "written" if written else "failed"

    def _finish(self, parking: _Parking, why: str) -> bool:
        """The compute loop's last part of a release: drop the session, or keep it if a request came meanwhile or
        its snapshot or record could not be written."""
        service, recovery = self.service, self.service.recovery
        slot, model_id = parking.slot, parking.home.model_id
        with parking.lock:
            if parking.record == "queued":  # the outbox has not got to it (Redis away): it must not write it now
                parking.record = "abandoned"
            record = parking.record
        with service.cond:
            if service.slots.get(model_id) is not slot:
                return False
            idle = self._idle(model_id, slot, time.monotonic(), 0.0)
            if idle and service.scheduler.position(model_id) == parking.seq_id and (
                    record == "written" or not recovery.journaling):
                del service.slots[model_id]
                service.scheduler.close(model_id)  # nothing waits in it (idle, under the lock)
                dropped = True
            else:
                dropped = False
        if not dropped:
            if record in ("writing", "written"):  # the session stays: its record says so again, after that write
                service.outbox.put(lambda: self._write(parking.home, self.settings.auto_snapshot_ttl_s))
            return False
        idle_s = parking.idle_s
        self._remember(model_id, idle_s)
        slot.session.close()
        service.snapshots.release_session(model_id)
        memory.release_memory()  # the allocators keep what the session freed; give it back to the OS now
        service.metrics.idle_releases.inc()
        service.metrics.sessions.set(len(service.slots))
        log.warning("released %s session %s from memory after %.0f s idle%s: %s", slot.session.kind, model_id,
                    idle_s, f" {why}" if why else "",
                    f"parked after request {parking.seq_id}, restored on its next request" if recovery.journaling
                    else "it cannot come back (TINKERQ_JOURNAL_MAX_ENTRIES=0)")
        return True

    def _idle(self, model_id: str, slot: Slot, now: float, idle_for: float) -> bool:
        """The scheduler finds it idle (nothing runs, waits or is on its way out; not held through a shard group's
        outage; not broken: its requests must keep getting the reason), and it is unused for ``idle_for`` seconds."""
        return self.service.scheduler.idle(model_id) and now - slot.session.last_used >= idle_for

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
            _bound(self.released)

    # -- return ------------------------------------------------------------------------------------------------

    def take(self, op: str, model_id: str, seq_id: int) -> Outcome | None:
        """A request for a session not open here (transport thread). If it is parked here, restore it and return
        None: take the request again. A ``close_model`` of a parked session closes it as it lies (its answer).
        Else an UnknownModelError that says why the session is not here."""
        store = self.service.connection.store.with_retry(self.settings.heartbeat_s)
        home = SessionHome.loads(store.get(keys.session_home(model_id)))
        if home is not None and home.parked and home.worker == self.worker_id:
            if op == "close_model" and seq_id == home.seq_id + 1:  # nothing to restore for that
                self._close(model_id)
                return ("ok", codec.packb({}), {})
            self._restore(model_id, store)
            return None
        with self._lock:
            idle_s = self.released.get(model_id)
            closed = self.closed_for_room.get(model_id)
        if idle_s is not None:
            raise UnknownModelError(self.why_gone(model_id, idle_s), released_idle_s=round(idle_s, 1))
        if closed is not None:
            raise UnknownModelError(closed)
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
        """Close a parked session (transport thread: nothing of it is in memory, and the compute loop does not wait
        on these deletes): its snapshot, journal and record go, as at any close."""
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


def _bound(remembered: OrderedDict[str, Any]) -> None:
    """Keep the ``REMEMBERED`` newest of what a worker remembers about sessions gone from it."""
    while len(remembered) > REMEMBERED:
        remembered.popitem(last=False)
