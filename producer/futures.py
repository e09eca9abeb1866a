"""Futures returned by every client call: ``.result(timeout)`` and ``await``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult

from tinkerq.errors import RequestTimeoutError, ServerError, TinkerqError, WorkerLostError
from tinkerq.wire import codec, messages
from tinkerq.wire.claimcheck import ClaimCheck

T = TypeVar("T")


class APIFuture(Generic[T]):
    """The eventual answer of one request. Errors arrive as :class:`tinkerq.errors.TinkerqError`."""

    def __init__(
        self,
        async_result: AsyncResult | None,
        decode: Callable[[Any], T] | None,
        *,
        claim_check: ClaimCheck | None = None,
        backend_lock: threading.Lock | None = None,
        poll_interval: float = 0.005,
        describe: str = "request",
        error: TinkerqError | None = None,
        worker_alive: Callable[[], bool | None] | None = None,
        liveness_period_s: float = 5.0,
    ) -> None:
        self._async_result = async_result
        self._decode = decode
        self._claim_check = claim_check
        self._lock = backend_lock or threading.Lock()
        self._poll_interval = poll_interval
        self._describe = describe
        self._error = error
        # While waiting: is the worker that must answer still registered? (None: cannot tell right now.)
        self._worker_alive = worker_alive
        self._liveness_period_s = liveness_period_s
        self._value: Any = None
        self._resolved = error is not None
        # What the worker measured: queue_wait_s, compute_s, tokens, tokens_per_s (when it got that far).
        self.timing: dict[str, float] = {}

    @classmethod
    def failed(cls, error: TinkerqError) -> APIFuture[Any]:
        """A future that already holds an error (e.g. the producer refused the request before sending)."""
        return cls(None, None, error=error)

    @property
    def task_id(self) -> str | None:
        return self._async_result.id if self._async_result is not None else None

    def done(self) -> bool:
        return self._resolved or (self._async_result is not None and self._async_result.ready())

    def result(self, timeout: float | None = None) -> T:
        """Wait for the answer (at most ``timeout`` seconds) and return it, or raise its error."""
        if not self._resolved:
            self._resolve(timeout)
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> TinkerqError | None:
        try:
            self.result(timeout)
        except TinkerqError as exc:
            return exc
        return None

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.get_running_loop().run_in_executor(None, self.result).__await__()

    def _resolve(self, timeout: float | None) -> None:
        assert self._async_result is not None and self._decode is not None
        # Celery's result consumers are not thread-safe: one waiter at a time per client.
        with self._lock:
            if self._resolved:
                return
            reply = self._wait(timeout)
            self._resolved = True
            self._async_result.forget()  # also stops listening for it
            if isinstance(reply, WorkerLostError):
                self._error = reply
                return
        if isinstance(reply, BaseException):  # Celery-level failure (e.g. the worker refused the message)
            self._error = ServerError(f"{self._describe} failed in the worker: {reply}")
            return
        if isinstance(reply, dict) and isinstance(reply.get("timing"), dict):
            self.timing = {str(k): float(v) for k, v in reply["timing"].items() if isinstance(v, (int, float))}
        error = messages.reply_error(reply)
        if error is not None:
            self._error = error
            return
        try:
            assert self._claim_check is not None
            ref = reply["payload"]
            body = codec.unpackb(self._claim_check.unwrap(ref))
            self._claim_check.discard(ref)
            self._value = self._decode(body)
        except TinkerqError as exc:
            self._error = exc

    def _wait(self, timeout: float | None) -> Any:
        """The reply, waiting in slices; between slices, a worker that is gone ends the wait."""
        assert self._async_result is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        missed = 0
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = self._liveness_period_s if left is None else min(self._liveness_period_s, left)
            try:
                return self._async_result.get(timeout=wait, interval=self._poll_interval, propagate=False)
            except CeleryTimeoutError:
                pass
            if deadline is not None and time.monotonic() >= deadline:
                raise RequestTimeoutError(
                    f"no answer to {self._describe} within {timeout} s; the request is still queued or "
                    f"running. Wait longer, or check that a worker serves this model (tinkerq fleet status)"
                )
            alive = self._worker_alive() if self._worker_alive is not None else True
            missed = missed + 1 if alive is False else 0
            if missed >= 2:  # gone at two checks in a row: not a heartbeat that was merely late
                if self._async_result.ready():  # it answered just before it went
                    return self._async_result.get(timeout=1, propagate=False)
                return WorkerLostError(
                    f"{self._describe}: the worker holding this training session stopped (its registration "
                    f"expired) before answering; the request may or may not have been applied. Create a new "
                    f"training client, or resume from your last checkpoint (create_training_client_from_state)"
                )

    def __repr__(self) -> str:
        state = "done" if self._resolved else "pending"
        return f"<APIFuture {self._describe} {state}>"
