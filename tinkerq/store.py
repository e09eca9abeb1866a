"""A small key-value store seam: Redis in a fleet, a dict in the embedded (one-process) fleet.

Used for claim-checked payloads, replies, worker registrations and heartbeats, dead letters, recovery
records, the gateway's records and the tenants' API keys (key names: :mod:`tinkerq.keys`). Every
Redis call is retried through an outage (:mod:`tinkerq.retry`) for ``retry_s`` seconds, so a Redis
restart or failover delays requests instead of failing them.
"""

from __future__ import annotations

import collections
import fnmatch
import math
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import redis

from tinkerq.retry import retrying

T = TypeVar("T")


class KeyValueStore(Protocol):
    def with_retry(self, retry_s: float) -> KeyValueStore: ...
    def set(self, key: str, value: bytes, ttl_s: float | None) -> None: ...  # ttl_s None: kept until deleted
    def set_if_absent(self, key: str, value: bytes, ttl_s: float) -> bool: ...
    def get(self, key: str) -> bytes | None: ...
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...
    def delete(self, key: str) -> None: ...
    def expire(self, key: str, ttl_s: float) -> None: ...  # a key's time to live, from now (none: nothing)
    def scan(self, pattern: str) -> list[str]: ...
    # Lists: producers' reply inboxes, the dead-letter queue, Celery's queues (read by the reaper).
    def push(self, key: str, value: bytes, ttl_s: float | None = None, max_len: int | None = None) -> None: ...
    def pop(self, key: str, timeout_s: float) -> bytes | None: ...
    def pop_tail(self, key: str) -> bytes | None: ...
    def list_range(self, key: str, start: int, stop: int) -> list[bytes]: ...
    def length(self, key: str) -> int: ...
    def count(self, key: str, ttl_s: float) -> int: ...
    # A reply: kept under its own key (read back after an outage) and pushed to the producer's inbox.
    def put_reply(self, key: str, value: bytes, inbox: str | None, item: bytes, ttl_s: float) -> None: ...
    # Heartbeats, timed by the store's own clock (hosts' clocks may disagree).
    def beat(self, zset: str, member: str) -> None: ...
    def ages(self, zset: str) -> dict[str, float]: ...
    def forget(self, zset: str, member: str) -> None: ...
    # kombu's record of delivered, unacknowledged messages (a hash + its time index), for the cleanup pass.
    def hash_items(self, key: str) -> dict[str, bytes]: ...
    def drop_unacked(self, hash_key: str, index_key: str, fields: list[str]) -> None: ...
    # The gateway's API keys (tinkerq/tenants.py): an index hash (tenant -> key digest) and one hash per key
    # ({tenant, created_at, last_used_at}), changed atomically.
    def hash_fields(self, keys: list[str], fields: list[str]) -> list[list[bytes | None]]: ...
    def add_api_key(self, index: str, record: str, tenant: str, digest: str, created_at: str) -> int: ...
    def remove_api_key(self, index: str, tenant: str, record_prefix: str) -> bool: ...
    def use_api_key(self, record: str, now: str, resolution_s: float) -> str | None: ...


