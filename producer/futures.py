"""Futures returned by every client call: ``.result(timeout)`` and ``await``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult

from tinkerq.errors import RequestTimeoutError, ServerError, TinkerqError
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
    ) -> None:
        self._async_result = async_result
        self._decode = decode
        self._claim_check = claim_check
        self._lock = backend_lock or threading.Lock()
        self._poll_interval = poll_interval
        self._describe = describe
        self._error = error
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
            try:
                reply = self._async_result.get(timeout=timeout, interval=self._poll_interval, propagate=False)
            except CeleryTimeoutError:
                raise RequestTimeoutError(
                    f"no answer to {self._describe} within {timeout} s; the request is still queued or "
                    f"running. Wait longer, or check that a worker serves this model (tinkerq fleet status)"
                ) from None
            self._resolved = True
            self._async_result.forget()
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

    def __repr__(self) -> str:
        state = "done" if self._resolved else "pending"
        return f"<APIFuture {self._describe} {state}>"
