"""The scheduler: the one owner of the requests a worker holds, and of every decision about them. Pure Python:
no torch, no Redis, no threads, no wall clock of its own (``clock`` is given: tests pass a fake one).

It holds every request the transport took off the broker, in one lane per training session (each request is
held once: in its lane's :class:`~worker.ordering.Ordering`), and decides:

* **Admission** (:meth:`Scheduler.admit`, typed :class:`Admission`): queue a request, join a copy already
  waiting, running or on its way out, answer a repeat from the kept replies, refuse one of a broken session or
  one that can never be kept (early, behind a gap, past the lane's bound), or tell the transport to wait for room
  (the lane is full of requests that will run: backpressure, which holds the broker's next messages back).
* **Order.** A session's requests run in ``seq_id`` order; a missing one breaks the session after the gap
  timeout (:meth:`Scheduler.expire_gaps`).
* **Passes.** Loss requests of sessions that share a base model (LoRA) and are next in their order run as
  one pass: all of the same kind (forward or forward_backward), at most ``max_pass_datums`` datums.
* **Fairness.** Least recently served first: among the lanes with a request ready, the one served longest
  ago goes next (a tenant that was just served goes behind every other tenant waiting), so a long backlog of
  one session delays another's request by at most one unit of work per waiting tenant. Between training and
  sampling, the side that used less compute lately goes next (usage decays with a half-life; a side back from
  idle gets at most ``max_credit_s`` of priority): each gets about half the compute whatever its unit sizes.
* **Control work** (adopting a session, dropping one) goes before everything: it is rare and other work may
  wait on it. Building a session comes next among training work: a new tenant has never been served.
* **Holds.** A shard group's sessions are held through its outage (:meth:`Scheduler.hold`): their requests
  are admitted and wait, none runs, until :meth:`Scheduler.release`; an interrupted request goes back to its
  place (:meth:`Scheduler.requeue`).
* **Memory.** Work refused for memory that something running will free (the sampling engine's rows) is
  deferred (:meth:`Scheduler.defer`) until memory frees or ``max_defer_s`` passes; work that can never fit is
  refused at once. A new session that waits for another to be released to make room is deferred the same way.
* **Eviction.** Which session makes room for a new one (:meth:`Scheduler.evictable`): a broken one first,
  else the longest idle of those with nothing waiting or running.

The scheduler only decides and records; the compute loop (worker/core/compute.py) runs what it picks and reports
back (:meth:`Scheduler.applied`, :meth:`Scheduler.finished`). Every method is called under the owner's lock
(worker/core/service.py). Nothing outside this module and worker/core/ordering.py reads or changes a lane
(tests/test_layering.py).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tinkerq.errors import MalformedMessageError, ServerError, TinkerqError
from tinkerq.operations import PASS_OPS
from tinkerq.worker.core.ordering import Ordering

KINDS = ("train", "sample")


@dataclass
class Caller:
    task_id: str
    inbox: str | None


@dataclass(eq=False)
class Request:
    """One request taken off the broker: what to run, and who waits for its answer."""

    op: str
    envelope: dict[str, Any]
    callers: list[Caller]
    model_id: str | None = None
    seq_id: int | None = None
    received: float = field(default_factory=time.monotonic)
    label: str = ""  # what the producer wrote for people (the task's argsrepr): `fleet status`, Flower
    done: bool = False  # answered (set by the owner; a create_model's transport thread waits for it)
    # Its body, fetched (claim check) and decoded ahead by the intake (worker/core/service.py): (raw, decoded), or the
    # error fetching or decoding raised (raised when the request runs, in its order); None: not fetched yet.
    body: Any = None
    prefetched: int = 0  # claim-checked bytes it holds against the worker's prefetch bound
    plan: Any = None  # what the transport decided for it (create_model: worker/transport/creation.py ``admit``)
    datums: int | None = None  # a loss request's datum count, when its body was decoded ahead (passes' bound)
    # Deferred for memory (Scheduler.defer): (the memory epoch then, when it was first deferred); None: never.
    deferred: tuple[int, float] | None = None


@dataclass
class Lane:
    """A training session as the scheduler sees it."""

    model_id: str
    pass_group: Any = None  # sessions whose loss requests may share a pass have the same non-None group
    ordering: Ordering = field(default_factory=Ordering)
    running: Request | None = None  # taken by the compute loop and not finished
    served: int = 0  # the fairness clock's value when this lane was last served (0: never)
    held: bool = False  # its shard group is down: its requests are admitted and wait, none runs
    broken: str | None = None  # why the session is unusable (its requests are refused with broken_error)
    broken_error: type[ServerError] = ServerError
    # Requests applied whose journal entry and answer are still on their way (worker/core/outbox.py), by seq: a repeat
    # of one joins it, so no answer goes out before its journal entry.
    unsent: dict[int, Request] = field(default_factory=dict)


@dataclass(frozen=True)
class Admission:
    """What became of a sequenced request offered to the scheduler (:meth:`Scheduler.admit`):

    * "queued": it waits in its lane, answered when it runs;
    * "joined": a copy of it waits, runs or is on its way out: the caller is answered with it;
    * "repeat": it was applied: answer ``reply`` (the kept answer);
    * "refused": answer ``error`` (a broken session; an answer no longer kept; early, behind a gap, past the
      lane's bound);
    * "wait": the lane is full of requests that will run: wait for room (backpressure), then offer it again;
    * "close": a close_model of a broken session: close it now, out of order, and answer it;
    * "unknown": no such session here (the owner restores it, or says why it is gone).
    """

    verdict: str
    reply: Any = None
    error: TinkerqError | None = None


@dataclass
class Work:
    """A unit the compute loop runs: ``kind`` is "control", "apply" (one request of one session), "pass" (loss
    requests of several sessions sharing a base model), "create", or "sample" (admit waiting sample requests
    and run one step of the sampling engine)."""

    kind: str
    requests: list[Request] = field(default_factory=list)
    lanes: list[Lane] = field(default_factory=list)
    control: Callable[[], Any] | None = None


class Scheduler:
    def __init__(self, *, half_life_s: float = 5.0, max_credit_s: float = 1.0, max_pass_datums: int = 1024,
                 max_defer_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._lanes: dict[str, Lane] = {}
        self._creates: deque[Request] = deque()
        self._samples: deque[Request] = deque()
        self._controls: deque[Work] = deque()
        self._sampling_busy = False  # the sampling engine holds rows (reported by the compute loop each turn)
        self._sampling_rows = 0
        self._tick = itertools.count(1)
        self._sample_served = 0
        self.max_pass_datums = max_pass_datums
        # Memory: work deferred until memory frees (an epoch passes) or max_defer_s has passed.
        self.max_defer_s = max_defer_s
        self._memory_epoch = 0
        # Train/sample balance (decayed seconds of compute per side).
        self.clock = clock
        self.half_life_s = half_life_s
        self.max_credit_s = max_credit_s
        self._used = dict.fromkeys(KINDS, 0.0)
        self.seconds = dict.fromkeys(KINDS, 0.0)  # totals, for metrics
        self._idle = dict.fromkeys(KINDS, True)
        self._at = clock()

    # -- sessions --------------------------------------------------------------------------------------------

    def open(self, model_id: str, pass_group: Any = None, ordering: Ordering | None = None) -> None:
        """A new session's lane (``ordering``: its order restored by an adopter, or bounds set by a test)."""
        self._lanes[model_id] = Lane(model_id, pass_group, ordering or Ordering())

    def regroup(self, model_id: str, pass_group: Any) -> None:
        """A session was re-made (its shard group re-formed): its loss requests share passes with this group."""
        self._lanes[model_id].pass_group = pass_group

    def close(self, model_id: str) -> list[Request]:
        """Forget a session; returns the requests that were waiting in its lane (to be answered). What it held in
        memory is free now: deferred work may fit."""
        lane = self._lanes.pop(model_id, None)
        if lane is None:
            return []
        self.memory_freed()
        return self._drop_waiting(lane)

    def position(self, model_id: str) -> int:
        """The last request of the session applied (0: none)."""
        return self._lanes[model_id].ordering.next_seq - 1

    def restore(self, model_id: str, last: int, kept: list[tuple[int, Any]], replayed: list[tuple[int, Any]]) -> None:
        """An adopter re-made a session from a snapshot after request ``last``, then replayed its journal: its order
        starts after the snapshot, the journal's answers the snapshot covers are ``kept`` (seq, reply) for
        repeats, and the ``replayed`` ones count as applied, in order."""
        ordering = self._lanes[model_id].ordering
        ordering.next_seq = last + 1
        for seq, reply in kept:
            ordering.keep(seq, reply)
        for seq, reply in replayed:
            ordering.applied(seq, reply)

    # -- intake ------------------------------------------------------------------------------------------------

    def admit(self, request: Request) -> Admission:
        """Offer a sequenced request (transport thread). See :class:`Admission` for what may become of it."""
        assert request.model_id is not None and request.seq_id is not None
        lane = self._lanes.get(request.model_id)
        if lane is None:
            return Admission("unknown")
        seq, ordering = request.seq_id, lane.ordering
        if ordering.classify(seq) == "repeat":
            unsent = lane.unsent.get(seq)
            if unsent is not None:  # applied; its journal entry and answer are on their way: it joins them
                unsent.callers.extend(request.callers)
                return Admission("joined")
            kept = ordering.reply_for(seq)
            if kept is None:
                return Admission("refused", error=MalformedMessageError(
                    f"request seq {seq} of session {lane.model_id} was already applied and its answer is no longer "
                    f"kept; it was not applied again"))
            return Admission("repeat", reply=kept)
        if lane.broken is not None:
            if request.op == "close_model":  # an unusable session can still be released, out of order
                return Admission("close")
            return Admission("refused", error=lane.broken_error(lane.broken, session_broken=True))
        if lane.running is not None and lane.running.seq_id == seq:
            lane.running.callers.extend(request.callers)
            return Admission("joined")
        if seq in ordering.buffered:
            ordering.buffered[seq].callers.extend(request.callers)
            return Admission("joined")
        if ordering.buffer(seq, request):
            return Admission("queued")
        if lane.running is None and ordering.next_seq not in ordering.buffered:
            # Early requests behind a gap fill the lane: refused, as bounded (they cannot run before it arrives).
            return Admission("refused", error=ServerError(
                f"session {lane.model_id} cannot keep request seq {seq} until seq {ordering.next_seq} arrives: "
                f"{ordering.refusal}"))
        return Admission("wait")  # its lane is full of requests that will run: room comes

    def add_create(self, request: Request) -> None:
        self._creates.append(request)

    def add_sample(self, request: Request) -> None:
        self._samples.append(request)

    def add_control(self, control: Callable[[], Any]) -> None:
        self._controls.append(Work("control", control=control))

    # -- picking -----------------------------------------------------------------------------------------------

    def _waits_for_memory(self, request: Request, now: float) -> bool:
        deferred = request.deferred
        return (deferred is not None and deferred[0] == self._memory_epoch
                and now - deferred[1] < self.max_defer_s)

    def _ready(self, now: float) -> list[Lane]:
        ready = []
        for lane in self._lanes.values():
            if lane.running is not None or lane.held:
                continue
            head = lane.ordering.buffered.get(lane.ordering.next_seq)
            if head is not None and not self._waits_for_memory(head, now):
                ready.append(lane)
        return ready

    def _head(self, lane: Lane) -> Request:
        return lane.ordering.buffered[lane.ordering.next_seq]

    def _first_ready(self, queue: deque[Request], now: float) -> Request | None:
        return next((r for r in queue if not self._waits_for_memory(r, now)), None)

    def has_work(self) -> bool:
        now = self.clock()
        return bool(self._controls or self._first_ready(self._creates, now) is not None or self._samples_ready(now)
                    or self._sampling_busy or self._ready(now))

    def _samples_ready(self, now: float) -> bool:
        return self._first_ready(self._samples, now) is not None

    def next(self) -> Work | None:
        """The next unit of work, marked running; None when there is nothing to run."""
        if self._controls:
            return self._controls.popleft()
        now = self.clock()
        ready = self._ready(now)
        create = self._first_ready(self._creates, now)
        train = bool(ready) or create is not None
        sample = self._samples_ready(now) or self._sampling_busy
        if not train and not sample:
            return None
        kind = "train" if train and (not sample or self._turn() == "train") else "sample"
        self._mark_busy(train, sample)
        if kind == "sample":
            self._sample_served = next(self._tick)
            taken = [r for r in self._samples if not self._waits_for_memory(r, now)]
            for request in taken:
                self._samples.remove(request)
            return Work("sample", requests=taken)
        if create is not None:  # a new tenant has never been served: it goes first
            self._creates.remove(create)
            return Work("create", requests=[create])
        first = min(ready, key=lambda lane: (lane.served, self._head(lane).received))
        head = self._take(first)
        if first.pass_group is None or head.op not in PASS_OPS:
            return Work("apply", requests=[head], lanes=[first])
        # A pass: the other ready lanes of the same base with a loss request of the same kind, least recently
        # served first, up to max_pass_datums datums (a request whose count is unknown, or larger, runs alone).
        lanes, requests = [first], [head]
        datums = head.datums
        for lane in sorted(ready, key=lambda ln: ln.served):
            if datums is None or lane is first or lane.pass_group is not first.pass_group:
                continue
            candidate = self._head(lane)
            if candidate.op != head.op or candidate.datums is None or datums + candidate.datums > self.max_pass_datums:
                continue
            datums += candidate.datums
            requests.append(self._take(lane))
            lanes.append(lane)
        return Work("pass", requests=requests, lanes=lanes)

    def _take(self, lane: Lane) -> Request:
        request = lane.ordering.pop_ready()
        assert request is not None
        lane.running = request
        lane.served = next(self._tick)
        return request

    def applied(self, request: Request, reply: Any) -> None:
        """``request`` (running) was applied with ``reply``: recorded in its order, its answer on its way out until
        :meth:`sent` (a repeat meanwhile joins it)."""
        assert request.model_id is not None and request.seq_id is not None
        lane = self._lanes.get(request.model_id)
        if lane is None:
            return
        lane.ordering.applied(request.seq_id, reply)
        lane.unsent[request.seq_id] = request

    def sent(self, request: Request) -> None:
        """``request``'s journal entry and answer were written: a repeat is answered from the kept replies."""
        lane = self._lanes.get(request.model_id or "")
        if lane is not None and request.seq_id is not None:
            lane.unsent.pop(request.seq_id, None)

    def finished(self, work: Work, kind: str, seconds: float, *, sampling_rows: int) -> None:
        """The compute loop ran ``work`` for ``seconds`` (kind "train" or "sample"); ``sampling_rows``: the rows
        the sampling engine holds after it (fewer than before: their memory is free)."""
        for lane in work.lanes:
            lane.running = None
        if sampling_rows < self._sampling_rows:
            self.memory_freed()
        self._sampling_rows = sampling_rows
        self._sampling_busy = sampling_rows > 0
        self._decay()
        self._used[kind] += seconds
        self.seconds[kind] += seconds

    # -- memory ------------------------------------------------------------------------------------------------

    def defer(self, request: Request, *, freeing: bool = False) -> bool:
        """``request`` (taken, not applied) did not fit now. Defer it (True: it goes back to its place and waits
        until memory frees, for at most ``max_defer_s``) when something under way will free what it needs: the
        sampling engine's rows, or (``freeing``, the caller started it) a session on its way out to make room
        for a new one. False: nothing will free it by itself, or it waited its bound: refuse it."""
        now = self.clock()
        first = request.deferred[1] if request.deferred is not None else now
        if not (self._sampling_busy or freeing) or now - first >= self.max_defer_s:
            return False
        request.deferred = (self._memory_epoch, first)
        if request.op == "sample":
            self._samples.appendleft(request)
        elif request.op == "create_model":
            self._creates.appendleft(request)
        else:
            self.requeue(request)
        return True

    def memory_freed(self) -> None:
        """Memory was freed (rows finished, a session closed, a release to make room settled): deferred work is
        offered again."""
        self._memory_epoch += 1

    # -- holds, breaks, gaps, eviction -------------------------------------------------------------------------

    def hold(self, model_ids: list[str]) -> list[str]:
        """Hold these sessions (their shard group is down): requests are admitted and wait, none runs. Returns
        those held (a broken session is not)."""
        held = []
        for model_id in model_ids:
            lane = self._lanes.get(model_id)
            if lane is not None and lane.broken is None:
                lane.held = True
                held.append(model_id)
        return held

    def release(self, model_id: str) -> None:
        lane = self._lanes.get(model_id)
        if lane is not None:
            lane.held = False

    def requeue(self, request: Request) -> bool:
        """Put a taken request that was not applied back in its place (it runs again, first of its lane)."""
        lane = self._lanes.get(request.model_id or "")
        if lane is None or request.seq_id != lane.ordering.next_seq:
            return False
        if lane.running is request:
            lane.running = None
        lane.ordering.put_back(request.seq_id, request)
        return True

    def break_session(self, model_id: str, reason: str, error: type[ServerError] = ServerError) -> list[Request]:
        """The session is unusable: every request of it from now on is refused with ``error(reason)``; returns
        the ones waiting (to be answered with it). It stays until closed (its lane: a close_model still works)."""
        lane = self._lanes.get(model_id)
        if lane is None:
            return []
        lane.broken, lane.broken_error, lane.held = reason, error, False
        return self._drop_waiting(lane)

    def broken(self, model_id: str) -> str | None:
        lane = self._lanes.get(model_id)
        return None if lane is None else lane.broken

    def expire_gaps(self, now: float, timeout_s: float, why: Callable[[str, int], str]) -> list[
            tuple[list[Request], ServerError]]:
        """Break every session whose oldest waiting request has waited more than ``timeout_s`` for a missing
        predecessor (``why(model_id, missing_seq)`` says so); returns each one's waiting requests and error."""
        expired = []
        for lane in list(self._lanes.values()):
            ordering = lane.ordering
            if (lane.running is None and not lane.held and ordering.buffered
                    and ordering.next_seq not in ordering.buffered and ordering.waited(now) > timeout_s):
                reason = why(lane.model_id, ordering.next_seq)
                expired.append((self.break_session(lane.model_id, reason), ServerError(reason, session_broken=True)))
        return expired

    def idle(self, model_id: str) -> bool:
        """Nothing of the session waits, runs or is on its way out, and it is neither held nor broken."""
        lane = self._lanes.get(model_id)
        return (lane is not None and lane.running is None and not lane.ordering.buffered and not lane.unsent
                and not lane.held and lane.broken is None)

    def evictable(self, last_used: dict[str, float], now: float, idle_s: float) -> str | None:
        """Which of these sessions (model id -> when last used) makes room for a new one: a broken one first, else
        the longest idle of those idle for more than ``idle_s``; None when none may go."""
        broken = [mid for mid in last_used if self.broken(mid) is not None]
        if broken:
            return broken[0]
        idle = [mid for mid, used in last_used.items() if self.idle(mid) and now - used > idle_s]
        return min(idle, key=lambda mid: last_used[mid]) if idle else None

    def drain(self) -> list[Request]:
        """Take every request still waiting, anywhere (the worker stops: they are answered)."""
        left = list(self._creates) + list(self._samples)
        self._creates.clear()
        self._samples.clear()
        for lane in self._lanes.values():
            left += self._drop_waiting(lane)
        return left

    def _drop_waiting(self, lane: Lane) -> list[Request]:
        return lane.ordering.drop_buffered()

    # -- train/sample balance --------------------------------------------------------------------------------

    def _turn(self) -> str:
        self._decay()
        return "train" if self._used["train"] <= self._used["sample"] else "sample"

    def _mark_busy(self, train: bool, sample: bool) -> None:
        """A side coming back from idle gets at most max_credit_s of priority for the time it was away."""
        self._decay()
        for kind, busy in (("train", train), ("sample", sample)):
            other = KINDS[1 - KINDS.index(kind)]
            if busy and self._idle[kind]:
                self._used[kind] = max(self._used[kind], self._used[other] - self.max_credit_s)
            self._idle[kind] = not busy

    def _decay(self) -> None:
        now = self.clock()
        factor = math.pow(0.5, (now - self._at) / self.half_life_s)
        self._at = now
        for kind in KINDS:
            self._used[kind] *= factor
