"""Redis connections from settings: one place that knows redis://, rediss:// (TLS), unix:// and sentinel://.

Two consumers need the same URL turned into working connections, and they must agree:

* tinkerq's own keys (claim-checked payloads, replies, registrations, heartbeats, dead letters) go
  through a redis-py client, :func:`redis_client`;
* Celery's broker (kombu) reads the URL itself, but needs the Sentinel master name and the TLS
  certificates as configuration, :func:`celery_redis_options`.

Sentinel URLs use kombu's syntax, so the same string works for both:
``sentinel://[[user]:password@]host:port[/db][;sentinel://host2:port2...]``. The password (and the db)
come from the first address and are the *data* nodes' credentials; the sentinels themselves are asked
without a password, as kombu and Celery do. The master's name is ``settings.sentinel_master``.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import redis
from redis.sentinel import Sentinel, SentinelManagedConnection

from tinkerq.settings import SettingsError

if TYPE_CHECKING:
    from tinkerq.settings import Settings

SENTINEL_SCHEME = "sentinel://"
TLS_SCHEME = "rediss://"
SENTINEL_URL_HELP = (
    "sentinel://[:password@]host:port[/db][;sentinel://host2:port2...] (the master's name comes from "
    "TINKERQ_SENTINEL_MASTER)"
)


def is_sentinel(url: str | None) -> bool:
    return bool(url) and url.startswith(SENTINEL_SCHEME)  # type: ignore[union-attr]


def is_tls(url: str | None) -> bool:
    return bool(url) and url.startswith(TLS_SCHEME)  # type: ignore[union-attr]


@dataclass(frozen=True)
class SentinelAddress:
    """A parsed ``sentinel://`` URL: where the sentinels are, and how to log in to the master they name."""

    sentinels: list[tuple[str, int]]
    username: str | None
    password: str | None
    db: int


def parse_sentinel_url(url: str) -> SentinelAddress:
    """Split kombu's ``;``-separated sentinel URL; a malformed one is a :class:`SettingsError`."""
    chunks = [c for c in url.split(";") if c.strip()]
    sentinels: list[tuple[str, int]] = []
    first = None
    for chunk in chunks:
        chunk = chunk.strip()
        if not chunk.startswith(SENTINEL_SCHEME):
            raise SettingsError(f"{_redact(url)}: every address must start with sentinel://; use {SENTINEL_URL_HELP}")
        try:
            parts = urlsplit(chunk)
            port = parts.port or 26379
        except ValueError as exc:
            raise SettingsError(f"{_redact(url)}: {exc}; use {SENTINEL_URL_HELP}") from None
        if not parts.hostname:
            raise SettingsError(f"{_redact(url)}: an address has no host; use {SENTINEL_URL_HELP}")
        sentinels.append((parts.hostname, port))
        first = first or parts
    if first is None:
        raise SettingsError(f"{_redact(url)} names no sentinel; use {SENTINEL_URL_HELP}")
    db_text = first.path.strip("/") or "0"
    if not db_text.isdigit():
        raise SettingsError(f"{_redact(url)}: database {db_text!r} is not a number; use {SENTINEL_URL_HELP}")
    return SentinelAddress(
        sentinels=sentinels,
        username=unquote(first.username) if first.username else None,
        password=unquote(first.password) if first.password else None,
        db=int(db_text),
    )


def check_tls_files(settings: Settings) -> None:
    """Certificate files named in settings must exist, and a client certificate needs its key (and back)."""
    for env, path in (("TINKERQ_TLS_CA_FILE", settings.tls_ca_file), ("TINKERQ_TLS_CERT_FILE", settings.tls_cert_file),
                      ("TINKERQ_TLS_KEY_FILE", settings.tls_key_file)):
        if path and not Path(path).is_file():
            raise SettingsError(
                f"{env}={path!r}: no such file; a rediss:// URL needs the PEM file of the CA that signed the "
                f"Redis server's certificate (or leave {env} empty to use the system's trusted CAs)"
                if env == "TINKERQ_TLS_CA_FILE" else f"{env}={path!r}: no such file"
            )
    if bool(settings.tls_cert_file) != bool(settings.tls_key_file):
        raise SettingsError(
            "a TLS client certificate needs both TINKERQ_TLS_CERT_FILE and TINKERQ_TLS_KEY_FILE (PEM files); "
            "set both, or neither if the server does not ask for client certificates"
        )


def ssl_options(settings: Settings) -> dict[str, Any]:
    """redis-py's (and kombu's, and Celery's) TLS keyword arguments: the server's certificate is verified.

    Without a CA file the system's trusted CAs verify it (managed Redis services); never CERT_NONE, which
    kombu would otherwise pick silently for a bare rediss:// URL.
    """
    options: dict[str, Any] = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    if settings.tls_ca_file:
        options["ssl_ca_certs"] = settings.tls_ca_file
    if settings.tls_cert_file:
        options["ssl_certfile"] = settings.tls_cert_file
        options["ssl_keyfile"] = settings.tls_key_file
    return options


