"""Futures returned by every client call: ``.result(timeout)``, ``.done()``, ``await`` and ``result_async()``.

A future is resolved by the client's dispatcher (producer/dispatch.py) from another thread; waiting on one
never takes a lock shared with other futures, so any number of threads or asyncio tasks can wait at once.

:class:`ClientFuture` is what the client-creating calls return, as in Tinker's SDK: a future of a client
that can also be used directly as the client (attribute access waits for it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, Generic, TypeVar, cast

from tinkerq.errors import RequestTimeoutError, TinkerqError
from tinkerq.threads import NamedThread
from tinkerq.wire import codec, messages
from tinkerq.wire.claimcheck import ClaimCheck

T = TypeVar("T")
U = TypeVar("U")
C = TypeVar("C")
F = TypeVar("F", bound="ClientFuture[Any]")


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

    @classmethod
    def completed(cls, value: T) -> APIFuture[T]:
        """A future that already holds ``value`` (a call with nothing to wait for)."""
        future: APIFuture[T] = cls(None)
        future._value, future._decoded = value, True
        future._arrived.set_result(None)
        return future

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
        """Whether the answer (or an error) has arrived: ``result()`` would not wait."""
        return self._arrived.done()

    def result(self, timeout: float | None = None) -> T:
        """Wait for the answer (at most ``timeout`` seconds) and return it, or raise its error."""
        try:
            reply = self._arrived.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._arrived.done():  # the request's own error (RequestTimeoutError is a TimeoutError too)
                raise
            raise self._timeout_error(timeout) from None
        with self._decode_lock:
            if not self._decoded:
                self._read(reply)
                self._decoded = True
        if self._error is not None:
            raise self._error
        return self._value

    def _timeout_error(self, timeout: float | None) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"no answer to {self._describe} within {timeout} s; the request is still queued or running. "
            f"Wait longer, or check that a worker serves this model (tinkerq fleet status)"
        )

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
        """The request's error once answered (waiting at most ``timeout`` seconds), or None if it succeeded."""
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

    async def result_async(self, timeout: float | None = None) -> T:
        """``await future``, waiting at most ``timeout`` seconds (Tinker's spelling)."""
        if timeout is None:
            return await self._await()
        try:
            return await asyncio.wait_for(self._await(), timeout)
        except asyncio.TimeoutError:
            if self.done():
                raise
            raise self._timeout_error(timeout) from None

    async def coroutine(self) -> T:
        """This future as a coroutine, for APIs that take one (``asyncio.create_task``)."""
        return await self._await()

    async def _await_arrival(self) -> None:
        if not self.done():
            with contextlib.suppress(TinkerqError):  # raised by result() after this
                await asyncio.wrap_future(self._arrived)

    async def _await(self) -> T:
        await self._await_arrival()
        # Decoding may read a claim-checked body from Redis: off the event loop.
        return await asyncio.get_running_loop().run_in_executor(None, self.result, 0)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<APIFuture {self._describe} {state}>"


class MappedFuture(APIFuture[U]):
    """``fn`` applied to another future's answer, by the first caller of ``result()`` (never in the dispatcher's
    thread). Used where the answer is reshaped client-side: ``compute_logprobs``, ``prompt_logprobs_last_n``,
    ``forward_backward_custom``'s metrics."""

    def __init__(self, source: APIFuture[Any], fn: Callable[[Any], U]) -> None:
        super().__init__(None, describe=source._describe, task_id=source.task_id)
        self._source = source
        self._fn = fn
        self._map_lock = threading.Lock()
        self._mapped: tuple[bool, Any] | None = None  # (ok, value or error), once computed

    def done(self) -> bool:
        return self._source.done()

    def result(self, timeout: float | None = None) -> U:
        value = self._source.result(timeout)
        self.timing = self._source.timing
        with self._map_lock:
            if self._mapped is None:
                try:
                    self._mapped = (True, self._fn(value))
                except TinkerqError as exc:
                    self._mapped = (False, exc)
        ok, out = self._mapped
        if not ok:
            raise cast(TinkerqError, out)
        return cast(U, out)

    def add_done_callback(self, fn: Callable[[APIFuture[U]], None]) -> None:
        self._source.add_done_callback(lambda _: fn(self))

    async def _await_arrival(self) -> None:
        await self._source._await_arrival()

    async def _await(self) -> U:
        await self._await_arrival()
        return await asyncio.get_running_loop().run_in_executor(None, self.result, 0)


