"""Futures returned by every client call: ``.result(timeout)``, ``.done()`` and ``await``.

A future is resolved by the client's dispatcher (producer/dispatch.py) from another thread; waiting on one
never takes a lock shared with other futures, so any number of threads or asyncio tasks can wait at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from tinkerq.errors import RequestTimeoutError, TinkerqError
from tinkerq.wire import codec, messages
from tinkerq.wire.claimcheck import ClaimCheck

T = TypeVar("T")


class APIFuture(Generic[T]):
    """The eventual answer of one request. Errors arrive as :class:`tinkerq.errors.TinkerqError`."""

    def __init__(self, decode: Callable[[Any], T] | None, *, claim_check: ClaimCheck | None = None,
                 describe: str = "request", task_id: str | None = None, error: TinkerqError | None = None) -> None:
        self._decode = decode
        self._claim_check = claim_check
        self._describe = describe
        self.task_id = task_id
        # Holds the raw reply (or an error) once it arrives; decoding is done by the first caller of result().
        self._arrived: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._decode_lock = threading.Lock()
        self._decoded = False
        self._value: Any = None
        self._error: TinkerqError | None = None
        # What the worker measured: queue_wait_s, compute_s, tokens, tokens_per_s (when it got that far).
        self.timing: dict[str, float] = {}
        if error is not None:
            self._fail(error)

    @classmethod
    def failed(cls, error: TinkerqError) -> APIFuture[Any]:
        """A future that already holds an error (e.g. the producer refused the request before sending)."""
        return cls(None, error=error)

    # -- set by the dispatcher ------------------------------------------------------------------------------

    def _arrive(self, reply: Any) -> bool:
        """The worker's reply arrived; False if the future was already resolved."""
        try:
            self._arrived.set_result(reply)
            return True
        except concurrent.futures.InvalidStateError:
            return False

    def _fail(self, error: TinkerqError) -> bool:
        try:
            self._arrived.set_exception(error)
            return True
        except concurrent.futures.InvalidStateError:
            return False

    # -- the caller's side ----------------------------------------------------------------------------------

    def done(self) -> bool:
        return self._arrived.done()

    def result(self, timeout: float | None = None) -> T:
        """Wait for the answer (at most ``timeout`` seconds) and return it, or raise its error."""
        try:
            reply = self._arrived.result(timeout)
        except concurrent.futures.TimeoutError:
            raise RequestTimeoutError(
                f"no answer to {self._describe} within {timeout} s; the request is still queued or running. "
                f"Wait longer, or check that a worker serves this model (tinkerq fleet status)"
            ) from None
        with self._decode_lock:
            if not self._decoded:
                self._read(reply)
                self._decoded = True
        if self._error is not None:
            raise self._error
        return self._value

    def _read(self, reply: Any) -> None:
        if isinstance(reply, dict) and isinstance(reply.get("timing"), dict):
            self.timing = {str(k): float(v) for k, v in reply["timing"].items() if isinstance(v, (int, float))}
        error = messages.reply_error(reply)
        if error is not None:
            self._error = error
            return
        try:
            assert self._claim_check is not None and self._decode is not None
            ref = reply["payload"]
            body = codec.unpackb(self._claim_check.unwrap(ref))
            self._value = self._decode(body)
        except TinkerqError as exc:
            self._error = exc
            return
        with contextlib.suppress(TinkerqError):  # the blob expires by itself
            self._claim_check.discard(ref)

    def exception(self, timeout: float | None = None) -> TinkerqError | None:
        try:
            self.result(timeout)
        except TinkerqError as exc:
            return exc
        return None

    def add_done_callback(self, fn: Callable[[APIFuture[T]], None]) -> None:
        """Call ``fn(self)`` once the answer (or an error) has arrived, from the thread that resolved it."""
        self._arrived.add_done_callback(lambda _: fn(self))

    def __await__(self) -> Generator[Any, None, T]:
        return self._await().__await__()

    async def _await(self) -> T:
        if not self.done():
            with contextlib.suppress(TinkerqError):  # raised by result() below
                await asyncio.wrap_future(self._arrived)
        # Decoding may read a claim-checked body from Redis: off the event loop.
        return await asyncio.get_running_loop().run_in_executor(None, self.result, 0)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<APIFuture {self._describe} {state}>"
