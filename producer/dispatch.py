"""The producer's dispatcher: posts requests, receives every reply, and notices lost workers and outages.

One per :class:`producer.ServiceClient`, with two daemon threads:

* the *listener* pops replies from this client's inbox (``tinkerq:replies:<client id>``, a Redis list that
  workers push to) and resolves the matching futures. A list, unlike pub/sub, keeps replies through a
  dropped connection. When Redis was unreachable, the listener then *recovers*: it reads the replies
  stored under each pending request's reply key and re-posts every request still unanswered (same task
  id, same sequence number). Re-posting is safe because workers apply a session's requests by sequence
  number and answer repeats from their kept replies; it covers what a Redis restart or failover may lose
  (the last second of an AOF, a replica's lag, a reply pushed while nobody listened).
* the *monitor* posts requests that could not be posted when they were submitted (Redis was away), and
  checks the heartbeats of every worker that owes this client an answer, in one call: a worker silent for
  1.5 of its heartbeat periods is gone, and every pending request it owes fails at once with
  ``WorkerLostError``. After an outage it first waits that long, so workers can beat again.

Submitting never blocks on Redis: a request that cannot be posted now is posted by the monitor later; if
Redis stays away longer than ``TINKERQ_REDIS_RETRY_S``, pending requests fail with BrokerUnavailableError.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tinkerq import keys
from tinkerq.celery_app import TASK_NAMES
from tinkerq.connection import Connection
from tinkerq.errors import BrokerUnavailableError, ServerError, TinkerqError, WorkerLostError, error_from_wire
from tinkerq.producer.futures import APIFuture
from tinkerq.records import SessionHome, SnapshotRecord
from tinkerq.retry import is_transient
from tinkerq.threads import NamedThread
from tinkerq.wire import codec, messages
from tinkerq.wire.claimcheck import ClaimCheck

log = logging.getLogger("tinkerq.producer")

LOST_AFTER_BEATS = 1.5  # as worker.registry: a worker beats twice per period
WAKE = b"wake"  # pushed to a client's own inbox by close(), so its listener stops at once


@dataclass
class Request:
    op: str
    # The envelope's model_id: the training session the request belongs to. A sample belongs to none: it carries
    # its sampling client's own id there (SamplingClient.client_id), only to name it in logs.
    model_id: str
    seq_id: int
    body: bytes  # kept until answered: a re-post after an outage writes the claim check again
    queue: str
    argsrepr: str
    future: APIFuture[Any]
    worker: str | None = None  # the worker that must answer; None: any worker of the model
    heartbeat_s: float = 5.0
    posted: bool = False
    posted_at: float = 0.0  # monotonic
    posting: bool = False  # a thread is posting it now (under Dispatcher._lock): no other thread posts it as new
    task_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    also: list[APIFuture[Any]] = field(default_factory=list)  # more futures for the same task id (tests)
    # A request outside any session's order (sampling) is pushed straight to its worker's intake list
    # (worker/transport/sample_intake.py), not through Celery, and may go to another worker when its worker is lost:
    # reroute() names one (worker, queue, heartbeat_s), or None to give up.
    sequenced: bool = True
    reroute: Callable[[], tuple[str, str, float] | None] | None = None

    @property
    def futures(self) -> list[APIFuture[Any]]:
        return [self.future, *self.also]


class Dispatcher:
    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.settings = connection.settings
        self.store = connection.store
        self.client_id = uuid.uuid4().hex
        self.inbox = keys.reply_list(self.client_id)
        self._pending: dict[str, Request] = {}
        self._lock = threading.Lock()
        self._recovery_lock = threading.Lock()
        self._stop = threading.Event()
        self._outage_since: float | None = None  # monotonic time Redis was first found unreachable
        self._reachable_since = time.monotonic()
        self._needs_recovery = False
        self._progress: dict[str, float] = {}  # model id -> when it last had an answer (monotonic)
        # Where each training session's requests go: model id -> (worker, its queue). The one place a
        # TrainingClient reads it from, so an adoption moves its future submissions too.
        self._homes: dict[str, tuple[str, str]] = {}
        # Sessions whose worker was lost and that may be adopted: model id -> (lost worker, give up at, monotonic).
        self._adopting: dict[str, tuple[str, float]] = {}
        # Publishing must fail fast while Redis is away (the monitor re-posts): kombu would otherwise retry the
        # connection for minutes inside the caller's submit, or wait on a paused server without a timeout.
        conf = connection.app.conf
        conf.broker_transport_options = {
            **conf.broker_transport_options, "max_retries": 1, "interval_start": 0, "interval_step": 0.2,
            "interval_max": 0.2, "socket_timeout": max(self.settings.connect_timeout_s, 30.0),
            "socket_connect_timeout": self.settings.connect_timeout_s,
        }
        self._threads = [NamedThread(target=self._listen, name="tinkerq-replies", daemon=True),
                         NamedThread(target=self._monitor, name="tinkerq-monitor", daemon=True)]
        for t in self._threads:
            t.start()

    # -- submitting ---------------------------------------------------------------------------------------

    def submit(self, op: str, body: bytes, *, model_id: str, seq_id: int, queue: str, argsrepr: str,
               decode: Callable[[Any], Any], worker: str | None = None, heartbeat_s: float | None = None,
               describe: str | None = None, sequenced: bool = True,
               reroute: Callable[[], tuple[str, str, float] | None] | None = None) -> APIFuture[Any]:
        """Post one request (now, or as soon as Redis is reachable) and return its future.

        ``model_id`` and ``seq_id``: the training session and the request's position in it (``create_model``
        is 0); a sample (``sequenced=False``) gives its sampling client's id and 0."""
        future: APIFuture[Any] = APIFuture(decode, claim_check=self.connection.claim_check(),
                                           describe=describe or f"{op} seq={seq_id}")
        request = Request(op, model_id, seq_id, body, queue, argsrepr, future, worker,
                          heartbeat_s or self.settings.heartbeat_s, sequenced=sequenced, reroute=reroute)
        future.task_id = request.task_id
        with self._lock:
            self._pending[request.task_id] = request
        self._try_post(request, unposted=True)
        return future

    def set_home(self, model_id: str, worker: str) -> None:
        with self._lock:
            self._homes[model_id] = (worker, keys.worker_queue(worker))

    def home(self, model_id: str) -> tuple[str, str]:
        """(worker, queue) that holds a training session now (set_home, or its adopter)."""
        with self._lock:
            return self._homes[model_id]

    def expect(self, task_id: str, decode: Callable[[Any], Any], *, worker: str | None = None,
               describe: str = "request") -> APIFuture[Any]:
        """A future for a message posted by the caller itself (tests send hand-made messages this way)."""
        future: APIFuture[Any] = APIFuture(decode, claim_check=self.connection.claim_check(), describe=describe,
                                           task_id=task_id)
        request = Request("", "", 0, b"", "", "", future, worker, self.settings.heartbeat_s, posted=True,
                          task_id=task_id)
        with self._lock:
            if task_id in self._pending:
                self._pending[task_id].also.append(future)
            else:
                self._pending[task_id] = request
        return future

    def abandon(self, future: APIFuture[Any]) -> None:
        """Stop tracking a request whose caller gave up waiting (its late answer is ignored)."""
        if future.task_id is not None:
            with self._lock:
                self._pending.pop(future.task_id, None)

    def _try_post(self, request: Request, *, unposted: bool = False) -> bool:
        """Post without waiting on an outage; False (and left for the monitor) if Redis is unreachable.

        ``unposted``: only if it is not posted yet, nor being posted by another thread now. The submitting
        thread and the monitor both post new requests; a request in ``_pending`` stays unposted until its post
        returns, and a monitor that looked meanwhile posted it too: a ``create_model`` then reached two workers
        (docs/reliability.md, "Exactly once")."""
        if self._outage_since is not None and threading.current_thread() not in self._threads:
            return False  # known to be down: the monitor posts it once Redis answers
        with self._lock:
            if unposted and (request.posted or request.posting):
                return True  # posted, or being posted by the other thread
            request.posting = True
        try:
            self._post(request, self.store.with_retry(0))
            return True
        except Exception as exc:
            if not (is_transient(exc) or isinstance(exc, BrokerUnavailableError) or _is_kombu_outage(exc)):
                self._finish(request.task_id, error=ServerError(f"{request.op} could not be posted: {exc}"))
                return False
            self._lost(exc)
            return False
        finally:
            request.posting = False

    def _post(self, request: Request, store: Any) -> None:
        s = self.settings
        ref = ClaimCheck(store, s.claim_check_bytes, s.blob_ttl_s, s.max_message_bytes).wrap(request.body)
        envelope = messages.make_envelope(request.op, request.model_id, request.seq_id, ref)
        if not request.sequenced:
            store.push(request.queue, messages.make_sample_item(request.task_id, self.inbox, envelope))
        else:
            self.connection.app.send_task(
                TASK_NAMES[request.op], args=(envelope,), queue=request.queue, task_id=request.task_id,
                headers={messages.REPLY_HEADER: self.inbox},
                # What Flower shows: never tensors.
                argsrepr=f"model_id={request.model_id[:8]} seq={request.seq_id} {request.argsrepr}".strip(),
                kwargsrepr="{}",
            )
        request.posted = True
        request.posted_at = time.monotonic()

    # -- resolving ---------------------------------------------------------------------------------------------

    def _finish(self, task_id: str, reply: Any = None, error: TinkerqError | None = None) -> None:
        with self._lock:
            request = self._pending.pop(task_id, None)
        if request is None:
            return  # a repeat's answer, or one for a future that already failed
        if request.model_id and request.sequenced:  # (for stalled sessions; samples are not in one)
            self._progress[request.model_id] = time.monotonic()
        for future in request.futures:
            if error is not None:
                future._fail(error)
            else:
                future._arrive(reply)
        if error is not None:
            return
        broken = messages.reply_error(reply)
        if broken is not None and broken.details.get("session_broken") and request.model_id:
            # The worker gave up on the session (e.g. a request never arrived): nothing pending of it will be
            # answered, including the request that went missing.
            self._fail_where(lambda r: r.model_id == request.model_id, lambda r: error_from_wire(reply["error"]))

    def _fail_where(self, which: Callable[[Request], bool], error: Callable[[Request], TinkerqError]) -> int:
        with self._lock:
            doomed = [r for r in self._pending.values() if which(r)]
            for r in doomed:
                del self._pending[r.task_id]
        for r in doomed:
            for future in r.futures:
                future._fail(error(r))
        return len(doomed)

    # -- the listener ---------------------------------------------------------------------------------------

    def _listen(self) -> None:
        delay = 0.02
        while not self._stop.is_set():
            try:
                item = self.store.pop(self.inbox, timeout_s=1.0)
            except Exception as exc:
                if self._stop.is_set():
                    return
                if not (is_transient(exc) or _is_kombu_outage(exc)):
                    log.exception("reading replies failed")
                self._lost(exc)
                self._stop.wait(delay)
                delay = min(delay * 2, 0.5)
                continue
            delay = 0.02
            if self._stop.is_set():
                return
            self._reached()
            if item is None:
                continue
            try:
                task_id, reply = messages.read_reply_item(item)
            except TinkerqError as exc:
                log.warning("ignored a malformed reply in %s: %s", self.inbox, exc.message)
                continue
            self._finish(task_id, reply)

    def _lost(self, exc: BaseException) -> None:
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            log.warning("Redis is unreachable (%s: %s); pending requests wait for it (TINKERQ_REDIS_RETRY_S=%g)",
                        type(exc).__name__, str(exc)[:200], self.settings.redis_retry_s)
        self._needs_recovery = True

    def _reached(self) -> None:
        """Redis answered. After an outage: collect replies stored meanwhile, re-post what is unanswered."""
        if not self._needs_recovery:
            return
        with self._recovery_lock:
            if not self._needs_recovery:
                return
            try:
                self._recover()
            except Exception as exc:
                self._lost(exc)
                return
            down = time.monotonic() - (self._outage_since or time.monotonic())
            self._needs_recovery = False
            self._outage_since = None
            self._reachable_since = time.monotonic()
            log.warning("Redis is reachable again after %.1f s; pending requests continue", down)

    def _recover(self) -> None:
        with self._lock:
            pending = list(self._pending.values())
        store = self.store.with_retry(0)
        stored = store.get_many([keys.reply(r.task_id) for r in pending])
        reposted = 0
        for request, raw in zip(pending, stored, strict=True):
            if raw is not None:
                try:
                    self._finish(request.task_id, codec.unpackb(raw))
                    continue
                except TinkerqError:
                    pass
            if request.op:  # hand-made messages (expect()) cannot be re-posted
                self._post(request, store)
                reposted += 1
        if reposted:
            log.warning("re-posted %d unanswered request(s) after the outage (workers apply each once)", reposted)

    # -- the monitor -----------------------------------------------------------------------------------------

    def _monitor(self) -> None:
        period = max(0.05, min(0.5, self.settings.heartbeat_s / 4))
        while not self._stop.wait(period):
            try:
                self._check()
            except Exception:
                log.exception("the producer's monitor failed; it keeps running")

    def _check(self) -> None:
        with self._lock:
            pending = list(self._pending.values())
        if not pending:
            return
        now = time.monotonic()
        if self._outage_since is not None and now - self._outage_since > self.settings.redis_retry_s:
            error = BrokerUnavailableError(
                f"Redis has been unreachable for {now - self._outage_since:.0f} s (TINKERQ_REDIS_RETRY_S); "
                f"pending requests are abandoned. Check Redis, then resume from your last checkpoint")
            self._fail_where(lambda r: True, lambda r: error)
            return
        for request in pending:
            if not request.posted and not self._try_post(request, unposted=True):
                return
        self._resend_stalled(pending, now)
        owed = {r.worker: r.heartbeat_s for r in pending if r.worker and r.model_id not in self._adopting}
        if not owed and not self._adopting:
            return
        asked = time.monotonic()
        try:
            ages = self.store.with_retry(0).ages(keys.HEARTBEATS)
        except Exception as exc:
            self._lost(exc)
            return
        self._follow_adoptions(ages, now)
        if time.monotonic() - asked > min(owed.values(), default=self.settings.heartbeat_s) / 2:
            # Redis took long to answer (paused, or stalled): no worker could beat meanwhile either.
            self._reachable_since = time.monotonic()
            return
        self._reached()
        seen_for = time.monotonic() - self._reachable_since
        for worker, heartbeat_s in owed.items():
            limit = LOST_AFTER_BEATS * heartbeat_s
            if ages.get(worker, float("inf")) > limit and seen_for > limit:
                silent = min(ages.get(worker, float("inf")), 1e9)

                def lost(r: Request, w: str = worker, silent: float = silent) -> TinkerqError:
                    return WorkerLostError(
                        f"{r.future._describe}: worker {w}, which holds this training session, stopped (no "
                        f"heartbeat for {silent:.1f} s) before answering; the request may or may not have been "
                        f"applied. {self._resume_hint(r.model_id)}")

                # A session with a record (worker/core/service.py) may be adopted by another worker: its requests
                # wait for that (bounded by adopt_timeout_s) instead of failing now.
                for model_id in {r.model_id for r in pending if r.worker == worker and r.sequenced and r.seq_id > 0
                                 and r.model_id not in self._adopting}:
                    if self.session_home(model_id) is not None:
                        self._adopting[model_id] = (worker, now + self.settings.adopt_timeout_s)
                        log.warning("worker %s, holding session %s, is gone: waiting up to %g s for another worker "
                                    "to adopt it", worker, model_id[:8], self.settings.adopt_timeout_s)

                def owed_by(r: Request, w: str = worker) -> bool:
                    return r.worker == w and r.model_id not in self._adopting

                moved = self._reroute([r for r in pending if r.worker == worker])
                n = self._fail_where(owed_by, lost)
                log.warning("worker %s is gone: %d pending request(s) failed, %d sent to other workers",
                            worker, n, moved)

    def session_home(self, model_id: str) -> SessionHome | None:
        """The session's home record (the worker holding it now), or None: no record (adoption off, or the
        session closed), an unreadable one, or Redis unreachable right now."""
        try:
            return SessionHome.loads(self.store.with_retry(0).get(keys.session_home(model_id)))
        except TinkerqError:
            return None

    def _follow_adoptions(self, ages: dict[str, float], now: float) -> None:
        """Sessions waiting for an adopter: move them to it once their record names a live worker, or fail
        their requests with WorkerLostError once adopt_timeout_s has passed without one."""
        for model_id, (lost, give_up_at) in list(self._adopting.items()):
            home = self.session_home(model_id)
            with self._lock:
                waiting = [r for r in self._pending.values() if r.model_id == model_id and r.sequenced and r.worker]
            limit = LOST_AFTER_BEATS * max((r.heartbeat_s for r in waiting), default=self.settings.heartbeat_s)
            adopter = home.worker if home is not None and home.worker != lost else None
            if adopter is not None and ages.get(adopter, float("inf")) <= limit:
                del self._adopting[model_id]
                self._move(model_id, adopter)
            elif home is None or now > give_up_at:
                del self._adopting[model_id]

                def lost_error(r: Request, w: str = lost) -> TinkerqError:
                    return WorkerLostError(
                        f"{r.future._describe}: worker {w}, which held this training session, stopped before "
                        f"answering, and no other worker of the model adopted the session within "
                        f"{self.settings.adopt_timeout_s:g} s (TINKERQ_ADOPT_TIMEOUT_S); the request may or may "
                        f"not have been applied. {self._resume_hint(r.model_id)}")

                def of_session(r: Request, m: str = model_id) -> bool:
                    return r.model_id == m and r.sequenced

                n = self._fail_where(of_session, lost_error)
                log.warning("session %s was not adopted: %d pending request(s) failed", model_id[:8], n)

    def _move(self, model_id: str, worker: str) -> None:
        """Send a session's pending requests (same task ids and seq ids), and its future ones, to its adopter:
        it answers those its lost worker had applied from their kept replies, and applies the others in order."""
        queue = keys.worker_queue(worker)
        with self._lock:
            self._homes[model_id] = (worker, queue)
            moved = sorted((r for r in self._pending.values() if r.model_id == model_id and r.sequenced and r.worker),
                           key=lambda r: r.seq_id)
            for r in moved:
                r.worker, r.queue, r.posted = worker, queue, False
        for r in moved:
            self._try_post(r)  # or by the monitor, once Redis answers
        log.warning("session %s was adopted by worker %s: %d pending request(s) sent to it", model_id[:8], worker,
                    len(moved))

    def _resume_hint(self, model_id: str) -> str:
        """What a caller whose session is lost can do: resume from its automatic training snapshot (the state
        the worker saves every few optimizer steps, docs/reliability.md) when it has one."""
        try:
            snapshot = SnapshotRecord.loads(self.store.with_retry(0).get(keys.auto_snapshot(model_id)))
        except TinkerqError:
            snapshot = None
        if snapshot is None:
            return ("Create a new training client, or resume from your last checkpoint "
                    "(create_training_client_from_state_with_optimizer)")
        return (f"Its latest automatic snapshot holds the state after its request {snapshot.seq_id}: resume "
                f"with sc.create_training_client_from_state_with_optimizer({snapshot.path!r}) and send again "
                f"the requests after that one")  # as docs/reliability.md quotes it

    def _reroute(self, requests: list[Request]) -> int:
        """Send the requests that may run anywhere (sampling) to another worker; returns how many moved."""
        moved = 0
        for r in requests:
            target = r.reroute() if r.reroute is not None else None
            if target is None:
                continue
            r.worker, r.queue, r.heartbeat_s = target
            r.posted = False
            if self._try_post(r):
                moved += 1
        return moved

    def _resend_stalled(self, pending: list[Request], now: float) -> None:
        """Post again the oldest request of each session that has had no answer for ``resend_after_s``."""
        heads: dict[str, Request] = {}
        for r in pending:
            # Not create_model: a repeat of it could open a second session on another worker of the model.
            # Not sampling: a long sample is no sign of a lost message (its worker's heartbeat covers it).
            if not (r.sequenced and r.worker and r.posted) or r.model_id in self._adopting:
                continue
            if r.model_id not in heads or r.seq_id < heads[r.model_id].seq_id:
                heads[r.model_id] = r
        for model_id, head in heads.items():
            quiet = now - max(head.posted_at, self._progress.get(model_id, 0.0))
            if quiet > self.settings.resend_after_s and self._try_post(head):
                log.info("%s of session %s had no answer for %.0f s: posted again (a repeat is never re-applied)",
                         head.future._describe, model_id[:8], quiet)

    def close(self) -> None:
        """Stop both threads before the caller closes the connection they use.

        A thread still blocked on a socket that gets closed under it would go on reading whatever file the
        process opens next under the same descriptor number (seen with TLS: OpenSSL reads the raw fd).
        """
        self._stop.set()
        with contextlib.suppress(Exception):  # wake the listener's BRPOP now; else it returns within 1 s
            self.store.with_retry(0).push(self.inbox, WAKE, ttl_s=60)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        self._fail_where(lambda r: True, lambda r: ServerError(f"{r.future._describe}: the client was closed"))


def _is_kombu_outage(exc: BaseException) -> bool:
    """kombu wraps a broker that went away in OperationalError (or raises the socket error itself)."""
    from kombu.exceptions import OperationalError

    return isinstance(exc, (OperationalError, ConnectionError, OSError))
