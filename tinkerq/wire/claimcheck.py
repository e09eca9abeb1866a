"""Claim check: payloads above a threshold travel as raw Redis values, the message carries the key.

kombu's Redis transport wraps every message body in base64 inside JSON (+33%, and a second copy in
its ``unacked`` hash). A payload reference is ``{"inline": bytes}`` for small payloads or
``{"blob": key, "size": n}`` for large ones; the blob lives ``blob_ttl_s`` seconds.
"""

from __future__ import annotations

import uuid
from typing import Any

from tinkerq import keys
from tinkerq.errors import MalformedMessageError
from tinkerq.store import KeyValueStore, Put, Write


class ClaimCheck:
    def __init__(self, store: KeyValueStore, threshold_bytes: int, ttl_s: float, max_bytes: int) -> None:
        self.store = store
        self.threshold_bytes = threshold_bytes
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes

    def check_size(self, size: int) -> None:
        """Refuse a request body larger than the fleet's limit, before anything is sent."""
        if size > self.max_bytes:
            raise MalformedMessageError(
                f"request of {size} bytes exceeds the limit of {self.max_bytes} bytes "
                f"(TINKERQ_MAX_MESSAGE_BYTES); split the batch into several forward_backward calls"
            )

    def wrap(self, payload: bytes, writes: list[Write] | None = None) -> dict[str, Any]:
        """The reference to ``payload``: inline, or a blob SET now, or, with ``writes``, a blob whose SET is
        appended there (the caller writes it in the same transaction as what names it: one round trip)."""
        self.check_size(len(payload))
        if len(payload) <= self.threshold_bytes:
            return {"inline": payload}
        key = keys.blob(uuid.uuid4().hex)
        if writes is None:
            self.store.set(key, payload, self.ttl_s)
        else:
            writes.append(Put(key, payload, self.ttl_s))
        return {"blob": key, "size": len(payload)}

    def unwrap(self, ref: Any) -> bytes:
        if not isinstance(ref, dict):
            raise MalformedMessageError(f"payload reference must be a map, got {type(ref).__name__}")
        if "inline" in ref:
            payload = ref["inline"]
            if not isinstance(payload, bytes):
                raise MalformedMessageError("inline payload must be bytes")
        elif "blob" in ref:
            key = ref["blob"]
            if not isinstance(key, str) or not key.startswith(keys.blob("")):
                raise MalformedMessageError(f"payload reference {key!r} is not a tinkerq blob key")
            size = ref.get("size")
            if isinstance(size, int) and size > self.max_bytes:
                raise MalformedMessageError(f"payload of {size} bytes exceeds the limit of {self.max_bytes}")
            payload = self.store.get(key)
            if payload is None:
                raise MalformedMessageError(
                    f"payload {key} has expired or never existed (blobs live {self.ttl_s:.0f} s; "
                    f"TINKERQ_BLOB_TTL_S)"
                )
        else:
            raise MalformedMessageError("payload reference has neither 'inline' nor 'blob'")
        if len(payload) > self.max_bytes:
            raise MalformedMessageError(f"payload of {len(payload)} bytes exceeds the limit of {self.max_bytes}")
        return payload

    def discard(self, ref: Any) -> None:
        if isinstance(ref, dict) and isinstance(ref.get("blob"), str):
            self.store.delete(ref["blob"])
