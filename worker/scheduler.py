"""The scheduler: which request the compute loop runs next. Pure Python: no torch, no Redis, no threads.

It holds every request the transport took off the broker, in one lane per training session, and decides:

* **Order.** A session's requests run in ``seq_id`` order (worker/ordering.py): early ones wait in the
  session's lane (bounded in count and bytes), repeats are answered from the kept replies, a missing one
  fails the session after the gap timeout (:meth:`Scheduler.expire_gaps`).
* **Passes.** Loss requests of sessions that share a base model (LoRA) and are next in their order run as
  one pass: all of the same kind (forward or forward_backward); the compute loop cuts a pass larger than
  ``TINKERQ_LORA_BATCH_MAX_DATUMS`` datums into consecutive ones.
* **Fairness.** Least recently served first: among the lanes with a request ready, the one served longest
  ago goes next (a tenant that was just served goes behind every other tenant waiting), so a long backlog of
  one session delays another's request by at most one unit of work per waiting tenant. Between training and
  sampling, the side that used less compute lately goes next (usage decays with a half-life; a side back from
  idle gets at most ``max_credit_s`` of priority): each gets about half the compute whatever its unit sizes.
* **Control work** (adopting a session, dropping one) goes before everything: it is rare and other work may
  wait on it. Building a session comes next among training work: a new tenant has never been served.

The scheduler only decides and records; the compute loop (worker/compute.py) runs what it picks and reports
back with :meth:`Scheduler.finished`. Every method is called under the owner's lock (worker/service.py).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tinkerq.operations import PASS_OPS
from tinkerq.worker.ordering import Ordering

KINDS = ("train", "sample")


@dataclass
class Caller:
    task_id: str
    inbox: str | None


@dataclass
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
    # Its body, fetched (claim check) and decoded ahead by the intake (worker/service.py): (raw, decoded), or the
    # error fetching or decoding raised (raised when the request runs, in its order); None: not fetched yet.
    body: Any = None
    prefetched: int = 0  # claim-checked bytes it holds against the worker's prefetch bound
    plan: Any = None  # what the transport decided for it (create_model: worker/creation.py ``admit``)


@dataclass
class Lane:
    """A training session as the scheduler sees it."""

    model_id: str
    pass_group: Any = None  # sessions whose loss requests may share a pass have the same non-None group
    ordering: Ordering = field(default_factory=Ordering)
    running: Request | None = None  # taken by the compute loop and not finished
    served: int = 0  # the fairness clock's value when this lane was last served (0: never)
    requests: dict[int, Request] = field(default_factory=dict)  # seq -> request waiting in order


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
    def __init__(self, *, half_life_s: float = 5.0, max_credit_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lanes: dict[str, Lane] = {}
        self.creates: deque[Request] = deque()
        self.samples: deque[Request] = deque()
        self.controls: deque[Work] = deque()
        self.sampling_busy = False  # the sampling engine holds rows (set by the owner after each step)
        self._tick = itertools.count(1)
        self._sample_served = 0
        # Train/sample balance (decayed seconds of compute per side).
        self.clock = clock
        self.half_life_s = half_life_s
        self.max_credit_s = max_credit_s
        self._used = dict.fromkeys(KINDS, 0.0)
        self.seconds = dict.fromkeys(KINDS, 0.0)  # totals, for metrics
        self._idle = dict.fromkeys(KINDS, True)
        self._at = clock()

    # -- sessions --------------------------------------------------------------------------------------------

    def open(self, model_id: str, pass_group: Any = None, ordering: Ordering | None = None) -> Lane:
        lane = Lane(model_id, pass_group, ordering or Ordering())
        self.lanes[model_id] = lane
        return lane

    def close(self, model_id: str) -> list[Request]:
        """Forget a session; returns the requests that were waiting in its lane (to be answered)."""
        lane = self.lanes.pop(model_id, None)
        if lane is None:
            return []
        return self.drop_waiting(lane)

    def drop_waiting(self, lane: Lane) -> list[Request]:
        """Take every request waiting in ``lane`` out of it (they will be answered with an error)."""
        lane.ordering.drop_buffered()
        dropped = list(lane.requests.values())
        lane.requests.clear()
        return dropped

    # -- intake ------------------------------------------------------------------------------------------------

    def add(self, lane: Lane, request: Request) -> str:
        """Queue a sequenced request in its lane: "queued", "joined" (a redelivery of one already waiting or
        running: one more caller), or "full" (``lane.ordering.refusal`` says why). Repeats are answered by the
        caller before this (``lane.ordering.classify``)."""
        assert request.seq_id is not None
        seq = request.seq_id
        if lane.running is not None and lane.running.seq_id == seq:
            lane.running.callers.extend(request.callers)
            return "joined"
        if seq in lane.requests:
            lane.requests[seq].callers.extend(request.callers)
            return "joined"
        if not lane.ordering.buffer(seq, request.op, request.envelope, request.callers[0].task_id):
            return "full"
        lane.requests[seq] = request
        return "queued"

    def drains(self, lane: Lane) -> bool:
        """Whether the lane will make room by itself: its next request is running or waiting (no gap)."""
        return lane.running is not None or lane.ordering.next_seq in lane.requests

    # -- picking -----------------------------------------------------------------------------------------------

    def _ready(self) -> list[Lane]:
        return [lane for lane in self.lanes.values()
                if lane.running is None and lane.ordering.next_seq in lane.requests]

    def has_work(self) -> bool:
        return bool(self.controls or self.creates or self.samples or self.sampling_busy or self._ready())

    def next(self) -> Work | None:
        """The next unit of work, marked running; None when there is nothing to run."""
        if self.controls:
            return self.controls.popleft()
        ready = self._ready()
        train = bool(ready or self.creates)
        sample = bool(self.samples or self.sampling_busy)
        if not train and not sample:
            return None
        kind = "train" if train and (not sample or self._turn() == "train") else "sample"
        self._mark_busy(train, sample)
        if kind == "sample":
            self._sample_served = next(self._tick)
            taken = list(self.samples)
            self.samples.clear()
            return Work("sample", requests=taken)
        if self.creates:  # a new tenant has never been served: it goes first
            return Work("create", requests=[self.creates.popleft()])
        first = min(ready, key=lambda lane: (lane.served, lane.requests[lane.ordering.next_seq].received))
        head = self._take(first)
        if first.pass_group is None or head.op not in PASS_OPS:
            return Work("apply", requests=[head], lanes=[first])
        # A pass: the other ready lanes of the same base with a loss request of the same kind, least recently
        # served first.
        lanes, requests = [first], [head]
        for lane in sorted(ready, key=lambda ln: ln.served):
            if lane is first or lane.pass_group is not first.pass_group:
                continue
            if lane.requests[lane.ordering.next_seq].op != head.op:
                continue
            requests.append(self._take(lane))
            lanes.append(lane)
        return Work("pass", requests=requests, lanes=lanes)

    def _take(self, lane: Lane) -> Request:
        ready = lane.ordering.pop_ready()
        assert ready is not None
        request = lane.requests.pop(ready[0])
        lane.running = request
        lane.served = next(self._tick)
        return request

    def finished(self, work: Work, kind: str, seconds: float) -> None:
        """The compute loop ran ``work`` for ``seconds`` (kind "train" or "sample"); its requests were recorded
        as applied in their lanes' orderings by the owner."""
        for lane in work.lanes:
            lane.running = None
        self._decay()
        self._used[kind] += seconds
        self.seconds[kind] += seconds

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

    # -- gaps --------------------------------------------------------------------------------------------------

    def stalled(self, now: float, timeout_s: float) -> list[Lane]:
        """Lanes whose oldest waiting request has waited more than ``timeout_s`` for a missing predecessor."""
        return [lane for lane in self.lanes.values()
                if lane.running is None and lane.requests and lane.ordering.next_seq not in lane.requests
                and lane.ordering.waited(now) > timeout_s]
