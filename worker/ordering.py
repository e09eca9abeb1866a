"""Strict per-session request order on top of a broker that may redeliver and reorder.

Redis queues are FIFO only while nothing fails: a redelivered message can arrive after later ones, and
a retry can arrive twice (field-notes). So the worker itself orders each session's requests by the
``seq_id`` the training client gave them:

* ``seq_id == next``: run it, then run every buffered successor that is now in order;
* ``seq_id > next``: buffer it (its answer is stored when it runs);
* ``seq_id < next``: a repeat of an applied request: answer it from the kept replies, never re-apply.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

KEPT_REPLIES = 256  # answers kept per session for repeated requests
MAX_BUFFERED = 4096  # out-of-order requests buffered per session


@dataclass
class Pending:
    op: str
    envelope: dict[str, Any]
    task_ids: list[str]
    since: float = field(default_factory=time.monotonic)


@dataclass
class Ordering:
    next_seq: int = 1
    buffered: dict[int, Pending] = field(default_factory=dict)
    replies: OrderedDict[int, Any] = field(default_factory=OrderedDict)

    def classify(self, seq_id: int) -> str:
        if seq_id == self.next_seq:
            return "run"
        if seq_id > self.next_seq:
            return "buffer"
        return "repeat"

    def buffer(self, seq_id: int, op: str, envelope: dict[str, Any], task_id: str) -> bool:
        """Keep an early request; False when the buffer is full (the caller answers with an error)."""
        if seq_id in self.buffered:
            self.buffered[seq_id].task_ids.append(task_id)
            return True
        if len(self.buffered) >= MAX_BUFFERED:
            return False
        self.buffered[seq_id] = Pending(op, envelope, [task_id])
        return True

    def applied(self, seq_id: int, reply: Any) -> None:
        """Record the answer to the request at ``next_seq`` and move on."""
        assert seq_id == self.next_seq
        self.replies[seq_id] = reply
        while len(self.replies) > KEPT_REPLIES:
            self.replies.popitem(last=False)
        self.next_seq += 1

    def pop_ready(self) -> tuple[int, Pending] | None:
        """The buffered request that is next in order, if it has arrived."""
        pending = self.buffered.pop(self.next_seq, None)
        return (self.next_seq, pending) if pending is not None else None

    def reply_for(self, seq_id: int) -> Any | None:
        return self.replies.get(seq_id)

    def waited(self, now: float) -> float:
        """How long the oldest buffered request has waited for ``next_seq`` (0 if none waits)."""
        return max((now - p.since for p in self.buffered.values()), default=0.0)

    def drop_buffered(self) -> list[Pending]:
        dropped = list(self.buffered.values())
        self.buffered.clear()
        return dropped
