"""The gateway's answers other than 200: an HTTPError carries the status and the JSON ``detail`` the SDK shows."""

from __future__ import annotations

from typing import Any

from tinkerq.errors import TinkerqError


class HTTPError(Exception):
    """An answer other than 200, with a JSON ``{"detail": ...}`` body the SDK shows to the user."""

    def __init__(self, status: int, detail: str, *, retry_after_s: float | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.retry_after_s = retry_after_s
        self.headers = headers or {}  # e.g. WWW-Authenticate on a refused token (gateway/auth.py)


def not_found(what: str, ident: Any) -> HTTPError:
    # Another tenant's object gets the same answer as a missing one: ids leak nothing.
    return HTTPError(404, f"{what} {ident!r} not found (unknown, expired, or made with another API key)")


def submit_error(exc: TinkerqError) -> HTTPError:
    """A fleet error met while accepting a request: user errors are final (400), server errors retried (503)."""
    return HTTPError(400 if exc.is_user_error else 503, exc.message)
