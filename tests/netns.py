"""Several "hosts" on this machine: Linux network namespaces joined by a bridge (tests/test_multihost.py).

    root namespace: bridge tq<pid>br, address 10.213.X.1/24 (the test process, Redis)
        ├── veth tq<pid>a0 ══ tqnet0 in namespace tqmh<pid>-a, 10.213.X.2  ("host a")
        └── veth tq<pid>b0 ══ tqnet0 in namespace tqmh<pid>-b, 10.213.X.3  ("host b")

A process started with :meth:`Hosts.command` runs inside its host's namespace: its only interfaces are its own
loopback and ``tqnet0``, so it reaches the others (and the root namespace) over the veth addresses only.
Every host's interface has the same name, ``tqnet0``: one ``GLOO_SOCKET_IFNAME`` serves them all.

X is picked at random among the /24s of 10.213.0.0/16 that no interface or route of this machine uses. The
names carry the creating pid, so parallel test sessions do not collide. :meth:`Hosts.down` kills what still
runs in the namespaces and deletes them, the veths and the bridge; each step is tried whatever failed before.
What a test session killed outright (SIGKILL: no finalizer ran) left behind is swept by the next :meth:`Hosts.up`
(:func:`sweep_stale`: namespaces whose creating process is gone).
This needs root (CAP_NET_ADMIN): :func:`unavailable` says why it cannot run, for a skip.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import time

IFNAME = "tqnet0"  # every host's interface, inside its namespace


def _ip(*args: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {result.stderr.strip()}")
    return result


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (not root, no `ip`, a kernel that refuses), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root"
    name = f"tqprobe-{os.getpid()}"
    try:
        result = _ip("netns", "add", name, check=False)
    except FileNotFoundError:
        return "`ip` (iproute2) is not installed: apt-get install -y iproute2"
    if result.returncode != 0:
        return f"`ip netns add` failed: {result.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _free_subnet() -> str:
    """'10.213.X' for an X no address or route of this machine uses."""
    used = _ip("-o", "addr").stdout + _ip("route").stdout
    candidates = [x for x in range(2, 250) if f"10.213.{x}." not in used]
    random.shuffle(candidates)
    if not candidates:
        raise RuntimeError("no free /24 in 10.213.0.0/16")
    return f"10.213.{candidates[0]}"


def _kill_all_in(ns: str) -> None:
    pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _ip("netns", "pids", ns, check=False).stdout.split():
        time.sleep(0.1)


def sweep_stale() -> None:
    """Remove the namespaces (with what runs in them, their veths) and bridges of test sessions that are gone."""
    listed = re.findall(r"^tqmh(\d+)-(\w+)", _ip("netns", "list", check=False).stdout, re.M)
    live = {pid for pid, _ in listed if os.path.exists(f"/proc/{pid}")}
    for pid, name in listed:
        if pid in live:
            continue
        _kill_all_in(f"tqmh{pid}-{name}")
        _ip("link", "del", f"tq{int(pid) % 100000}{name}0", check=False)
        _ip("netns", "del", f"tqmh{pid}-{name}", check=False)
    for pid in {pid for pid, _ in listed} - live:
        _ip("link", "del", f"tq{int(pid) % 100000}br", check=False)


class Hosts:
    """Namespaces ``names`` (one letter each, e.g. "a", "b"), up when :meth:`up` returns."""

    def __init__(self, names: list[str]) -> None:
        self.tag = f"tq{os.getpid() % 100000}"  # interface names: 15 characters at most
        self.names = list(names)
        self.subnet = _free_subnet()
        self.bridge = f"{self.tag}br"
        self.gateway = f"{self.subnet}.1"  # the root namespace's address on the bridge
        self.addresses = {name: f"{self.subnet}.{i + 2}" for i, name in enumerate(self.names)}

    def netns(self, name: str) -> str:
        return f"tqmh{os.getpid()}-{name}"

    def veth(self, name: str) -> str:
        """The root namespace's end of ``name``'s link (what :meth:`cut` takes down)."""
        return f"{self.tag}{name}0"

    def up(self) -> Hosts:
        sweep_stale()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for name in self.names:
                ns = self.netns(name)
                _ip("netns", "add", ns)
                _ip("link", "add", self.veth(name), "type", "veth", "peer", "name", IFNAME, "netns", ns)
                _ip("link", "set", self.veth(name), "master", self.bridge)
                _ip("link", "set", self.veth(name), "up")
                _ip("addr", "add", f"{self.addresses[name]}/24", "dev", IFNAME, netns=ns)
                _ip("link", "set", IFNAME, "up", netns=ns)
                _ip("link", "set", "lo", "up", netns=ns)
        except BaseException:
            self.down()
            raise
        return self

    def command(self, name: str, cmd: list[str]) -> list[str]:
        """``cmd`` run inside host ``name``'s namespace."""
        return ["ip", "netns", "exec", self.netns(name), *cmd]

    def cut(self, name: str) -> None:
        """Take host ``name``'s link down: nothing reaches it or leaves it (no RST either: packets vanish)."""
        _ip("link", "set", self.veth(name), "down")

    def restore(self, name: str) -> None:
        _ip("link", "set", self.veth(name), "up")
        _ip("link", "set", self.veth(name), "master", self.bridge)

    def pids(self, name: str) -> list[int]:
        result = _ip("netns", "pids", self.netns(name), check=False)
        return [int(p) for p in result.stdout.split()]

    def sockets(self, name: str) -> str:
        """`ss -tn` inside host ``name``: its TCP connections, to check which addresses they use."""
        return subprocess.run(["ip", "netns", "exec", self.netns(name), "ss", "-tnp"], capture_output=True,
                              text=True, timeout=30).stdout

    def down(self) -> None:
        """Kill whatever still runs in the namespaces, then delete them, the veths and the bridge."""
        for name in self.names:
            _kill_all_in(self.netns(name))
        for name in self.names:
            _ip("link", "del", self.veth(name), check=False)  # deletes its peer in the namespace too
            _ip("netns", "del", self.netns(name), check=False)
        _ip("link", "del", self.bridge, check=False)
