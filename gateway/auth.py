"""Who is calling: API keys, and the short-lived tokens the SDK exchanges them for (docs/security.md).

Every request carries ``X-API-Key``. It holds either a tenant's API key (``tml-...``, checked against its SHA-256
in Redis: tinkerq/tenants.py) or, when the gateway's ``client/config`` turns ``pjwt_auth_enabled`` on
(``TINKERQ_GATEWAY_TOKEN_EXCHANGE``, on by default), a JSON Web Token the SDK got from ``POST /api/v1/auth/token``
in exchange for its key and refreshes at half its lifetime. The token is signed with the fleet's secret
(gateway/signing.py, PyJWT), lives ``TOKEN_LIFETIME_S``, and names its tenant and the key it was exchanged for:
a token is accepted only while that key is the tenant's live key, so revoking a key ends its tokens as fast as the
key itself (the same ``AUTH_CACHE_S``). A token that expired, was altered or forged, or outlived its key is
refused with 401 and ``WWW-Authenticate: Bearer error="invalid_token"``, on which the SDK exchanges its key again
and replays the request once.

``GET /api/v1/auth/apikey/me`` (``tinker auth login``) checks a pasted key and describes it; ``DELETE`` there revokes
the presented key itself (``tinker auth logout`` of a key the CLI was issued); ``whoami`` is read by the SDK from the
token's claims (``sub``: the tenant, ``org_id``: the tenant).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tinkerq.gateway import lifecycle
from tinkerq.gateway.signing import BadToken, Signer
from tinkerq.tenants import ApiKeys

if TYPE_CHECKING:
    from tinkerq.gateway.service import Gateway

PURPOSE = "tinker-api"  # the tokens' audience: a download URL's token is no credential, nor the reverse
TOKEN_LIFETIME_S = 900.0
ISSUER = "tinkerq-gateway"
JWT_PREFIX = "eyJ"  # what the SDK tells a token by
INVALID_TOKEN = {"www-authenticate": 'Bearer error="invalid_token"'}
T = TypeVar("T")
R = TypeVar("R")


class Refused(Exception):
    """A credential that is not accepted; ``token`` when it was a token (the SDK then exchanges its key again)."""

    def __init__(self, message: str, *, token: bool) -> None:
        super().__init__(message)
        self.token = token


def key_id(tenant: str, created_at: float) -> str:
    """A stable id of one key of ``tenant`` (a new key has another): a digest of its name and creation time, so it
    says nothing about the key."""
    return hashlib.sha256(f"tinkerq-key:{tenant}:{created_at!r}".encode()).hexdigest()[:16]


class Credentials:
    """Resolves ``X-API-Key`` to a tenant, and mints the SDK's tokens."""

    def __init__(self, keys: ApiKeys, signer: Signer, *, cache_s: float) -> None:
        self.keys = keys
        self.signer = signer
        self.cache_s = cache_s
        self._live: dict[str, tuple[str | None, float]] = {}  # tenant -> (its live key's id, monotonic expiry)
        self._lock = threading.Lock()

    def tenant(self, header: str | None) -> str:
        """The caller's tenant; Refused for a missing, unknown or revoked key, or a token not accepted."""
        if isinstance(header, str) and header.startswith(JWT_PREFIX):
            return self._token_tenant(header)
        tenant = self.keys.authenticate(header)
        if tenant is None:
            raise Refused("unknown or revoked API key (X-API-Key): ask the fleet's operator for one "
                          "(`tinkerq keys create NAME`) and set TINKER_API_KEY", token=False)
        return tenant

    def cached_tenant(self, header: str | None) -> str | None:
        """The caller's tenant when what decides it is in this process's caches (the signing secret and the
        tenant's live key for a token; the key's last check for an API key): no I/O, so the event loop may call
        it. None: ask :meth:`tenant` (on a thread), which also gives every refusal its reason."""
        if isinstance(header, str) and header.startswith(JWT_PREFIX):
            secret = self.signer.cached_secret()
            if secret is None:
                return None
            try:
                claims = self.signer.verify(header, PURPOSE, secret=secret)
            except BadToken:
                return None
            tenant, kid = str(claims["sub"]), claims.get("kid")
            with self._lock:
                hit = self._live.get(tenant)
            if kid is None or hit is None or hit[1] <= time.monotonic() or hit[0] != kid:
                return None
            return tenant
        return self.keys.cached(header)

    def key_tenant(self, header: str | None) -> str:
        """The tenant of an API key proper (the token exchange and ``auth/apikey/me`` take no token)."""
        if isinstance(header, str) and header.startswith(JWT_PREFIX):
            raise Refused("this call takes an API key (tml-...), not a token", token=False)
        return self.tenant(header)

    def mint(self, tenant: str) -> str:
        """``POST auth/token``: a token for the tenant whose API key made the call."""
        kid = self._live_key_id(tenant, fresh=True)
        if kid is None:  # revoked between the key check and now
            raise Refused("this API key was just revoked", token=False)
        token, _ = self.signer.sign(PURPOSE, tenant, TOKEN_LIFETIME_S, kid=kid, org_id=tenant, iss=ISSUER)
        return token

    def describe(self, tenant: str) -> dict[str, Any]:
        """``GET auth/apikey/me``: Tinker's ``SelfApiKeyResponse`` for the tenant's key (never the key)."""
        created_at = self.keys.created_at(tenant)
        if created_at is None:
            raise Refused("this API key was just revoked", token=False)
        created = time.strftime("%Y-%m-%d", time.gmtime(created_at))
        return {"key_id": int(key_id(tenant, created_at)[:12], 16), "name": tenant,
                "note": f"tinkerq API key of tenant {tenant!r}, created {created}",
                "details": {"org_details": {"name": tenant}, "user_details": {"email": tenant}}}

    def revoke(self, tenant: str, gateway: Gateway) -> None:
        """``DELETE auth/apikey/me``: the caller's key ends (its tokens with it), and the tenant's open runs and
        sessions are ended on the workers (checkpoints stay), as ``tinkerq keys revoke`` does."""
        self.keys.revoke(tenant)
        with self._lock:
            self._live.pop(tenant, None)
        lifecycle.end_tenant(gateway.service, gateway.records, gateway.quotas, tenant)

    def _token_tenant(self, token: str) -> str:
        try:
            claims = self.signer.verify(token, PURPOSE)
        except BadToken as exc:
            raise Refused(f"token refused: {exc}", token=True) from None
        tenant, kid = str(claims["sub"]), claims.get("kid")
        if kid is None or kid != self._live_key_id(tenant):
            raise Refused("token refused: the API key it was exchanged for was revoked", token=True)
        return tenant

    def _live_key_id(self, tenant: str, *, fresh: bool = False) -> str | None:
        """The id of the tenant's live key (None: none), cached ``cache_s`` (a revoked key's tokens end with it)."""
        now = time.monotonic()
        with self._lock:
            hit = self._live.get(tenant)
        if hit is not None and hit[1] > now and not fresh:
            return hit[0]
        created_at = self.keys.created_at(tenant)
        kid = None if created_at is None else key_id(tenant, created_at)
        with self._lock:
            if len(self._live) > 10_000:
                self._live.clear()
            self._live[tenant] = (kid, now + self.cache_s)
        return kid


def credentials(call: Callable[[T], R], arg: T) -> R:
    """``call(arg)`` with a refusal answered 401 (a refused token says so, for the SDK to exchange its key again)."""
    from tinkerq.gateway.http_errors import HTTPError

    try:
        return call(arg)
    except Refused as exc:
        raise HTTPError(401, str(exc), headers=INVALID_TOKEN if exc.token else None) from None
