"""The gateway's futures, shared by every gateway of a fleet through Redis.

Every submission answers at once with a request id; ``retrieve_future`` long-polls it, on any gateway.

A future is a record in Redis (``future`` table of :mod:`gateway.records`: its tenant, kind, the gateway that
owns it, and its *job*, a JSON description of the work that any gateway can run again), and, once ready, an
answer (:class:`Answer`, msgpack under :func:`tinkerq.keys.gateway_answer`). The owner runs the job as an asyncio
task, stores the answer (the first stored answer wins), and publishes the request id on a Redis channel so that
gateways holding polls for it answer at once.

A gateway that dies (or restarts) loses nothing: its heartbeat stops, and the next poll of one of its pending
futures, through any gateway, *adopts* it: one gateway wins a claim on it and runs the job again. Jobs are safe to
run twice (gateway/jobs.py): a training request is re-posted with the same sequence number, which a worker
answers from its kept reply without applying it again.

A poll waits at most ``poll_s`` (the SDK gives up on a poll after 45 s and re-polls at once on a ``try_again``, so
the wait must be long enough not to be a hot loop and short enough not to time out). Answers stay retrievable for
``keep_s``: a delivered answer can be lost on the way and polled again. Nothing about a future is kept in a
gateway's memory once its answer is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tinkerq import keys
from tinkerq.errors import ServerError, TinkerqError
from tinkerq.gateway.records import Records
from tinkerq.store import Delete, Expire, KeyValueStore, Publish, Write
from tinkerq.threads import NamedThread
from tinkerq.wire import codec

log = logging.getLogger("tinkerq.gateway")

BEAT_S = 1.0  # how often a gateway says it is alive
LOST_AFTER_S = 5.0  # a gateway silent this long has lost its futures to whoever polls them next
PENDING_TTL_S = 24 * 3600.0  # a future not answered within a day is forgotten
CHECK_S = 1.0  # a poll of another gateway's future re-reads Redis at least this often (a missed announcement)


@dataclass(frozen=True)
class Answer:
    """A finished future as the SDK reads it: ``proto`` bytes, or a ``json`` body (a result or a failure)."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None
    # What answering used ({tenant, session_id, counts}), never sent to the client: counted once, from the
    # answer that was stored (a re-run by an adopter may sample other tokens than the first run did).
    usage: dict[str, Any] | None = None

    @classmethod
    def failure(cls, exc: TinkerqError) -> Answer:
        # 200 with error + category: the SDK raises RequestFailedError and the training client goes on.
        return cls(json={"error": exc.message, "category": exc.category})

    def pack(self) -> bytes:
        return codec.packb({"json": self.json, "proto": self.proto, "usage": self.usage})

    @classmethod
    def unpack(cls, raw: bytes) -> Answer:
        body = codec.unpackb(raw)
        return cls(json=body.get("json"), proto=body.get("proto"), usage=body.get("usage"))


@dataclass(frozen=True)
class Waiting:
    """Why a future is not ready yet, as the SDK's ``queue_state`` says it: ``active`` (queued or running),
    ``paused_rate_limit`` (the key's quota holds it) or ``paused_capacity`` (no worker can take it now)."""

    state: str = "active"
    reason: str | None = None


RunJob = Callable[[str, str, dict[str, Any]], Awaitable[Answer]]  # (request id, tenant, job) -> its answer
Account = Callable[[str, Answer], None]  # (request id, its stored answer): count its usage, once per request id