class ClientFuture(Generic[C]):
    """A future of a client (Tinker's ``Backcompat*ClientFuture``): ``.result(timeout)``, ``await``,
    ``result_async()``; and, so code written when these calls returned the client keeps working, any public
    attribute is read from the client once it exists (waiting for it).

    The client is made in a background thread (:func:`in_background`), so creating several
    clients at once, or awaiting one in asyncio code, does not serialize on their creation.
    """

    def __init__(self, future: concurrent.futures.Future[C], describe: str = "client") -> None:
        self._future = future
        self._describe = describe

    @classmethod
    def of(cls: type[F], client: Any, describe: str = "client") -> F:
        """A future that already holds ``client``."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_result(client)
        return cls(future, describe)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> C:
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._future.done():  # the creation's own error (RequestTimeoutError is a TimeoutError too)
                raise
            raise RequestTimeoutError(f"{self._describe} was not ready within {timeout} s") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except Exception as exc:
            return exc
        return None

    async def result_async(self, timeout: float | None = None) -> C:
        try:
            # shield: giving up waiting must not cancel the creation itself
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._future)), timeout)
        except asyncio.TimeoutError:
            if self._future.done():  # the creation's own error (RequestTimeoutError is a TimeoutError too)
                raise
            raise RequestTimeoutError(f"{self._describe} was not ready within {timeout} s") from None

    def future(self) -> concurrent.futures.Future[C]:
        """The underlying ``concurrent.futures.Future`` (``concurrent.futures.wait``, ``as_completed``)."""
        return self._future

    def __await__(self) -> Generator[Any, None, C]:
        return asyncio.wrap_future(self._future).__await__()

    def __getattr__(self, name: str) -> Any:
        # Only what the class itself lacks gets here: the client's methods and attributes (model_id, info, ...;
        # its private ones too, which tinkerq's tests and gateway use). Never the future's own state (missing
        # only while copy or pickle builds one) nor dunders, which Python and libraries probe for.
        if name in ("_future", "_describe") or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)
        return getattr(self.result(), name)

    def __repr__(self) -> str:
        if not self._future.done():
            return f"<{type(self).__name__} {self._describe} pending>"
        error = self._future.exception()
        return f"<{type(self).__name__} {self._describe} failed: {error!r}>" if error else \
            f"<{type(self).__name__} {self._future.result()!r}>"


def in_background(make: Callable[[], C]) -> concurrent.futures.Future[C]:
    """Run ``make`` in a daemon thread; its result or error lands in the returned future. Client creation
    waits on the fleet (minutes when workers are busy), so it must not hold the caller."""
    future: concurrent.futures.Future[C] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(make())
        except BaseException as exc:
            future.set_exception(exc)

    NamedThread(target=run, name="tinkerq-create", daemon=True).start()
    return future


async def off_loop(fn: Callable[..., C], *args: Any, **kwargs: Any) -> C:
    """``fn(*args, **kwargs)`` in a thread: it reads Redis or waits, which must not stall the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))


def wait_all(futures: Sequence[APIFuture[Any]], timeout: float | None = None) -> list[Any]:
    """Results of several futures, in order, with one overall deadline."""
    deadline = None if timeout is None else time.monotonic() + timeout
    out = []
    for f in futures:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        out.append(f.result(timeout=remaining))
    return out