_BEAT = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) + tonumber(t[2]) / 1000000, ARGV[1])
return 1
"""
_AGES = """
local t = redis.call('TIME')
return {t[1], t[2], redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')}
"""
# API keys. KEYS[1] = the index hash, KEYS[2] = the new key's record; ARGV = tenant, digest, created_at.
# 1: made; 0: the tenant has a key; -1: a record with this digest exists.
_ADD_API_KEY = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], 'tenant', ARGV[1], 'created_at', ARGV[3])
return 1
"""
# KEYS[1] = the index hash; ARGV = tenant, the records' key prefix. The record's key comes from the index, so
# it cannot be declared in KEYS: fine on one Redis (with Sentinel or not); tinkerq does not run on Cluster.
_REMOVE_API_KEY = """
local digest = redis.call('HGET', KEYS[1], ARGV[1])
if not digest then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DEL', ARGV[2] .. digest)
return 1
"""
# KEYS[1] = the key's record; ARGV = now, resolution_s. A removed key has no record: nil, and nothing written
# (so a check racing a removal cannot leave half a record behind).
_USE_API_KEY = """
local tenant = redis.call('HGET', KEYS[1], 'tenant')
if not tenant then return false end
local last = tonumber(redis.call('HGET', KEYS[1], 'last_used_at') or '0') or 0
if tonumber(ARGV[1]) - last >= tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], 'last_used_at', ARGV[1])
end
return tenant
"""


class RedisStore:
    def __init__(self, client: redis.Redis, retry_s: float = 600.0) -> None:
        self.client = client
        self.retry_s = retry_s
        self._beat = client.register_script(_BEAT)
        self._ages = client.register_script(_AGES)
        self._add_api_key = client.register_script(_ADD_API_KEY)
        self._remove_api_key = client.register_script(_REMOVE_API_KEY)
        self._use_api_key = client.register_script(_USE_API_KEY)

    def with_retry(self, retry_s: float) -> RedisStore:
        """The same store, retrying for ``retry_s`` instead (heartbeats must not wait out a long outage)."""
        other = RedisStore.__new__(RedisStore)
        other.__dict__.update(self.__dict__, retry_s=retry_s)
        return other

    def _do(self, what: str, fn: Callable[[], T]) -> T:
        return retrying(fn, deadline_s=self.retry_s, what=what)

    def set(self, key: str, value: bytes, ttl_s: float | None) -> None:
        self._do(f"writing {key}", lambda: self.client.set(key, value, px=None if ttl_s is None else _ms(ttl_s)))

    def set_if_absent(self, key: str, value: bytes, ttl_s: float) -> bool:
        return bool(self._do(f"writing {key}", lambda: self.client.set(key, value, px=_ms(ttl_s), nx=True)))

    def get(self, key: str) -> bytes | None:
        return _bytes(self._do(f"reading {key}", lambda: self.client.get(key)))

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        return [_bytes(v) for v in self._do("reading replies", lambda: self.client.mget(keys))]

    def delete(self, key: str) -> None:
        self._do(f"deleting {key}", lambda: self.client.delete(key))

    def expire(self, key: str, ttl_s: float) -> None:
        self._do(f"renewing {key}", lambda: self.client.pexpire(key, _ms(ttl_s)))

    def scan(self, pattern: str) -> list[str]:
        return self._do(f"scanning {pattern}", lambda: [
            k.decode() if isinstance(k, bytes) else k for k in self.client.scan_iter(match=pattern, count=1000)])

    def push(self, key: str, value: bytes, ttl_s: float | None = None, max_len: int | None = None) -> None:
        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.lpush(key, value)
            if max_len is not None:
                pipe.ltrim(key, 0, max_len - 1)
            if ttl_s is not None:
                pipe.pexpire(key, _ms(ttl_s))
            pipe.execute()

        self._do(f"pushing to {key}", run)

    def pop(self, key: str, timeout_s: float) -> bytes | None:
        # BRPOP: the oldest first (LPUSH + BRPOP is FIFO). Not retried here: a listener loops anyway.
        item = self.client.brpop([key], timeout=timeout_s)
        return None if item is None else _bytes(item[1])

    def pop_tail(self, key: str) -> bytes | None:
        return _bytes(self._do(f"reading {key}", lambda: self.client.rpop(key)))  # type: ignore[arg-type]

    def list_range(self, key: str, start: int, stop: int) -> list[bytes]:
        items = self._do(f"reading {key}", lambda: self.client.lrange(key, start, stop))
        return [v if isinstance(v, bytes) else str(v).encode() for v in items]

    def length(self, key: str) -> int:
        return int(self._do(f"reading {key}", lambda: self.client.llen(key)))

    def count(self, key: str, ttl_s: float) -> int:
        def run() -> int:
            pipe = self.client.pipeline(transaction=True)
            pipe.incr(key)
            pipe.pexpire(key, _ms(ttl_s))
            return int(pipe.execute()[0])

        return self._do(f"counting {key}", run)

    def put_reply(self, key: str, value: bytes, inbox: str | None, item: bytes, ttl_s: float) -> None:
        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.set(key, value, px=_ms(ttl_s))
            if inbox is not None:
                pipe.lpush(inbox, item)
                pipe.pexpire(inbox, _ms(ttl_s))
            pipe.execute()

        self._do(f"storing reply {key}", run)

    def beat(self, zset: str, member: str) -> None:
        self._do("sending a heartbeat", lambda: self._beat(keys=[zset], args=[member]))

    def ages(self, zset: str) -> dict[str, float]:
        sec, usec, flat = self._ages(keys=[zset])
        now = int(sec) + int(usec) / 1e6
        return {_text(flat[i]): now - float(flat[i + 1]) for i in range(0, len(flat), 2)}

    def forget(self, zset: str, member: str) -> None:
        self._do("removing a heartbeat", lambda: self.client.zrem(zset, member))

    def hash_items(self, key: str) -> dict[str, bytes]:
        items = self._do(f"reading {key}", lambda: self.client.hgetall(key))
        return {_text(k): v if isinstance(v, bytes) else str(v).encode() for k, v in items.items()}

    def drop_unacked(self, hash_key: str, index_key: str, fields: list[str]) -> None:
        if not fields:
            return

        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.hdel(hash_key, *fields)
            pipe.zrem(index_key, *fields)
            pipe.execute()

        self._do(f"cleaning {hash_key}", run)

    def hash_fields(self, keys: list[str], fields: list[str]) -> list[list[bytes | None]]:
        def run() -> list[list[bytes | None]]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.hmget(key, fields)
            return [[_bytes(v) for v in values] for values in pipe.execute()]

        return self._do("reading hashes", run) if keys else []

    def add_api_key(self, index: str, record: str, tenant: str, digest: str, created_at: str) -> int:
        return int(self._do(f"creating an API key for {tenant}",
                            lambda: self._add_api_key(keys=[index, record], args=[tenant, digest, created_at])))

    def remove_api_key(self, index: str, tenant: str, record_prefix: str) -> bool:
        return bool(self._do(f"revoking the API key of {tenant}",
                             lambda: self._remove_api_key(keys=[index], args=[tenant, record_prefix])))

    def use_api_key(self, record: str, now: str, resolution_s: float) -> str | None:
        raw = self._do("checking an API key", lambda: self._use_api_key(keys=[record], args=[now, resolution_s]))
        return None if raw is None else _text(raw)


def _bytes(value: object) -> bytes | None:
    """A reply of redis-py as bytes (it answers str only for a client made with decode_responses)."""
    if value is None or isinstance(value, bytes):
        return value
    return str(value).encode()


def _ms(ttl_s: float) -> int:
    return max(1, int(ttl_s * 1000))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class MemoryStore:
    """In-process store with the same semantics (expiry included), for the embedded fleet.

    Like kombu's ``memory://`` transport, one instance is shared by the whole process
    (:meth:`shared`), so an embedded worker and the producers beside it see the same keys.
    """

    _shared: MemoryStore | None = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> MemoryStore:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def __init__(self) -> None:
        self._data: dict[str, tuple[bytes, float]] = {}
        self._lists: dict[str, collections.deque[bytes]] = collections.defaultdict(collections.deque)
        self._zsets: dict[str, dict[str, float]] = collections.defaultdict(dict)
        self._hashes: dict[str, dict[str, bytes]] = {}
        self._counts: dict[str, int] = collections.defaultdict(int)
        self._lock = threading.Condition()

    def with_retry(self, retry_s: float) -> MemoryStore:
        return self

    def set(self, key: str, value: bytes, ttl_s: float | None) -> None:
        with self._lock:
            self._data[key] = (bytes(value), math.inf if ttl_s is None else time.monotonic() + ttl_s)

    def set_if_absent(self, key: str, value: bytes, ttl_s: float) -> bool:
        with self._lock:
            if self._get(key) is not None:
                return False
            self._data[key] = (bytes(value), time.monotonic() + ttl_s)
            return True

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._get(key)

    def _get(self, key: str) -> bytes | None:
        item = self._data.get(key)
        if item is None:
            return None
        if item[1] < time.monotonic():
            del self._data[key]
            return None
        return item[0]

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        with self._lock:
            return [self._get(k) for k in keys]

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)
            self._lists.pop(key, None)
            self._hashes.pop(key, None)

    def expire(self, key: str, ttl_s: float) -> None:
        with self._lock:
            value = self._get(key)
            if value is not None:
                self._data[key] = (value, time.monotonic() + ttl_s)

    def scan(self, pattern: str) -> list[str]:
        now = time.monotonic()
        with self._lock:
            names = [k for k, (_, exp) in self._data.items() if exp >= now] + [k for k, v in self._lists.items() if v]
            names += [k for k, v in self._hashes.items() if v]
            return [k for k in names if fnmatch.fnmatchcase(k, pattern)]

    def push(self, key: str, value: bytes, ttl_s: float | None = None, max_len: int | None = None) -> None:
        with self._lock:
            items = self._lists[key]
            items.appendleft(bytes(value))
            while max_len is not None and len(items) > max_len:
                items.pop()
            self._lock.notify_all()

    def pop(self, key: str, timeout_s: float) -> bytes | None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self._lists.get(key):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(left)
            return self._lists[key].pop()

    def pop_tail(self, key: str) -> bytes | None:
        with self._lock:
            items = self._lists.get(key)
            return items.pop() if items else None

    def list_range(self, key: str, start: int, stop: int) -> list[bytes]:
        with self._lock:
            items = list(self._lists.get(key, ()))
        return items[start:] if stop == -1 else items[start:stop + 1]

    def length(self, key: str) -> int:
        with self._lock:
            return len(self._lists.get(key, ()))

    def count(self, key: str, ttl_s: float) -> int:
        with self._lock:
            self._counts[key] += 1
            return self._counts[key]

    def put_reply(self, key: str, value: bytes, inbox: str | None, item: bytes, ttl_s: float) -> None:
        self.set(key, value, ttl_s)
        if inbox is not None:
            self.push(inbox, item)

    def beat(self, zset: str, member: str) -> None:
        with self._lock:
            self._zsets[zset][member] = time.monotonic()

    def ages(self, zset: str) -> dict[str, float]:
        now = time.monotonic()
        with self._lock:
            return {m: now - t for m, t in self._zsets[zset].items()}

    def forget(self, zset: str, member: str) -> None:
        with self._lock:
            self._zsets[zset].pop(member, None)

    def hash_items(self, key: str) -> dict[str, bytes]:
        with self._lock:  # (the in-memory transport keeps no unacked record here: {} for those)
            return dict(self._hashes.get(key, {}))

    def drop_unacked(self, hash_key: str, index_key: str, fields: list[str]) -> None:
        return None

    def hash_fields(self, keys: list[str], fields: list[str]) -> list[list[bytes | None]]:
        with self._lock:
            return [[self._hashes.get(key, {}).get(f) for f in fields] for key in keys]

    def add_api_key(self, index: str, record: str, tenant: str, digest: str, created_at: str) -> int:
        with self._lock:
            tenants = self._hashes.setdefault(index, {})
            if tenant in tenants:
                return 0
            if record in self._hashes:
                return -1
            tenants[tenant] = digest.encode()
            self._hashes[record] = {"tenant": tenant.encode(), "created_at": created_at.encode()}
            return 1

    def remove_api_key(self, index: str, tenant: str, record_prefix: str) -> bool:
        with self._lock:
            digest = self._hashes.get(index, {}).pop(tenant, None)
            if digest is None:
                return False
            self._hashes.pop(record_prefix + digest.decode(), None)
            return True

    def use_api_key(self, record: str, now: str, resolution_s: float) -> str | None:
        with self._lock:
            fields = self._hashes.get(record)
            if fields is None:
                return None
            if float(now) - float(fields.get("last_used_at", b"0")) >= resolution_s:
                fields["last_used_at"] = now.encode()
            return fields["tenant"].decode()
