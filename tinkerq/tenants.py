"""Tenants and their API keys: who may use the HTTP gateway, and whose sessions are whose.

The official ``tinker`` SDK sends ``X-API-Key: tml-...`` with every request; the gateway asks
:meth:`ApiKeys.authenticate` which tenant the key belongs to, and every session, model and checkpoint it
creates belongs to that tenant. Operators manage keys with ``tinkerq keys create|list|revoke``.

One live key per tenant. The fleet's Redis holds (names in :mod:`tinkerq.keys`):

* ``tinkerq:tenants``: a hash, tenant name -> hex SHA-256 of its key (so list and revoke work by name);
* ``tinkerq:apikey:<hex sha256>``: a hash ``{tenant, created_at, last_used_at}`` (epoch seconds).

Never the key itself: it is printed once, by ``tinkerq keys create``, and only its digest is kept. Whoever
reads the Redis (a backup, a replica, ``MONITOR``, an operator) learns no key that works. A plain unsalted
SHA-256 is the right digest here, unlike for passwords: a key is 256 bits from :func:`secrets.token_urlsafe`,
so there is no dictionary or small space to search; a salt or a slow hash (bcrypt, scrypt) defends only
against guessing low-entropy secrets, and would make each request's check cost milliseconds of CPU. An
unsalted digest is also what lets :meth:`ApiKeys.authenticate` find the record in one lookup.

Creating and revoking are Lua scripts, so they are atomic: two concurrent ``create`` of one name cannot
both succeed, and ``authenticate`` never sees half a key.
"""

from __future__ import annotations

import builtins
import hashlib
import re
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict, TypeVar

from tinkerq import keys
from tinkerq.errors import UserError, ValidationError
from tinkerq.retry import retrying

if TYPE_CHECKING:
    import redis

    from tinkerq.connection import Connection
    from tinkerq.settings import Settings

KEY_PREFIX = "tml-"  # the tinker SDK refuses keys without it
MAX_KEY_CHARS = 256  # longer X-API-Key values are refused unhashed (ours are 47 characters)
MAX_NAME_CHARS = 64
# Last-used times are written at most this often per key, so a busy key does not write on every request.
LAST_USED_RESOLUTION_S = 60.0
DEFAULT_RETRY_S = 10.0

_NAME_RE = re.compile(rf"[A-Za-z0-9_.-]{{1,{MAX_NAME_CHARS}}}")
_KEY_RE = re.compile(r"tml-[A-Za-z0-9_-]{16,252}")
_CACHE_MAX_ENTRIES = 10_000
T = TypeVar("T")

# KEYS[1] = tenants hash, KEYS[2] = the new key's record; ARGV = name, digest, created_at.
_CREATE = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], 'tenant', ARGV[1], 'created_at', ARGV[3])
return 1
"""
# KEYS[1] = tenants hash; ARGV = name, the records' key prefix. The record's key comes from the hash, so
# it cannot be declared in KEYS: fine on one Redis (with Sentinel or not); tinkerq does not run on Cluster.
_REVOKE = """
local digest = redis.call('HGET', KEYS[1], ARGV[1])
if not digest then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DEL', ARGV[2] .. digest)
return 1
"""
# KEYS[1] = the key's record; ARGV = now, LAST_USED_RESOLUTION_S. A revoked key has no record: nil, and
# nothing written (so a check racing a revoke cannot leave half a record behind).
_AUTHENTICATE = """
local tenant = redis.call('HGET', KEYS[1], 'tenant')
if not tenant then return false end
local last = tonumber(redis.call('HGET', KEYS[1], 'last_used_at') or '0') or 0
if tonumber(ARGV[1]) - last >= tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], 'last_used_at', ARGV[1])
end
return tenant
"""


class TenantInfo(TypedDict):
    """One tenant as :meth:`ApiKeys.list` reports it: never its key, nor the key's digest."""

    name: str
    created_at: float  # epoch seconds
    last_used_at: float | None  # epoch seconds, to within LAST_USED_RESOLUTION_S; None: never used


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


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _number(value: bytes | str | None) -> float | None:
    try:
        return None if value is None else float(_text(value))
    except ValueError:
        return None


