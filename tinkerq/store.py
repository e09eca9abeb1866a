"""The key-value store seam: Redis in a fleet, a dict in the embedded (one-process) fleet.

Generic primitives only (strings, lists, hashes, sorted sets, a counter, pub/sub, an atomic batch of writes and
an optimistic transaction); each domain writes its records once on top of them, beside its owner: API keys in
:mod:`tinkerq.tenants`, limits and quotas in :mod:`tinkerq.quotas`, usage in :mod:`tinkerq.usage`, the gateway's
records in ``gateway/records.py``, the worker's journal and replies in ``worker/``. Key names:
:mod:`tinkerq.keys`. Nothing outside this module (and :mod:`tinkerq.redis_client`, which makes the client)
speaks redis-py.

Every Redis call is retried through an outage (:mod:`tinkerq.retry`) for ``retry_s`` seconds, so a Redis restart
or failover delays requests instead of failing them.
"""

from __future__ import annotations

import collections
import fnmatch
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import redis
from redis.exceptions import WatchError

from tinkerq.retry import retrying

T = TypeVar("T")

# What a Redis call that bypassed the retries raises while Redis is away (the gateway answers them 503).
UNREACHABLE: tuple[type[Exception], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


# -- writes: applied in order and all at once by write_many, or at the end of a transaction -------------------

@dataclass(frozen=True)
class Push:
    """LPUSH ``value`` (the list is a FIFO read by pop), then keep the newest ``max_len`` and renew ``ttl_s``."""

    key: str
    value: bytes
    ttl_s: float | None = None
    max_len: int | None = None


@dataclass(frozen=True)
class Reply:
    """A reply: kept under its own key (read back after an outage) and ``item`` pushed to the producer's inbox
    (None: no inbox), both for ``ttl_s``."""

    key: str
    value: bytes
    inbox: str | None
    item: bytes
    ttl_s: float


@dataclass(frozen=True)
class Put:
    """SET ``key`` (``ttl_s`` None: kept until deleted)."""

    key: str
    value: bytes
    ttl_s: float | None = None


@dataclass(frozen=True)
class Delete:
    key: str


@dataclass(frozen=True)
class Expire:
    """A key's time to live, from now (a key that does not exist: nothing)."""

    key: str
    ttl_s: float


@dataclass(frozen=True)
class HashPut:
    key: str
    fields: Mapping[str, bytes | str]


@dataclass(frozen=True)
class HashDelete:
    key: str
    fields: Sequence[str]


@dataclass(frozen=True)
class HashIncr:
    key: str
    field: str
    by: int


@dataclass(frozen=True)
class ZAdd:
    """Score ``member`` of a sorted set; ``only_greater``: only if that raises its score (or adds it)."""

    key: str
    member: str
    score: float
    only_greater: bool = False


@dataclass(frozen=True)
class ZRemove:
    key: str
    members: Sequence[str]


@dataclass(frozen=True)
class ZRemoveBelow:
    """Drop the members scored strictly below ``score``."""

    key: str
    score: float


@dataclass(frozen=True)
class Publish:
    """PUBLISH ``message`` on ``channel``, after the writes before it (subscribers then find them)."""

    channel: str
    message: bytes

    @property
    def key(self) -> str:  # (what a failed write names)
        return self.channel


Write = (Push | Reply | Put | Delete | Expire | HashPut | HashDelete | HashIncr | ZAdd | ZRemove | ZRemoveBelow
         | Publish)


class Transaction(Protocol):
    """What a transaction's function sees: reads of watched keys (a write to one by anyone before the transaction
    commits runs the function again), the store's clock, and the writes it queues (applied at the end, all at
    once; a read never sees the transaction's own writes)."""

    def watch(self, *keys: str) -> None: ...  # more keys to watch (ones found by reading), before reading them
    def now(self) -> float: ...  # the store's clock, in seconds (Redis: its TIME; hosts' clocks may disagree)
    def get(self, key: str) -> bytes | None: ...
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...  # one round trip
    def exists(self, key: str) -> bool: ...
    def hash_get(self, key: str, fields: Sequence[str]) -> list[bytes | None]: ...
    def hash_size(self, key: str) -> int: ...
    def zset_size(self, key: str) -> int: ...
    def zset_range(self, key: str, min_score: float, max_score: float) -> list[tuple[str, float]]: ...
    def write(self, *writes: Write) -> None: ...


class Subscription(Protocol):
    def get(self, timeout_s: float) -> bytes | None: ...  # the next message on the channel (None: none in time)
    def close(self) -> None: ...


class KeyValueStore(Protocol):
    def with_retry(self, retry_s: float) -> KeyValueStore: ...
    # Strings.
    def set(self, key: str, value: bytes, ttl_s: float | None) -> None: ...  # ttl_s None: kept until deleted
    def set_if_absent(self, key: str, value: bytes, ttl_s: float) -> bool: ...
    # ``writes``, then ``key`` set to ``value`` unless it exists, all at once (one round trip): None when this call
    # set it, else the value it holds.
    def claim_after(self, writes: Sequence[Write], key: str, value: bytes, ttl_s: float) -> bytes | None: ...
    def get(self, key: str) -> bytes | None: ...
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...
    def exists_many(self, keys: list[str]) -> list[bool]: ...
    def delete(self, key: str) -> None: ...
    def expire(self, key: str, ttl_s: float) -> None: ...  # a key's time to live, from now (none: nothing)
    def scan(self, pattern: str) -> list[str]: ...
    def count(self, key: str, ttl_s: float) -> int: ...  # +1, and the count after; the key lives ttl_s
    # Lists: producers' reply inboxes, the dead-letter queue, journals, Celery's queues (read by the reaper).
    def push(self, key: str, value: bytes, ttl_s: float | None = None, max_len: int | None = None) -> None: ...
    def pop(self, key: str, timeout_s: float) -> bytes | None: ...
    def pop_tail(self, key: str) -> bytes | None: ...
    def list_range(self, key: str, start: int, stop: int) -> list[bytes]: ...
    def length(self, key: str) -> int: ...
    # Hashes.
    def hash_items(self, key: str) -> dict[str, bytes]: ...
    def hash_items_many(self, keys: list[str]) -> list[dict[str, bytes]]: ...
    def hash_fields(self, keys: list[str], fields: list[str]) -> list[list[bytes | None]]: ...
    # Sorted sets.
    def zset_range(self, zset: str, min_score: float, max_score: float) -> list[tuple[str, float]]: ...
    def zset_score(self, zset: str, member: str) -> float | None: ...
    # Members scored by the store's clock (heartbeats: hosts' clocks may disagree), and their ages.
    def beat(self, zset: str, member: str) -> None: ...
    def ages(self, zset: str) -> dict[str, float]: ...
    def forget(self, zset: str, member: str) -> None: ...
    def now(self) -> float: ...
    # Several writes in one round trip, applied in order and all at once (a worker's journal entries and answers:
    # worker/core/outbox.py).
    def write_many(self, writes: Sequence[Write]) -> None: ...
    # ``fn`` run against the keys it watches, its writes applied at once if none of them changed meanwhile (else
    # it runs again); its result.
    def transaction(self, fn: Callable[[Transaction], T], watch: Sequence[str] = (), *, what: str) -> T: ...
    # Pub/sub: fire and forget (a subscriber that is not listening misses the message).
    def publish(self, channel: str, message: bytes | str) -> None: ...
    def subscribe(self, channel: str) -> Subscription: ...


class _Derived:
    """The store's calls written once on top of the primitives both stores implement."""

    def beat(self: Any, zset: str, member: str) -> None:
        self.transaction(lambda t: t.write(ZAdd(zset, member, t.now())), what="sending a heartbeat")

    def ages(self: Any, zset: str) -> dict[str, float]:
        now = self.now()
        return {member: now - at for member, at in self.zset_range(zset, -math.inf, math.inf)}

    def forget(self: Any, zset: str, member: str) -> None:
        self._write([ZRemove(zset, [member])])

    def push(self: Any, key: str, value: bytes, ttl_s: float | None = None, max_len: int | None = None) -> None:
        self._write([Push(key, value, ttl_s, max_len)])


# -- Redis ------------------------------------------------------------------------------------------------------


class RedisStore(_Derived):
    def __init__(self, client: redis.Redis, retry_s: float = 600.0) -> None:
        self.client = client
        self.retry_s = retry_s

    def with_retry(self, retry_s: float) -> RedisStore:
        """The same store, retrying for ``retry_s`` instead (heartbeats must not wait out a long outage)."""
        other = RedisStore.__new__(RedisStore)
        other.__dict__.update(self.__dict__, retry_s=retry_s)
        return other

    def close(self) -> None:
        self.client.close()

    def _do(self, what: str, fn: Callable[[], T]) -> T:
        return retrying(fn, deadline_s=self.retry_s, what=what)

    def set(self, key: str, value: bytes, ttl_s: float | None) -> None:
        self._do(f"writing {key}", lambda: self.client.set(key, value, px=None if ttl_s is None else _ms(ttl_s)))

    def set_if_absent(self, key: str, value: bytes, ttl_s: float) -> bool:
        return bool(self._do(f"writing {key}", lambda: self.client.set(key, value, px=_ms(ttl_s), nx=True)))

    def claim_after(self, writes: Sequence[Write], key: str, value: bytes, ttl_s: float) -> bytes | None:
        def run() -> bytes | None:
            pipe = self.client.pipeline(transaction=True)
            for w in writes:
                _queue(pipe, w)
            pipe.set(key, value, px=_ms(ttl_s), nx=True)
            pipe.get(key)  # in the same transaction: a holder's claim cannot expire between the two
            *_, got, held = pipe.execute()
            return None if got else _bytes(held)

        return self._do(f"claiming {key}", run)

    def get(self, key: str) -> bytes | None:
        return _bytes(self._do(f"reading {key}", lambda: self.client.get(key)))

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        return [_bytes(v) for v in self._do("reading replies", lambda: self.client.mget(keys))]

    def exists_many(self, keys: list[str]) -> list[bool]:
        def run() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(n) for n in pipe.execute()]

        return self._do("reading keys", run) if keys else []

    def delete(self, key: str) -> None:
        self._do(f"deleting {key}", lambda: self.client.delete(key))

    def expire(self, key: str, ttl_s: float) -> None:
        self._do(f"renewing {key}", lambda: self.client.pexpire(key, _ms(ttl_s)))

    def scan(self, pattern: str) -> list[str]:
        return self._do(f"scanning {pattern}", lambda: [
            _text(k) for k in self.client.scan_iter(match=pattern, count=1000)])

    def count(self, key: str, ttl_s: float) -> int:
        def run() -> int:
            pipe = self.client.pipeline(transaction=True)
            pipe.incr(key)
            pipe.pexpire(key, _ms(ttl_s))
            return int(pipe.execute()[0])

        return self._do(f"counting {key}", run)

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

    def hash_items(self, key: str) -> dict[str, bytes]:
        items = self._do(f"reading {key}", lambda: self.client.hgetall(key))
        return {_text(k): v if isinstance(v, bytes) else str(v).encode() for k, v in items.items()}

    def hash_items_many(self, keys: list[str]) -> list[dict[str, bytes]]:
        def run() -> list[dict[str, bytes]]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(key)
            return [{_text(k): _bytes(v) or b"" for k, v in items.items()} for items in pipe.execute()]

        return self._do("reading hashes", run) if keys else []

    def hash_fields(self, keys: list[str], fields: list[str]) -> list[list[bytes | None]]:
        def run() -> list[list[bytes | None]]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.hmget(key, fields)
            return [[_bytes(v) for v in values] for values in pipe.execute()]

        return self._do("reading hashes", run) if keys else []

    def zset_range(self, zset: str, min_score: float, max_score: float) -> list[tuple[str, float]]:
        found: Any = self._do(f"reading {zset}", lambda: self.client.zrangebyscore(
            zset, _score(min_score), _score(max_score), withscores=True))
        return [(_text(member), float(score)) for member, score in found]

    def zset_score(self, zset: str, member: str) -> float | None:
        score: Any = self._do(f"reading {zset}", lambda: self.client.zscore(zset, member))
        return None if score is None else float(score)

    def now(self) -> float:
        sec, usec = self._do("reading the store's clock", lambda: self.client.time())
        return int(sec) + int(usec) / 1e6

    def write_many(self, writes: Sequence[Write]) -> None:
        self._write(writes)

    def _write(self, writes: Sequence[Write]) -> None:
        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            for w in writes:
                _queue(pipe, w)
            pipe.execute()

        if writes:
            what = f"writing {writes[0].key}" if len(writes) == 1 else f"writing {len(writes)} entries"
            self._do(what, run)

    def transaction(self, fn: Callable[[Transaction], T], watch: Sequence[str] = (), *, what: str) -> T:
        def run() -> T:
            with self.client.pipeline(transaction=True) as pipe:
                while True:
                    txn = _RedisTransaction(self.client, pipe)
                    try:
                        txn.watch(*watch)
                        result = fn(txn)
                        if txn.writes:
                            pipe.multi()
                            for w in txn.writes:
                                _queue(pipe, w)
                            pipe.execute()
                        return result
                    except WatchError:
                        continue
                    finally:
                        pipe.reset()

        return self._do(what, run)

    def publish(self, channel: str, message: bytes | str) -> None:
        self._do(f"publishing on {channel}", lambda: self.client.publish(channel, message))

    def subscribe(self, channel: str) -> Subscription:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(channel)
        return _RedisSubscription(pubsub)


