"""A small key-value store seam: Redis in a fleet, a dict in the embedded (one-process) fleet.

Used for claim-checked payloads, replies, worker registrations and heartbeats, dead letters, recovery
records, the gateway's records and the tenants' API keys (key names: :mod:`tinkerq.keys`). Every
Redis call is retried through an outage (:mod:`tinkerq.retry`) for ``retry_s`` seconds, so a Redis
restart or failover delays requests instead of failing them.
"""

from __future__ import annotations

import collections
import fnmatch
import functools
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import redis

from tinkerq.retry import retrying

T = TypeVar("T")


@dataclass(frozen=True)
class Push:
    """A write for :meth:`KeyValueStore.write_many`: what :meth:`KeyValueStore.push` does."""

    key: str
    value: bytes
    ttl_s: float | None = None
    max_len: int | None = None


@dataclass(frozen=True)
class Reply:
    """A write for :meth:`KeyValueStore.write_many`: what :meth:`KeyValueStore.put_reply` does."""

    key: str
    value: bytes
    inbox: str | None
    item: bytes
    ttl_s: float


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
    # Several pushes and replies in one round trip, applied in order and all at once (a worker's journal entries
    # and answers: worker/outbox.py).
    def write_many(self, writes: Sequence[Push | Reply]) -> None: ...
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
    # -- tenants' limits, quotas and usage (tinkerq/quotas.py, tinkerq/usage.py) --
    # A tenant's limits are fields of its key's record, found through the index (None/False: no such tenant).
    def update_api_key(self, index: str, tenant: str, record_prefix: str, set_fields: Mapping[str, str],
                       clear_fields: list[str]) -> bool: ...
    def api_key_fields(self, index: str, tenant: str, record_prefix: str,
                       fields: list[str]) -> list[bytes | None] | None: ...
    # Capacity: a sorted set of holders scored by when their lease ends (store time; no lease: never). Joining
    # drops ended leases, then admits ``member`` if it is already in or fewer than ``cap`` are (None: no cap).
    # Leaving is forget().
    def join_capped(self, zset: str, member: str, cap: int | None, lease_s: float | None) -> bool: ...
    def live_members(self, zset: str) -> list[str]: ...
    # A token bucket as a GCRA theoretical arrival time, and a run's latest scheduled time: the epoch second at
    # which ``tokens`` may go (tinkerq/quotas.py explains). capacity 0: no rate limit, the run's order only.
    def reserve_rate(self, bucket: str, run: str, now: float, tokens: int, per_token_s: float,
                     capacity: int) -> float: ...
    # Usage: counters added to an hour's hash, that hour noted in the tenant's index, the tenant in the index of
    # tenants, all at once and, with ``once_key``, only if that marker was not set yet (False: skipped).
    def add_usage(self, hour_key: str, hours_key: str, tenants_key: str, once_key: str | None, tenant: str,
                  hour: int, oldest_hour: int, ttl_s: float, once_ttl_s: float,
                  increments: Mapping[str, int]) -> bool: ...
    def zset_range(self, zset: str, min_score: float, max_score: float) -> list[tuple[str, float]]: ...
    def hash_items_many(self, keys: list[str]) -> list[dict[str, bytes]]: ...


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

    def write_many(self, writes: Sequence[Push | Reply]) -> None:
        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            for w in writes:
                if isinstance(w, Push):
                    pipe.lpush(w.key, w.value)
                    if w.max_len is not None:
                        pipe.ltrim(w.key, 0, w.max_len - 1)
                    if w.ttl_s is not None:
                        pipe.pexpire(w.key, _ms(w.ttl_s))
                else:
                    pipe.set(w.key, w.value, px=_ms(w.ttl_s))
                    if w.inbox is not None:
                        pipe.lpush(w.inbox, w.item)
                        pipe.pexpire(w.inbox, _ms(w.ttl_s))
            pipe.execute()

        if writes:
            self._do(f"writing {len(writes)} journal entries and replies", run)

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

    # -- tenants' limits, quotas and usage (tinkerq/quotas.py, tinkerq/usage.py) --

    @functools.cached_property
    def _tenant_scripts(self) -> dict[str, Any]:
        # Registered on first use (a gateway's store needs them; a worker's never does).
        return {name: self.client.register_script(source) for name, source in _TENANT_SCRIPTS.items()}

    def _run_script(self, name: str, what: str, keys: list[str], args: list[Any]) -> Any:
        script = self._tenant_scripts[name]
        return self._do(what, lambda: script(keys=keys, args=args))

    def update_api_key(self, index: str, tenant: str, record_prefix: str, set_fields: Mapping[str, str],
                       clear_fields: list[str]) -> bool:
        args = [tenant, record_prefix, str(len(set_fields))]
        for name, value in set_fields.items():
            args += [name, value]
        return bool(self._run_script("update_api_key", f"updating the API key of {tenant}", [index],
                                     args + list(clear_fields)))

    def api_key_fields(self, index: str, tenant: str, record_prefix: str,
                       fields: list[str]) -> list[bytes | None] | None:
        found = self._run_script("api_key_fields", f"reading the limits of {tenant}", [index],
                                 [tenant, record_prefix, *fields])
        if not found:
            return None
        return [_bytes(v) if v else None for v in found[1:]]

    def join_capped(self, zset: str, member: str, cap: int | None, lease_s: float | None) -> bool:
        args = [member, -1 if cap is None else cap, "" if lease_s is None else repr(float(lease_s))]
        return bool(self._run_script("join_capped", f"counting {zset}", [zset], args))

    def live_members(self, zset: str) -> list[str]:
        return [_text(m) for m in self._run_script("live_members", f"reading {zset}", [zset], [])]

    def reserve_rate(self, bucket: str, run: str, now: float, tokens: int, per_token_s: float,
                     capacity: int) -> float:
        args = [repr(float(now)), int(tokens), repr(float(per_token_s)), int(capacity)]
        return float(_text(self._run_script("reserve_rate", f"scheduling {run}", [bucket, run], args)))

    def add_usage(self, hour_key: str, hours_key: str, tenants_key: str, once_key: str | None, tenant: str,
                  hour: int, oldest_hour: int, ttl_s: float, once_ttl_s: float,
                  increments: Mapping[str, int]) -> bool:
        keys = [hour_key, hours_key, tenants_key] + ([] if once_key is None else [once_key])
        args: list[Any] = [tenant, int(hour), int(oldest_hour), _ms(ttl_s), _ms(once_ttl_s)]
        for name, value in increments.items():
            args += [name, int(value)]
        return bool(self._run_script("add_usage", f"recording the usage of {tenant}", keys, args))

    def zset_range(self, zset: str, min_score: float, max_score: float) -> list[tuple[str, float]]:
        found: Any = self._do(f"reading {zset}", lambda: self.client.zrangebyscore(
            zset, _score(min_score), _score(max_score), withscores=True))
        return [(_text(member), float(score)) for member, score in found]

    def hash_items_many(self, keys: list[str]) -> list[dict[str, bytes]]:
        def run() -> list[dict[str, bytes]]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(key)
            return [{_text(k): _bytes(v) or b"" for k, v in items.items()} for items in pipe.execute()]

        return self._do("reading hashes", run) if keys else []


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

    def write_many(self, writes: Sequence[Push | Reply]) -> None:
        for w in writes:
            if isinstance(w, Push):
                self.push(w.key, w.value, w.ttl_s, w.max_len)
            else:
                self.put_reply(w.key, w.value, w.inbox, w.item, w.ttl_s)

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

    # -- tenants' limits, quotas and usage: as RedisStore's scripts do, under the lock; leases by the monotonic
    # clock; usage hashes are kept for the process's life (no TTL on this store's hashes) --

    def _record_of(self, index: str, tenant: str, record_prefix: str) -> dict[str, bytes] | None:
        digest = self._hashes.get(index, {}).get(tenant)
        return None if digest is None else self._hashes.get(record_prefix + digest.decode())

    def update_api_key(self, index: str, tenant: str, record_prefix: str, set_fields: Mapping[str, str],
                       clear_fields: list[str]) -> bool:
        with self._lock:
            record = self._record_of(index, tenant, record_prefix)
            if record is None:
                return False
            record.update({name: value.encode() for name, value in set_fields.items()})
            for name in clear_fields:
                record.pop(name, None)
            return True

    def api_key_fields(self, index: str, tenant: str, record_prefix: str,
                       fields: list[str]) -> list[bytes | None] | None:
        with self._lock:
            record = self._record_of(index, tenant, record_prefix)
            return None if record is None else [record.get(name) for name in fields]

    def join_capped(self, zset: str, member: str, cap: int | None, lease_s: float | None) -> bool:
        now = time.monotonic()
        with self._lock:
            holders = self._zsets[zset]
            for ended in [m for m, until in holders.items() if until < now]:
                del holders[ended]
            if member not in holders and cap is not None and len(holders) >= cap:
                return False
            holders[member] = math.inf if lease_s is None else now + lease_s
            return True

    def live_members(self, zset: str) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return [m for m, until in sorted(self._zsets[zset].items(), key=lambda item: item[1]) if until >= now]

    def reserve_rate(self, bucket: str, run: str, now: float, tokens: int, per_token_s: float,
                     capacity: int) -> float:
        with self._lock:
            start = now
            if capacity > 0 and tokens > 0:
                tat = float(self._get(bucket) or b"0")
                start = max(now, tat + min(tokens, capacity) * per_token_s - capacity * per_token_s)
                new_tat = max(tat, start) + tokens * per_token_s
                self._data[bucket] = (repr(new_tat).encode(), time.monotonic() + new_tat - now + _RATE_KEEP_S)
            start = max(start, float(self._get(run) or b"0"))
            self._data[run] = (repr(start).encode(), time.monotonic() + max(0.0, start - now) + _RATE_KEEP_S)
            return start

    def add_usage(self, hour_key: str, hours_key: str, tenants_key: str, once_key: str | None, tenant: str,
                  hour: int, oldest_hour: int, ttl_s: float, once_ttl_s: float,
                  increments: Mapping[str, int]) -> bool:
        with self._lock:
            if once_key is not None:
                if self._get(once_key) is not None:
                    return False
                self._data[once_key] = (b"1", time.monotonic() + once_ttl_s)
            counts = self._hashes.setdefault(hour_key, {})
            for name, value in increments.items():
                counts[name] = str(int(counts.get(name, b"0")) + int(value)).encode()
            hours = self._zsets[hours_key]
            hours[str(hour)] = float(hour)
            for old in [h for h, score in hours.items() if score < oldest_hour]:
                del hours[old]
            tenants = self._hashes.setdefault(tenants_key, {})
            if hour > int(tenants.get(tenant, b"0")):
                tenants[tenant] = str(hour).encode()
            return True

    def zset_range(self, zset: str, min_score: float, max_score: float) -> list[tuple[str, float]]:
        with self._lock:
            found = [(m, s) for m, s in self._zsets.get(zset, {}).items() if min_score <= s <= max_score]
        return sorted(found, key=lambda item: (item[1], item[0]))

    def hash_items_many(self, keys: list[str]) -> list[dict[str, bytes]]:
        with self._lock:
            return [dict(self._hashes.get(key, {})) for key in keys]