class ApiKeys:
    """The fleet's API keys, in its Redis: create, authenticate, list, revoke.

    ``client`` is a redis-py client of the fleet's Redis (:func:`tinkerq.redis_client.redis_client`, or
    :meth:`from_connection` for the one a :class:`~tinkerq.connection.Connection` holds). Every call is
    retried through a Redis outage for ``retry_s`` seconds, then raises
    :class:`~tinkerq.errors.BrokerUnavailableError`: a gateway must answer that with 503, not 401.

    ``cache_s`` > 0 keeps *successful* :meth:`authenticate` answers in this process for that long (a gateway
    checks every request): a revoked key then keeps working here for up to ``cache_s`` (revoking through
    this same object takes effect at once). Unknown keys are never cached, so a key just created works at
    once everywhere. The cache is keyed by digest, never by the key, and bounded.
    """

    def __init__(self, client: redis.Redis, *, retry_s: float = DEFAULT_RETRY_S, cache_s: float = 0.0) -> None:
        self.client = client
        self.retry_s = retry_s
        self.cache_s = cache_s
        self._owned = False  # close() closes the client only if open() made it
        self._create = client.register_script(_CREATE)
        self._revoke = client.register_script(_REVOKE)
        self._authenticate = client.register_script(_AUTHENTICATE)
        self._cache: dict[str, tuple[str, float]] = {}  # digest -> (tenant, monotonic expiry)
        self._lock = threading.Lock()

    @classmethod
    def from_connection(cls, conn: Connection, *, retry_s: float | None = None, cache_s: float = 0.0) -> ApiKeys:
        """The API keys of the fleet ``conn`` is connected to (shares its Redis client; ``conn`` closes it)."""
        from tinkerq.store import RedisStore

        if not isinstance(conn.store, RedisStore):
            raise UserError("API keys live in the fleet's Redis, and the embedded (memory://) fleet has none: pass "
                            "--broker redis://host:6379/0 or set TINKERQ_BROKER_URL")
        return cls(conn.store.client, retry_s=conn.store.retry_s if retry_s is None else retry_s, cache_s=cache_s)

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
        api_keys._owned = True
        return api_keys

    def close(self) -> None:
        if self._owned:
            self.client.close()

    def _do(self, what: str, fn: Callable[[], T]) -> T:
        return retrying(fn, deadline_s=self.retry_s, what=what)

    def create(self, name: str) -> str:
        """A new key for tenant ``name``, returned once and stored only as its digest.

        A name that already has a live key is refused (UserError); so is an invalid name (ValidationError).
        """
        check_tenant_name(name)
        key = KEY_PREFIX + secrets.token_urlsafe(32)  # 256 random bits
        digest = _digest(key)
        now = repr(time.time())
        created = int(self._do(f"creating an API key for {name}",
                               lambda: self._create(keys=[keys.TENANTS, keys.api_key(digest)],
                                                    args=[name, digest, now])))
        if created == 0:
            raise UserError(f"tenant {name!r} already has an API key: revoke it first "
                            f"(tinkerq keys revoke {name}) or pick another name")
        if created != 1:  # a 256-bit collision: never in practice
            raise UserError("the new key collided with an existing one; run the command again")
        return key

    def authenticate(self, key: str | None) -> str | None:
        """The tenant whose live key ``key`` is; None for a missing, malformed, unknown or revoked key.

        One Redis round trip (a script that also notes the last use, at most once a minute per key). Raises
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
        raw = self._do("checking an API key",
                       lambda: self._authenticate(keys=[keys.api_key(digest)],
                                                  args=[repr(time.time()), LAST_USED_RESOLUTION_S]))
        if raw is None:
            return None
        tenant = _text(raw)
        if self.cache_s > 0:
            with self._lock:
                if len(self._cache) >= _CACHE_MAX_ENTRIES:
                    self._cache.clear()
                self._cache[digest] = (tenant, time.monotonic() + self.cache_s)
        return tenant

    def list(self) -> builtins.list[TenantInfo]:
        """Every tenant with a live key, by name: when its key was created and last used."""

        def run() -> builtins.list[TenantInfo]:
            names = {_text(k): _text(v) for k, v in self.client.hgetall(keys.TENANTS).items()}
            ordered = sorted(names)
            pipe = self.client.pipeline(transaction=False)
            for name in ordered:
                pipe.hmget(keys.api_key(names[name]), ["created_at", "last_used_at"])
            found: builtins.list[TenantInfo] = []
            for name, (created, used) in zip(ordered, pipe.execute(), strict=True):
                found.append({"name": name, "created_at": _number(created) or 0.0, "last_used_at": _number(used)})
            return found

        return self._do("listing API keys", run)

    def revoke(self, name: str) -> bool:
        """Remove tenant ``name``'s key (authenticate answers None for it from now on); False if it has none."""
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            return False
        revoked = bool(self._do(f"revoking the API key of {name}",
                                lambda: self._revoke(keys=[keys.TENANTS], args=[name, keys.api_key("")])))
        with self._lock:
            for digest in [d for d, (tenant, _) in self._cache.items() if tenant == name]:
                del self._cache[digest]
        return revoked
