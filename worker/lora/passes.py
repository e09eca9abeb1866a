"""The worker's LoRA pass loop: loss requests of different LoRA sessions waiting together run as one pass.

The request handling (worker/service.py) hands over each LoRA ``forward_backward`` / ``forward`` once it is
next in its session's order, and answers it when :meth:`LoraPasses.submit`'s ``done`` is called. A
session has at most one request here at a time (its later requests wait in its order, so none runs past
the session's own earlier optim_step). While a pass runs, new requests gather; the next pass takes all of
them (up to ``max_datums``): the busier the worker, the larger its passes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from tinkerq.errors import TinkerqError, WorkerError
from tinkerq.worker.lora.batch import LossItem, run_pass
from tinkerq.worker.lora.session import LoraBase

log = logging.getLogger("tinkerq.lora")


@dataclass
class _Queued:
    item: LossItem
    backward: bool
    done: Callable[[LossItem], None]


class LoraPasses:
    def __init__(self, base: LoraBase, *, max_datums: int,
                 gate: Callable[[], AbstractContextManager] | None = None) -> None:
        self.base = base
        self.max_datums = max_datums
        self._gate = gate or contextlib.nullcontext
        self._cond = threading.Condition()
        self._queue: list[_Queued] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self.passes = 0  # passes run, and the requests they held (metrics, tests, benchmarks)
        self.requests = 0

    def submit(self, item: LossItem, *, backward: bool, done: Callable[[LossItem], None]) -> None:
        with self._cond:
            if self._closed:
                raise WorkerError("the worker is stopping; LoRA requests are no longer taken")
            self._queue.append(_Queued(item, backward, done))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tinkerq-lora-passes", daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _take(self) -> list[_Queued] | None:
        """The next pass's requests: the oldest request's kind (training or not), in arrival order."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            kind = self._queue[0].backward
            taken, rest, datums = [], [], 0
            for q in self._queue:
                if q.backward == kind and (not taken or datums + len(q.item.data) <= self.max_datums):
                    taken.append(q)
                    datums += len(q.item.data)
                else:
                    rest.append(q)
            self._queue = rest
            return taken

    def _loop(self) -> None:
        while (taken := self._take()) is not None:
            items = [q.item for q in taken]
            try:
                with self._gate():
                    run_pass(items, self.base.model, self.base.logprobs, head=self.base.head,
                             microbatch_tokens=self.base.microbatch_tokens, device=self.base.device,
                             backward=taken[0].backward)
            except TinkerqError as exc:
                for item in items:
                    item.error = exc
            except Exception as exc:  # the pass itself failed: every engine was put back as it was
                log.exception("a LoRA pass over %d requests failed", len(items))
                for item in items:
                    item.error = WorkerError(f"the LoRA pass failed in the worker ({type(exc).__name__}: {exc}); "
                                             f"nothing was applied")
            self.passes += 1
            self.requests += len(items)
            for q in taken:
                try:
                    q.done(q.item)
                except Exception:
                    log.exception("answering a LoRA request failed")
        # Closed: whatever still waits is answered.
        with self._cond:
            left, self._queue = self._queue, []
        for q in left:
            q.item.error = WorkerError("the worker stopped before this LoRA request ran; send it again")
            q.done(q.item)
