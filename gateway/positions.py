"""No answer leaves a hole in a training run's sequence.

The SDK numbers a training client's requests (``seq_id``) and the worker applies a run's requests in that order,
holding later ones until each earlier position is filled (worker/core/ordering.py), and failing the run after the gap
timeout. The gateway's own refusals fill their position (``OrderedRequests.accept``, gateway/ordered_requests.py).
:class:`SequenceGuard` covers every other way a numbered request can be answered without being taken: a route or
method this server does not have (``save_weights_external`` before it was served wedged runs so), a body the app
cannot read, a refusal raised before the position was read, a crash in a handler. Once the app has answered such a
request with a final error (4xx but the statuses the SDK retries, or an unhandled exception), or answered by a route
that takes no position, the guard reads ``model_id`` and ``seq_id`` from its body (JSON, or the forward_backward
protobuf) and fills the position for the caller's tenant (an error: before the answer is sent), so the run's next
request is served at once. Filling is a claim: a position taken or refused before is left as it is, so a request
another tenant sends with someone's model id fills nothing. On the routes that take positions, retryable answers
(408, 409, 429, 5xx the app chose) leave the position open: the SDK resends the same request. A route that takes
none has any numbered request's position filled, whatever it answered (a resend there would never fill it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeGuard

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("tinkerq.gateway")

RETRIED = {408, 409, 429}  # the SDK resends these (and 5xx): the position stays open for the resend
PROTOBUF = "application/x-protobuf"

Fill = Callable[[str | None, str, int, str], Awaitable[None]]  # (api key, model_id, seq_id, why)


def sequence_position(body: bytes, content_type: str) -> tuple[str, int] | None:
    """(model_id, seq_id) of a request body that names a run's position, else None. JSON objects and the
    forward_backward protobuf; whatever the route was, since a body sent to the wrong route still took a number."""
    if not body:
        return None
    if not content_type.startswith(PROTOBUF):
        try:
            raw: Any = json.loads(body)
        except ValueError:
            raw = None
        if isinstance(raw, dict):
            model_id, seq_id = raw.get("model_id"), raw.get("seq_id")
            if isinstance(model_id, str) and model_id and _is_position(seq_id):
                return model_id, seq_id
            return None
    return _protobuf_position(body)


def _protobuf_position(body: bytes) -> tuple[str, int] | None:
    from google.protobuf.message import DecodeError

    from tinkerq.gateway.proto import pb

    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(bytes(body))
    except (DecodeError, ValueError):
        return None
    seq_id = int(msg.seq_id)
    return (msg.model_id, seq_id) if msg.model_id and _is_position(seq_id) else None


def _is_position(seq_id: Any) -> TypeGuard[int]:
    return isinstance(seq_id, int) and not isinstance(seq_id, bool) and seq_id >= 1


def _final(status: int) -> bool:
    return 400 <= status < 500 and status not in RETRIED


class SequenceGuard:
    """ASGI middleware: a numbered request answered with a final error has its position filled (module doc)."""

    def __init__(self, app: ASGIApp, fill: Fill, ordered_paths: frozenset[str]) -> None:
        self.app = app
        self.fill = fill
        self.ordered_paths = ordered_paths  # routes that take positions: their successes need no look

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        body = _Body(receive)
        held: list[Message] = []
        status = 0

        async def guarded(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if _final(status):
                    held.append(message)
                    return
                if scope.get("path") not in self.ordered_paths:
                    await body.whole()  # a route that did not read it: once answered, the server drops the rest
            if not held:
                await send(message)
                return
            held.append(message)  # the held answer's body: sent once the position is filled
            if not message.get("more_body"):
                await self._fill_from(scope, body, _detail(held))
                for m in held:
                    await send(m)
                held.clear()

        try:
            await self.app(scope, body.receive, guarded)
        except Exception:
            await self._fill_from(scope, body, "the gateway failed on this request")
            raise
        if status and not _final(status) and scope.get("path") not in self.ordered_paths:
            # A numbered body sent to a route that takes no position (get_info, telemetry, ...): answered, and
            # its number would otherwise never be filled.
            await self._fill_from(scope, body, f"{status}: sent to {scope.get('path')}, which takes no position")

    async def _fill_from(self, scope: Scope, body: _Body, why: str) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        position = sequence_position(await body.whole(), headers.get("content-type", ""))
        if position is None:
            return
        try:
            await self.fill(headers.get("x-api-key"), position[0], position[1], why)
        except Exception:  # the answer still goes out; the worker's gap timeout is the last resort
            log.exception("could not fill seq_id %d of model %s", position[1], position[0])


class _Body:
    """The request body as the app reads it; :meth:`whole` reads the rest when the app answered without it (an
    unknown route). The gateway's BodyLimit, outside, bounds it."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._chunks: list[bytes] = []
        self._done = False

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self._chunks.append(message.get("body", b""))
            self._done = not message.get("more_body", False)
        else:  # http.disconnect
            self._done = True
        return message

    async def whole(self) -> bytes:
        while not self._done:
            await self.receive()
        return b"".join(self._chunks)


def _detail(answer: list[Message]) -> str:
    """The ``detail`` of a held JSON answer (what the caller is told), for the filled position's record."""
    raw = b"".join(m.get("body", b"") for m in answer if m["type"] == "http.response.body")
    try:
        detail = json.loads(raw).get("detail")
    except (ValueError, AttributeError):
        detail = None
    status = answer[0]["status"] if answer else 0
    return f"{status}: {detail}" if isinstance(detail, str) else f"{status}: refused by the gateway"
