"""Warnings about how a process reaches its broker (docs/security.md says why each matters).

Whoever can log in to the fleet's Redis can read every tenant's payloads and replies, forge any request
and shut workers down, so a worker or Flower started against a broker without a password, or over plain
TCP to another host, says so loudly at start. Nothing here refuses to start: a private test Redis on
127.0.0.1 without a password is fine, and the operator decides.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import unquote, urlsplit

from tinkerq.connection import redact_url

_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere, so it counts as a network host


def _hosts(netloc: str) -> list[str]:
    """The host names of ``[user:password@]host[:port]`` (several, comma-separated, for sentinel URLs)."""
    hosts = []
    for part in netloc.rpartition("@")[2].split(","):
        part = part.strip()
        if part.startswith("["):  # [::1]:6379
            hosts.append(part[1:].split("]")[0])
        elif part:
            hosts.append(part.rsplit(":", 1)[0] if part.count(":") == 1 else part)
    return hosts


def broker_warnings(url: str | None) -> list[str]:
    """What is unsafe about reaching the broker at ``url``: one line each (empty: nothing to warn about).

    - no password (``redis://host/0``): anyone who reaches the port controls the fleet;
    - ``redis://`` to a host other than loopback: password, requests and replies cross the network in clear
      text (use ``rediss://``);
    - ``sentinel://`` to a host other than loopback: tinkerq speaks TLS only with ``rediss://``, so the
      sentinels and the master are reached in clear text.
    ``unix://`` (filesystem permissions guard it) and ``memory://`` (in-process) are fine. A sentinel URL
    (``sentinel://[:password@]host:port;sentinel://host2:port2``) is one broker: its password is the first
    address's, its hosts are all of them.
    """
    if not url:
        return []
    out: list[str] = []
    chunks = [u.strip() for u in url.split(";") if u.strip()]
    if chunks and chunks[0].lower().startswith("sentinel://"):
        chunks = [chunks[0]]  # the password comes from the first address; every address is a host
        hosts = [h for c in url.split(";") if c.strip() for h in _hosts(urlsplit(c.strip()).netloc)]
    else:
        hosts = []
    for one in chunks:
        scheme = one.split("://", 1)[0].lower() if "://" in one else ""
        shown = redact_url(url if scheme == "sentinel" else one)
        if scheme in ("memory", "unix", "redis+socket", "socket"):
            continue
        if scheme not in ("redis", "rediss", "sentinel"):
            out.append(f"broker {shown}: unknown scheme {scheme!r}; tinkerq expects redis://, rediss:// or unix://")
            continue
        netloc = urlsplit(one).netloc
        userinfo = netloc.rpartition("@")[0]
        password = unquote(userinfo.partition(":")[2]) if ":" in userinfo else ""
        if not password:
            out.append(
                f"broker {shown} has no password: anyone who can reach it can read every session's data, forge "
                f"requests and shut workers down. Start Redis with a password (requirepass or ACL users) and put "
                f"it in TINKERQ_BROKER_URL as redis://:PASSWORD@host:port/db (docs/security.md)")
        remote = [h for h in (hosts or _hosts(netloc)) if not _is_loopback(h)]
        if scheme == "redis" and remote:
            out.append(
                f"broker {shown} is reached over the network without TLS ({', '.join(remote)}): the password, "
                f"requests and replies cross it in clear text. Use rediss:// (Redis with tls-port) or keep "
                f"Redis on loopback behind an SSH tunnel (docs/security.md)")
        elif scheme == "sentinel" and remote:
            out.append(
                f"broker {shown}: the sentinels and the master ({', '.join(remote)}) are reached without TLS "
                f"(tinkerq uses TLS only with rediss://): the password, requests and replies cross the network "
                f"in clear text; keep them on a private network (docs/security.md)")
    return out


def password_in_argv(url: str | None) -> bool:
    """Whether a broker URL given on a command line holds a password (which every local user sees in ps)."""
    if not url:
        return False
    return any(urlsplit(u.strip()).password for u in url.split(";") if "://" in u)


def warn_about_broker(cli_broker: str | None, url: str | None) -> None:
    """Log what is unsafe about how this process reaches the broker: a password on the command line
    (``cli_broker``, what ``--broker`` gave), then :func:`broker_warnings` for the URL in use."""
    import logging

    if password_in_argv(cli_broker):
        logging.warning("--broker holds a password, which every user of this machine can read in the process "
                        "list; set TINKERQ_BROKER_URL in the environment instead")
    for warning in broker_warnings(url):
        logging.warning(warning)
