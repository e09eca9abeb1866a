"""Tenants and their API keys: who may use the HTTP gateway, and whose sessions are whose.

The official ``tinker`` SDK sends ``X-API-Key: tml-...`` with every request; the gateway asks
:meth:`ApiKeys.authenticate` which tenant the key belongs to, and every session, model and checkpoint it
creates belongs to that tenant. Operators manage keys with ``tinkerq keys create|list|revoke``.

One live key per tenant. The fleet's Redis holds, through the store seam (:mod:`tinkerq.store`; key names
in :mod:`tinkerq.keys`):

* ``keys.TENANTS``: a hash, tenant name -> hex SHA-256 of its key (so list and revoke work by name);
* ``keys.api_key(<hex sha256>)``: a hash ``{tenant, created_at, last_used_at}`` (epoch seconds), plus the
  tenant's limits (:class:`~tinkerq.quotas.Limits`, one field each, set ones only): they go with the key.

Never the key itself: it is printed once, by ``tinkerq keys create``, and only its digest is kept. Whoever
reads the Redis (a backup, a replica, ``MONITOR``, an operator) learns no key that works. A plain unsalted
SHA-256 is the right digest here, unlike for passwords: a key is 256 bits from :func:`secrets.token_urlsafe`,
so there is no dictionary or small space to search; a salt or a slow hash (bcrypt, scrypt) defends only
against guessing low-entropy secrets, and would make each request's check cost milliseconds of CPU. An
unsalted digest is also what lets :meth:`ApiKeys.authenticate` find the record in one lookup.

Creating, revoking and checking a key are store transactions (:meth:`~tinkerq.store.KeyValueStore.transaction`,
written once here on the store's primitives): two concurrent ``create`` of one name cannot both succeed, and
``authenticate`` never sees half a key.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import re
import secrets
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypedDict

from tinkerq import keys
from tinkerq.audit import AuditLog
from tinkerq.errors import UserError, ValidationError
from tinkerq.quotas import LIMIT_NAMES, Limits, check_limit, option_of, tenant_key_fields
from tinkerq.store import Delete, HashDelete, HashPut, Transaction

if TYPE_CHECKING:
    from tinkerq.connection import Connection
    from tinkerq.settings import Settings
    from tinkerq.store import KeyValueStore

KEY_PREFIX = "tml-"  # the tinker SDK refuses keys without it
MAX_KEY_CHARS = 256  # longer X-API-Key values are refused unhashed (ours are 47 characters)
MAX_NAME_CHARS = 64
# Last-used times are written at most this often per key, so a busy key does not write on every request.
LAST_USED_RESOLUTION_S = 60.0
DEFAULT_RETRY_S = 10.0

_NAME_RE = re.compile(rf"[A-Za-z0-9_.-]{{1,{MAX_NAME_CHARS}}}")
_KEY_RE = re.compile(r"tml-[A-Za-z0-9_-]{16,252}")
_CACHE_MAX_ENTRIES = 10_000

class TenantInfo(TypedDict):
    """One tenant as :meth:`ApiKeys.list` reports it: never its key, nor the key's digest."""

    name: str
    created_at: float  # epoch seconds
    last_used_at: float | None  # epoch seconds, to within LAST_USED_RESOLUTION_S; None: never used
    limits: Limits


