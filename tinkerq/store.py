"""A small key-value store seam: Redis in a fleet, a dict in the embedded (one-process) fleet.

Used for claim-checked payloads and worker registrations; both need only set-with-TTL, get, delete
and a prefix scan.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from typing import Protocol

import redis


class KeyValueStore(Protocol):
    def set(self, key: str, value: bytes, ttl_s: float) -> None: ...
    def get(self, key: str) -> bytes | None: ...
    def delete(self, key: str) -> None: ...
    def scan(self, pattern: str) -> list[str]: ...


class RedisStore:
    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def set(self, key: str, value: bytes, ttl_s: float) -> None:
        self.client.set(key, value, px=max(1, int(ttl_s * 1000)))

    def get(self, key: str) -> bytes | None:
        return self.client.get(key)

    def delete(self, key: str) -> None:
        self.client.delete(key)

    def scan(self, pattern: str) -> list[str]:
        return [k.decode() if isinstance(k, bytes) else k for k in self.client.scan_iter(match=pattern)]


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
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes, ttl_s: float) -> None:
        with self._lock:
            self._data[key] = (bytes(value), time.monotonic() + ttl_s)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            item = self._data.get(key)
            if item is None:
                return None
            if item[1] < time.monotonic():
                del self._data[key]
                return None
            return item[0]

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    def scan(self, pattern: str) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return [k for k, (_, exp) in self._data.items() if exp >= now and fnmatch.fnmatchcase(k, pattern)]
