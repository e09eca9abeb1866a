"""The gateway's futures: every submission answers at once with a request id; ``retrieve_future`` long-polls it.

Each future is an asyncio task that awaits the fleet's answer and turns it into what the SDK expects
(:class:`Answer`: protobuf bytes for forward_backward and sample results, JSON for the rest, or a failure
body). A poll waits at most ``poll_s`` for the task (the SDK gives up on a poll after 45 s and re-polls at
once on a ``try_again``, so the wait must be long enough not to be a hot loop and short enough not to time
out). Results stay retrievable for ``keep_s`` after they are ready: a delivered answer can be lost on the
way and polled again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from tinkerq.errors import ServerError, TinkerqError

log = logging.getLogger("tinkerq.gateway")


@dataclass(frozen=True)
class Answer:
    """A finished future as the SDK reads it: ``proto`` bytes, or a ``json`` body (a result or a failure)."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None

    @classmethod
    def failure(cls, exc: TinkerqError) -> Answer:
        # 200 with error + category: the SDK raises RequestFailedError and the training client goes on.
        return cls(json={"error": exc.message, "category": exc.category})


@dataclass
class Entry:
    tenant: str
    kind: str  # what the SDK asked for (x-tinker-request-type), for logs
    task: asyncio.Task[Answer]
    ready_at: float | None = None  # monotonic, once the task finished
    created_at: float = field(default_factory=time.monotonic)


class Futures:
    def __init__(self, *, poll_s: float = 25.0, keep_s: float = 600.0) -> None:
        self.poll_s = poll_s
        self.keep_s = keep_s
        self._entries: dict[str, Entry] = {}
        self._added = itertools.count()

    def add(self, tenant: str, kind: str, work: Awaitable[Answer]) -> str:
        """Start ``work`` and return its request id."""
        request_id = uuid.uuid4().hex
        task = asyncio.ensure_future(_answer(work, kind, request_id))
        entry = Entry(tenant, kind, task)
        task.add_done_callback(lambda _t: setattr(entry, "ready_at", time.monotonic()))
        self._entries[request_id] = entry
        if next(self._added) % 256 == 0:
            self.sweep()
        return request_id

    def get(self, request_id: str, tenant: str) -> Entry | None:
        """The entry, or None when it does not exist or belongs to another tenant (the same 404 either way)."""
        entry = self._entries.get(request_id)
        return entry if entry is not None and entry.tenant == tenant else None

    async def wait(self, entry: Entry) -> Answer | None:
        """The answer, or None after ``poll_s`` (the caller answers try_again)."""
        with contextlib.suppress(asyncio.TimeoutError):
            return await asyncio.wait_for(asyncio.shield(entry.task), self.poll_s)
        return None

    def sweep(self, now: float | None = None) -> None:
        """Forget answers ready for longer than ``keep_s``."""
        now = time.monotonic() if now is None else now
        stale = [rid for rid, e in self._entries.items() if e.ready_at is not None and now - e.ready_at > self.keep_s]
        for rid in stale:
            del self._entries[rid]

    def pending(self) -> int:
        return sum(1 for e in self._entries.values() if e.ready_at is None)

    def cancel_all(self) -> None:
        for entry in self._entries.values():
            entry.task.cancel()


async def _answer(work: Awaitable[Answer], kind: str, request_id: str) -> Answer:
    """Never raises: a fleet error becomes the SDK's failure body (user or server category)."""
    try:
        return await work
    except TinkerqError as exc:
        return Answer.failure(exc)
    except Exception as exc:  # a gateway bug: the caller still gets an answer, the operator a traceback
        log.exception("%s request %s failed in the gateway", kind, request_id)
        return Answer.failure(ServerError(f"the gateway failed while answering this {kind} request: {exc}"))
