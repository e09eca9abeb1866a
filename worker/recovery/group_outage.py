"""A shard group's outage, as its rank 0 lives through it (docs/reliability.md, "A shard group's sessions outlive
a lost shard"): the sessions are held, not failed, while the group re-forms; then each is re-made from its
automatic snapshot and journal by the code an adopter runs (``Recovery.rebuild``). A group that does not re-form
within ``adopt_timeout_s`` gives its sessions up: to another worker of the model (this one stops beating, so they
adopt them), else with a ShardGroupError that says how to resume.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tinkerq import keys
from tinkerq.errors import ShardGroupError, TinkerqError
from tinkerq.records import JournalEntry, SnapshotRecord
from tinkerq.worker.core.scheduler import Request
from tinkerq.worker.recovery.registry import LOST_AFTER_BEATS, adopters
from tinkerq.worker.training.sessions import Slot

if TYPE_CHECKING:
    from tinkerq.worker.recovery import Recovery

log = logging.getLogger("tinkerq.worker")


@dataclass
class GroupOutage:
    """Rank 0's shard group is down: the sessions it held wait here (held by the scheduler, so nothing of theirs
    runs) until the group re-forms, or until ``adopt_timeout_s`` has passed (then they are given up)."""

    reason: str
    since: float = field(default_factory=time.monotonic)
    held: dict[str, Slot] = field(default_factory=dict)  # model id -> the session held (its lane: held)
    given_up: bool = False  # the bound passed: sessions failed or handed off; nothing is held until it re-forms


class GroupHold:
    def __init__(self, recovery: Recovery) -> None:
        self.recovery = recovery
        self.service = recovery.service
        self.settings = recovery.settings
        self.store = recovery.store
        self.worker_id = recovery.worker_id
        # The group is down, and what it holds (guarded by the service's lock).
        self.outage: GroupOutage | None = None
        self.restores = 0  # sessions re-made here after their shard group re-formed (`inspect stats`, tests)

    def hold(self, reason: str) -> set[str]:
        """The shard group failed (any thread; under the service's lock): hold its sessions instead of failing
        them. The scheduler holds them, so their requests wait (callers see nothing, bounded by their own
        timeouts); the producers keep waiting too, as this worker still beats. Returns the model ids held (none
        when journaling is off, or when the outage was already given up: those sessions fail as before)."""
        service = self.service
        if not self.recovery.journaling or service.shards is None:
            return set()
        outage = self.outage
        if outage is None:
            outage = self.outage = GroupOutage(reason)
            log.warning("the shard group failed; holding its %d session(s) and their requests until it re-forms "
                        "(at most %g s, TINKERQ_ADOPT_TIMEOUT_S)", len(service.slots), self.settings.adopt_timeout_s)
        elif outage.given_up:
            return set()
        for model_id in service.scheduler.hold([mid for mid in service.slots if mid not in outage.held]):
            outage.held[model_id] = service.slots[model_id]
        return set(outage.held)

    def rerun_later(self, slot: Slot, request: Request) -> bool:
        """``request`` failed with a ShardGroupError while it ran (compute loop): the group broke under it, so it
        was not applied. Hold it to run again once its session is re-made; False: answer the error."""
        service = self.service
        shards = service.shards
        if shards is None:
            return False
        with service.cond:
            model_id = slot.session.model_id
            if self.outage is None and shards.group.healthy:  # not the group's failure (it would be down)
                return False
            if self.outage is None:  # the ping thread broke the group and has not told us yet
                self.hold(shards.group.broken or "the shard group failed")
            outage = self.outage
            if outage is None or model_id not in outage.held or request.seq_id is None:
                return False
            if not service.scheduler.requeue(request):
                return False
        log.warning("%s seq %d of session %s was interrupted by the shard group's failure: it runs again once the "
                    "session is re-made", request.op, request.seq_id, model_id)
        return True

    def group_formed(self) -> None:
        """The shard group re-formed (its re-forming thread): re-make every session it held, on the compute loop,
        from its automatic snapshot and journal; then their waiting requests run, the interrupted one first."""
        with self.service.cond:
            outage, self.outage = self.outage, None
        if outage is None:
            return
        if outage.given_up:
            log.warning("the shard group re-formed after its sessions were given up")
            return
        down = time.monotonic() - outage.since
        # What re-making needs from Redis is read here, before anything of it runs on the compute loop. The
        # followers wait for rank 0's next command only TINKERQ_COLLECTIVE_TIMEOUT_S; rank 0 pings them while its
        # loop is idle, not while the loop waits on Redis between two of the re-make's commands. Right after an
        # outage Redis can be slow for longer than that (a stalled connection, the outbox's backlog), and the
        # group would break again.
        service = self.service
        store = self.store.with_retry(self.settings.heartbeat_s)
        service.outbox.flush()  # its last journal entries and a staged snapshot may still be on their way
        for model_id in list(outage.held):
            try:
                journal = self.recovery.read_journal(model_id, store)
            except Exception as exc:
                self._not_remade(model_id, exc)
                continue
            service.run_control(lambda m=model_id, j=journal: self._restore(m, j, down))

    def _restore(self, model_id: str, journal: list[JournalEntry], down: float) -> None:
        """Re-make one held session after its group re-formed (compute loop; nothing here waits on the network);
        if that fails for another reason than the group failing again, the session is broken and its waiting
        requests are answered with the reason."""
        service = self.service
        with service.cond:
            slot = service.slots.get(model_id)
            if slot is None or self.outage is not None:  # closed meanwhile, or the group failed again: held anew
                return
        started = time.perf_counter()
        try:
            others = {mid: s for mid, s in service.slots.items() if mid != model_id}  # not counted twice
            recipe = slot.session.recipe()
            slot.session.close()  # its shards went with the group; nothing to do on a re-formed group
            slot.session = service.factory.make(model_id, recipe, others, service.close_session,
                                                optimizer=slot.session.optimizer_config)
            with service.cond:
                service.scheduler.regroup(model_id, slot.session.pass_group)
            last, entries = self.recovery.rebuild(slot, journal, resume=True)
        except ShardGroupError as exc:
            if self.outage is not None:  # failed again while re-making it: held until the next re-forming
                log.warning("re-making session %s was interrupted: %s", model_id, exc.message)
                return
            self._fail_held(model_id, slot, f"session {model_id} could not be re-made after its shard group "
                                            f"re-formed: {exc.message}")
            return
        except Exception as exc:
            self._not_remade(model_id, exc)
            return
        with service.cond:
            if self.outage is None:  # else the group failed again meanwhile: the new outage holds it
                service.scheduler.release(model_id)
                service.cond.notify_all()
        self.restores += 1
        log.warning("re-made session %s after its shard group re-formed (down %.1f s): snapshot after request %d + "
                    "%d journaled request(s) replayed in %.1f s; its waiting requests go on", model_id, down, last,
                    len(entries), time.perf_counter() - started)

    def _not_remade(self, model_id: str, exc: Exception) -> None:
        """Re-making a held session failed (reading its journal, or on the loop): broken, with the reason."""
        log.exception("re-making session %s after its shard group re-formed failed", model_id)
        slot = self.service.slots.get(model_id)
        if slot is None:
            return
        message = exc.message if isinstance(exc, TinkerqError) else f"{type(exc).__name__}: {exc}"
        self._fail_held(model_id, slot, f"session {model_id} could not be re-made after its shard group "
                                        f"re-formed ({message}); {self._resume_hint(model_id)}")

    def _fail_held(self, model_id: str, slot: Slot, message: str) -> None:
        """A held session cannot go on: broken (no longer held), its waiting requests answered."""
        service = self.service
        log.error(message)
        with service.cond:
            if service.slots.get(model_id) is not slot:  # closed, or re-made meanwhile
                return
        service.break_session(model_id, message, ShardGroupError)

    def expire_outage(self) -> None:
        """The group has not re-formed within ``adopt_timeout_s`` (watchdog): give the held sessions up. When
        another worker of the model could adopt them, this worker stops beating (``on_hand_off``): the fleet takes
        it for lost, a worker adopts each session from its snapshot and journal, and the producers send the waiting
        requests there. Else they fail with a ShardGroupError that says how to resume."""
        service, s = self.service, self.settings
        with service.cond:
            outage = self.outage
            if outage is None or outage.given_up or time.monotonic() - outage.since < s.adopt_timeout_s:
                return
            outage.given_up = True
            held = dict(outage.held)
            outage.held.clear()
        if not held:
            return
        store = self.store.with_retry(s.heartbeat_s)
        others = adopters(store, service.base_model, self.worker_id, LOST_AFTER_BEATS * s.heartbeat_s)
        if others and self.recovery.on_hand_off is not None:
            log.error("the shard group has not re-formed within %g s (TINKERQ_ADOPT_TIMEOUT_S): handing its %d "
                      "session(s) to the other worker(s) of the model (%s); this worker stops beating until the "
                      "group re-forms", s.adopt_timeout_s, len(held), ", ".join(sorted(others)))
            self.recovery.on_hand_off()
            for model_id in held:
                self.recovery.moved[model_id] = "another worker of the model"  # late requests: the adopter answers them
                service.run_control(lambda m=model_id: service.drop_session(m))  # its requests go unanswered
            return
        cause = outage.reason.rstrip(".; ")
        for model_id, slot in held.items():
            if service.slots.get(model_id) is not slot:
                continue
            self._fail_held(model_id, slot, (
                f"{cause}. The group did not re-form within {s.adopt_timeout_s:g} s (TINKERQ_ADOPT_TIMEOUT_S) and no "
                f"other worker of {service.base_model} can adopt session {model_id}: restart the failed shard (the "
                f"group re-forms by itself), then {self._resume_hint(model_id)}"))

    def _resume_hint(self, model_id: str) -> str:
        """How to go on from a session's latest automatic snapshot, or from a save_state checkpoint."""
        try:
            record = SnapshotRecord.loads(self.store.get(keys.auto_snapshot(model_id)))
        except TinkerqError:
            record = None
        if record is None:
            return "resume from your last save_state checkpoint"
        return (f"resume from its latest automatic snapshot, the state after its request {record.seq_id}: "
                f"sc.create_training_client_from_state_with_optimizer({record.path!r}), then send again the "
                f"requests after that one (or resume from your last save_state checkpoint)")