def _timeouts(settings: Settings) -> dict[str, float]:
    # Connecting fails fast; a command may take longer (a large claim-checked payload on a slow link).
    return {"socket_connect_timeout": settings.connect_timeout_s,
            "socket_timeout": max(settings.connect_timeout_s, 30.0)}


class SentinelMasterConnection(SentinelManagedConnection):
    """A connection to whichever node the sentinels call master, *every* time it connects.

    redis-py asks the sentinels only when the pool hands out a connection that is not connected. A
    connection dropped while in use (a ``READONLY`` answer from a demoted primary drops it) reconnects on
    its next command to the address it had: the demoted node, which serves reads and refuses every write,
    until something drops the connection again. kombu's restore of unacknowledged messages, a ``WATCH``
    transaction retried on every ``WatchError``, then spun forever in the worker's consumer: each ``EXEC``
    failed ``READONLY`` there, and the pipeline's ``UNWATCH`` reconnected to the same node. The worker
    stopped consuming (and so stopped beating) after every failover that demoted a running primary.
    """

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self._sock:
            self.connect()  # through the sentinels (SentinelManagedConnection.connect), not to the last address
        super().send_packed_command(command, check_health=check_health)


class SentinelMasterRedis(redis.Redis):
    """A client of whichever node the sentinels call master; closing it also closes the sentinel connections.

    ``Sentinel.master_for`` leaves those connections to the caller, and ``Connection.close`` only knows
    the client.
    """

    sentinel_manager: Sentinel | None = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            manager, self.sentinel_manager = self.sentinel_manager, None
            if manager is not None:
                manager.close()


def redis_client(settings: Settings, url: str | None = None) -> redis.Redis:
    """A redis-py client for ``url`` (default: the broker URL) configured from ``settings``.

    Connects lazily: the first command (``ping``) reports an unreachable server. A ``sentinel://`` client
    asks the sentinels for the current master on every new connection, so after a failover it follows the
    new master (a command that hits the demoted one fails over to it on redis-py's retry).
    """
    url = url or settings.broker_url
    if not url:
        raise SettingsError("no broker configured: pass --broker redis://host:6379/0 or set TINKERQ_BROKER_URL")
    timeouts = _timeouts(settings)
    if is_sentinel(url):
        address = parse_sentinel_url(url)
        # sentinel_kwargs: the sentinels get the timeouts but not the data nodes' password.
        manager = Sentinel(address.sentinels, sentinel_kwargs=dict(timeouts),
                           socket_connect_timeout=timeouts["socket_connect_timeout"],
                           socket_timeout=timeouts["socket_timeout"])
        client = manager.master_for(settings.sentinel_master, redis_class=SentinelMasterRedis,
                                    connection_class=SentinelMasterConnection, username=address.username,
                                    password=address.password, db=address.db)
        client.sentinel_manager = manager
        return client
    extra = ssl_options(settings) if is_tls(url) else {}
    return redis.Redis.from_url(url, **timeouts, **extra)


def local_server_answers(port: int, password: str | None = None) -> bool:
    """Whether a Redis server on 127.0.0.1:``port`` answers PING (one the launcher is starting)."""
    client = redis.Redis(port=port, password=password, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.AuthenticationError, redis.ResponseError):
        return False
    finally:
        client.close()


def celery_redis_options(settings: Settings) -> dict[str, dict[str, Any]]:
    """Celery configuration that the broker URL needs beyond the URL itself (there is no Celery result
    backend: replies travel through tinkerq's own inboxes).

    Every value is a dict, to be merged into what ``app.conf`` already holds for that key (transport
    options carry other settings too). kombu's SentinelChannel and Celery's SentinelBackend both read the
    master's name from ``master_name`` in their transport options; kombu takes TLS options from
    ``broker_use_ssl``, Celery's backend from ``redis_backend_use_ssl`` (and refuses a rediss:// backend
    without ``ssl_cert_reqs``).
    """
    if settings.is_embedded:
        return {}
    options: dict[str, dict[str, Any]] = {}
    broker = settings.broker_url
    if is_sentinel(broker):
        options["broker_transport_options"] = {"master_name": settings.sentinel_master}
    if is_tls(broker):
        options["broker_use_ssl"] = ssl_options(settings)
    return options


def _redact(url: str) -> str:
    # The password never reaches an error message (same rule as tinkerq.connection.redact_url).
    return ";".join(
        f"{c.split('://', 1)[0]}://***@{c.rsplit('@', 1)[1]}" if "@" in c and "://" in c else c
        for c in url.split(";")
    )