class _RedisTransaction:
    """Reads on the watching pipeline (redis-py runs them at once, on the connection holding the WATCH); before
    any WATCH, on the client."""

    def __init__(self, client: redis.Redis, pipe: Any) -> None:
        self._client = client
        self._pipe = pipe
        self.writes: list[Write] = []

    @property
    def _reader(self) -> Any:
        return self._pipe if self._pipe.watching else self._client

    def watch(self, *keys: str) -> None:
        if keys:
            self._pipe.watch(*keys)

    def now(self) -> float:
        sec, usec = self._reader.time()
        return int(sec) + int(usec) / 1e6

    def get(self, key: str) -> bytes | None:
        return _bytes(self._reader.get(key))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [_bytes(v) for v in self._reader.mget(list(keys))] if keys else []

    def exists(self, key: str) -> bool:
        return bool(self._reader.exists(key))

    def hash_get(self, key: str, fields: Sequence[str]) -> list[bytes | None]:
        return [_bytes(v) for v in self._reader.hmget(key, list(fields))]

    def hash_size(self, key: str) -> int:
        return int(self._reader.hlen(key))

    def zset_size(self, key: str) -> int:
        return int(self._reader.zcard(key))

    def zset_range(self, key: str, min_score: float, max_score: float) -> list[tuple[str, float]]:
        found = self._reader.zrangebyscore(key, _score(min_score), _score(max_score), withscores=True)
        return [(_text(member), float(score)) for member, score in found]

    def write(self, *writes: Write) -> None:
        self.writes += writes


