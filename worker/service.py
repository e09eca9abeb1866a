"""What a worker does with a request: decode, order, validate, apply, answer.

Transport-independent: the Celery tasks in :mod:`tinkerq.worker.tasks` hand envelopes to :meth:`WorkerService.handle`
and return what it gives back. Nothing here raises to Celery; every failure becomes an error reply in
our own wire format, and the worker keeps serving.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedModel

from tinkerq import keys, types
from tinkerq.celery_app import TASK_NAMES
from tinkerq.connection import Connection
from tinkerq.errors import (
    CapacityError,
    MalformedMessageError,
    RequestTimeoutError,
    ServerError,
    ShardGroupError,
    TinkerqError,
    UnknownModelError,
    ValidationError,
    WorkerError,
)
from tinkerq.validation import (
    Limits,
    validate_adam,
    validate_lora,
    validate_loss_request,
    validate_sampling,
    validate_ttl_seconds,
)
from tinkerq.wire import codec, messages
from tinkerq.worker import checkpoints, memory
from tinkerq.worker.intake import DeadLetters, store_reply
from tinkerq.worker.logprobs import LogprobComputer
from tinkerq.worker.lora.batch import LossItem
from tinkerq.worker.lora.passes import LoraPasses
from tinkerq.worker.lora.session import LoraBase, LoraSession, config_dict
from tinkerq.worker.metrics import WorkerMetrics
from tinkerq.worker.model_loading import max_seq_len, vocab_size
from tinkerq.worker.ordering import Ordering
from tinkerq.worker.registry import LOST_AFTER_BEATS, reap_dead_workers
from tinkerq.worker.sampling.engine import SampleJob
from tinkerq.worker.sampling.rules import StopRule
from tinkerq.worker.sampling.torch_engine import TorchEngine
from tinkerq.worker.session import Session, TrainingSession
from tinkerq.worker.sharding.host import LeaderSession, ShardHost
from tinkerq.worker.snapshots import Snapshots
from tinkerq.worker.turns import ComputeTurns

log = logging.getLogger("tinkerq.worker")

# An answer as kept by the worker: ("ok", msgpack body bytes, timing) or ("error", wire error map, timing).
# It is wrapped into a reply (claim check) each time it is sent, so a repeated request gets a fresh copy.
Outcome = tuple[str, Any, dict[str, float]]
NO_TIMING: dict[str, float] = {}





@dataclass
class _Slot:
    session: Session
    ordering: Ordering
    broken: str | None = None
    broken_error: type[ServerError] = ServerError  # the error that tells callers the session is unusable
    # A LoRA loss request handed to the pass loop: its seq and the task ids waiting for its answer. The
    # session's later requests wait in its order meanwhile.
    in_flight: int | None = None
    in_flight_tasks: list[str] | None = None
    steps_since_snapshot: int = 0  # optimizer steps since the latest automatic snapshot
    journal_len: int = 0  # entries in the session's journal (requests applied since that snapshot)
    snapshot_due: bool = False  # auto_snapshot_steps reached: snapshot once the current request is journaled
    snapshot_at: float | None = None  # wall time of the latest automatic snapshot (None before the first)
    adopted_from: str | None = None  # the lost worker this session was adopted from


class WorkerService:
    def __init__(self, connection: Connection, base_model: str, model_dir: str, model: PreTrainedModel,
                 worker_id: str, shards: ShardHost | None = None) -> None:
        self.connection = connection
        self.settings = connection.settings
        self.claim_check = connection.claim_check()
        self.base_model = base_model
        self.model_dir = model_dir
        self.model = model
        self.worker_id = worker_id
        self.vocab_size = vocab_size(model)
        self.max_seq_len = max_seq_len(model)
        self.num_parameters = sum(p.numel() for p in model.parameters())
        # A sharded worker (rank 0 of a group): sessions are LeaderSessions driving every shard.
        self.shards = shards
        self.logprobs = shards.logprobs if shards is not None else LogprobComputer(model, self.settings.loss_backend)
        self.limits = Limits(max_datums=self.settings.max_datums, max_batch_tokens=self.settings.max_batch_tokens)
        self.slots: dict[str, _Slot] = {}
        self._tokenizer: Any = None
        self.metrics = WorkerMetrics()
        self._lock = threading.RLock()
        self._inboxes: dict[str, str | None] = {}  # buffered task id -> its sender's reply inbox
        self.dead_letters: DeadLetters | None = None  # set by a worker on Redis (not the embedded fleet)
        # When Redis last came back after an outage: a missing predecessor cannot arrive while Redis is down,
        # so the gap timeout counts from here (set by the heartbeat, which notices outages first).
        self.redis_back_at = time.monotonic()
        # Sampling runs in the engine's thread, decoupled from the training stream; the two take fair turns
        # on the compute (worker/turns.py).
        self.turns = ComputeTurns()
        self.snapshots = Snapshots(connection.store, self.settings, base_model, model,
                                   sessions=lambda: [slot.session for slot in list(self.slots.values())],
                                   worker_id=worker_id)
        self.engine = TorchEngine(max_rows=self.settings.sample_max_rows, gate=lambda: self.turns.take("sample"))
        self.metrics.watch_sampling(self.engine.load, self.turns.seconds)
        # LoRA sessions share this model, frozen (made on the first LoRA session; docs/lora.md).
        self._lora_base: LoraBase | None = None
        self.lora_passes: LoraPasses | None = None
        # op -> (session, body) -> (reply body bytes, tokens processed)
        self._ops: dict[str, Callable[[Session, Any], tuple[bytes, int]]] = {
            "forward_backward": lambda s, body: self._loss(s, body, backward=True),
            "forward": lambda s, body: self._loss(s, body, backward=False),
            "optim_step": self._optim_step,
            "save_weights_for_sampler": self._save_weights,
            "save_state": self._save_state,
            "load_state": self._load_state,
            "create_sampler": self._create_sampler,
            "echo": lambda s, body: (codec.packb(body), 0),
            "close_model": lambda s, body: (codec.packb({}), 0),
        }
        self._sweeping = threading.Lock()  # held while expired checkpoints are being deleted
        self._moved: dict[str, str] = {}  # sessions adopted by another worker while this one was taken for lost
        self.metrics.journal_entries.set_function(lambda: sum(s.journal_len for s in list(self.slots.values())))
        self.metrics.watch_sessions(self.session_stats)
        self.sweep_checkpoints()

    # -- entry point -----------------------------------------------------------------------------------------

    def handle(self, op: str, envelope: Any, task_id: str, inbox: str | None = None) -> dict[str, Any] | None:
        """The reply to send now, or None when the request was buffered (it is answered when it runs).

        ``inbox`` is the sender's reply list: a buffered request is answered there when it finally runs.
        """
        started = time.perf_counter()
        # A sample request touches no session: it is checked and handed to the engine without waiting for the
        # training request that may hold the lock (its snapshots, engine and memory checks are thread-safe).
        with self._lock if op != "sample" else contextlib.nullcontext():
            try:
                if op == "create_model":
                    outcome = self._create_model(envelope)
                elif op == "sample":  # not in any session's order: it joins the running sampling batch
                    outcome = self._sample(envelope, task_id, inbox)
                else:
                    outcome = self._sequenced(op, envelope, task_id, inbox)
            except MalformedMessageError as exc:  # our own envelope or body layer: answered, and kept
                outcome = ("error", exc.to_wire(), NO_TIMING)
                self._dead_letter(op, envelope, task_id, exc)
            except TinkerqError as exc:
                outcome = ("error", exc.to_wire(), NO_TIMING)
            except Exception as exc:  # a bug: answer it, log it, keep serving
                log.exception("unexpected failure in %s", op)
                error = WorkerError(f"{op} failed in the worker: {type(exc).__name__}: {exc}")
                outcome = ("error", error.to_wire(), NO_TIMING)
        if outcome is None:
            return None
        log.info("%s %s in %.1f ms", op, outcome[0], 1000 * (time.perf_counter() - started))
        return self._reply(outcome)

    # -- sessions -------------------------------------------------------------------------------------------------

    def _create_model(self, envelope: Any) -> Outcome | None:
        model_id, _, ref = messages.check_envelope(envelope, "create_model")
        body = self._decode(ref)
        requested = body.get("base_model") if isinstance(body, dict) else None
        if requested != self.base_model:
            raise UnknownModelError(f"this worker serves {self.base_model!r}, not {requested!r}")
        if self.settings.role == "sampler":
            raise UnknownModelError(f"worker {self.worker_id} only samples (--role sampler); training sessions "
                                    f"open on workers started without it")
        deadline = body.get("deadline")
        if isinstance(deadline, (int, float)) and time.time() > deadline:
            # The producer stopped waiting long ago (a message that sat in a queue without workers): opening
            # a session nobody will use would only take a slot.
            raise RequestTimeoutError(f"create_model for {requested!r} arrived after its caller stopped waiting")
        lora = messages.decode_lora(body.get("lora"))
        if model_id not in self.slots:
            holder = self._claim_creation(model_id)
            if holder != self.worker_id:  # a duplicate delivery: the worker holding the claim answers
                log.warning("create_model of %s not applied here: worker %s built it", model_id, holder)
                return None
            session = self._new_lora_session(model_id, lora) if lora is not None else self._new_full_session(model_id)
            self.slots[model_id] = _Slot(session, Ordering())
            log.info("opened %s session %s (%d open)", "LoRA" if lora else "full", model_id, len(self.slots))
            self._write_home(session)
        session = self.slots[model_id].session
        extra = {"device": self.settings.device, "dtype": self.settings.dtype, "loss_backend": self.logprobs.backend,
                 "shards": self.settings.shards, "heartbeat_s": self.settings.heartbeat_s}
        if isinstance(session, LoraSession):
            extra["lora"] = {**config_dict(session.config), "trainable_parameters": session.num_parameters(),
                             "state_bytes": session.state_bytes()}
        info = types.ModelInfo(
            model_id=model_id, base_model=self.base_model, vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len, num_parameters=self.num_parameters, worker=self.worker_id, extra=extra,
        )
        return ("ok", codec.packb(info.__dict__), NO_TIMING)

    def _claim_creation(self, model_id: str) -> str:
        """Claim the right to build session ``model_id`` (SET NX); the worker that holds the claim.

        A ``create_model`` can reach two workers (docs/reliability.md, "Exactly once"); only the first to claim
        builds the session. A claim held here for a session no longer open means it was built and closed."""
        store = self.connection.store.with_retry(self.settings.heartbeat_s)
        ttl_s = self.settings.auto_snapshot_ttl_s
        if store.set_if_absent(keys.session_claim(model_id), self.worker_id.encode(), ttl_s):
            return self.worker_id
        raw = store.get(keys.session_claim(model_id))
        holder = raw.decode(errors="replace") if raw else self.worker_id
        if holder == self.worker_id:
            raise UnknownModelError(f"training session {model_id} was already created here and closed; "
                                    f"create a new training client")
        return holder

    def _new_full_session(self, model_id: str) -> Session:
        self._make_room(lora=False)
        memory.admit_session(self.model, self.settings, [slot.session for slot in self.slots.values()])
        return self._new_session(model_id)

    def _new_lora_session(self, model_id: str, config: types.LoraConfig) -> LoraSession:
        validate_lora(config, max_rank=self.settings.max_lora_rank)
        if self.shards is not None:
            raise ValidationError(f"worker {self.worker_id} is sharded ({self.settings.shards} shards); LoRA sessions "
                                  f"are served by unsharded workers (docs/lora.md): start one with tinkerq worker "
                                  f"--model {self.base_model}, or use create_training_client for full-parameter "
                                  f"training here")
        if config.seed is None:  # Tinker: no seed, a random one; kept so the session can be told and re-made
            config = types.LoraConfig(**{**config_dict(config), "seed": secrets.randbits(63)})
        base = self._lora()
        targets = base.targets(config)
        self._make_room(lora=True)
        parameters = config.rank * sum(t.parameters_per_rank() for t in targets)
        memory.admit_lora_session(parameters, self.settings, [slot.session for slot in self.slots.values()])
        return LoraSession(model_id, base, config, base_model=self.base_model)

    def _lora(self) -> LoraBase:
        if self._lora_base is None:
            self._lora_base = LoraBase(self.model, self.logprobs, model_dir=self.model_dir,
                                       microbatch_tokens=self.settings.microbatch_tokens)
            passes = self.lora_passes = LoraPasses(self._lora_base, max_datums=self.settings.lora_batch_max_datums,
                                                   gate=lambda: self.turns.take("train"))
            self.metrics.watch_lora(lambda: (passes.passes, passes.requests))
        return self._lora_base

    def _new_session(self, model_id: str) -> Session:
        if self.shards is not None:
            return LeaderSession(self.shards, model_id)
        # Every weight of the copy trains (the shared model itself is frozen once LoRA sessions use it).
        return TrainingSession(model_id, copy.deepcopy(self.model).requires_grad_(True), base_dir=self.model_dir,
                               microbatch_tokens=self.settings.microbatch_tokens, logprobs=self.logprobs,
                               blank_model=lambda: copy.deepcopy(self.model))

    def shard_group_failed(self, reason: str) -> None:
        """The shard group broke: every session it held is gone. Answer their waiting requests now."""
        with self._lock:
            outcome = ("error", ShardGroupError(reason, session_broken=True).to_wire(), NO_TIMING)
            for slot in self.slots.values():
                slot.broken, slot.broken_error = reason, ShardGroupError
                for pending in slot.ordering.drop_buffered():
                    self._store_late(pending.task_ids, outcome)

    def _make_room(self, *, lora: bool) -> None:
        """Close a broken or idle session of the same kind when that kind is at its count limit."""
        kind = {mid: s for mid, s in self.slots.items() if isinstance(s.session, LoraSession) == lora}
        limit, setting = ((self.settings.max_lora_sessions, "TINKERQ_MAX_LORA_SESSIONS") if lora
                          else (self.settings.max_sessions, "TINKERQ_MAX_SESSIONS"))
        if len(kind) < limit:
            return
        now = time.monotonic()
        broken = [mid for mid, s in kind.items() if s.broken is not None]
        if broken:  # a session that can no longer serve goes first
            self._close(broken[0])
            return
        idle = [mid for mid, s in kind.items()
                if s.in_flight is None and now - s.session.last_used > self.settings.session_idle_ttl_s]
        if idle:
            oldest = min(idle, key=lambda mid: self.slots[mid].session.last_used)
            log.warning("closing idle session %s to make room", oldest)
            self._close(oldest)
            return
        raise CapacityError(
            f"worker {self.worker_id} already holds {len(kind)} {'LoRA' if lora else 'full-parameter'} training "
            f"sessions ({setting}); close unused training clients (tc.close()) or start another worker for this model"
        )

    def _close(self, model_id: str) -> None:
        slot = self.slots.pop(model_id)
        slot.session.close()
        self.snapshots.forget_session(model_id)
        # A closed session needs no snapshot to resume from (and a full one holds the whole model's state).
        with contextlib.suppress(TinkerqError):
            self.connection.store.delete(keys.auto_snapshot(model_id))
            self.connection.store.delete(keys.session_home(model_id))  # nothing to adopt any more
            self.connection.store.delete(keys.journal(model_id))
        checkpoints.remove_auto_snapshot(self.settings.checkpoint_dir, model_id)
        gone = ("error", UnknownModelError(f"training session {model_id} was closed").to_wire(), NO_TIMING)
        for pending in slot.ordering.buffered.values():
            self._store_late(pending.task_ids, gone)

    def expire_gaps(self) -> int:
        """Fail requests that waited too long for a missing predecessor; returns how many were failed.

        Called periodically (:meth:`start_watchdog`). The session is marked unusable: applying later
        requests without the missing one would silently change what the client asked for.
        """
        now, failed = time.monotonic(), 0
        with self._lock:
            for model_id, slot in self.slots.items():
                if slot.in_flight is not None:  # its successors wait for a running LoRA pass, not a lost message
                    continue
                if min(slot.ordering.waited(now), now - self.redis_back_at) <= self.settings.gap_timeout_s:
                    continue
                missing = slot.ordering.next_seq
                slot.broken = (
                    f"request seq {missing} of session {model_id} never reached worker {self.worker_id} within "
                    f"{self.settings.gap_timeout_s:g} s (TINKERQ_GAP_TIMEOUT_S), so the requests after it were "
                    f"not applied; create a new training client (or resume from a checkpoint)"
                )
                log.error(slot.broken)
                outcome = ("error", ServerError(slot.broken, session_broken=True).to_wire(), NO_TIMING)
                for pending in slot.ordering.drop_buffered():
                    self._store_late(pending.task_ids, outcome)
                    failed += 1
        return failed

    def start_watchdog(self, period_s: float = 1.0) -> threading.Event:
        """Run :meth:`expire_gaps` every ``period_s``, and the dead-worker reaper every few heartbeats, in a
        daemon thread; set the returned event to stop."""
        stop = threading.Event()
        reap_every = max(1, round(2 * self.settings.heartbeat_s / period_s))

        def loop() -> None:
            ticks = 0
            while not stop.wait(period_s):
                ticks += 1
                try:
                    self.expire_gaps()
                    # Only once this worker has been in touch with Redis for a while: after an outage every
                    # heartbeat is old, and live workers must get the time to beat again.
                    settled = time.monotonic() - self.redis_back_at > 4 * self.settings.heartbeat_s
                    if settled:  # every tick: a lost worker's sessions are adopted as soon as it is seen gone
                        self.adopt_orphans()
                    if ticks % reap_every == 0 and settled:
                        reap_dead_workers(self.connection.store.with_retry(self.settings.heartbeat_s),
                                          self.settings, self.worker_id)
                except TinkerqError as exc:
                    log.warning("watchdog: %s", exc.message)
                except Exception:
                    log.exception("gap watchdog failed")

        threading.Thread(target=loop, name="tinkerq-gap-watchdog", daemon=True).start()
        return stop

    def close(self) -> None:
        """Stop the sampling engine and the LoRA pass loop (requests still waiting are answered with an error)."""
        self.engine.close()
        if self.lora_passes is not None:
            self.lora_passes.close()

    # -- adoption (docs/reliability.md) --------------------------------------------------------------------------

    @property
    def _journaling(self) -> bool:
        """Whether this worker's sessions are adoptable: journaled, with a session record. Not on sharded
        workers (a shard group's session is not re-made elsewhere: a documented limit)."""
        return self.settings.journal_max_entries > 0 and self.shards is None and self.settings.role != "sampler"

    def _write_home(self, session: Session) -> None:
        """Record where the session lives and how to re-make it (an adopter opens the same one)."""
        if not self._journaling:
            return
        lora = config_dict(session.config) if isinstance(session, LoraSession) else None  # the effective seed
        home = {"model_id": session.model_id, "base_model": self.base_model, "worker": self.worker_id, "lora": lora}
        try:
            self.connection.store.set(keys.session_home(session.model_id), json.dumps(home).encode(),
                                      self.settings.auto_snapshot_ttl_s)
        except TinkerqError as exc:  # the session works; it just cannot be adopted
            log.warning("could not record session %s: %s", session.model_id, exc.message)

    def _applied(self, slot: _Slot, seq_id: int, op: str, raw: bytes | None, outcome: Outcome) -> None:
        """A request was applied (its answer is not sent yet): journal it, then take the automatic snapshot if
        one is due, so every answered request is in the snapshot or the journal. A request whose answer is an
        error changed nothing: its body is not kept, only the answer; nor is the body of a request that changes no
        state (forward, echo: an adopter only answers a repeat of it, it never applies it again)."""
        if op == "close_model":
            return
        entry = None
        if self._journaling:
            keep_body = outcome[0] == "ok" and op not in STATELESS_OPS
            entry = codec.packb({"seq": seq_id, "op": op, "body": raw if keep_body else None,
                                 "reply": list(outcome)})
            try:
                self.connection.store.push(keys.journal(slot.session.model_id), entry,
                                           ttl_s=self.settings.auto_snapshot_ttl_s)
                slot.journal_len += 1
            except TinkerqError as exc:  # its answer cannot be stored either: the producer posts it again
                log.warning("could not journal %s seq %d of %s: %s", op, seq_id, slot.session.model_id, exc.message)
                return
        # Due after auto_snapshot_steps optimizer steps, or when the journal is too long (any request boundary).
        if slot.broken is None and (slot.snapshot_due or slot.journal_len > self.settings.journal_max_entries > 0):
            self._snapshot(slot, seq_id, entry)

    def adopt_orphans(self) -> int:
        """Adopt the sessions of lost workers of this model (periodic); returns how many were adopted.

        A session record whose worker has not beaten for ``LOST_AFTER_BEATS`` periods is claimed (SET NX, so one
        worker adopts it), re-made from its automatic snapshot and journal, and recorded as this worker's; the
        producers then send its requests here (producer/dispatch.py)."""
        if not self._journaling:
            return 0
        store = self.connection.store.with_retry(self.settings.heartbeat_s)
        limit = LOST_AFTER_BEATS * self.settings.heartbeat_s
        ages = store.ages(keys.HEARTBEATS)
        adopted = 0
        for key in store.scan(keys.SESSION_HOME_PATTERN):
            home = _home(store.get(key))
            if home is not None and home["worker"] != self.worker_id and home["model_id"] in self.slots:
                self._adopted_away(home)
                continue
            if (home is None or home["base_model"] != self.base_model or home["worker"] == self.worker_id
                    or ages.get(home["worker"], float("inf")) <= limit or home["model_id"] in self.slots):
                continue
            model_id = home["model_id"]
            if not self._claim(store, model_id, ages, limit):
                continue
            try:
                # Claimed; re-read: another worker may have adopted it between our scan and the claim.
                home = _home(store.get(key))
                if home is None or ages.get(home["worker"], float("inf")) <= limit:
                    continue
                with self._lock:
                    self._adopt(home, store)
                adopted += 1
            except Exception:
                log.exception("adopting session %s failed; another worker may try", model_id)
            finally:
                with contextlib.suppress(TinkerqError):
                    store.delete(keys.adopting(model_id))
        return adopted

    def session_stats(self) -> list[dict[str, Any]]:
        """Per training session held here, for Prometheus, `inspect stats` (Flower) and tests: journal length,
        seconds since its latest automatic snapshot (None before the first), and whether it was adopted. Reads
        a copy of the slot list, without the worker's lock (a request may be running)."""
        now = time.time()
        return [{"model_id": model_id, "journal_entries": slot.journal_len,
                 "snapshot_age_s": None if slot.snapshot_at is None else round(max(0.0, now - slot.snapshot_at), 3),
                 "adopted": slot.adopted_from is not None}
                for model_id, slot in list(self.slots.items())]

    def stats(self) -> dict[str, Any]:
        """The ``tinkerq`` block of the Celery worker's ``inspect stats`` (Flower's worker page, Stats)."""
        return {"worker": self.worker_id, "adoptions": self.metrics.adoptions_count(),
                "sessions": self.session_stats()}

    def _adopted_away(self, home: dict[str, Any]) -> None:
        """This worker was taken for lost (paused, cut off) and another adopted one of its sessions: the copy here
        is dropped without touching the session's record, journal or snapshot (the adopter's now), and requests
        still reaching it here go unanswered (their producer sent them to the adopter, which answers)."""
        with self._lock:
            slot = self.slots.pop(home["model_id"], None)
            if slot is None:
                return
            self._moved[home["model_id"]] = home["worker"]
            slot.session.close()
            self.snapshots.forget_session(home["model_id"])
            slot.ordering.drop_buffered()
            log.error("training session %s was adopted by worker %s while this worker was taken for lost: dropped "
                      "here", home["model_id"], home["worker"])

    def _claim(self, store: Any, model_id: str, ages: dict[str, float], limit: float) -> bool:
        """Claim a session for adoption; a claim left by a worker lost meanwhile (mid-adoption) is taken over."""
        if store.set_if_absent(keys.adopting(model_id), self.worker_id.encode(), ADOPT_CLAIM_TTL_S):
            return True
        holder = store.get(keys.adopting(model_id))
        if holder is None or ages.get(holder.decode(errors="replace"), float("inf")) <= limit:
            return False
        store.delete(keys.adopting(model_id))
        return store.set_if_absent(keys.adopting(model_id), self.worker_id.encode(), ADOPT_CLAIM_TTL_S)

    def _adopt(self, home: dict[str, Any], store: Any) -> None:
        """Re-make a lost worker's session here: snapshot, then the journal's later requests, in order."""
        model_id, lost = home["model_id"], home["worker"]
        started = time.perf_counter()
        lora = home.get("lora")
        session = (self._new_lora_session(model_id, types.LoraConfig(**lora)) if lora
                   else self._new_full_session(model_id))
        slot = _Slot(session, Ordering())
        self.slots[model_id] = slot
        try:
            # The snapshot directory's own seq_id is the truth: a kill can fall between its rename and the record.
            directory = checkpoints.state_path(self.settings.checkpoint_dir, model_id, checkpoints.AUTO_SNAPSHOT)
            if not (directory / checkpoints.STATE_FILE).is_file():  # killed between write_atomically's renames
                directory = checkpoints.previous_path(directory)
            last = 0
            if (directory / checkpoints.STATE_FILE).is_file():
                last = int(session.load_state(directory, optimizer=True)["seq_id"])
            slot.ordering.next_seq = last + 1
            journal = sorted((codec.unpackb(raw) for raw in store.list_range(keys.journal(model_id), 0, -1)),
                             key=lambda e: e["seq"])
            for entry in journal:  # covered by the snapshot; their answers may not have reached their callers
                if entry["seq"] <= last:
                    slot.ordering.keep(entry["seq"], _outcome(entry))
            entries = [e for e in journal if e["seq"] > last]
            # Replayed requests are neither journaled again nor snapshotted here (_applied is not called): the
            # journal being replayed stays in Redis until the next snapshot covers it.
            for entry in entries:
                if entry["seq"] < slot.ordering.next_seq:  # twice (a worker resumed after being taken for lost)
                    continue
                if entry["seq"] != slot.ordering.next_seq:
                    raise WorkerError(f"the journal of {model_id} misses request {slot.ordering.next_seq}")
                reply = _outcome(entry)
                self._replay(slot, entry["op"], entry["body"], reply)
                slot.ordering.applied(entry["seq"], reply)  # a repeat of it is answered as the lost worker did
            slot.journal_len = len(journal)
            slot.steps_since_snapshot = sum(1 for e in entries if e["op"] == "optim_step" and e["reply"][0] == "ok")
            slot.snapshot_at, slot.adopted_from = _snapshot_time(store.get(keys.auto_snapshot(model_id))), lost
            home = {**home, "worker": self.worker_id, "adopted_from": lost}
            store.set(keys.session_home(model_id), json.dumps(home).encode(), self.settings.auto_snapshot_ttl_s)
        except BaseException:
            self.slots.pop(model_id, None)
            session.close()
            raise
        self.metrics.adoptions.inc()
        self.metrics.sessions.set(len(self.slots))
        log.warning("adopted session %s of lost worker %s: snapshot after request %d + %d journaled request(s) "
                    "replayed in %.1f s", model_id, lost, last, len(entries), time.perf_counter() - started)

    def _replay(self, slot: _Slot, op: str, body: bytes | None, reply: Outcome) -> None:
        """Apply a journaled request again, as the lost worker did (its answer is already known)."""
        session = slot.session
        status, value, _ = reply
        if status != "ok":  # an error changed nothing, unless it broke the session
            details = value.get("details") if isinstance(value, dict) else None
            if isinstance(details, dict) and details.get("session_broken"):
                slot.broken = str(value.get("message") or "the session broke on its lost worker")
            return
        if op in STATELESS_OPS:  # no state change (and no body journaled)
            return
        answer = codec.unpackb(value)
        if op in ("save_state", "save_weights_for_sampler") and os.path.exists(str(answer.get("path"))):
            return  # written before the loss: not rewritten (a user may already read it)
        if op == "create_sampler":  # the same id: sampling clients made from it keep working
            self.snapshots.add(session.snapshot(), session.model_id, snapshot_id=str(answer["sampler_id"]))
            return
        assert body is not None
        with self.turns.take("train"):  # the LoRA pass loop and sampling share this compute (and the base model)
            out, _ = self._ops[op](session, self._unpack(body))
        if op == "forward_backward" and out != value:
            log.warning("replayed forward_backward of %s differs from the lost worker's answer", session.model_id)

    # -- ordered requests --------------------------------------------------------------------------------------------

    def _sequenced(self, op: str, envelope: Any, task_id: str, inbox: str | None) -> Outcome | None:
        model_id, seq_id, _ = messages.check_envelope(envelope, op)
        if model_id in self._moved:  # its producer sent it to the adopter too: that one answers
            log.warning("%s seq %d of session %s (adopted by %s) not answered here", op, seq_id, model_id,
                        self._moved[model_id])
            return None
        slot = self.slots.get(model_id)
        if slot is None:
            raise UnknownModelError(
                f"training session {model_id} is not open on worker {self.worker_id} (closed, evicted, or "
                f"the worker restarted); create a new training client"
            )
        ordering = slot.ordering
        kind = ordering.classify(seq_id)
        if slot.broken is not None and kind != "repeat":
            if op == "close_model":  # an unusable session can still be released, out of order
                self._close(model_id)
                return ("ok", codec.packb({}), NO_TIMING)
            raise slot.broken_error(slot.broken, session_broken=True)
        if kind == "run" and slot.in_flight == seq_id:  # a redelivery of the request a LoRA pass is running
            self._inboxes[task_id] = inbox
            assert slot.in_flight_tasks is not None
            slot.in_flight_tasks.append(task_id)
            return None
        if kind == "repeat":
            kept = ordering.reply_for(seq_id)
            if kept is None:
                raise MalformedMessageError(
                    f"request seq {seq_id} of session {model_id} was already applied and its answer is no "
                    f"longer kept; it was not applied again"
                )
            return kept
        if kind == "buffer":
            self._inboxes[task_id] = inbox
            if not ordering.buffer(seq_id, op, envelope, task_id):
                self._inboxes.pop(task_id, None)
                raise ServerError(f"session {model_id} cannot keep request seq {seq_id} until seq "
                                  f"{ordering.next_seq} arrives: {ordering.refusal}")
            return None
        self._inboxes[task_id] = inbox  # in case it is handed to the LoRA pass loop (answered later)
        outcome = self._apply(slot, op, envelope, seq_id, [task_id])
        if outcome is not None:
            self._inboxes.pop(task_id, None)
        self._advance(slot)
        return outcome

    def _advance(self, slot: _Slot) -> None:
        """Run the buffered requests that are next in order now (until one goes to the LoRA pass loop); their
        callers get their answers through the backend."""
        model_id = slot.session.model_id
        while model_id in self.slots and slot.in_flight is None and (ready := slot.ordering.pop_ready()) is not None:
            seq, pending = ready
            late = self._apply(slot, pending.op, pending.envelope, seq, pending.task_ids)
            if late is not None:
                self._store_late(pending.task_ids, late)

    def _apply(self, slot: _Slot, op: str, envelope: dict[str, Any], seq_id: int,
               task_ids: list[str]) -> Outcome | None:
        """Apply the request next in order, or hand a LoRA loss request to the pass loop (None: answered later)."""
        model_id = slot.session.model_id
        ref = envelope.get("payload")
        started = time.time()
        timing = _queue_wait(envelope, started)
        raw: bytes | None = None  # the request's body, claim check unwrapped (for the journal)
        if (slot.broken is None and isinstance(slot.session, LoraSession) and op in ("forward_backward", "forward")):
            try:
                raw = self.claim_check.unwrap(ref)
                self._to_lora_pass(slot, op, raw, ref, seq_id, task_ids, timing, started)
                return None
            except TinkerqError as exc:  # refused before it reached the pass: answered now, in order
                outcome: Outcome = ("error", exc.to_wire(), timing)
                if isinstance(exc, MalformedMessageError):
                    self._dead_letter(op, envelope, None, exc)
            except Exception as exc:  # a bug while checking it; nothing was changed, so the session goes on
                log.exception("%s seq %d of session %s could not be queued", op, seq_id, model_id)
                outcome = ("error", WorkerError(f"{op} failed in the worker: {type(exc).__name__}: {exc}").to_wire(),
                           timing)
            slot.ordering.applied(seq_id, outcome)
            self._applied(slot, seq_id, op, raw, outcome)
            self.metrics.observe(op, outcome[0], timing)
            return outcome
        if slot.broken is not None:
            outcome = ("error", slot.broken_error(slot.broken, session_broken=True).to_wire(), timing)
        elif op not in self._ops:
            outcome = ("error", MalformedMessageError(f"unknown operation {op!r}").to_wire(), timing)
        else:
            try:
                with self.turns.take("train"):
                    raw = self.claim_check.unwrap(ref)
                    body, tokens = self._ops[op](slot.session, self._unpack(raw))
                compute = time.time() - started
                timing.update(compute_s=compute, tokens=float(tokens))
                if tokens:
                    timing["tokens_per_s"] = tokens / compute if compute > 0 else 0.0
                outcome = ("ok", body, timing)
                self.claim_check.discard(ref)
            except TinkerqError as exc:
                outcome = ("error", exc.to_wire(), timing)
                if isinstance(exc, MalformedMessageError):
                    self._dead_letter(op, envelope, None, exc)
            except Exception as exc:  # state may be half-changed: refuse everything after it
                log.exception("%s seq %d of session %s failed", op, seq_id, model_id)
                slot.broken = (f"session {model_id} is unusable since {op} seq {seq_id} failed in the worker "
                               f"({type(exc).__name__}: {exc}); create a new training client")
                outcome = ("error", WorkerError(slot.broken, session_broken=True).to_wire(), timing)
        slot.ordering.applied(seq_id, outcome)
        self._applied(slot, seq_id, op, raw, outcome)  # after applying, before the caller stores the reply
        if op == "close_model" and outcome[0] == "ok":
            self._close(model_id)
        self.metrics.observe(op, outcome[0], timing)
        self.metrics.sessions.set(len(self.slots))
        if memory.is_large(ref, outcome):  # give the request's freed buffers back to the OS (RSS)
            memory.release_memory()
        return outcome

    def _to_lora_pass(self, slot: _Slot, op: str, raw: bytes, ref: Any, seq_id: int, task_ids: list[str],
                      timing: dict[str, float], started: float) -> None:
        """Check a LoRA loss request and queue it for the next mixed pass; answered by :meth:`_lora_done`."""
        data, loss_fn, config = messages.decode_loss_request(self._unpack(raw))
        validate_loss_request(data, loss_fn, config, limits=self.limits, vocab_size=self.vocab_size,
                              max_seq_len=self.max_seq_len)
        backward = op == "forward_backward"
        memory.admit_batch(self.model, self.settings, [d.model_input.length for d in data], backward=backward,
                           logprobs=self.logprobs, lora=True)
        session = slot.session
        assert isinstance(session, LoraSession) and self.lora_passes is not None
        session.last_used = time.monotonic()
        item = LossItem(session, data, loss_fn, config)
        slot.in_flight, slot.in_flight_tasks = seq_id, list(task_ids)
        tokens = sum(d.model_input.length for d in data)

        def done(item: LossItem) -> None:
            self._lora_done(slot, op, seq_id, raw, ref, item, timing, started, tokens)

        try:
            self.lora_passes.submit(item, backward=backward, done=done)
        except BaseException:  # not queued (the worker is stopping): the session's order moves on
            slot.in_flight, slot.in_flight_tasks = None, None
            raise

    def _lora_done(self, slot: _Slot, op: str, seq_id: int, raw: bytes, ref: Any, item: LossItem,
                   timing: dict[str, float], started: float, tokens: int) -> None:
        """A LoRA loss request's pass is over (pass loop thread): answer it, then run its session's next ones."""
        with self._lock:
            compute = time.time() - started
            if item.output is not None:
                timing.update(compute_s=compute, tokens=float(tokens), tokens_per_s=tokens / max(compute, 1e-9))
                outcome: Outcome = ("ok", codec.packb(messages.encode_forward_backward_output(item.output)), timing)
                self.claim_check.discard(ref)
            else:
                error = item.error or WorkerError("the LoRA pass gave no answer")
                outcome = ("error", error.to_wire(), timing)
            tasks = slot.in_flight_tasks or []
            slot.in_flight, slot.in_flight_tasks = None, None
            slot.ordering.applied(seq_id, outcome)
            self._applied(slot, seq_id, op, raw, outcome)  # before the answer goes out
            self.metrics.observe(op, outcome[0], timing)
            self._store_late(tasks, outcome)
            if memory.is_large(ref, outcome):  # as for requests applied inline: give freed buffers back
                memory.release_memory()
            self._advance(slot)

    # -- operations ----------------------------------------------------------------------------------------------------

    def _loss(self, session: Session, body: Any, *, backward: bool) -> bytes:
        data, loss_fn, config = messages.decode_loss_request(body)
        # Validate the whole batch before anything touches the model.
        validate_loss_request(data, loss_fn, config, limits=self.limits, vocab_size=self.vocab_size,
                              max_seq_len=self.max_seq_len)
        memory.admit_batch(self.model, self.settings, [d.model_input.length for d in data], backward=backward,
                           logprobs=self.logprobs)
        out = session.run_loss(data, loss_fn, config, backward=backward)
        tokens = sum(d.model_input.length for d in data)
        return codec.packb(messages.encode_forward_backward_output(out)), tokens

    def _optim_step(self, session: Session, body: Any) -> bytes:
        adam = messages.decode_adam(body)
        validate_adam(adam)
        metrics = session.optim_step(adam).metrics
        if "shard_state_bytes:max" in metrics:
            self.metrics.shard_state_bytes.set(metrics["shard_state_bytes:max"])
        self._auto_snapshot(session)
        return codec.packb({"metrics": metrics}), 0

    def _auto_snapshot(self, session: Session) -> None:
        """Every ``auto_snapshot_steps`` optimizer steps, the session's whole state (as save_state) goes to its
        automatic snapshot, recorded in Redis: a lost worker then costs at most that many steps (or nothing,
        when another worker adopts the session), and the producer's WorkerLostError names the snapshot to resume
        from (docs/reliability.md). Taken once this optim_step is applied and journaled (:meth:`_applied`)."""
        slot = self.slots[session.model_id]
        slot.steps_since_snapshot += 1
        if 0 < self.settings.auto_snapshot_steps <= slot.steps_since_snapshot:
            slot.snapshot_due = True

    def _snapshot(self, slot: _Slot, seq_id: int, entry: bytes | None) -> None:
        """Write the session's automatic snapshot as the state after its request ``seq_id``, record it, and then
        cut its journal down to that request's own ``entry`` (everything older is covered now; the answer to
        ``seq_id`` is kept, as it may not have reached its caller: an adopter answers a repeat of it)."""
        s, session = self.settings, slot.session
        started = time.perf_counter()
        try:
            path = session.save_state(s.checkpoint_dir, checkpoints.AUTO_SNAPSHOT, base_model=self.base_model,
                                      seq_id=seq_id, expires_at=time.time() + s.auto_snapshot_ttl_s)
            written = time.time()
            record = {"path": path, "seq_id": seq_id, "time": written, "worker": self.worker_id}
            self.connection.store.set(keys.auto_snapshot(session.model_id), json.dumps(record).encode(),
                                      s.auto_snapshot_ttl_s)
            slot.snapshot_at = written
        except (TinkerqError, OSError) as exc:  # a full disk must not fail the step it follows; the next one retries
            log.warning("automatic snapshot of %s failed: %s", session.model_id, exc)
            return
        if entry is not None:
            try:  # after the record: a kill in between leaves entries the adopter does not apply (seq <= S)
                # One atomic LPUSH + LTRIM: the journal is this entry alone, never empty in between.
                self.connection.store.push(keys.journal(session.model_id), entry, ttl_s=s.auto_snapshot_ttl_s,
                                           max_len=1)
                slot.journal_len = 1
            except TinkerqError as exc:
                log.warning("could not cut the journal of %s: %s", session.model_id, exc)
        try:  # the sampling snapshots the session still serves go with it: published (once each), so any
            # worker can load them after this one is gone
            self.snapshots.publish_session(session.model_id)
        except (TinkerqError, OSError) as exc:
            log.warning("could not publish the sampling snapshots of %s: %s", session.model_id, exc)
        slot.steps_since_snapshot, slot.snapshot_due = 0, False
        self.metrics.auto_snapshots.inc()
        self.metrics.auto_snapshot_seconds.observe(time.perf_counter() - started)

    def _create_sampler(self, session: Session, body: Any) -> tuple[bytes, int]:
        # Refused (CapacityError) before the weights are copied when the copy would not fit (a LoRA snapshot
        # is its adapter only: small).
        if not isinstance(session, LoraSession):
            memory.admit_snapshot(self.model, self.settings, [slot.session for slot in self.slots.values()])
        snapshot_id = self.snapshots.add(session.snapshot(), session.model_id)
        return codec.packb({"sampler_id": snapshot_id}), 0

    def _sample(self, envelope: Any, task_id: str, inbox: str | None) -> Outcome | None:
        """Check a sample request and hand it to the engine; it is answered when its rows are done (None)."""
        _, _, ref = messages.check_envelope(envelope, "sample")
        request = messages.decode_sample_request(self._decode(ref))
        source, prompt, num_samples, params = request.source, request.prompt, request.num_samples, request.params
        s = self.settings
        validate_sampling(prompt, num_samples, params, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len,
                          max_num_samples=s.max_num_samples, max_tokens=s.max_sample_tokens)
        max_tokens = params.max_tokens or min(self.max_seq_len - prompt.length, s.max_sample_tokens)
        memory.admit_sample(self.model, s, prompt.length, max_tokens, num_samples)
        key, model, adapter = self.snapshots.resolve(source)
        stop = StopRule(params.stop, self._default_stop_ids(), self._tokenizer_for(params.stop))
        started = time.time()
        timing = _queue_wait(envelope, started)
        prompt_logprobs: list[np.ndarray] = []  # filled by the engine before ``done`` when asked

        def done(sequences: list[types.SampledSequence] | None, error: BaseException | None) -> None:
            outcome: Outcome
            if sequences is not None:
                tokens = sum(len(seq.tokens) for seq in sequences)
                compute = time.time() - started
                timing.update(compute_s=compute, tokens=float(tokens), tokens_per_s=tokens / max(compute, 1e-9))
                response = types.SampleResponse(sequences=sequences)
                if prompt_logprobs:
                    response.prompt_logprobs = [None, *prompt_logprobs[0][1:].tolist()]
                outcome = ("ok", codec.packb(messages.encode_sample_response(response)), timing)
            elif isinstance(error, TinkerqError):
                outcome = ("error", error.to_wire(), timing)
            else:
                log.error("sampling failed: %s", error, exc_info=error)
                outcome = ("error", WorkerError(f"sampling failed in the worker: {type(error).__name__}: "
                                                f"{error}").to_wire(), timing)
            self.metrics.observe("sample", outcome[0], timing)
            log.info("sample %s in %.1f ms", outcome[0], 1000 * (time.time() - started))
            self.answer(task_id, inbox, self._reply(outcome))
            self.claim_check.discard(ref)

        self.engine.submit(SampleJob(model=model, model_key=key, prompt=prompt.to_ints(), num_samples=num_samples,
                                     params=params, stop=stop, max_tokens=max_tokens, on_done=done, adapter=adapter,
                                     on_prompt_logprobs=prompt_logprobs.append if request.prompt_logprobs else None))
        return None

    def _default_stop_ids(self) -> list[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None) or self.model.config.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def _tokenizer_for(self, stop: Any) -> Any:
        """The model's tokenizer when stop strings need decoding (loaded once), else None."""
        if not (isinstance(stop, str) or (isinstance(stop, list) and stop and isinstance(stop[0], str))):
            return None
        if self._tokenizer is None:
            try:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            except (OSError, ValueError) as exc:
                raise ValidationError(
                    f"stop strings need the model's tokenizer, which cannot be loaded from {self.model_dir} "
                    f"({exc}); pass stop token ids instead"
                ) from exc
        return self._tokenizer

    def _save_state(self, session: Session, body: Any) -> tuple[bytes, int]:
        name = checkpoints.check_name(body.get("name") if isinstance(body, dict) else None)
        overwrite = _flag(body, "overwrite", True, "save_state")  # absent: replace, as before the field existed
        expires_at = _expires_at(body)
        # The last request applied before this one (this one is recorded once it returns): the state saved
        # is the state after it.
        seq_id = self.slots[session.model_id].ordering.next_seq - 1
        path = session.save_state(self.settings.checkpoint_dir, name, base_model=self.base_model, seq_id=seq_id,
                                  expires_at=expires_at, overwrite=overwrite)
        self.sweep_checkpoints()
        return codec.packb(_saved(path, expires_at)), 0

    def _load_state(self, session: Session, body: Any) -> tuple[bytes, int]:
        path = body.get("path") if isinstance(body, dict) else None
        optimizer = _flag(body, "optimizer", True, "load_state")  # absent: weights and optimizer, as before
        directory = checkpoints.resolve_state_path(path, self.settings.checkpoint_dir)
        meta = session.load_state(directory, optimizer=optimizer)
        # optimizer_steps: the session's count now (0 when the optimizer starts afresh).
        return codec.packb({"path": str(directory), "optimizer": optimizer, "optimizer_steps": session.steps,
                            "seq_id": meta["seq_id"]}), 0

    def _save_weights(self, session: Session, body: Any) -> tuple[bytes, int]:
        name = body.get("name") if isinstance(body, dict) else None
        merged = _flag(body, "merged", False, "save_weights_for_sampler")
        expires_at = _expires_at(body)
        directory = self.settings.checkpoint_dir
        if isinstance(session, LoraSession):
            path = session.save_weights(directory, name, base_model=self.base_model, merged=merged,
                                        expires_at=expires_at)
        else:  # a full session's weights are the merged ones already
            path = session.save_weights(directory, name, base_model=self.base_model, expires_at=expires_at)
        self.sweep_checkpoints()
        return codec.packb(_saved(path, expires_at)), 0

    def sweep_checkpoints(self) -> None:
        """Delete expired checkpoints on a thread of its own (best effort), so no reply waits for it. Skipped
        while a sweep runs: the next save sweeps again."""
        if not self._sweeping.acquire(blocking=False):
            return

        def sweep() -> None:
            try:
                checkpoints.remove_expired(self.settings.checkpoint_dir)
            except Exception:  # never fatal: an expired checkpoint is also refused (and deleted) when named
                log.exception("deleting expired checkpoints failed")
            finally:
                self._sweeping.release()

        threading.Thread(target=sweep, name="tinkerq-checkpoint-sweep", daemon=True).start()

    # -- wire -------------------------------------------------------------------------------------------------------

    def _decode(self, ref: Any) -> Any:
        return self._unpack(self.claim_check.unwrap(ref))

    def _unpack(self, raw: bytes) -> Any:
        return codec.unpackb(raw, max_bytes=self.settings.max_message_bytes)

    def _reply(self, outcome: Outcome) -> dict[str, Any]:
        status, value, timing = outcome
        reply = messages.ok_reply(self.claim_check.wrap(value)) if status == "ok" else {"ok": False, "error": value}
        if timing:
            reply["timing"] = timing
        return reply

    def _store_late(self, task_ids: list[str], outcome: Outcome) -> None:
        """Answer requests that were buffered (they are answered when they run, or fail)."""
        for task_id in task_ids:
            self.answer(task_id, self._inboxes.pop(task_id, None), self._reply(outcome))

    def _dead_letter(self, op: str, envelope: Any, task_id: str | None, exc: MalformedMessageError) -> None:
        """Keep a request whose envelope or body is malformed in tinkerq.dead (its sender is answered anyway)."""
        if self.dead_letters is None:
            return
        try:
            raw = codec.packb(envelope)
        except TinkerqError:
            raw = repr(envelope)[:4096].encode()
        self.dead_letters.refuse(exc.message, raw, f"task {TASK_NAMES.get(op, op)}", task_id, answer=False)

    def answer(self, task_id: str, inbox: str | None, reply: dict[str, Any]) -> None:
        """Store ``reply`` for ``task_id`` and push it to the sender's inbox; retried through Redis outages."""
        if inbox is not None and not keys.REPLY_LIST_RE.match(inbox):
            inbox = None
        try:
            store_reply(self.connection.store, self.settings, task_id, inbox, reply)
        except TinkerqError as exc:  # Redis stayed away for the whole retry window: the request is redelivered
            log.error("could not answer %s: %s", task_id, exc.message)


STATELESS_OPS = frozenset({"forward", "echo"})  # requests that change no session state
ADOPT_CLAIM_TTL_S = 600.0  # a claim outlives any adoption; one left by a lost adopter is taken over sooner


def _outcome(entry: dict[str, Any]) -> Outcome:
    """A journal entry's answer, as kept."""
    status, value, timing = entry["reply"]
    return (status, value, timing or {})


def _home(raw: bytes | None) -> dict[str, Any] | None:
    """A session record (keys.session_home), or None when absent or unreadable."""
    try:
        home = json.loads(raw) if raw else None
    except ValueError:
        return None
    if not isinstance(home, dict) or not all(isinstance(home.get(k), str) for k in ("model_id", "worker",
                                                                                     "base_model")):
        return None
    return home


def _snapshot_time(raw: bytes | None) -> float | None:
    """The time of an automatic snapshot record (keys.auto_snapshot), or None when absent or unreadable."""
    try:
        when = json.loads(raw)["time"] if raw else None
    except (ValueError, KeyError, TypeError):
        return None
    return float(when) if isinstance(when, (int, float)) else None


def _flag(body: Any, key: str, default: bool, op: str) -> bool:
    """A True/False field of a request body (``default`` when absent); anything else is a user error."""
    value = body.get(key, default) if isinstance(body, dict) else default
    if not isinstance(value, bool):
        raise ValidationError(f"{op} {key}= must be True or False, got {value!r:.80}")
    return value


def _expires_at(body: Any) -> float | None:
    """When a save with the body's ``ttl_seconds`` expires (unix seconds), or None: kept until deleted."""
    ttl_seconds = body.get("ttl_seconds") if isinstance(body, dict) else None
    validate_ttl_seconds(ttl_seconds)
    return None if ttl_seconds is None else checkpoints.now() + ttl_seconds


def _saved(path: str, expires_at: float | None) -> dict[str, Any]:
    """A save's reply: its path, and when it expires if it does."""
    return {"path": path} if expires_at is None else {"path": path, "expires_at": expires_at}


def _queue_wait(envelope: dict[str, Any], started: float) -> dict[str, float]:
    """A request's timing so far: how long it waited since the producer sent it (if the envelope says when)."""
    sent_at = envelope.get("sent_at")
    if not isinstance(sent_at, (int, float)):
        return {}
    return {"queue_wait_s": max(0.0, started - sent_at)}  # across hosts: as good as their clocks
