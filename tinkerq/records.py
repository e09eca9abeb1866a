"""Typed recovery records: what a worker writes to Redis so a session survives its worker, and what producers
and other workers read back. One module for both sides (no JSON parsed by hand anywhere else).

* :class:`SessionHome` (``keys.session_home``): where a training session lives and how to re-make it; or, for a
  session released idle (worker/recovery/idle_release.py), that it is *parked*: in no worker's memory, restored by
  ``worker`` from its automatic snapshot on its next request.
* :class:`SnapshotRecord` (``keys.auto_snapshot``): the session's latest automatic training snapshot.
* :class:`JournalEntry` (``keys.journal``, msgpack): a request the session applied since that snapshot.

``loads`` returns None for a record that is absent or unreadable: a reader then acts as if there were none.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from tinkerq.wire import codec


def _json(raw: bytes | None) -> dict[str, Any] | None:
    try:
        value = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class SessionHome:
    model_id: str
    base_model: str
    worker: str
    lora: dict[str, Any] | None = None  # the LoRA config with its effective seed; None: a full-parameter session
    adopted_from: str | None = None  # the lost worker it was adopted from
    # Parked (released idle): when (unix seconds; None: live in ``worker``'s memory), after how long idle, and the
    # last request it applied (its automatic snapshot holds the state after it).
    parked_at: float | None = None
    idle_s: float = 0.0
    seq_id: int = 0
    # Its optimizer's config (tinkerq.optimizers.encode_config): re-made with the same one. None: AdamW (records
    # written before the field was).
    optimizer: dict[str, Any] | None = None

    def dumps(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def loads(cls, raw: bytes | None) -> SessionHome | None:
        value = _json(raw)
        if value is None or not all(isinstance(value.get(k), str) for k in ("model_id", "worker", "base_model")):
            return None
        lora, optimizer = value.get("lora"), value.get("optimizer")
        adopted_from = value.get("adopted_from")
        parked_at, idle_s, seq_id = value.get("parked_at"), value.get("idle_s"), value.get("seq_id")
        return cls(value["model_id"], value["base_model"], value["worker"],
                   lora if isinstance(lora, dict) else None,
                   adopted_from if isinstance(adopted_from, str) else None,
                   _float(parked_at), _float(idle_s) or 0.0,
                   seq_id if isinstance(seq_id, int) and not isinstance(seq_id, bool) else 0,
                   optimizer if isinstance(optimizer, dict) else None)

    @property
    def parked(self) -> bool:
        return self.parked_at is not None

    def moved_to(self, worker: str) -> SessionHome:
        """The record once ``worker`` has adopted the session from the one named here (a parked one stays parked:
        only who restores it changes)."""
        return replace(self, worker=worker, adopted_from=self.worker)

    def parked_by(self, at: float, idle_s: float, seq_id: int) -> SessionHome:
        """The record once the session was released idle after request ``seq_id``."""
        return replace(self, parked_at=at, idle_s=idle_s, seq_id=seq_id)

    def live_on(self, worker: str) -> SessionHome:
        """The record once ``worker`` holds the session in memory again (restored after a release)."""
        return replace(self, worker=worker, parked_at=None, idle_s=0.0, seq_id=0)


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class SnapshotRecord:
    """A session's latest automatic training snapshot: its directory, the last request it holds, when, where."""

    path: str
    seq_id: int
    time: float
    worker: str

    def dumps(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def loads(cls, raw: bytes | None) -> SnapshotRecord | None:
        value = _json(raw)
        if value is None or not isinstance(value.get("path"), str):
            return None
        seq_id, when, worker = value.get("seq_id"), value.get("time"), value.get("worker")
        return cls(value["path"], seq_id if isinstance(seq_id, int) else 0,
                   float(when) if isinstance(when, (int, float)) else 0.0, worker if isinstance(worker, str) else "")


@dataclass(frozen=True)
class JournalEntry:
    """One applied request: its position, operation, body (None when not needed to replay it) and answer,
    ``(status, value, timing)`` as the worker keeps answers."""

    seq: int
    op: str
    body: bytes | None
    reply: tuple[str, Any, dict[str, float]]

    def dumps(self) -> bytes:
        return codec.packb({"seq": self.seq, "op": self.op, "body": self.body, "reply": list(self.reply)})

    @classmethod
    def loads(cls, raw: bytes) -> JournalEntry:
        value = codec.unpackb(raw)
        status, answer, timing = value["reply"]
        return cls(int(value["seq"]), str(value["op"]), value["body"], (status, answer, timing or {}))