class _RedisSubscription:
    def __init__(self, pubsub: Any) -> None:
        self._pubsub = pubsub

    def get(self, timeout_s: float) -> bytes | None:
        message = self._pubsub.get_message(timeout=timeout_s)
        return None if message is None else _bytes(message["data"])

    def close(self) -> None:
        self._pubsub.close()


def _queue(pipe: Any, w: Write) -> None:
    """Queue ``w`` on a redis-py pipeline."""
    if isinstance(w, Push):
        pipe.lpush(w.key, w.value)
        if w.max_len is not None:
            pipe.ltrim(w.key, 0, w.max_len - 1)
        if w.ttl_s is not None:
            pipe.pexpire(w.key, _ms(w.ttl_s))
    elif isinstance(w, Reply):
        pipe.set(w.key, w.value, px=_ms(w.ttl_s))
        if w.inbox is not None:
            pipe.lpush(w.inbox, w.item)
            pipe.pexpire(w.inbox, _ms(w.ttl_s))
    elif isinstance(w, Put):
        pipe.set(w.key, w.value, px=None if w.ttl_s is None else _ms(w.ttl_s))
    elif isinstance(w, Delete):
        pipe.delete(w.key)
    elif isinstance(w, Expire):
        pipe.pexpire(w.key, _ms(w.ttl_s))
    elif isinstance(w, HashPut):
        if w.fields:
            pipe.hset(w.key, mapping=dict(w.fields))
    elif isinstance(w, HashDelete):
        if w.fields:
            pipe.hdel(w.key, *w.fields)
    elif isinstance(w, HashIncr):
        pipe.hincrby(w.key, w.field, w.by)
    elif isinstance(w, ZAdd):
        pipe.zadd(w.key, {w.member: _score(w.score)}, gt=w.only_greater)
    elif isinstance(w, ZRemove):
        if w.members:
            pipe.zrem(w.key, *w.members)
    elif isinstance(w, Publish):
        pipe.publish(w.channel, w.message)
    else:
        pipe.zremrangebyscore(w.key, "-inf", "(" + _score(w.score))


