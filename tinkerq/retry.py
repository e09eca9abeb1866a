"""Retrying Redis operations through an outage: a restart, a Sentinel failover, a pause, a dropped connection.

An outage must cost time, not sessions: every Redis call tinkerq makes for a request (claim-check reads and
writes, replies, heartbeats) goes through :func:`retrying`, which retries transient errors with capped
exponential backoff until a deadline, then raises :class:`BrokerUnavailableError`. Everything else (a
wrong password, a script error) is not transient and raises at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from tinkerq.errors import BrokerUnavailableError

log = logging.getLogger("tinkerq.redis")

T = TypeVar("T")

# What a restart (refused/reset connections, LOADING while the AOF is replayed), a pause (timeouts) or a
# failover (READONLY from a demoted primary) look like from a client. AuthenticationError is a
# ConnectionError subclass in redis-py but never heals by waiting.
TRANSIENT: tuple[type[BaseException], ...] = (
    redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError, ConnectionResetError,
    BrokenPipeError,
)
NOT_TRANSIENT: tuple[type[BaseException], ...] = (redis.AuthenticationError,)

MAX_BACKOFF_S = 0.5  # how late, at most, an operation notices that Redis is back


# Errors a server answers while it changes role or loads its data (a failover, a restart): wait them out.
_TRANSIENT_REPLIES = ("UNBLOCKED", "READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN")


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, redis.ResponseError) and str(exc).startswith(_TRANSIENT_REPLIES):
        return True
    return isinstance(exc, TRANSIENT) and not isinstance(exc, NOT_TRANSIENT)


def retrying(fn: Callable[[], T], *, deadline_s: float, what: str) -> T:
    """``fn()``, retried while Redis is unreachable, for at most ``deadline_s`` seconds."""
    start = time.monotonic()
    delay = 0.02
    warned = False
    while True:
        try:
            result = fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            waited = time.monotonic() - start
            if waited >= deadline_s:
                raise BrokerUnavailableError(
                    f"Redis was unreachable for {waited:.0f} s while {what} ({type(exc).__name__}: {exc}); "
                    f"check that Redis runs and is reachable (retries last TINKERQ_REDIS_RETRY_S)"
                ) from None
            if not warned and waited >= 1.0:
                log.warning("Redis unreachable while %s (%s: %s); retrying", what, type(exc).__name__, exc)
                warned = True
            time.sleep(min(delay, max(0.0, deadline_s - waited)))
            delay = min(delay * 2, MAX_BACKOFF_S)
            continue
        if warned:
            log.warning("Redis is back after %.1f s (%s)", time.monotonic() - start, what)
        return result
