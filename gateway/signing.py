"""Short-lived signed tokens: the gateway's download URLs and the SDK's exchanged credentials (docs/security.md).

One per-fleet secret, kept in the fleet's Redis (``keys.gateway_signing_secret``), made by whichever gateway needs
it first (``SET NX``, so every gateway of the fleet signs with the same one) from :func:`secrets.token_bytes`. The
signatures are PyJWT's HS256 JSON Web Tokens (no cryptography of our own): each token says what it is for
(``aud``), whom it is for (``sub``, the tenant) and when it stops working (``exp``); a token for one purpose is
refused for another. Deleting the secret in Redis ends every outstanding token and URL (gateways re-read it
within ``SECRET_CACHE_S``).
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import jwt

from tinkerq import keys
from tinkerq.store import KeyValueStore

ALGORITHM = "HS256"
SECRET_BYTES = 64
SECRET_TTL_S = 10 * 365 * 24 * 3600.0  # kept until an operator deletes it (the store wants a time to live)
SECRET_CACHE_S = 60.0  # a secret deleted in Redis stops being used here within this long
LEEWAY_S = 0  # an expired token is expired (the gateways' clocks are assumed in step, as for every ttl here)


class BadToken(Exception):
    """A token that is malformed, forged (wrong signature), for another purpose, or expired; the message says which."""


class Signer:
    """Signs and verifies the fleet's tokens with its shared secret (read from Redis, cached briefly)."""

    def __init__(self, store: KeyValueStore) -> None:
        self.store = store.with_retry(0)
        self._secret: bytes | None = None
        self._read_at = 0.0
        self._lock = threading.Lock()

    def cached_secret(self) -> bytes | None:
        """The secret if it was read within ``SECRET_CACHE_S`` (no I/O); None when :meth:`secret` must read it."""
        with self._lock:
            if self._secret is None or time.monotonic() - self._read_at > SECRET_CACHE_S:
                return None
            return self._secret

    def secret(self) -> bytes:
        with self._lock:
            if self._secret is None or time.monotonic() - self._read_at > SECRET_CACHE_S:
                key = keys.gateway_signing_secret()
                self.store.set_if_absent(key, secrets.token_bytes(SECRET_BYTES), SECRET_TTL_S)
                secret = self.store.get(key)
                if secret is None:  # deleted between the two calls: the next call makes a new one
                    raise BadToken("the fleet's signing secret is being replaced; try again")
                self._secret, self._read_at = secret, time.monotonic()
            return self._secret

    def sign(self, purpose: str, subject: str, lifetime_s: float, **claims: Any) -> tuple[str, float]:
        """A token for ``purpose`` and ``subject`` (the tenant), valid for ``lifetime_s``: (token, expiry, unix s)."""
        now = time.time()
        expires = now + lifetime_s
        payload = {**claims, "aud": purpose, "sub": subject, "iat": int(now), "exp": int(expires)}
        return jwt.encode(payload, self.secret(), algorithm=ALGORITHM), float(int(expires))

    def verify(self, token: str, purpose: str, *, secret: bytes | None = None) -> dict[str, Any]:
        """The claims of a valid, unexpired token signed for ``purpose``; BadToken otherwise. ``secret``: the one
        :meth:`cached_secret` gave (no I/O here then)."""
        try:
            return dict(jwt.decode(token, self.secret() if secret is None else secret, algorithms=[ALGORITHM],
                                   audience=purpose, leeway=LEEWAY_S, options={"require": ["exp", "sub", "aud"]}))
        except jwt.ExpiredSignatureError:
            raise BadToken("this token has expired; ask for a new one") from None
        except jwt.InvalidAudienceError:
            raise BadToken("this token was not issued for this use") from None
        except jwt.InvalidSignatureError:
            raise BadToken("this token's signature is not valid (altered, or signed by another fleet)") from None
        except jwt.InvalidTokenError as exc:
            raise BadToken(f"this token is not valid: {exc}") from None