def _bytes(value: object) -> bytes | None:
    """A reply of redis-py as bytes (it answers str only for a client made with decode_responses)."""
    if value is None or isinstance(value, bytes):
        return value
    return str(value).encode()


def _ms(ttl_s: float) -> int:
    return max(1, int(ttl_s * 1000))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _score(value: float) -> str:
    return "+inf" if value == math.inf else "-inf" if value == -math.inf else repr(float(value))


# -- memory -----------------------------------------------------------------------------------------------------


class MemoryStore(_Derived):
    """In-process store with the same semantics (string keys' expiry included; lists, hashes and sorted sets are
    kept for the process's life), for the embedded fleet. Its clock is the monotonic one.

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
        self._subscribers: dict[str, list[queue.SimpleQueue[bytes]]] = collections.defaultdict(list)
        self._lock = threading.Condition()  # (an RLock inside: a transaction's function may call the store)

    def with_retry(self, retry_s: float) -> MemoryStore:
        return self

    def close(self) -> None:
        return None

    def set(self, key: str, value: bytes, ttl_s: float | None) -> None:
        self._write([Put(key, value, ttl_s)])

    def set_if_absent(self, key: str, value: bytes, ttl_s: float) -> bool:
        with self._lock:
            if self._get(key) is not None:
                return False
            self._apply(Put(key, value, ttl_s))
            return True

    def claim_after(self, writes: Sequence[Write], key: str, value: bytes, ttl_s: float) -> bytes | None:
        with self._lock:
            self._write(writes)
            held = self._get(key)
            if held is None:
                self._apply(Put(key, value, ttl_s))
            return held

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

    def exists_many(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [self._exists(k) for k in keys]

    def _exists(self, key: str) -> bool:
        return (self._get(key) is not None or bool(self._lists.get(key)) or bool(self._hashes.get(key))
                or bool(self._zsets.get(key)))

    def delete(self, key: str) -> None:
        self._write([Delete(key)])

    def expire(self, key: str, ttl_s: float) -> None:
        self._write([Expire(key, ttl_s)])

    def scan(self, pattern: str) -> list[str]:
        now = time.monotonic()
        with self._lock:
            names = [k for k, (_, exp) in self._data.items() if exp >= now] + [k for k, v in self._lists.items() if v]
            names += [k for k, v in self._hashes.items() if v]
            return [k for k in names if fnmatch.fnmatchcase(k, pattern)]

    def count(self, key: str, ttl_s: float) -> int:
        with self._lock:
            self._counts[key] += 1
            return self._counts[key]

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

    def hash_items(self, key: str) -> dict[str, bytes]:
        with self._lock:  # (the in-memory transport keeps no unacked record here: {} for those)
            return dict(self._hashes.get(key, {}))

    def hash_items_many(self, keys: list[str]) -> list[dict[str, bytes]]:
        with self._lock:
            return [dict(self._hashes.get(key, {})) for key in keys]

    def hash_fields(self, keys: list[str], fields: list[str]) -> list[list[bytes | None]]:
        with self._lock:
            return [[self._hashes.get(key, {}).get(f) for f in fields] for key in keys]

    def zset_range(self, zset: str, min_score: float, max_score: float) -> list[tuple[str, float]]:
        with self._lock:
            found = [(m, s) for m, s in self._zsets.get(zset, {}).items() if min_score <= s <= max_score]
        return sorted(found, key=lambda item: (item[1], item[0]))

    def zset_score(self, zset: str, member: str) -> float | None:
        with self._lock:
            return self._zsets.get(zset, {}).get(member)

    def now(self) -> float:
        return time.monotonic()

    def write_many(self, writes: Sequence[Write]) -> None:
        self._write(writes)

    def _write(self, writes: Sequence[Write]) -> None:
        with self._lock:
            for w in writes:
                self._apply(w)
            if any(isinstance(w, Push | Reply) for w in writes):
                self._lock.notify_all()

    def transaction(self, fn: Callable[[Transaction], T], watch: Sequence[str] = (), *, what: str) -> T:
        with self._lock:  # nobody writes meanwhile: nothing to watch
            txn = _MemoryTransaction(self)
            result = fn(txn)
            self._write(txn.writes)
            return result

    def publish(self, channel: str, message: bytes | str) -> None:
        data = message.encode() if isinstance(message, str) else bytes(message)
        with self._lock:
            for subscriber in self._subscribers.get(channel, ()):
                subscriber.put(data)

    def subscribe(self, channel: str) -> Subscription:
        inbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        with self._lock:
            self._subscribers[channel].append(inbox)
        return _MemorySubscription(self, channel, inbox)

    def _unsubscribe(self, channel: str, inbox: queue.SimpleQueue[bytes]) -> None:
        with self._lock:
            if inbox in self._subscribers.get(channel, ()):
                self._subscribers[channel].remove(inbox)

    def _apply(self, w: Write) -> None:
        """Apply one write; the caller holds the lock. TTLs are kept for string keys (and replies) only."""
        if isinstance(w, Push):
            items = self._lists[w.key]
            items.appendleft(bytes(w.value))
            while w.max_len is not None and len(items) > w.max_len:
                items.pop()
        elif isinstance(w, Reply):
            self._data[w.key] = (bytes(w.value), time.monotonic() + w.ttl_s)
            if w.inbox is not None:
                self._lists[w.inbox].appendleft(bytes(w.item))
        elif isinstance(w, Put):
            self._data[w.key] = (bytes(w.value), math.inf if w.ttl_s is None else time.monotonic() + w.ttl_s)
        elif isinstance(w, Delete):
            for table in (self._data, self._lists, self._hashes, self._zsets):
                table.pop(w.key, None)  # type: ignore[attr-defined]
        elif isinstance(w, Expire):
            value = self._get(w.key)
            if value is not None:
                self._data[w.key] = (value, time.monotonic() + w.ttl_s)
        elif isinstance(w, HashPut):
            self._hashes.setdefault(w.key, {}).update(
                {name: value.encode() if isinstance(value, str) else bytes(value) for name, value in w.fields.items()})
        elif isinstance(w, HashDelete):
            fields = self._hashes.get(w.key, {})
            for name in w.fields:
                fields.pop(name, None)
            if not fields:
                self._hashes.pop(w.key, None)  # as Redis: a hash without fields does not exist
        elif isinstance(w, HashIncr):
            fields = self._hashes.setdefault(w.key, {})
            fields[w.field] = str(int(fields.get(w.field, b"0")) + int(w.by)).encode()
        elif isinstance(w, ZAdd):
            members = self._zsets[w.key]
            old = members.get(w.member)
            if not (w.only_greater and old is not None and w.score <= old):
                members[w.member] = float(w.score)
        elif isinstance(w, ZRemove):
            members = self._zsets[w.key]
            for name in w.members:
                members.pop(name, None)
        elif isinstance(w, Publish):
            for subscriber in self._subscribers.get(w.channel, ()):
                subscriber.put(bytes(w.message))
        else:
            members = self._zsets[w.key]
            for name in [m for m, score in members.items() if score < w.score]:
                del members[name]


@dataclass
class _MemoryTransaction:
    store: MemoryStore
    writes: list[Write] = field(default_factory=list)

    def watch(self, *keys: str) -> None:
        return None

    def now(self) -> float:
        return time.monotonic()

    def get(self, key: str) -> bytes | None:
        return self.store._get(key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.store._get(key) for key in keys]

    def exists(self, key: str) -> bool:
        return self.store._exists(key)

    def hash_get(self, key: str, fields: Sequence[str]) -> list[bytes | None]:
        found = self.store._hashes.get(key, {})
        return [found.get(name) for name in fields]

    def hash_size(self, key: str) -> int:
        return len(self.store._hashes.get(key, {}))

    def zset_size(self, key: str) -> int:
        return len(self.store._zsets.get(key, {}))

    def zset_range(self, key: str, min_score: float, max_score: float) -> list[tuple[str, float]]:
        return self.store.zset_range(key, min_score, max_score)

    def write(self, *writes: Write) -> None:
        self.writes += writes


class _MemorySubscription:
    def __init__(self, store: MemoryStore, channel: str, inbox: queue.SimpleQueue[bytes]) -> None:
        self._store, self._channel, self._inbox = store, channel, inbox

    def get(self, timeout_s: float) -> bytes | None:
        try:
            return self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._store._unsubscribe(self._channel, self._inbox)

