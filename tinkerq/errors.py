"""One error root for the whole fleet, and its wire form.

Every error a caller can see is a :class:`TinkerqError` with a ``category``:

* ``"user"``: the request was wrong (bad input, unknown model, malformed message). Fix the call.
* ``"server"``: the fleet failed (a bug, a lost worker, a timeout). Retry or page an operator.

Errors cross process boundaries as plain msgpack maps (:meth:`TinkerqError.to_wire` /
:func:`error_from_wire`), never pickled. User errors also inherit ``ValueError`` and server errors
``RuntimeError``, so ``except ValueError`` keeps working for callers who do not know our types.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

Category = Literal["user", "server"]


class TinkerqError(Exception):
    """Root of every tinkerq error."""

    category: ClassVar[Category] = "server"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    @property
    def is_user_error(self) -> bool:
        return self.category == "user"

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "category": self.category,
            "message": self.message,
            "details": {k: v for k, v in self.details.items() if isinstance(v, (str, int, float, bool))},
        }

    def __str__(self) -> str:
        return f"[{self.category} error] {self.message}"


class UserError(TinkerqError, ValueError):
    """The request is wrong; the model was not changed."""

    category: ClassVar[Category] = "user"


class ServerError(TinkerqError, RuntimeError):
    """The fleet failed to serve a valid request."""

    category: ClassVar[Category] = "server"


class ValidationError(UserError):
    """A batch or parameter failed validation (names the datum and field)."""


class MalformedMessageError(UserError):
    """A message could not be decoded, uses a forbidden type, or is too large."""


class UnknownModelError(UserError):
    """No worker serves the requested base model, or the training session does not exist."""


class ModelLoadError(UserError):
    """The model directory cannot be served (missing, not a causal LM, unreadable, a bad checkpoint)."""


class NonFiniteError(UserError):
    """A loss or gradient norm was NaN/inf; the step was refused and the weights are unchanged."""


class BrokerUnavailableError(ServerError):
    """The broker (Redis) cannot be reached."""


class RequestTimeoutError(ServerError, TimeoutError):
    """No answer arrived in time."""


class WorkerError(ServerError):
    """The worker hit an unexpected failure while serving a request."""


class WorkerLostError(ServerError):
    """The worker holding a training session stopped (its registration expired) before answering."""


class ShardGroupError(ServerError):
    """A sharded worker's group cannot serve: a shard died, hung, or has not joined yet."""


class CapacityError(ServerError):
    """The worker does not have the memory a request needs; nothing was allocated, the session goes on.

    The message says what was asked, how much it needs, how much is free, and what to do.
    """


_BY_NAME: dict[str, type[TinkerqError]] = {
    cls.__name__: cls
    for cls in (
        TinkerqError,
        UserError,
        ServerError,
        ValidationError,
        MalformedMessageError,
        UnknownModelError,
        NonFiniteError,
        BrokerUnavailableError,
        RequestTimeoutError,
        WorkerError,
        WorkerLostError,
        ShardGroupError,
        CapacityError,
    )
}


def error_from_wire(wire: Any) -> TinkerqError:
    """Rebuild an error sent by :meth:`TinkerqError.to_wire`; unknown shapes become a ServerError."""
    if not isinstance(wire, dict):
        return ServerError(f"the worker sent an error in an unknown format: {wire!r:.200}")
    cls = _BY_NAME.get(str(wire.get("type")))
    category = wire.get("category")
    if cls is None:  # a newer worker's error type: keep its category
        cls = UserError if category == "user" else ServerError
    raw = wire.get("details")
    details: dict[str, Any] = {str(k): v for k, v in raw.items()} if isinstance(raw, dict) else {}
    return cls(str(wire.get("message", "")), **details)