def check_tenant_name(name: object) -> str:
    """``name`` if it is a valid tenant name (1-64 of ``A-Z a-z 0-9 _ . -``, not only dots), else ValidationError."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or not name.strip("."):
        raise ValidationError(
            f"tenant name {name!r:.80} is not valid: use 1-{MAX_NAME_CHARS} characters among letters, digits, "
            f"'_', '.' and '-' (and not only dots), e.g. 'alice' or 'team-a.prod'"
        )
    return name


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("ascii")).hexdigest()


def _number(value: bytes | None) -> float | None:
    try:
        return None if value is None else float(value.decode())
    except ValueError:
        return None


class ApiKeys:
    """The fleet's API keys, in its Redis: create, authenticate, list, revoke.

    ``store`` is the fleet's store (a :class:`~tinkerq.store.RedisStore`; :meth:`from_connection` takes the
    one a :class:`~tinkerq.connection.Connection` holds). Every call is
    retried through a Redis outage for ``retry_s`` seconds, then raises
    :class:`~tinkerq.errors.BrokerUnavailableError`: a gateway must answer that with 503, not 401.

    ``cache_s`` > 0 keeps *successful* :meth:`authenticate` answers in this process for that long (a gateway
    checks every request): a revoked key then keeps working here for up to ``cache_s`` (revoking through
    this same object takes effect at once). Unknown keys are never cached, so a key just created works at
    once everywhere. The cache is keyed by digest, never by the key, and bounded.
    """

    def __init__(self, store: KeyValueStore, *, retry_s: float = DEFAULT_RETRY_S, cache_s: float = 0.0) -> None:
        self.store = store.with_retry(retry_s)
        self.retry_s = retry_s
        self.cache_s = cache_s
        self._connection: Connection | None = None  # close() closes it only if open() made it
        self._cache: dict[str, tuple[str, float]] = {}  # digest -> (tenant, monotonic expiry)
        self._lock = threading.Lock()

    @classmethod
    def from_connection(cls, conn: Connection, *, retry_s: float | None = None, cache_s: float = 0.0) -> ApiKeys:
        """The API keys of the fleet ``conn`` is connected to (shares its Redis client; ``conn`` closes it)."""
        from tinkerq.store import RedisStore

        if not isinstance(conn.store, RedisStore):
            raise UserError("API keys live in the fleet's Redis, and the embedded (memory://) fleet has none: pass "
                            "--broker redis://host:6379/0 or set TINKERQ_BROKER_URL")
        return cls(conn.store, retry_s=conn.store.retry_s if retry_s is None else retry_s, cache_s=cache_s)

    @classmethod
    def open(cls, settings: Settings, *, cache_s: float = 0.0) -> ApiKeys:
        """Connect to the Redis ``settings`` names (clear errors if it is unreachable); :meth:`close` when done.

        Calls retry for ``settings.connect_timeout_s`` (an operator's command should fail fast).
        """
        from tinkerq.connection import Connection

        if settings.is_embedded:
            raise UserError("no broker: API keys live in the fleet's Redis; pass --broker redis://host:6379/0 or "
                            "set TINKERQ_BROKER_URL")
        conn = Connection.open(settings, retry_s=settings.connect_timeout_s)
        conn.app.close()  # only the Redis client is needed
        try:
            api_keys = cls.from_connection(conn, cache_s=cache_s)
        except BaseException:
            conn.close()
            raise
        api_keys._connection = conn
        return api_keys

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()

    def create(self, name: str, limits: Limits | None = None) -> str:
        """A new key for tenant ``name`` with ``limits`` (default: none), returned once and stored only as its digest.

        A name that already has a live key is refused (UserError); so is an invalid name (ValidationError).
        """
        check_tenant_name(name)
        limits = limits or Limits()
        key = KEY_PREFIX + secrets.token_urlsafe(32)  # 256 random bits
        digest = _digest(key)
        now = repr(time.time())
        record = keys.api_key(digest)

        def add(t: Transaction) -> int:  # 1: made; 0: the tenant has a key; -1: a record with this digest exists
            if t.hash_get(keys.TENANTS, [name])[0] is not None:
                return 0
            if t.exists(record):
                return -1
            t.write(HashPut(keys.TENANTS, {name: digest}), HashPut(record, {"tenant": name, "created_at": now}))
            return 1

        created = self.store.transaction(add, [keys.TENANTS, record], what=f"creating an API key for {name}")
        if created == 0:
            raise UserError(f"tenant {name!r} already has an API key: revoke it first "
                            f"(tinkerq keys revoke {name}) or pick another name")
        if created != 1:  # a 256-bit collision: never in practice
            raise UserError("the new key collided with an existing one; run the command again")
        if limits != Limits():
            # A second call: nobody holds the key before this method returns it, so nobody can use it unlimited
            # meanwhile. If the limits cannot be written, the key is removed again (best effort) and never shown.
            try:
                self._write_limits(name, limits.as_dict())
            except BaseException:
                with contextlib.suppress(Exception):
                    self.revoke(name)
                raise
        AuditLog(self.store).record(name, "api_key_create", key_digest_prefix=digest[:12])
        return key

    def update_limits(self, name: str, changes: Mapping[str, int | None]) -> Limits:
        """Set (a number) or remove (None) some of tenant ``name``'s limits; the others stay. Its limits after.

        Gateways apply the change within their cache time (:class:`~tinkerq.quotas.Quotas`, 1 s by default).
        Refused: an invalid limit (ValidationError: 0, negative, unknown name) or a tenant without a key (UserError).
        """
        if not changes:
            raise ValidationError("no limit to change: pass at least one of "
                                  + ", ".join(option_of(n) for n in LIMIT_NAMES))
        for limit_name, value in changes.items():
            check_limit(limit_name, value)
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or not self._write_limits(name, changes):
            raise UserError(f"tenant {name!r:.80} has no API key (see: tinkerq keys list; create one with: "
                            f"tinkerq keys create NAME)")
        limits = self.limits(name)
        if limits is None:  # revoked between the two calls
            raise UserError(f"tenant {name!r} has no API key (it was just revoked)")
        return limits

    def _write_limits(self, name: str, changes: Mapping[str, int | None]) -> bool:
        written = {n: str(v) for n, v in changes.items() if v is not None}
        cleared = [n for n, v in changes.items() if v is None]

        def update(t: Transaction) -> bool:
            digest = t.hash_get(keys.TENANTS, [name])[0]
            if digest is None:
                return False
            record = keys.api_key(digest.decode())
            t.write(HashPut(record, written), HashDelete(record, cleared))
            return True

        # Watching the index is enough: a revoke (the only way a record goes) changes it.
        return self.store.transaction(update, [keys.TENANTS], what=f"updating the API key of {name}")

    def limits(self, name: str) -> Limits | None:
        """Tenant ``name``'s limits; None if it has no key."""
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            return None
        fields = tenant_key_fields(self.store, name, list(LIMIT_NAMES))
        return None if fields is None else Limits.from_fields(fields)

    def created_at(self, name: str) -> float | None:
        """When tenant ``name``'s live key was created (epoch seconds; it tells one key of a tenant from the next, so
        the gateway's tokens end with the key they were exchanged for); None if it has no key."""
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            return None
        fields = tenant_key_fields(self.store, name, ["created_at"])
        return None if fields is None else _number(fields[0])

    def cached(self, key: str | None) -> str | None:
        """The tenant of ``key`` if :meth:`authenticate` accepted it within ``cache_s`` (no I/O); None when it must
        be asked (unknown here, expired, or no cache)."""
        if self.cache_s <= 0 or not isinstance(key, str) or len(key) > MAX_KEY_CHARS or not _KEY_RE.fullmatch(key):
            return None
        with self._lock:
            hit = self._cache.get(_digest(key))
        return hit[0] if hit is not None and hit[1] > time.monotonic() else None

    def authenticate(self, key: str | None) -> str | None:
        """The tenant whose live key ``key`` is; None for a missing, malformed, unknown or revoked key.

        One read (and, at most once a minute per key, a store transaction noting the last use). Raises
        BrokerUnavailableError if Redis stays unreachable for ``retry_s``: "cannot tell", not "no".
        """
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS or not _KEY_RE.fullmatch(key):
            return None
        digest = _digest(key)
        if self.cache_s > 0:
            with self._lock:
                hit = self._cache.get(digest)
            if hit is not None and hit[1] > time.monotonic():
                return hit[0]
        record, now = keys.api_key(digest), time.time()
        # One read on the common path (a key used within the last minute): a transaction only to note the use.
        tenant_raw, last_raw = self.store.hash_fields([record], ["tenant", "last_used_at"])[0]
        if tenant_raw is None:
            return None
        if now - (_number(last_raw) or 0.0) < LAST_USED_RESOLUTION_S:
            return self._remember(digest, tenant_raw.decode())

        def use(t: Transaction) -> str | None:
            # A removed key has no record: None, and nothing written (a check racing a removal cannot leave half a
            # record behind).
            tenant, last = t.hash_get(record, ["tenant", "last_used_at"])
            if tenant is None:
                return None
            if now - (_number(last) or 0.0) >= LAST_USED_RESOLUTION_S:
                t.write(HashPut(record, {"last_used_at": repr(now)}))
            return tenant.decode()

        tenant = self.store.transaction(use, [record], what="checking an API key")
        return None if tenant is None else self._remember(digest, tenant)

    def _remember(self, digest: str, tenant: str) -> str:
        if self.cache_s > 0:
            with self._lock:
                if len(self._cache) >= _CACHE_MAX_ENTRIES:
                    self._cache.clear()
                self._cache[digest] = (tenant, time.monotonic() + self.cache_s)
        return tenant

    def list(self) -> builtins.list[TenantInfo]:
        """Every tenant with a live key, by name: when its key was created and last used, and its limits."""

        names = {name: digest.decode() for name, digest in self.store.hash_items(keys.TENANTS).items()}
        ordered = sorted(names)
        fields = self.store.hash_fields([keys.api_key(names[name]) for name in ordered],
                                        ["created_at", "last_used_at", *LIMIT_NAMES])
        return [{"name": name, "created_at": _number(values[0]) or 0.0, "last_used_at": _number(values[1]),
                 "limits": Limits.from_fields(values[2:])}
                for name, values in zip(ordered, fields, strict=True)]

    def revoke(self, name: str) -> bool:
        """Remove tenant ``name``'s key (authenticate answers None for it from now on); False if it has none."""
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            return False
        def remove(t: Transaction) -> bool:
            digest = t.hash_get(keys.TENANTS, [name])[0]
            if digest is None:
                return False
            t.write(HashDelete(keys.TENANTS, [name]), Delete(keys.api_key(digest.decode())))
            return True

        revoked = self.store.transaction(remove, [keys.TENANTS], what=f"revoking the API key of {name}")
        with self._lock:
            for digest in [d for d, (tenant, _) in self._cache.items() if tenant == name]:
                del self._cache[digest]
        if revoked:
            AuditLog(self.store).record(name, "api_key_revoke")
        return revoked