# -- Lua of the tenants' limits, quotas and usage (RedisStore's methods above say what each does) -----------------

# Past a token bucket's full time (or a run's scheduled time) its key is worth nothing; it is kept this much longer
# (clocks of gateways may differ a little).
_RATE_KEEP_S = 600.0


def _score(value: float) -> str:
    return "+inf" if value == math.inf else "-inf" if value == -math.inf else repr(float(value))


_TENANT_SCRIPTS = {
    # KEYS[1] = the index; ARGV = tenant, records' prefix, n, n (field, value) pairs, then fields to clear.
    "update_api_key": """
local digest = redis.call('HGET', KEYS[1], ARGV[1])
if not digest then return 0 end
local record = ARGV[2] .. digest
local n = tonumber(ARGV[3])
for i = 4, 3 + 2 * n, 2 do redis.call('HSET', record, ARGV[i], ARGV[i + 1]) end
for i = 4 + 2 * n, #ARGV do redis.call('HDEL', record, ARGV[i]) end
return 1
""",
    # KEYS[1] = the index; ARGV = tenant, records' prefix, fields. {} when the tenant has no key, else {1, values}.
    "api_key_fields": """
local digest = redis.call('HGET', KEYS[1], ARGV[1])
if not digest then return {} end
local found = {1}
for i = 3, #ARGV do found[#found + 1] = redis.call('HGET', ARGV[2] .. digest, ARGV[i]) end
return found
""",
    # KEYS[1] = the holders; ARGV = member, cap (-1: none), lease seconds ('' : none). Times are Redis's own.
    "join_capped": """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%.6f', now))
local until_ = '+inf'
if ARGV[3] ~= '' then until_ = string.format('%.6f', now + tonumber(ARGV[3])) end
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  local cap = tonumber(ARGV[2])
  if cap >= 0 and redis.call('ZCARD', KEYS[1]) >= cap then return 0 end
end
redis.call('ZADD', KEYS[1], until_, ARGV[1])
return 1
""",
    "live_members": """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
return redis.call('ZRANGEBYSCORE', KEYS[1], string.format('%.6f', now), '+inf')
""",
    # KEYS = the tenant's bucket, the run's schedule; ARGV = now, tokens, seconds per token, capacity (0: none).
    # A request needs min(tokens, capacity) tokens in the bucket to go and takes all of its tokens (debt); one of
    # 0 tokens takes nothing and waits for nothing but its run.
    "reserve_rate": f"""
local now = tonumber(ARGV[1])
local tokens = tonumber(ARGV[2])
local per_token = tonumber(ARGV[3])
local capacity = tonumber(ARGV[4])
local keep_ms = {int(_RATE_KEEP_S * 1000)}
local start = now
if capacity > 0 and tokens > 0 then
  local tat = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
  start = math.max(now, tat + math.min(tokens, capacity) * per_token - capacity * per_token)
  local new_tat = math.max(tat, start) + tokens * per_token
  redis.call('SET', KEYS[1], string.format('%.6f', new_tat), 'PX', math.floor((new_tat - now) * 1000) + keep_ms)
end
start = math.max(start, tonumber(redis.call('GET', KEYS[2]) or '0') or 0)
redis.call('SET', KEYS[2], string.format('%.6f', start), 'PX', math.floor(math.max(0, start - now) * 1000) + keep_ms)
return string.format('%.6f', start)
""",
    # KEYS = the hour's hash, the tenant's hours, the tenants [, the once-marker]; ARGV = tenant, hour, oldest
    # hour kept, the hash's TTL (ms), the marker's TTL (ms), then (field, increment) pairs.
    "add_usage": """
if #KEYS == 4 and not redis.call('SET', KEYS[4], '1', 'NX', 'PX', ARGV[5]) then return 0 end
for i = 6, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
local last = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0') or 0
if tonumber(ARGV[2]) > last then redis.call('HSET', KEYS[3], ARGV[1], ARGV[2]) end
return 1
""",
}
