"""A worker's request handling, wired together: the transport hands requests in, the scheduler decides, the
compute loop runs, recovery journals and adopts.

    transport (worker/transport/tasks.py, intake.py, sample_intake.py, events.py)
        -> WorkerService.submit: checks the envelope; answers repeats and refusals at once, queues the rest
        -> Scheduler (worker/core/scheduler.py): per-session order, passes, fairness          [no torch, no Redis]
        -> ComputeLoop (worker/core/compute.py): the one thread that owns the model            [runs Operations]
        -> WorkerService.applied / finish: recorded in the session's order (memory), then on the outbox thread
           (worker/core/outbox.py): journal (worker/recovery/), answer, Celery task event            [no compute]

The compute loop never waits on the network: the transport thread fetches (claim check) and decodes a request's
body before queueing it (:meth:`WorkerService._prefetch`, bounded by ``PREFETCH_BYTES``), and every write after
compute is the outbox's.

Nothing here raises to Celery; every failure becomes an error reply in our own wire format, and the worker
keeps serving. The lock guards the scheduler's bookkeeping and the session table, never the compute.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from transformers import PreTrainedModel

from tinkerq import keys, types
from tinkerq.connection import Connection
from tinkerq.errors import (
    MalformedMessageError,
    ServerError,
    ShardGroupError,
    TinkerqError,
    UnknownModelError,
    WorkerError,
)
from tinkerq.operations import TASK_NAMES, UNORDERED, task_name
from tinkerq.store import Write
from tinkerq.wire import codec, messages
from tinkerq.worker.core.compute import ComputeLoop
from tinkerq.worker.core.metrics import WorkerMetrics
from tinkerq.worker.core.operations import Operations
from tinkerq.worker.core.outbox import Outbox, Parcel
from tinkerq.worker.core.scheduler import Caller, Request, Scheduler
from tinkerq.worker.loading.models import max_seq_len, vocab_size
from tinkerq.worker.loading.quantized_base import parameter_count
from tinkerq.worker.recovery import Recovery
from tinkerq.worker.recovery.idle_release import IdleRelease
from tinkerq.worker.sampling.snapshots import Snapshots
from tinkerq.worker.sampling.torch_engine import TorchEngine
from tinkerq.worker.sharding.host import ShardHost
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.session import Session
from tinkerq.worker.training.sessions import SessionFactory, Slot
from tinkerq.worker.transport import creation
from tinkerq.worker.transport.events import TaskEvents
from tinkerq.worker.transport.intake import DeadLetters, reply_write, store_reply

log = logging.getLogger("tinkerq.worker")

# An answer as kept by the worker: ("ok", msgpack body bytes, timing) or ("error", wire error map, timing).
# It is wrapped into a reply (claim check) each time it is sent, so a repeated request gets a fresh copy.
Outcome = tuple[str, Any, dict[str, float]]

# Claim-checked bodies the transport fetches ahead of the compute loop, at most this many bytes at a time (beyond
# it, the compute loop fetches a body when it runs the request). Inline bodies are bounded by the lanes.
PREFETCH_BYTES = 256 * 1024 * 1024


class WorkerService:
    def __init__(self, connection: Connection, base_model: str, model_dir: str, model: PreTrainedModel,
                 worker_id: str, shards: ShardHost | None = None) -> None:
        self.connection = connection
        self.settings = s = connection.settings
        self.claim_check = connection.claim_check()
        self.base_model = base_model
        self.model_dir = model_dir
        self.model = model
        self.worker_id = worker_id
        self.vocab_size = vocab_size(model)
        self.max_seq_len = max_seq_len(model)
        self.num_parameters = parameter_count(model)  # a base kept quantized counts its kept weights too
        # A sharded worker (rank 0 of a group): sessions are LeaderSessions driving every shard.
        self.shards = shards
        self.logprobs = shards.logprobs if shards is not None else LogprobComputer(model, s.loss_backend)
        self.metrics = WorkerMetrics()
        self.cond = threading.Condition(threading.RLock())
        self.scheduler = Scheduler(max_pass_datums=s.lora_batch_max_datums)
        self.slots: dict[str, Slot] = {}
        self.dead_letters: DeadLetters | None = None  # set by a worker on Redis (not the embedded fleet)
        self.events = TaskEvents()  # Celery task events: set up by the transport in a worker process
        # When Redis last came back after an outage: a missing predecessor cannot arrive while Redis is down,
        # so the gap timeout counts from here (set by the heartbeat, which notices outages first).
        self.redis_back_at = time.monotonic()
        self.snapshots = Snapshots(connection.store, s, base_model, model,
                                   sessions=lambda: [slot.session for slot in list(self.slots.values())],
                                   worker_id=worker_id, sampling_base=shards.sampling_model if shards else None,
                                   serialise=self.run_control if shards is not None else None,
                                   blank=shards.blank_model if shards is not None else None)
        self.engine = TorchEngine(max_rows=s.sample_max_rows)
        self.factory = SessionFactory(s, model, model_dir, self.logprobs, base_model, worker_id, shards,
                                      evictable=self._evictable)
        self.operations = Operations(
            s, model, model_dir, base_model, self.logprobs, self.snapshots, vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len, position=self.scheduler.position,
            admit_sampler=lambda session: self.factory.admit_sampler(session, self.slots),
            on_metrics=self._shard_metrics)
        self.recovery = Recovery(self)
        self.idle = IdleRelease(self)
        self.compute = ComputeLoop(self)
        self.outbox = Outbox(self._deliver)
        self._prefetched = 0  # claim-checked bytes fetched ahead and not yet taken by the compute loop
        self.metrics.watch_sampling(self.engine.load, lambda: dict(self.scheduler.seconds))
        self.metrics.watch_lora(lambda: (self.compute.passes, self.compute.pass_requests))
        self.metrics.journal_entries.set_function(lambda: sum(s.journal_len for s in list(self.slots.values())))
        self.metrics.watch_sessions(self.session_stats)
        self.operations.sweep_checkpoints()

    def start(self) -> None:
        """Start the outbox and the compute loop (worker/core/lifecycle.py's Compute step)."""
        self.outbox.start()
        self.compute.start()

    # -- intake (transport threads) --------------------------------------------------------------------------

    def submit(self, op: str, envelope: Any, task_id: str, inbox: str | None = None,
               label: str = "") -> dict[str, Any] | None:
        """The reply to send now (a repeat, a refusal), or None: queued, answered when it runs.

        ``inbox`` is the sender's reply list (our own format, checked): the answer is pushed there."""
        caller = Caller(task_id, inbox if inbox is not None and keys.REPLY_LIST_RE.match(inbox) else None)
        try:
            outcome = self._take(op, envelope, caller, label[:512])
        except MalformedMessageError as exc:  # our own envelope or body layer: answered, and kept
            outcome = ("error", exc.to_wire(), {})
            self.dead_letter(op, envelope, task_id, exc)
        except TinkerqError as exc:
            outcome = ("error", exc.to_wire(), {})
        except Exception as exc:  # a bug: answer it, log it, keep serving
            log.exception("unexpected failure taking %s", op)
            outcome = ("error", WorkerError(f"{op} failed in the worker: {type(exc).__name__}: {exc}").to_wire(), {})
        return None if outcome is None else self.reply(outcome)

    def _take(self, op: str, envelope: Any, caller: Caller, label: str, tries: int = 3) -> Outcome | None:
        if op in UNORDERED:  # in no session's order
            model_id, _, _ = messages.check_envelope(envelope, op)
            request = Request(op, envelope, [caller], model_id=model_id, label=label)
            self._prefetch(request)
            if op == "create_model" and (why := creation.admit(self, request)) is not None:
                self.events.dropped(request, why)  # not answered here
                return None
            with self.cond:
                (self.scheduler.add_sample if op == "sample" else self.scheduler.add_create)(request)
                self.cond.notify_all()
                if op == "create_model":
                    # Taken one at a time, each once built: a busy worker does not take every new session off the
                    # model's queue (the others' share), yet builds the one it took right after its current unit.
                    while not request.done and self.compute.alive:
                        self.cond.wait(1.0)
            self.events.taken(request)
            return None
        model_id, seq_id, _ = messages.check_envelope(envelope, op)
        request = Request(op, envelope, [caller], model_id=model_id, seq_id=seq_id, label=label)
        self._prefetch(request)
        queued: list[Request] = []
        try:
            return self._queue(request, tries, queued)
        finally:
            if not queued:  # answered, refused, or joined a copy already waiting: its fetched body goes
                self.unreserve(request)

    def _queue(self, request: Request, tries: int, queued: list[Request]) -> Outcome | None:
        op, model_id, seq_id, caller, envelope, label = (request.op, request.model_id, request.seq_id,
                                                         request.callers[0], request.envelope, request.label)
        assert model_id is not None and seq_id is not None
        with self.cond:
            while True:
                if model_id in self.recovery.moved:  # its producer sent it to the adopter too: that one answers
                    log.warning("%s seq %d of session %s (adopted by %s) not answered here", op, seq_id, model_id,
                                self.recovery.moved[model_id])
                    return None
                admission = self.scheduler.admit(request)
                verdict = admission.verdict
                if verdict == "wait":
                    # Its session's queue is full of requests that will run: wait for room (this holds the broker's
                    # next messages back too: the bound in bytes is what keeps a worker's memory finite).
                    self.cond.wait(1.0)
                    continue
                if verdict == "repeat":
                    return admission.reply  # type: ignore[no-any-return]
                if verdict == "refused":
                    assert admission.error is not None
                    raise admission.error
                if verdict == "close":
                    self.close_session(model_id)
                    return ("ok", codec.packb({}), {})
                if verdict == "queued":
                    queued.append(request)
                    self.cond.notify_all()
                break
        if verdict == "unknown":  # released idle (worker/recovery/idle_release.py): restored, then taken again; or gone
            if tries <= 0:
                raise WorkerError(f"training session {model_id} was restored but released again before request "
                                  f"seq {seq_id} reached it; send it again")
            outcome = self.idle.take(op, model_id, seq_id)
            return outcome if outcome is not None else self._take(op, envelope, caller, label, tries - 1)
        # Hand the GIL over: the compute loop, woken above, starts the request now rather than after this thread's
        # next few milliseconds of Celery bookkeeping (measured: 1.5 ms median from submit to start otherwise).
        time.sleep(0)
        self.events.taken(request)
        return None

    # -- the compute loop's side ---------------------------------------------------------------------------------

    def _prefetch(self, request: Request) -> None:
        """Fetch (claim check) and decode ``request``'s body now, on the transport thread, so that the compute loop
        finds it ready (:meth:`take_body`). What fetching or decoding raises is kept and raised when the request
        runs, in its order, as it would have been there. Claim-checked bodies beyond ``PREFETCH_BYTES`` in all are
        left for the compute loop to fetch."""
        ref = request.envelope.get("payload")
        claimed = ref.get("size") if isinstance(ref, dict) and "inline" not in ref else 0
        size = claimed if isinstance(claimed, int) and not isinstance(claimed, bool) and claimed > 0 else 0
        if size:
            with self.cond:
                if self._prefetched and self._prefetched + size > PREFETCH_BYTES:
                    return
                self._prefetched += size
            request.prefetched = size
        try:
            raw = self.claim_check.unwrap(ref)
            request.body = (raw, self.unpack(raw))
            data = request.body[1].get("data") if isinstance(request.body[1], dict) else None
            request.datums = len(data) if isinstance(data, list) else None  # a loss request's (passes' bound)
        except Exception as exc:  # raised again where the compute loop takes the body
            request.body = exc

    def unreserve(self, request: Request) -> None:
        """``request``'s prefetched body no longer counts against the prefetch bound (taken, or never queued)."""
        with self.cond:
            self._prefetched -= request.prefetched
            request.prefetched = 0

    def take_body(self, request: Request) -> tuple[bytes, Any]:
        """``request``'s body as (raw bytes, decoded): the one prefetched by the intake, else fetched now (the
        compute loop; a request beyond the prefetch bound). Raises what fetching or decoding raised."""
        body, request.body = request.body, None
        if request.prefetched:
            self.unreserve(request)
        if body is None:
            raw = self.claim_check.unwrap(request.envelope.get("payload"))
            return raw, self.unpack(raw)
        if isinstance(body, BaseException):
            raise body
        return body

    def applied(self, slot: Slot, request: Request, raw: bytes | None, outcome: Outcome, *, runtime: float = 0.0,
                shared: str = "", discard: Any = None) -> None:
        """A request of ``slot`` ran (the compute loop): record it in its session's order now, so the next one can
        run; its journal entry and answer go out on the outbox, in order (``discard``: a claim-checked body to
        drop then). When the automatic snapshot is due, it is written here and put in place by the outbox before this
        request is answered (its answer names the snapshot a lost worker's client resumes from)."""
        seq = request.seq_id
        assert seq is not None
        entry = self.recovery.entry(seq, request.op, raw, outcome)
        with self.cond:
            self.scheduler.applied(request, outcome)
            self.cond.notify_all()  # a transport thread may wait for room in this lane
        self.metrics.observe(request.op, outcome[0], outcome[2])
        self.metrics.sessions.set(len(self.slots))
        if entry is not None:
            slot.journal_planned += 1
        if self.recovery.snapshot_due(slot):
            # The state after this request goes to files here, beside the automatic snapshot (no Redis); the outbox
            # then, after every earlier answer, journals this request, puts the snapshot in place and cuts the
            # journal down to this entry, and only then answers it. A kill at any point leaves a snapshot and a
            # journal that reach every answered request.
            if slot.snapshot_staged:
                # The previous one is still on its way to its place: the outbox is a whole snapshot period behind
                # (a Redis outage, or a very slow link). It goes first, as every snapshot did before they left the
                # loop, so that snapshots land where they are due and one at a time.
                self.outbox.flush()
            started = time.perf_counter()
            if self.recovery.stage_snapshot(slot, seq):
                staged_entry, entry = entry, None
                slot.journal_planned = int(staged_entry is not None)  # the cut: this request's entry alone
                self.outbox.put(lambda: self._install_snapshot(slot, request, staged_entry, started))
        self.outbox.put(Parcel(request, outcome, runtime, shared, slot, entry, discard))

    def _install_snapshot(self, slot: Slot, request: Request, entry: bytes | None, started: float) -> None:
        """The outbox, in order: ``request``'s journal entry, then its session's staged snapshot put in place."""
        assert request.seq_id is not None
        if entry is not None:
            self.recovery.journal(slot, request.seq_id, request.op, entry)
        self.recovery.install_snapshot(slot, request.seq_id, entry, started)

    def finish(self, request: Request, outcome: Outcome, *, runtime: float = 0.0, shared: str = "",
               discard: Any = None) -> None:
        """Answer every caller of ``request`` and report its end to Celery's event stream (on the outbox)."""
        self.outbox.put(Parcel(request, outcome, runtime, shared, discard=discard))

    def fail_all(self, requests: list[Request], error: TinkerqError) -> None:
        """Answer every one of ``requests`` (taken out of the scheduler) with ``error``."""
        wire = error.to_wire()
        for request in requests:
            self.finish(request, ("error", wire, {}))

    def _deliver(self, parcels: list[Parcel]) -> None:
        """The outbox thread: the journal entries and answers of ``parcels`` in one transaction (entries first),
        their task events in one message, then what is left to clean up."""
        writes: list[Write] = []
        answered: list[tuple[Parcel, dict[str, Any], int]] = []
        with self.cond:  # the callers known now; one that joins before the write below is answered after it
            callers = [list(p.request.callers) for p in parcels]
        for parcel in parcels:
            if parcel.slot is not None and parcel.entry is not None:
                writes.append(self.recovery.journal_write(parcel.slot, parcel.entry))
        for parcel, known in zip(parcels, callers, strict=True):
            reply = self.reply(parcel.outcome, writes)  # a claim-checked body: in the same transaction, before it
            writes += [reply_write(self.settings, c.task_id, c.inbox, reply) for c in known]
            answered.append((parcel, reply, len(known)))
        written = True
        try:
            self.connection.store.write_many(writes)
        except TinkerqError as exc:  # Redis stayed away for the whole retry window: the requests are sent again
            log.error("could not journal and answer %d request(s): %s", len(parcels), exc.message)
            written = False
        late: list[list[Caller]] = []
        with self.cond:  # from here a repeat is answered from the kept replies: its journal entry is written
            for parcel, _, known_count in answered:
                request = parcel.request
                if parcel.slot is not None and parcel.entry is not None:
                    parcel.slot.journal_len += written
                if parcel.slot is not None:
                    self.scheduler.sent(request)
                late.append(request.callers[known_count:])
        with self.events.batch():
            for (parcel, reply, _), joined in zip(answered, late, strict=True):
                for caller in joined:
                    self.answer(caller.task_id, caller.inbox, reply)
                self.events.finished(parcel.request, reply, parcel.runtime, parcel.shared)
                log.info("%s %s in %.1f ms", parcel.request.op, parcel.outcome[0], 1000 * parcel.runtime)
        with self.cond:
            for parcel in parcels:
                parcel.request.done = True
            self.cond.notify_all()
        for parcel in parcels:
            if parcel.discard is not None:
                self.claim_check.discard(parcel.discard)

    def run_control(self, fn: Any) -> Any:
        """Run ``fn`` on the compute loop before any other work and wait for it (adoption, dropping a session)."""
        if self.compute.is_current() or not self.compute.alive:
            return fn()
        done, result = threading.Event(), {}

        def control() -> None:
            try:
                result["value"] = fn()
            except BaseException as exc:
                result["error"] = exc
            finally:
                done.set()

        self._queue_control(control)
        done.wait()
        if "error" in result:
            raise result["error"]
        return result.get("value")

    def post_control(self, fn: Any) -> None:
        """Queue ``fn`` on the compute loop before any other work, without waiting for it (the outbox wakes the
        loop this way: worker/recovery/idle_release.py). An error is logged; the loop goes on."""
        def control() -> None:
            try:
                fn()
            except Exception:
                log.exception("control work posted to the compute loop failed")

        if self.compute.is_current() or not self.compute.alive:
            control()
            return
        self._queue_control(control)

    def _queue_control(self, control: Any) -> None:
        with self.cond:
            self.scheduler.add_control(control)
            self.cond.notify_all()

    def run_when_idle(self, fn: Any) -> bool:
        """Run ``fn`` on the compute loop and wait for it, but only when the loop has nothing else to run (a shard
        group's idle ping); False, and nothing run, when it is busy."""
        with self.cond:
            if self.scheduler.has_work() or self.compute.current is not None or not self.compute.alive:
                return False
        self.run_control(fn)
        return True

    # -- sessions ------------------------------------------------------------------------------------------------

    def open_session(self, model_id: str, lora: Any, optimizer: Any = None) -> Slot:
        session = self.factory.make(model_id, lora, self.slots, self.idle.make_room, optimizer)
        with self.cond:
            self.scheduler.open(model_id, session.pass_group)
            slot = Slot(session)
            self.slots[model_id] = slot
        self.metrics.sessions.set(len(self.slots))
        return slot

    def _evictable(self, last_used: dict[str, float], now: float, idle_s: float) -> str | None:
        with self.cond:
            return self.scheduler.evictable(last_used, now, idle_s)

    def release_creation(self, model_id: str) -> None:
        """Give up this worker's claim on a session it could not build (worker/transport/creation.py); on the outbox."""
        creation.release_creation(self, model_id)

    def drop_session(self, model_id: str) -> Slot | None:
        """Forget a session here without answering what waits for it (adopted elsewhere, or never built)."""
        with self.cond:
            slot = self.slots.pop(model_id, None)
            self.scheduler.close(model_id)
        if slot is not None:
            slot.session.close()
            self.snapshots.forget_session(model_id)
        return slot

    def close_session(self, model_id: str) -> None:
        with self.cond:
            slot = self.slots.pop(model_id, None)
            waiting = self.scheduler.close(model_id)
        if slot is None:
            return
        slot.session.close()
        self.snapshots.forget_session(model_id)
        # After its last journal entries, which the outbox may still hold: forgotten with the rest of its records.
        self.outbox.put(lambda: self.recovery.forget(model_id))
        self.fail_all(waiting, UnknownModelError(f"training session {model_id} was closed"))

    def break_session(self, model_id: str, reason: str, error: type[ServerError] = ServerError) -> None:
        """Make a session unusable (any thread): its waiting requests and every later one are refused with
        ``error(reason)``; it stays until closed."""
        with self.cond:
            waiting = self.scheduler.break_session(model_id, reason, error)
        self.fail_all(waiting, error(reason, session_broken=True))

    def model_info(self, session: Session) -> dict[str, Any]:
        extra = {"device": self.settings.device, "dtype": self.settings.dtype, "loss_backend": self.logprobs.backend,
                 "shards": self.settings.shards, "heartbeat_s": self.settings.heartbeat_s, **session.describe()}
        return types.ModelInfo(
            model_id=session.model_id, base_model=self.base_model, vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len, num_parameters=self.num_parameters, worker=self.worker_id, extra=extra,
        ).__dict__

    def expire_gaps(self) -> int:
        """Fail requests that waited too long for a missing predecessor; returns how many were failed.

        Called periodically (the watchdog). The session is marked unusable: applying later requests without the
        missing one would silently change what the client asked for."""
        now, failed = time.monotonic(), 0
        if now - self.redis_back_at <= self.settings.gap_timeout_s:
            return 0

        def why(model_id: str, missing: int) -> str:
            return (f"request seq {missing} of session {model_id} never reached worker {self.worker_id} within "
                    f"{self.settings.gap_timeout_s:g} s (TINKERQ_GAP_TIMEOUT_S), so the requests after it were not "
                    f"applied; create a new training client (or resume from a checkpoint)")

        with self.cond:
            expired = self.scheduler.expire_gaps(now, self.settings.gap_timeout_s, why)
        for waiting, error in expired:
            log.error(error.message)
            self.fail_all(waiting, error)
            failed += len(waiting)
        return failed

    def shard_group_failed(self, reason: str) -> None:
        """The shard group broke and dropped its sessions' shards (any thread). Journaled sessions are held: their
        requests wait, and each is re-made once the group re-forms (:meth:`shard_group_formed`), or given up after
        ``adopt_timeout_s`` (worker/recovery/). Any other session is gone: its waiting requests are answered now."""
        # ShardHost's text says what failed; what becomes of the sessions that are not held is told here.
        lost = (f"{reason.rstrip('.')}. Its training sessions are lost: restart the failed shard (the group "
                f"re-forms by itself) and resume from your last save_state checkpoint")
        with self.cond:
            held = self.recovery.group.hold(reason)
            waiting = []
            for model_id in self.slots:
                if model_id not in held:
                    waiting += self.scheduler.break_session(model_id, lost, ShardGroupError)
        self.fail_all(waiting, ShardGroupError(lost, session_broken=True))

    def shard_group_formed(self) -> None:
        """The shard group re-formed (its re-forming thread): re-make the sessions held through the outage from
        their snapshots and journals (on the compute loop; this waits for it), then their requests run."""
        self.recovery.group.group_formed()

    def start_watchdog(self, period_s: float = 1.0) -> threading.Event:
        return self.recovery.start_watchdog(period_s)

    def close(self, drain_s: float = 30.0) -> None:
        """Finish the queued work (up to ``drain_s``), then stop; requests still waiting are answered."""
        self.compute.stop(drain_s)
        self.engine.close()
        with self.cond:
            left = self.scheduler.drain()
        self.fail_all(left, WorkerError("the worker stopped before this request ran; send it again"))
        self.outbox.stop(drain_s)

    # -- stats -----------------------------------------------------------------------------------------------------

    def session_stats(self) -> list[dict[str, Any]]:
        """Per training session held here, for Prometheus, `inspect stats` (Flower) and tests: journal length,
        seconds since its latest automatic snapshot (None before the first), and whether it was adopted."""
        now = time.time()
        return [{"model_id": model_id, "journal_entries": slot.journal_len,
                 "snapshot_age_s": None if slot.snapshot_at is None else round(max(0.0, now - slot.snapshot_at), 3),
                 "adopted": slot.adopted_from is not None}
                for model_id, slot in list(self.slots.items())]

    def stats(self) -> dict[str, Any]:
        """The ``tinkerq`` block of the Celery worker's ``inspect stats`` (Flower's worker page, Stats)."""
        work = self.compute.current
        running = [{"name": task_name(r.op), "args": r.label} for r in (work.requests if work else [])]
        return {"worker": self.worker_id, "adoptions": self.metrics.adoptions_count(),
                "restored": self.recovery.group.restores, "released": self.metrics.count("tinkerq_idle_releases"),
                "resumed": self.metrics.count("tinkerq_idle_resumes"), "sessions": self.session_stats(),
                "running": running}

    def _shard_metrics(self, metrics: dict[str, float]) -> None:
        if "shard_state_bytes:max" in metrics:
            self.metrics.shard_state_bytes.set(metrics["shard_state_bytes:max"])

    # -- wire --------------------------------------------------------------------------------------------------------

    def unpack(self, raw: bytes) -> Any:
        return codec.unpackb(raw, max_bytes=self.settings.max_message_bytes)

    def reply(self, outcome: Outcome, writes: list[Write] | None = None) -> dict[str, Any]:
        """The reply to ``outcome``; a claim-checked body is SET now or, with ``writes``, appended there."""
        status, value, timing = outcome
        reply = (messages.ok_reply(self.claim_check.wrap(value, writes)) if status == "ok"
                 else {"ok": False, "error": value})
        if timing:
            reply["timing"] = timing
        return reply

    def dead_letter(self, op: str, envelope: Any, task_id: str | None, exc: MalformedMessageError) -> None:
        """Keep a request whose envelope or body is malformed in tinkerq.dead (its sender is answered anyway). From
        the compute loop the write goes on the outbox: the loop does not wait on Redis."""
        if self.dead_letters is None:
            return
        try:
            raw = codec.packb(envelope)
        except TinkerqError:
            raw = repr(envelope)[:4096].encode()
        letters, where = self.dead_letters, f"task {TASK_NAMES.get(op, op)}"
        if self.compute.is_current():
            self.outbox.put(lambda: letters.refuse(exc.message, raw, where, task_id, answer=False))
        else:
            letters.refuse(exc.message, raw, where, task_id, answer=False)

    def answer(self, task_id: str, inbox: str | None, reply: dict[str, Any]) -> None:
        """Store ``reply`` for ``task_id`` and push it to the sender's inbox; retried through Redis outages."""
        if inbox is not None and not keys.REPLY_LIST_RE.match(inbox):
            inbox = None
        try:
            store_reply(self.connection.store, self.settings, task_id, inbox, reply)
        except TinkerqError as exc:  # Redis stayed away for the whole retry window: the request is redelivered
            log.error("could not answer %s: %s", task_id, exc.message)
