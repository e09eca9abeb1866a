"""Strict per-session request order on top of a broker that may redeliver and reorder.

Redis queues are FIFO only while nothing fails: a redelivered message can arrive after later ones, and
a retry can arrive twice (field-notes). So the worker itself orders each session's requests by the
``seq_id`` the training client gave them:

* ``seq_id == next``: run it, then run every buffered successor that is now in order;
* ``seq_id > next``: buffer it (its answer is stored when it runs);
* ``seq_id < next``: a repeat of an applied request: answer it from the kept replies, never re-apply.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

KEPT_REPLIES = 256  # answers kept per session for repeated requests
MAX_BUFFERED = 4096  # out-of-order requests buffered per session
# Bytes bounds too, per session: a kept forward_backward reply can be tens of MB, and a hostile or broken
# producer could send large inline payloads out of order. The newest reply is always kept, whatever its
# size (the likeliest to be asked again, by a client retry); buffered requests beyond the bound are refused.
KEPT_REPLY_BYTES = 64 * 1024 * 1024
MAX_BUFFERED_BYTES = 64 * 1024 * 1024
# Counted for every buffered request and kept reply on top of its payload: the envelope map, task ids,
# the Pending record. Keeps many tiny entries from being free.
ENTRY_OVERHEAD_BYTES = 1024


def envelope_bytes(envelope: Any) -> int:
    """What buffering ``envelope`` costs: its inline payload (a claim-checked one stays in Redis) + overhead."""
    size = ENTRY_OVERHEAD_BYTES
    ref = envelope.get("payload") if isinstance(envelope, dict) else None
    if isinstance(ref, dict) and isinstance(ref.get("inline"), (bytes, bytearray)):
        size += len(ref["inline"])
    return size


def reply_bytes(reply: Any) -> int:
    """What keeping ``reply`` costs: the bytes it holds (an Outcome's msgpack body) + overhead."""
    parts = reply if isinstance(reply, (tuple, list)) else (reply,)
    return ENTRY_OVERHEAD_BYTES + sum(len(x) for x in parts if isinstance(x, (bytes, bytearray, memoryview)))


class Waiting(Protocol):
    """What waits in an ordering: a request (worker/core/scheduler.py) with its envelope and arrival time."""

    envelope: dict[str, Any]
    received: float


@dataclass
class Ordering:
    """One session's order: the next ``seq_id`` to apply, the requests that arrived early (held once, here), and
    the kept answers to repeat. Owned by the scheduler (worker/core/scheduler.py); nothing else changes it."""

    next_seq: int = 1
    buffered: dict[int, Any] = field(default_factory=dict)  # seq -> the request (a Waiting), early or next
    replies: OrderedDict[int, Any] = field(default_factory=OrderedDict)
    max_buffered: int = MAX_BUFFERED
    max_buffered_bytes: int = MAX_BUFFERED_BYTES
    kept_replies: int = KEPT_REPLIES
    kept_reply_bytes: int = KEPT_REPLY_BYTES
    buffered_bytes: int = 0  # sum of envelope_bytes() over the buffered requests
    reply_bytes: int = 0  # sum of reply_bytes() over the kept replies
    _reply_sizes: dict[int, int] = field(default_factory=dict)
    _buffered_sizes: dict[int, int] = field(default_factory=dict)
    # Why the last buffer() call refused, for the caller's error message ("" when it did not).
    refusal: str = ""

    def classify(self, seq_id: int) -> str:
        if seq_id == self.next_seq:
            return "run"
        if seq_id > self.next_seq:
            return "buffer"
        return "repeat"

    def buffer(self, seq_id: int, request: Waiting) -> bool:
        """Keep ``request`` until its turn; False when the buffer is full, by count or bytes (``refusal`` says
        which; the caller answers with an error). A redelivery of a buffered one is the caller's to join."""
        self.refusal = ""
        assert seq_id not in self.buffered
        nbytes = envelope_bytes(request.envelope)
        if len(self.buffered) >= self.max_buffered:
            self.refusal = f"{len(self.buffered)} requests already wait (at most {self.max_buffered})"
            return False
        if self.buffered_bytes + nbytes > self.max_buffered_bytes:
            self.refusal = (f"the {len(self.buffered)} requests already waiting hold {self.buffered_bytes} bytes; "
                            f"this one ({nbytes} bytes) would pass the {self.max_buffered_bytes}-byte bound")
            return False
        self.buffered[seq_id] = request
        self._buffered_sizes[seq_id] = nbytes
        self.buffered_bytes += nbytes
        return True

    def put_back(self, seq_id: int, request: Waiting) -> None:
        """Return a request taken with :meth:`pop_ready` and not applied (it runs again), whatever the bounds."""
        nbytes = envelope_bytes(request.envelope)
        self.buffered[seq_id] = request
        self._buffered_sizes[seq_id] = nbytes
        self.buffered_bytes += nbytes

    def applied(self, seq_id: int, reply: Any) -> None:
        """Record the answer to the request at ``next_seq`` and move on.

        The oldest kept replies go when there are more than ``kept_replies`` or they hold more than
        ``kept_reply_bytes``; the newest one always stays.
        """
        assert seq_id == self.next_seq
        self.keep(seq_id, reply)
        self.next_seq += 1

    def keep(self, seq_id: int, reply: Any) -> None:
        """Keep the answer to a request already applied (``applied``; an adopter: the journal's entries its
        snapshot covers), for repeats of it."""
        if seq_id in self.replies:
            return
        size = reply_bytes(reply)
        self.replies[seq_id] = reply
        self._reply_sizes[seq_id] = size
        self.reply_bytes += size
        while len(self.replies) > 1 and (len(self.replies) > self.kept_replies
                                          or self.reply_bytes > self.kept_reply_bytes):
            old, _ = self.replies.popitem(last=False)
            self.reply_bytes -= self._reply_sizes.pop(old)

    def pop_ready(self) -> Any | None:
        """The buffered request that is next in order, if it has arrived."""
        request = self.buffered.pop(self.next_seq, None)
        if request is not None:
            self.buffered_bytes -= self._buffered_sizes.pop(self.next_seq)
        return request

    def reply_for(self, seq_id: int) -> Any | None:
        return self.replies.get(seq_id)

    def waited(self, now: float) -> float:
        """How long the oldest buffered request has waited for ``next_seq`` (0 if none waits)."""
        return max((now - r.received for r in self.buffered.values()), default=0.0)

    def drop_buffered(self) -> list[Any]:
        dropped = list(self.buffered.values())
        self.buffered.clear()
        self._buffered_sizes.clear()
        self.buffered_bytes = 0
        return dropped