class Futures:
    def __init__(self, store: KeyValueStore, records: Records, run_job: RunJob, account: Account, *,
                 poll_s: float = 25.0, keep_s: float = 600.0) -> None:
        self.store = store.with_retry(0)
        self.records = records
        self.run_job = run_job
        self.account = account
        self.poll_s = poll_s
        self.keep_s = keep_s
        self.gateway_id = f"gw-{uuid.uuid4().hex[:12]}"
        self._tasks: dict[str, asyncio.Task[Answer]] = {}  # futures this gateway is running now
        self._events: dict[str, set[asyncio.Event]] = {}  # polls waiting for another gateway's answer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # Called once per request, by the gateway whose answer was stored first, with the future's record: writes
        # made with the answer's announcement (gateway/session_trace.py).
        self.on_stored: Callable[[str, Answer, dict[str, Any]], list[Write]] | None = None

    # -- life -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Beat and listen for answers (call on the event loop that will run the futures)."""
        self._loop = asyncio.get_running_loop()
        self._beat()
        self._threads = [NamedThread(target=self._beating, name="tinkerq-gw-beat", daemon=True),
                         NamedThread(target=self._listening, name="tinkerq-gw-answers", daemon=True)]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        """Stop, and say so at once: the futures this gateway was running go to whoever polls them next."""
        self._stop.set()
        for task in self._tasks.values():
            task.cancel()
        with contextlib.suppress(Exception):
            self.store.forget(keys.GATEWAY_HEARTBEATS, self.gateway_id)

    def _beat(self) -> None:
        with contextlib.suppress(Exception):  # Redis away: polls fail anyway; beat again when it is back
            self.store.beat(keys.GATEWAY_HEARTBEATS, self.gateway_id)

    def _beating(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._beat()

    def _listening(self) -> None:
        """Wake the polls waiting for an announced answer (a dropped connection: reconnect; polls re-read Redis)."""
        while not self._stop.is_set():
            try:
                subscription = self.store.subscribe(keys.GATEWAY_ANSWERS)
                try:
                    while not self._stop.is_set():
                        message = subscription.get(timeout_s=1.0)
                        if message is not None and self._loop is not None:
                            self._loop.call_soon_threadsafe(self._wake, message.decode(errors="replace"))
                finally:
                    subscription.close()
            except Exception as exc:  # Redis away: try again shortly
                log.debug("answers channel: %s", exc)
                self._stop.wait(1.0)

    def _wake(self, request_id: str) -> None:
        for event in self._events.get(request_id, ()):
            event.set()

    # -- submitting -------------------------------------------------------------------------------------------

    def add(self, tenant: str, kind: str, job: dict[str, Any]) -> str:
        """Record a future whose work is ``job`` and start it here; return its request id."""
        request_id = uuid.uuid4().hex
        self._start(request_id, self.record(tenant, kind, job, request_id=request_id))
        return request_id

    def record(self, tenant: str, kind: str, job: dict[str, Any], *, request_id: str) -> dict[str, Any]:
        """Write the future's record without starting it (:meth:`begin` does); return the record."""
        record = self._record_of(tenant, kind, job, None)
        self.records.put("future", request_id, record, ttl_s=PENDING_TTL_S)
        return record

    def record_claimed(self, tenant: str, kind: str, job: dict[str, Any], *, request_id: str, claim: str,
                       value: str, waiting: Waiting | None = None, after: Sequence[Write] = ()
                       ) -> tuple[dict[str, Any], str | None]:
        """Write the future's record and claim the request's identity ``claim`` (a seq_id: Records.claim) for
        ``value``, in one step (``after``: writes made first, in the same step). Returns the record and None when
        this call got the claim (:meth:`begin` starts it), else the claim's holder (:meth:`discard` the record).
        The record is written with the claim, so a claim never names a future that does not exist, whenever this
        gateway dies."""
        record = self._record_of(tenant, kind, job, waiting)
        put = self.records.written("future", request_id, record, ttl_s=PENDING_TTL_S)
        return record, self.records.claim(claim, value, after=[*after, put])

    def _record_of(self, tenant: str, kind: str, job: dict[str, Any], waiting: Waiting | None) -> dict[str, Any]:
        record = {"tenant": tenant, "kind": kind, "owner": self.gateway_id, "created": time.time(), "job": job}
        if waiting is not None:
            record.update(state=waiting.state, reason=waiting.reason)
        return record

    def begin(self, request_id: str, record: dict[str, Any]) -> None:
        self._start(request_id, record)

    def discard(self, request_id: str) -> None:
        """Forget a recorded future that was never started (its claim went to an earlier copy of the request)."""
        self.records.delete("future", request_id)
        self.store.delete(keys.gateway_body(request_id))

    def _start(self, request_id: str, record: dict[str, Any]) -> asyncio.Task[Answer]:
        task = asyncio.ensure_future(self._run(request_id, record))
        self._tasks[request_id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(request_id, None))
        return task

    async def _run(self, request_id: str, record: dict[str, Any]) -> Answer:
        """Never raises: a fleet error becomes the SDK's failure body (user or server category)."""
        kind = record.get("kind")
        try:
            answer = await self.run_job(request_id, record["tenant"], record["job"])
        except TinkerqError as exc:
            answer = Answer.failure(exc)
        except asyncio.CancelledError:
            raise  # this gateway is stopping: the future goes to the next gateway that polls it
        except Exception as exc:  # a gateway bug: the caller still gets an answer, the operator a traceback
            log.exception("%s request %s failed in the gateway", kind, request_id)
            answer = Answer.failure(ServerError(f"the gateway failed while answering this {kind} request: {exc}"))
        return await asyncio.to_thread(self._store_answer, request_id, answer, record)

    def _store_answer(self, request_id: str, answer: Answer, record: dict[str, Any]) -> Answer:
        """Store ``answer`` unless one is stored already (then that one is the answer), and announce it."""
        key = keys.gateway_answer(request_id)
        writes: list[Write] = []
        if not self.store.set_if_absent(key, answer.pack(), self.keep_s):
            raw = self.store.get(key)
            answer = Answer.unpack(raw) if raw is not None else answer
        elif self.on_stored is not None:
            writes += self.on_stored(request_id, answer, record)
        # The record kept a while for polls, the body gone, the answer announced: one round trip.
        self.store.write_many([*writes, Expire(keys.gateway_record("future", request_id), self.keep_s),
                               Delete(keys.gateway_body(request_id)),
                               Publish(keys.GATEWAY_ANSWERS, request_id.encode())])
        self.account(request_id, answer)  # once per request id: a gateway dying here leaves it to the next poll
        return answer

    def set_waiting(self, request_id: str, tenant: str, waiting: Waiting) -> None:
        """Say why the future is held (polls on every gateway report it), as its job goes on."""
        record = self.records.get("future", request_id, tenant)
        if record is not None and (record.get("state"), record.get("reason")) != (waiting.state, waiting.reason):
            record.update(state=waiting.state, reason=waiting.reason)
            self.records.put("future", request_id, record, ttl_s=PENDING_TTL_S)

    # -- polling ----------------------------------------------------------------------------------------------

    def get(self, request_id: str, tenant: str) -> tuple[dict[str, Any] | None, bytes | None]:
        """The future's record, or None when it does not exist or belongs to another tenant (the same 404), and
        its stored answer if any (for :meth:`wait`), in one round trip."""
        return self.records.get_with("future", request_id, tenant, keys.gateway_answer(request_id))

    async def wait(self, request_id: str, record: dict[str, Any], stored: bytes | None = None) -> Answer | Waiting:
        """The answer, or why it is not ready after ``poll_s`` (the caller answers try_again). ``stored``: the
        answer :meth:`get` read with the record (None: not stored then)."""
        deadline = time.monotonic() + self.poll_s
        event = asyncio.Event()
        self._events.setdefault(request_id, set()).add(event)
        first = True
        try:
            while True:
                if first:  # read just now with the record
                    raw, first = stored, False
                else:
                    raw = await asyncio.to_thread(self.store.get, keys.gateway_answer(request_id))
                if raw is not None:
                    answer = Answer.unpack(raw)
                    await asyncio.to_thread(self.account, request_id, answer)  # a no-op once counted
                    return answer
                task = self._tasks.get(request_id)
                if task is None:
                    record = await asyncio.to_thread(self._record, request_id, record)
                    task = await asyncio.to_thread(self._adopt, request_id, record)
                left = deadline - time.monotonic()
                if left <= 0:
                    return Waiting(str(record.get("state") or "active"), record.get("reason"))
                if task is not None:
                    with contextlib.suppress(asyncio.TimeoutError):
                        return await asyncio.wait_for(asyncio.shield(task), min(left, self.poll_s))
                    return await asyncio.to_thread(self._waiting, request_id, record)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), min(left, CHECK_S))
                event.clear()
        finally:
            waiters = self._events.get(request_id)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._events[request_id]

    def _record(self, request_id: str, fallback: dict[str, Any]) -> dict[str, Any]:
        return self.records.get("future", request_id, fallback["tenant"]) or fallback

    def _waiting(self, request_id: str, record: dict[str, Any]) -> Waiting:
        record = self._record(request_id, record)
        return Waiting(str(record.get("state") or "active"), record.get("reason"))

    def _adopt(self, request_id: str, record: dict[str, Any]) -> asyncio.Task[Answer] | None:
        """Run the future here if its owner is gone and this gateway wins the claim on it (else None)."""
        owner = str(record.get("owner"))
        if owner == self.gateway_id or not isinstance(record.get("job"), dict):
            return None
        age = self.store.ages(keys.GATEWAY_HEARTBEATS).get(owner)
        if age is not None and age < LOST_AFTER_S:
            return None
        claim = keys.gateway_claim(f"adopt:{request_id}:{owner}")
        if not self.store.set_if_absent(claim, self.gateway_id.encode(), PENDING_TTL_S):
            return None
        log.warning("adopting %s request %s of gateway %s (silent for %s)", record.get("kind"), request_id, owner,
                    "ever" if age is None else f"{age:.1f} s")
        record["owner"] = self.gateway_id
        self.records.put("future", request_id, record, ttl_s=PENDING_TTL_S)
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self._start_later(request_id, record), self._loop).result()

    async def _start_later(self, request_id: str, record: dict[str, Any]) -> asyncio.Task[Answer]:
        return self._start(request_id, record)

    def running(self) -> int:
        """How many futures this gateway is running now."""
        return len(self._tasks)
