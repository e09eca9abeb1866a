"""A connection to a fleet: the Celery app, the key-value store and the settings, opened together."""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis
from celery import Celery

from tinkerq import keys
from tinkerq.celery_app import make_celery
from tinkerq.errors import BrokerUnavailableError
from tinkerq.redis_client import redis_client
from tinkerq.settings import Settings
from tinkerq.store import KeyValueStore, MemoryStore, RedisStore
from tinkerq.wire.claimcheck import ClaimCheck


@dataclass
class Connection:
    settings: Settings
    app: Celery
    store: KeyValueStore

    @classmethod
    def open(cls, settings: Settings, *, retry_s: float | None = None) -> Connection:
        """Connect to the fleet ``settings`` names; fail fast with a clear error if Redis is unreachable.

        Once connected, Redis calls are retried through outages for ``retry_s`` (default
        ``settings.redis_retry_s``; workers pass their visibility timeout).
        """
        if settings.is_embedded:
            return cls(settings=settings, app=make_celery(settings), store=MemoryStore.shared())
        assert settings.broker_url is not None
        client = redis_client(settings)  # redis://, rediss:// (TLS), unix://, sentinel://
        try:
            client.ping()
        except redis.AuthenticationError as exc:
            raise BrokerUnavailableError(
                f"Redis at {redact_url(settings.broker_url)} refused the credentials ({exc}); "
                f"check the password in the broker URL (redis://:PASSWORD@host:port/db)"
            ) from None
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise BrokerUnavailableError(
                f"cannot reach Redis at {redact_url(settings.broker_url)} within {settings.connect_timeout_s:g} s "
                f"({exc}); start it or set --broker / TINKERQ_BROKER_URL to a reachable redis:// URL"
            ) from None
        except redis.ResponseError as exc:
            raise BrokerUnavailableError(f"Redis at {redact_url(settings.broker_url)} answered: {exc}") from None
        except redis.RedisError as exc:  # e.g. an HTTP server on that port: "Protocol Error: b'HTTP/1.1 400 ...'"
            raise BrokerUnavailableError(
                f"{redact_url(settings.broker_url)} answered, but not as Redis ({exc}); check the host and port"
            ) from None
        store = RedisStore(client, settings.redis_retry_s if retry_s is None else retry_s)
        return cls(settings=settings, app=make_celery(settings), store=store)

    def claim_check(self) -> ClaimCheck:
        s = self.settings
        return ClaimCheck(self.store, s.claim_check_bytes, s.blob_ttl_s, s.max_message_bytes)

    def workers_serving(self, base_model: str | None = None) -> list[dict]:
        """Live worker registrations (heartbeats), optionally for one base model."""
        found = []
        for key in self.store.scan(keys.serving_pattern(base_model)):
            raw = self.store.get(key)
            if raw:
                found.append(json.loads(raw))
        return found

    def close(self) -> None:
        self.app.close()
        if isinstance(self.store, RedisStore):
            self.store.client.close()


def redact_url(url: str) -> str:
    """A broker URL without its password, for error messages and logs."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
