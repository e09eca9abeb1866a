"""Local redis-server setups beyond the plain one: a TLS server, and a primary + replica + sentinel.

Each runs as real redis-server processes on free ports, with their files in a temporary folder; the
pytest fixtures in tests/test_redis_modes.py stop them at teardown. The TLS server's certificate is
signed by a throwaway CA generated here with openssl, so clients verify it exactly as in production.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tinkerq.launcher.processes import free_port, redis_command, wait_for

MASTER_NAME = "mymaster"


def _require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise RuntimeError(f"{binary} is not installed: apt-get install -y {binary}")
    return path


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False


# -- TLS ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    ca: Path  # the CA's certificate: what clients trust (TINKERQ_TLS_CA_FILE)
    cert: Path  # the server's certificate, for 127.0.0.1 and localhost
    key: Path


def make_tls_files(folder: Path) -> TlsFiles:
    """A self-signed CA and a server certificate it signed, valid for 127.0.0.1 (hostnames are checked)."""
    openssl = _require("openssl")
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = folder / "ca.crt", folder / "ca.key"
    cert, key, csr = folder / "server.crt", folder / "server.key", folder / "server.csr"
    ext = folder / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]  # EC keys: instant to make
    for cmd in (
        [openssl, "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=tinkerq test CA"],
        [openssl, "req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        [openssl, "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
         "-days", "2", "-extfile", ext],
    ):
        subprocess.run([str(c) for c in cmd], check=True, capture_output=True, timeout=60)
    return TlsFiles(ca=ca, cert=cert, key=key)


@dataclass
class TlsRedis:
    proc: subprocess.Popen
    port: int
    files: TlsFiles

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        _stop(self.proc)


def start_tls_redis(folder: Path) -> TlsRedis:
    """A redis-server that speaks only TLS (``--port 0``), on a free port; answering PING when returned."""
    files = make_tls_files(folder / "certs")
    port = free_port()
    cmd = [
        *redis_command(0, folder),  # port 0: no plain TCP port at all
        "--tls-port", str(port), "--tls-cert-file", str(files.cert), "--tls-key-file", str(files.key),
        "--tls-ca-cert-file", str(files.ca), "--tls-auth-clients", "no",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    client = redis.Redis(port=port, ssl=True, ssl_ca_certs=str(files.ca), socket_connect_timeout=1)
    try:
        wait_for(lambda: _pings(client), 20, "TLS redis-server", proc, folder / "redis.log")
    except Exception:
        _stop(proc)
        raise
    finally:
        client.close()
    return TlsRedis(proc=proc, port=port, files=files)


# -- Sentinel -------------------------------------------------------------------------------------------


@dataclass
class SentinelSetup:
    """Redis nodes (initially: nodes[0] primary, the others its replicas) watched by sentinels."""

    folder: Path
    nodes: dict[int, subprocess.Popen] = field(default_factory=dict)  # port -> redis-server
    sentinels: dict[int, subprocess.Popen] = field(default_factory=dict)  # port -> redis-server --sentinel
    blocked_at_demotion: int = 0  # clients waiting in BRPOP on the old primary when failover() demoted it

    @property
    def url(self) -> str:
        """kombu's syntax: every sentinel, separated by ';'."""
        return ";".join(f"sentinel://127.0.0.1:{port}/0" for port in self.sentinels)

    def sentinel_client(self) -> redis.Redis:
        for port in self.sentinels:
            client = redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=1, decode_responses=True)
            if _pings(client):
                return client
            client.close()
        raise RuntimeError("no sentinel answers")

    def primary_port(self) -> int:
        """The port sentinel currently calls the primary."""
        client = self.sentinel_client()
        try:
            _, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
            return int(port)
        finally:
            client.close()

    def _ready(self, primary: int) -> bool:
        """Sentinel names ``primary``, which is a writable master, and knows a replica in sync with it."""
        try:
            if self.primary_port() != primary:
                return False
            node = redis.Redis(port=primary, socket_timeout=2)
            try:
                if node.info("replication")["role"] != "master":
                    return False
            finally:
                node.close()
            client = self.sentinel_client()
            try:
                replicas = client.execute_command("SENTINEL", "REPLICAS", MASTER_NAME)
            finally:
                client.close()
            return any(_replica_usable(r) for r in replicas)
        except (redis.RedisError, OSError, RuntimeError):
            return False

    def wait_ready(self, primary: int, timeout: float = 30.0) -> None:
        wait_for(lambda: self._ready(primary), timeout, f"sentinel setup with primary on port {primary}",
                 log=self.folder / "sentinel-0" / "sentinel.log")

    def failover(self, timeout: float = 30.0, *, when_blocked: bool = False, drop_clients: bool = True) -> int:
        """``SENTINEL FAILOVER``: a replica is promoted while the old primary still runs. Returns the new port.

        ``when_blocked``: demote the old primary only once its BRPOP clients (an idle worker's) all wait there,
        so that they get the ``UNBLOCKED`` error a demotion answers them with. ``drop_clients=False``:
        its clients stay connected to it, and learn of the demotion from its ``READONLY`` answers.
        """
        old = self.primary_port()
        client = self.sentinel_client()
        try:
            client.execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
        finally:
            client.close()
        new = self._wait_new_primary(old, timeout)
        # Sentinel demotes the old primary only when it next polls it (INFO every 10 s): until then it
        # stays a writable master, and clients still connected to it write where nobody reads (a real
        # split brain; docs/redis.md). Demote it now, the way Sentinel does (REPLICAOF, then drop the
        # clients so they reconnect through the sentinels), so the window is milliseconds, not seconds.
        self.blocked_at_demotion = self._demote(old, new, when_blocked=when_blocked, drop_clients=drop_clients)
        return new

    def _demote(self, port: int, primary: int, *, when_blocked: bool = False, drop_clients: bool = True) -> int:
        """``REPLICAOF primary`` on ``port``, then drop its clients as Sentinel does; returns how many clients
        were blocked (BRPOP, BLMPOP) there when it was demoted.

        The sentinels' own connections are spared: Sentinel never drops its own link (``CLIENT KILL`` skips
        the caller). Dropping it, as ``CLIENT KILL TYPE normal`` from here would, made the sentinel judge the
        *new* primary down a second later (+sdown right after +switch-master) and fail back over to this
        node, leaving two writable primaries for 10 s.
        """
        node = redis.Redis(port=port, socket_timeout=2, decode_responses=True)
        try:
            if when_blocked:  # every client whose last command was a blocking pop is waiting in it now
                def all_blocked() -> bool:
                    # BLMPOP: a worker's own queue is popped several messages at a time (worker/transport/intake.py)
                    waiting = [c for c in node.client_list() if c["cmd"] in ("brpop", "blmpop")]
                    return bool(waiting) and all("b" in c["flags"] for c in waiting)

                wait_for(all_blocked, 10, f"clients blocked in BRPOP/BLMPOP on port {port}")
            pipe = node.pipeline(transaction=True)  # counted at the very moment of the demotion
            pipe.info("clients")
            pipe.execute_command("REPLICAOF", "127.0.0.1", str(primary))
            blocked = int(pipe.execute()[0]["blocked_clients"])
            if not drop_clients:
                return blocked
            me = node.client_id()
            for client in node.client_list():
                if (client["name"].startswith("sentinel-") or int(client["id"]) == me
                        or set(client["flags"]) & {"S", "M"}):  # sentinels, this one, replication links
                    continue
                with contextlib.suppress(redis.ResponseError):  # gone meanwhile
                    node.execute_command("CLIENT", "KILL", "ID", client["id"])
            return blocked
        finally:
            node.close()

    def kill_primary(self, timeout: float = 30.0) -> int:
        """SIGKILL the primary (an outage, not a handover): sentinel promotes a replica. Returns the new port."""
        old = self.primary_port()
        self.nodes[old].send_signal(signal.SIGKILL)
        self.nodes[old].wait(10)
        return self._wait_new_primary(old, timeout)

    def _settled_port(self) -> int:
        """The primary's port in ``SENTINEL MASTER``, what redis-py's ``discover_master`` reads. During a
        failover ``GET-MASTER-ADDR-BY-NAME`` names the promoted replica a little earlier (from the moment it
        is promoted), while ``SENTINEL MASTER`` still names the old primary until the failover ends."""
        client = self.sentinel_client()
        try:
            return int(client.sentinel_master(MASTER_NAME)["port"])
        finally:
            client.close()

    def _wait_new_primary(self, old: int, timeout: float) -> int:
        """The new primary once the failover has ended: every sentinel query names it, and it is a master."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError, OSError, RuntimeError):
                port = self.primary_port()
                if port != old and self._settled_port() == port:
                    node = redis.Redis(port=port, socket_timeout=2)
                    try:
                        if node.info("replication")["role"] == "master":
                            return port
                    finally:
                        node.close()
            time.sleep(0.1)
        tail = (self.folder / "sentinel-0" / "sentinel.log").read_text()[-3000:]
        raise RuntimeError(f"sentinel did not promote a new primary within {timeout:g} s\n{tail}")

    def stop(self) -> None:
        for proc in [*self.sentinels.values(), *self.nodes.values()]:
            _stop(proc)

    def describe(self, pids: dict[int, str] | None = None) -> str:
        """What each node holds and who is connected to it, and the sentinel's last words: for a failure report.

        ``pids`` names processes (pid -> name) so each client in ``CLIENT LIST`` says whose it is.
        """
        owners = _socket_owners(pids or {})
        lines = []
        for port, proc in self.nodes.items():
            if proc.poll() is not None:
                lines.append(f"node {port}: exited ({proc.returncode})")
                continue
            node = redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=1, decode_responses=True)
            try:
                info = node.info("replication")
                sec, usec = node.time()
                beats = node.zrange("tinkerq:heartbeats", 0, -1, withscores=True)
                serving = sorted(node.scan_iter(match="tinkerq:serving:*", count=1000))
                lines.append(f"node {port}: role={info['role']} master_port={info.get('master_port')} "
                             f"link={info.get('master_link_status')} offset={info.get('master_repl_offset')}")
                lines.append(f"  heartbeats (age s): {[(m, round(sec + usec / 1e6 - t, 2)) for m, t in beats]}")
                lines.append(f"  registrations: {serving}")
                for client in node.client_list():
                    if client.get("name") == "" and client.get("cmd") == "client|list":
                        continue  # this very connection
                    peer = int(client["addr"].rsplit(":", 1)[1])
                    lines.append(f"  client {client['addr']} of {owners.get(peer, '?')}: flags={client['flags']} "
                                 f"cmd={client['cmd']} age={client['age']} idle={client['idle']}")
            except (redis.RedisError, OSError) as exc:
                lines.append(f"node {port}: {type(exc).__name__}: {exc}")
            finally:
                node.close()
        log = self.folder / "sentinel-0" / "sentinel.log"
        if log.exists():
            lines.append("sentinel log (tail):")
            lines += log.read_text().splitlines()[-25:]
        return "\n".join(lines)


def _socket_owners(pids: dict[int, str]) -> dict[int, str]:
    """Local TCP port -> the named process holding that socket (from ``ss -tnp``; empty without ss)."""
    try:
        out = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    owners = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 6 or "pid=" not in fields[-1]:
            continue
        pid = int(fields[-1].split("pid=", 1)[1].split(",", 1)[0])
        owners[int(fields[3].rsplit(":", 1)[1])] = pids.get(pid, f"pid {pid}")
    return owners


def _replica_usable(fields: dict | list) -> bool:
    # redis-py returns SENTINEL REPLICAS as dicts (parsed) or flat lists, depending on the version.
    info = fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2], strict=False))
    flags = str(info.get("flags", ""))
    link = info.get("master-link-status", info.get("master_link_status", ""))
    return "s_down" not in flags and "disconnected" not in flags and str(link) in ("ok", "True")


def _in_sync(port: int) -> bool:
    client = redis.Redis(port=port, socket_timeout=2, decode_responses=True)
    try:
        return client.info("replication").get("master_link_status") == "up"
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def start_sentinel_setup(folder: Path, *, replicas: int = 1, sentinels: int = 1) -> SentinelSetup:
    """A primary, ``replicas`` replicas of it and ``sentinels`` sentinels (quorum 1), all on free ports.

    Failure detection is fast (down-after 1 s) so a killed primary is replaced in a few seconds.
    """
    _require("redis-server")
    setup = SentinelSetup(folder=folder)
    try:
        primary = free_port()
        for i in range(1 + replicas):
            port = primary if i == 0 else free_port()
            workdir = folder / f"node-{i}"
            workdir.mkdir(parents=True, exist_ok=True)
            # A replica syncs at once (the default waits 5 s for more replicas to share a diskless sync).
            cmd = [*redis_command(port, workdir), "--repl-diskless-sync-delay", "0"]
            if i > 0:
                cmd += ["--replicaof", "127.0.0.1", str(primary)]
            setup.nodes[port] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                 start_new_session=True)
        for port, proc in setup.nodes.items():
            client = redis.Redis(port=port, socket_connect_timeout=1)
            try:
                wait_for(lambda c=client: _pings(c), 20, f"redis-server on port {port}", proc)
            finally:
                client.close()
        # Sentinels start once every replica is in sync: their first INFO of the primary then lists the
        # replicas (the next one comes 10 s later).
        for port in list(setup.nodes)[1:]:
            wait_for(lambda p=port: _in_sync(p), 20, f"replica on port {port}", setup.nodes[port])
        for i in range(sentinels):
            port = free_port()
            workdir = folder / f"sentinel-{i}"
            workdir.mkdir(parents=True, exist_ok=True)
            conf = workdir / "sentinel.conf"  # sentinel rewrites its config file: one each, writable
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {workdir}\nlogfile {workdir / 'sentinel.log'}\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary} 1\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} 1000\n"
                f"sentinel failover-timeout {MASTER_NAME} 5000\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            setup.sentinels[port] = subprocess.Popen(
                [_require("redis-server"), str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True)
        setup.wait_ready(primary)
    except Exception:
        setup.stop()
        raise
    return setup
