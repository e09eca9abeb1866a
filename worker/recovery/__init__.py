"""Recovery: the journal, automatic training snapshots and adoption of a lost worker's sessions
(docs/reliability.md). Records are the typed ones of tinkerq/records.py, shared with the producer.

* Every applied request is journaled (``keys.journal``) before its answer goes out; every
  ``auto_snapshot_steps`` optimizer steps (or when the journal is long) the session's whole state goes to its
  automatic snapshot and the journal is cut: every answered request is in the snapshot or the journal.
* The watchdog thread (:meth:`Recovery.start_watchdog`) expires gaps, reaps dead workers, and claims the
  sessions of lost workers (SET NX); the adoption itself (snapshot + journal replay) runs on the compute loop.
* On a sharded worker (rank 0), a shard group that fails holds its sessions (worker/recovery/group_outage.py,
  ``Recovery.group``): their requests wait, the one that was running included, and once the group re-forms each
  session is re-made from its snapshot and journal by the same code an adopter runs (:meth:`Recovery.rebuild`).
  A group that does not re-form within ``adopt_timeout_s`` gives its sessions up: to another worker of the model
  (this one stops beating, so they adopt them), else with a ShardGroupError.
* A session released idle (worker/recovery/idle_release.py) is re-made by :meth:`Recovery.adopt` when its client
returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tinkerq import keys, optimizers
from tinkerq.errors import CapacityError, TinkerqError, WorkerError
from tinkerq.operations import CHECKPOINT_KINDS, PASS_OPS
from tinkerq.operations import STATELESS as STATELESS_OPS
from tinkerq.records import JournalEntry, SessionHome, SnapshotRecord
from tinkerq.store import Push
from tinkerq.threads import NamedThread
from tinkerq.wire import codec
from tinkerq.worker import checkpoints
from tinkerq.worker.recovery.group_outage import GroupHold
from tinkerq.worker.recovery.host import SessionsHost
from tinkerq.worker.recovery.registry import LOST_AFTER_BEATS, reap_dead_workers
from tinkerq.worker.training.session import Session
from tinkerq.worker.training.sessions import RoomComing, Slot

if TYPE_CHECKING:
    from tinkerq.errors import ServerError
    from tinkerq.worker.core.operations import Operations
    from tinkerq.worker.core.outbox import Outbox
    from tinkerq.worker.core.service import Outcome
    from tinkerq.worker.recovery.idle_release import IdleRelease
    from tinkerq.worker.sharding.host import ShardHost
    from tinkerq.worker.training.sessions import SessionFactory

log = logging.getLogger("tinkerq.worker")


class RecoveryHost(SessionsHost, Protocol):
    """What recovery (with its shard-group holds, worker/recovery/group_outage.py) uses of the worker that owns it
    (worker/core/service.py passes itself); nothing else."""

    shards: ShardHost | None
    factory: SessionFactory
    operations: Operations
    outbox: Outbox
    idle: IdleRelease
    redis_back_at: float

    def open_session(self, model_id: str, lora: Any, optimizer: Any = None) -> Slot: ...
    def drop_session(self, model_id: str) -> Slot | None: ...
    def break_session(self, model_id: str, reason: str, error: type[ServerError] = ...) -> None: ...
    def expire_gaps(self) -> int: ...
    def unpack(self, raw: bytes) -> Any: ...

ROOM_TRIES = 4  # an adopter at the session count limit asks this many times for room (each wait bounded)
ADOPT_CLAIM_TTL_S = 600.0  # a claim outlives any adoption; one left by a lost adopter is taken over sooner

class Recovery:
    def __init__(self, service: RecoveryHost) -> None:
        self.service = service
        self.settings = service.settings
        self.store = service.connection.store
        self.worker_id = service.worker_id
        self.moved: dict[str, str] = {}  # sessions adopted by another worker while this one was taken for lost
        # Set by the worker's assembly (worker/core/runtime.py): stop beating, so that other workers of the model take
        # this one for lost and adopt its sessions (a group that did not re-form in time hands them over).
        self.on_hand_off: Callable[[], None] | None = None
        # A sharded worker (rank 0): its sessions held through its shard group's outages
        # (worker/recovery/group_outage.py).
        self.group = GroupHold(self)

    @property
    def journaling(self) -> bool:
        """Whether this worker's sessions are adoptable and restorable: journaled, with a session record
        (sharded workers too: a session saves and loads at any shard count)."""
        s = self.settings
        return s.journal_max_entries > 0 and s.role != "sampler"

    # -- records ---------------------------------------------------------------------------------------------

    def write_home(self, session: Session) -> None:
        """Record where the session lives and how to re-make it (an adopter opens the same one)."""
        if not self.journaling:
            return
        home = SessionHome(session.model_id, self.service.base_model, self.worker_id, session.recipe(),
                           optimizer=optimizers.encode_config(session.optimizer_config))
        try:
            self.store.set(keys.session_home(session.model_id), home.dumps(), self.settings.auto_snapshot_ttl_s)
        except TinkerqError as exc:  # the session works; it just cannot be adopted
            log.warning("could not record session %s: %s", session.model_id, exc.message)

    def forget(self, model_id: str) -> None:
        """A closed session needs no snapshot to resume from (and a full one holds the whole model's state)."""
        with contextlib.suppress(TinkerqError):
            self.store.delete(keys.auto_snapshot(model_id))
            self.store.delete(keys.session_home(model_id))  # nothing to adopt any more
            self.store.delete(keys.journal(model_id))
        checkpoints.remove_auto_snapshot(self.settings.checkpoint_dir, model_id)

    def entry(self, seq_id: int, op: str, raw: bytes | None, outcome: Outcome) -> bytes | None:
        """The journal entry of a request just applied (None when nothing is journaled). A request whose answer
        is an error changed nothing: its body is not kept, only the answer; nor is the body of a request that
        changes no state (an adopter only answers a repeat of it, it never applies it again)."""
        if op == "close_model" or not self.journaling:
            return None
        keep_body = outcome[0] == "ok" and op not in STATELESS_OPS
        return JournalEntry(seq_id, op, raw if keep_body else None, outcome).dumps()

    def journal_write(self, slot: Slot, entry: bytes) -> Push:
        """The store write of ``entry`` to the session's journal (worker/core/service.py writes it on the outbox, in
        the same round trip as, and before, its answer: every answered request is in the snapshot or the
        journal); once written, ``slot.journal_len`` counts it."""
        return Push(keys.journal(slot.session.model_id), entry, ttl_s=self.settings.auto_snapshot_ttl_s)

    def journal(self, slot: Slot, seq_id: int, op: str, entry: bytes) -> None:
        """Write ``entry`` now (the outbox, before an automatic snapshot is put in place: a kill during the
        snapshot's install leaves the previous snapshot and a journal that reaches this request)."""
        try:
            self.store.push(keys.journal(slot.session.model_id), entry, ttl_s=self.settings.auto_snapshot_ttl_s)
            with self.service.cond:
                slot.journal_len += 1
        except TinkerqError as exc:  # its answer cannot be stored either: the producer posts it again
            log.warning("could not journal %s seq %d of %s: %s", op, seq_id, slot.session.model_id, exc.message)

    def snapshot_due(self, slot: Slot) -> bool:
        """Whether the automatic snapshot is due after the request just applied: ``auto_snapshot_steps`` optimizer
        steps were taken, or the journal is too long (counted as it will be once the outbox has written what it
        holds: ``slot.journal_planned``, so snapshots fall on the same requests however far behind the outbox is)."""
        with self.service.cond:
            if self.service.scheduler.broken(slot.session.model_id) is not None:
                return False
        return slot.snapshot_due or slot.journal_planned > self.settings.journal_max_entries > 0

    def step_taken(self, slot: Slot) -> None:
        """An optimizer step was applied: every ``auto_snapshot_steps`` of them, a snapshot is due (taken once
        the step is journaled: worker/core/service.py ``applied``). A lost worker then costs at most that many steps
        (or nothing, when another worker adopts the session), and the producer's WorkerLostError names the
        snapshot."""
        slot.steps_since_snapshot += 1
        if 0 < self.settings.auto_snapshot_steps <= slot.steps_since_snapshot:
            slot.snapshot_due = True

    def stage_snapshot(self, slot: Slot, seq_id: int) -> bool:
        """Write the state after request ``seq_id`` beside the automatic snapshot (``AUTO_SNAPSHOT_STAGED``), on the
        compute loop: local files only, no Redis. Whether it was written; :meth:`install_snapshot` puts it in place.

        The snapshot may be written before the requests it covers are journaled (their entries may still be on the
        outbox), so it must not replace the automatic snapshot yet: a kill then would leave a snapshot ahead of a
        journal that misses answers an adopter must repeat. The outbox installs it after them, in order."""
        s, session = self.settings, slot.session
        try:
            session.save_state(s.checkpoint_dir, checkpoints.AUTO_SNAPSHOT_STAGED, base_model=self.service.base_model,
                               seq_id=seq_id, expires_at=time.time() + s.auto_snapshot_ttl_s)
        except (TinkerqError, OSError) as exc:  # a full disk must not fail the step it follows; the next one retries
            log.warning("automatic snapshot of %s failed: %s", session.model_id, exc)
            return False
        with self.service.cond:
            slot.snapshot_staged = True
            slot.steps_since_snapshot, slot.snapshot_due = 0, False
        return True

    def install_snapshot(self, slot: Slot, seq_id: int, entry: bytes | None, started: float) -> None:
        """Put the staged snapshot of request ``seq_id`` in place, record it, and then cut the session's journal
        down to that request's own ``entry`` (everything older is covered now; the answer to ``seq_id`` is kept, as
        it may not have reached its caller: an adopter answers a repeat of it). On the outbox, after every request
        before ``seq_id`` was journaled; ``entry`` itself is journaled by the caller before this."""
        s, session, metrics = self.settings, slot.session, self.service.metrics
        model_id = session.model_id
        try:
            if self.service.slots.get(model_id) is not slot:  # closed or dropped meanwhile: its files went with it
                return
            final = checkpoints.state_path(s.checkpoint_dir, model_id, checkpoints.AUTO_SNAPSHOT)
            checkpoints.install_directory(final.with_name(checkpoints.AUTO_SNAPSHOT_STAGED), final)
            record = SnapshotRecord(str(final), seq_id, time.time(), self.worker_id)
            self.store.set(keys.auto_snapshot(model_id), record.dumps(), s.auto_snapshot_ttl_s)
            with self.service.cond:
                slot.snapshot_at, slot.snapshot_seq = record.time, seq_id
        except (TinkerqError, OSError) as exc:  # the next optimizer step tries again
            log.warning("automatic snapshot of %s failed: %s", model_id, exc)
            with self.service.cond:
                slot.snapshot_due = True
            return
        finally:
            with self.service.cond:
                slot.snapshot_staged = False
        if entry is not None:
            try:  # after the record: a kill in between leaves entries the adopter does not apply (seq <= S)
                # One atomic LPUSH + LTRIM: the journal is this entry alone, never empty in between.
                self.store.push(keys.journal(model_id), entry, ttl_s=s.auto_snapshot_ttl_s, max_len=1)
                with self.service.cond:
                    slot.journal_len = 1
            except TinkerqError as exc:
                log.warning("could not cut the journal of %s: %s", model_id, exc)
        try:  # the sampler weights the session still serves go with it: published (once each), so any worker can
            # load them after this one is gone
            self.service.snapshots.publish_session(model_id)
        except (TinkerqError, OSError) as exc:
            log.warning("could not publish the sampler weights of %s: %s", model_id, exc)
        metrics.auto_snapshots.inc()
        metrics.auto_snapshot_seconds.observe(time.perf_counter() - started)

    # -- adoption ----------------------------------------------------------------------------------------------

    def adopt_orphans(self) -> int:
        """Adopt the sessions of lost workers of this model (watchdog thread); returns how many were adopted.

        A session record whose worker has not beaten for ``LOST_AFTER_BEATS`` periods is claimed (SET NX, so one
        worker adopts it), re-made from its automatic snapshot and journal on the compute loop, and recorded as
        this worker's; the producers then send its requests here (producer/dispatch.py)."""
        if not self.journaling:
            return 0
        store = self.store.with_retry(self.settings.heartbeat_s)
        limit = LOST_AFTER_BEATS * self.settings.heartbeat_s
        ages = store.ages(keys.HEARTBEATS)
        slots = self.service.slots
        adopted = 0
        for key in store.scan(keys.SESSION_HOME_PATTERN):
            home = SessionHome.loads(store.get(key))
            if home is not None and home.worker != self.worker_id and home.model_id in slots:
                self.service.run_control(lambda h=home: self.adopted_away(h))
                continue
            if (home is None or home.base_model != self.service.base_model or home.worker == self.worker_id
                    or ages.get(home.worker, float("inf")) <= limit or home.model_id in slots
                    or not self._can_adopt()):
                continue
            model_id = home.model_id
            if not self._claim(store, model_id, ages, limit):
                continue
            try:
                # Claimed; re-read: another worker may have adopted it between our scan and the claim.
                home = SessionHome.loads(store.get(key))
                if home is None or ages.get(home.worker, float("inf")) <= limit:
                    continue
                if home.parked:  # released idle: it stays out of memory, restored here on its next request
                    self.service.idle.take_over(home, store)
                else:
                    self.adopt(home, store)
                adopted += 1
            except Exception:
                log.exception("adopting session %s failed; another worker may try", model_id)
            finally:
                with contextlib.suppress(TinkerqError):
                    store.delete(keys.adopting(model_id))
        return adopted

    def adopted_away(self, home: SessionHome) -> None:
        """This worker was taken for lost (paused, cut off) and another adopted one of its sessions: the copy here
        is dropped without touching the session's record, journal or snapshot (the adopter's now), and requests
        still reaching it here go unanswered (their producer sent them to the adopter, which answers)."""
        if self.service.drop_session(home.model_id) is None:
            return
        self.moved[home.model_id] = home.worker
        log.error("training session %s was adopted by worker %s while this worker was taken for lost: dropped "
                  "here", home.model_id, home.worker)

    def _claim(self, store: Any, model_id: str, ages: dict[str, float], limit: float) -> bool:
        """Claim a session for adoption; a claim left by a worker lost meanwhile (mid-adoption) is taken over."""
        if store.set_if_absent(keys.adopting(model_id), self.worker_id.encode(), ADOPT_CLAIM_TTL_S):
            return True
        holder = store.get(keys.adopting(model_id))
        if holder is None or ages.get(holder.decode(errors="replace"), float("inf")) <= limit:
            return False
        store.delete(keys.adopting(model_id))
        return store.set_if_absent(keys.adopting(model_id), self.worker_id.encode(), ADOPT_CLAIM_TTL_S)

    def _can_adopt(self) -> bool:
        """A shard group takes no other worker's session while it is down (it could not build one)."""
        shards = self.service.shards
        return shards is None or (shards.group.healthy and self.group.outage is None)

    def adopt(self, home: SessionHome, store: Any) -> None:
        """Re-make a lost worker's session here (watchdog thread): snapshot, then the journal's later requests.

        A parked session (released idle, worker/recovery/idle_release.py) is re-made here the same way when its
        client comes back (transport thread): it must then reach the request it was parked after, and its record
        names it live here. What the re-make needs from Redis is read first, on the calling thread; the compute
        loop then re-makes it without waiting on the network (on a shard group a follower waits for rank 0's next
        command only TINKERQ_COLLECTIVE_TIMEOUT_S, and rank 0 pings only while its loop is idle); the record is
        written after, here again."""
        model_id, service = home.model_id, self.service
        started = time.perf_counter()
        journal = self.read_journal(model_id, store)
        record = SnapshotRecord.loads(store.get(keys.auto_snapshot(model_id)))
        made = self._remake_when_room(home, journal, record)
        if made is None:  # another request of the parked session restored it meanwhile
            return
        last, entries = made
        again = home.live_on(self.worker_id) if home.parked else home.moved_to(self.worker_id)
        try:
            store.set(keys.session_home(model_id), again.dumps(), self.settings.auto_snapshot_ttl_s)
        except BaseException:
            service.run_control(lambda: service.drop_session(model_id))
            raise
        service.metrics.sessions.set(len(service.slots))
        if home.parked:
            service.metrics.idle_resumes.inc()
            log.warning("restored parked session %s (released after %.0f s idle): snapshot after request %d + %d "
                        "journaled request(s) replayed in %.1f s", model_id, home.idle_s, last, len(entries),
                        time.perf_counter() - started)
            return
        service.metrics.adoptions.inc()
        log.warning("adopted session %s of lost worker %s: snapshot after request %d + %d journaled request(s) "
                    "replayed in %.1f s", model_id, home.worker, last, len(entries), time.perf_counter() - started)

    def _remake_when_room(self, home: SessionHome, journal: list[JournalEntry],
                          record: SnapshotRecord | None) -> tuple[int, list[JournalEntry]] | None:
        """:meth:`_remake` on the compute loop. At the session count limit another session is released to make
        room (worker/recovery/idle_release.py): this thread, not the loop, waits for the outbox to record it parked,
        then asks again."""
        for _ in range(ROOM_TRIES):
            try:
                return self.service.run_control(lambda: self._remake(home, journal, record))  # type: ignore[no-any-return]
            except RoomComing:
                self.service.idle.wait_for_room()  # then the release settles as it stands
        raise CapacityError(f"no room to re-make training session {home.model_id} on worker {self.worker_id}: the "
                            f"sessions released for it did not leave; retry shortly")

    def _remake(self, home: SessionHome, journal: list[JournalEntry],
                record: SnapshotRecord | None) -> tuple[int, list[JournalEntry]] | None:
        """The compute loop's part of :meth:`adopt` (no network): open the session and rebuild it from its snapshot
        and ``journal``. None when it is open here already."""
        model_id, service = home.model_id, self.service
        if model_id in service.slots:
            return None
        slot = service.open_session(model_id, home.lora, home.optimizer)
        try:
            last, entries = self.rebuild(slot, journal, resume=False)
            with service.cond:
                reached = service.scheduler.position(model_id)
            # Further is fine: a request that came while it was being released ran, and was journaled.
            if home.parked and reached < home.seq_id:
                raise WorkerError(f"the automatic snapshot and journal of {model_id} reach request {reached}, short "
                                  f"of request {home.seq_id}, which it was parked after")
        except BaseException:
            service.drop_session(model_id)
            raise
        slot.snapshot_at = record.time if record else None
        slot.adopted_from = home.adopted_from if home.parked else home.worker
        return last, entries

    @staticmethod
    def read_journal(model_id: str, store: Any) -> list[JournalEntry]:
        """A session's journal, in request order (Redis: read it before :meth:`rebuild`, which touches no network)."""
        return sorted((JournalEntry.loads(raw) for raw in store.list_range(keys.journal(model_id), 0, -1)),
                      key=lambda e: e.seq)

    def rebuild(self, slot: Slot, journal: list[JournalEntry], *, resume: bool) -> tuple[int, list[JournalEntry]]:
        """Bring ``slot``'s new session to the state after the last request of ``journal`` (its journal, read with
        :meth:`read_journal`; compute loop): load the automatic snapshot with its optimizer, then apply the
        journal's later requests again, in order. Returns the snapshot's position and the entries replayed.

        ``resume=False``, an adopter: the lane's order starts after the snapshot, the journal's answers kept for
        repeats. ``resume=True``, rank 0 re-making its own session after its shard group re-formed: the order
        already holds every answer, and the journal must reach the last request it applied."""
        model_id, service = slot.session.model_id, self.service
        # The snapshot directory's own seq_id is the truth: a kill can fall between its rename and the record.
        directory = checkpoints.state_path(self.settings.checkpoint_dir, model_id, checkpoints.AUTO_SNAPSHOT)
        if not (directory / checkpoints.STATE_FILE).is_file():  # killed between write_atomically's renames
            directory = checkpoints.previous_path(directory)
        last = 0
        if (directory / checkpoints.STATE_FILE).is_file():
            last = int(slot.session.load_state(Path(directory), optimizer=True)["seq_id"])
            slot.snapshot_seq = last
        # Covered by the snapshot; their answers may not have reached their callers: kept for repeats.
        covered = [(e.seq, e.reply) for e in journal if e.seq <= last]
        entries = [e for e in journal if e.seq > last]
        # Replayed requests are neither journaled again nor snapshotted here (applied() is not called): the
        # journal being replayed stays in Redis until the next snapshot covers it.
        following, replayed, broken = last + 1, [], None
        for entry in entries:
            if entry.seq < following:  # twice (a worker resumed after being taken for lost)
                continue
            if entry.seq != following:
                raise WorkerError(f"the journal of {model_id} misses request {following}")
            broken = self._replay(slot, entry, resume=resume) or broken
            replayed.append((entry.seq, entry.reply))  # a repeat of it is answered as the lost worker did
            following += 1
        with service.cond:
            if not resume:  # an adopter: its order starts after the snapshot, the replayed requests applied
                service.scheduler.restore(model_id, last, covered, replayed)
            elif following - 1 != service.scheduler.position(model_id):
                raise WorkerError(f"the snapshot and journal of {model_id} reach request {following - 1}, but "
                                  f"request {service.scheduler.position(model_id)} was applied")
        if broken is not None:
            service.break_session(model_id, broken)
        slot.journal_len = slot.journal_planned = len(journal)
        slot.steps_since_snapshot = sum(1 for e in entries if e.op == "optim_step" and e.reply[0] == "ok")
        return last, entries

    def _replay(self, slot: Slot, entry: JournalEntry, *, resume: bool = False) -> str | None:
        """Apply a journaled request again, as the lost worker did (its answer is already known). A LoRA loss
        request runs alone here; passes are batch-invariant (worker/lora/batch.py), so its numbers are the
        lost worker's. ``resume``: this worker applied it first (its sampler snapshots are still held here).
        Returns why the session broke, when the entry's answer says it did."""
        session = slot.session
        status, value, _ = entry.reply
        if status != "ok":  # an error changed nothing, unless it broke the session
            details = value.get("details") if isinstance(value, dict) else None
            if isinstance(details, dict) and details.get("session_broken"):
                return str(value.get("message") or "the session broke on its lost worker")
            return None
        if entry.op in STATELESS_OPS:  # no state change (and no body journaled)
            return None
        answer = codec.unpackb(value)
        if entry.op in CHECKPOINT_KINDS and os.path.exists(str(answer.get("path"))):
            return None  # written before the loss: not rewritten (a user may already read it)
        if entry.op == "create_sampler":  # the same id: sampling clients made from it keep working
            if resume:  # made here before the group failed, and still held
                return None
            self.service.snapshots.add(session.snapshot(), session.model_id, snapshot_id=str(answer["sampler_id"]))
            return None
        assert entry.body is not None
        body = self.service.unpack(entry.body)
        if entry.op in PASS_OPS and session.pass_group is not None:  # as it ran: in a pass (of its own)
            out = self.service.operations.loss_alone(session, body, backward=entry.op == "forward_backward")
        else:
            out, _ = self.service.operations.ops[entry.op](session, body)
        if entry.op == "forward_backward" and out != value:
            log.warning("replayed forward_backward of %s differs from the lost worker's answer", session.model_id)
        return None


    # -- watchdog ----------------------------------------------------------------------------------------------

    def start_watchdog(self, period_s: float = 1.0) -> threading.Event:
        """Expire gaps every ``period_s``, adopt lost workers' sessions, and reap dead workers every few
        heartbeats, in a daemon thread; set the returned event to stop."""
        stop = threading.Event()
        reap_every = max(1, round(2 * self.settings.heartbeat_s / period_s))
        service = self.service

        def loop() -> None:
            ticks = 0
            while not stop.wait(period_s):
                ticks += 1
                try:
                    service.expire_gaps()
                    self.group.expire_outage()
                    service.idle.sweep()
                    # Only once this worker has been in touch with Redis for a while: after an outage every
                    # heartbeat is old, and live workers must get the time to beat again.
                    settled = time.monotonic() - service.redis_back_at > 4 * self.settings.heartbeat_s
                    if settled:  # every tick: a lost worker's sessions are adopted as soon as it is seen gone
                        self.adopt_orphans()
                    if ticks % reap_every == 0 and settled:
                        reap_dead_workers(self.store.with_retry(self.settings.heartbeat_s), self.settings,
                                          self.worker_id)
                except TinkerqError as exc:
                    log.warning("watchdog: %s", exc.message)
                except Exception:
                    log.exception("watchdog failed")

        NamedThread(target=loop, name="tinkerq-watchdog", daemon=True).start()
        return stop
