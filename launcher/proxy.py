"""`tinkerq proxy`: one address in front of several gateways, round robin per TCP connection.

`tinkerq fleet up --gateways N` starts N `tinkerq gateway` processes on private ports and this proxy on the
gateway port. Each client connection goes to the next backend in turn. A backend that refuses the connection
(a gateway being restarted) or does not accept it within CONNECT_TIMEOUT_S is skipped for the next one, so
clients do not see it; only when every backend fails does the client get a 502.

It works on bytes, not on HTTP: keep-alive connections, long polls (the SDK's retrieve_future waits up to 45 s)
and large request bodies pass untouched, and a connection stays on the backend it started on. That is enough
because the gateways keep their state in Redis: any gateway may serve any request.

Each connection is logged with the backend it went to, so the spread is visible in the proxy's log.

Every TRIM_EVERY_S the proxy gives its allocators' free memory back (tinkerq/allocator.py). Without it its RSS
crept up under the SDK's traffic (reads of every size fragment the heap) while its Python objects stayed flat
(tracemalloc): 61 to 70 MiB over the 10 minutes of benchmarks/tenants.py; 56.5 to 59.0 MiB over 150 s of 12 SDK
clients in a closed loop, where with the trims it stayed at 55.3-55.4 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging

from tinkerq.allocator import trim_heap
from tinkerq.errors import UserError

CONNECT_TIMEOUT_S = 5.0  # a backend that accepts nothing this long (hung, or its host gone) is skipped
TRIM_EVERY_S = 30.0  # gc + malloc_trim of a heap this small take a few milliseconds
BUFFER = 64 * 1024

log = logging.getLogger("tinkerq.proxy")

Address = tuple[str, int]


def add_proxy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="where clients connect, e.g. 127.0.0.1:8000")
    p.add_argument("--backend", action="append", required=True, metavar="HOST:PORT",
                   help="a gateway to pass connections to (repeat: round robin over them in the order given)")


def parse_address(text: str, flag: str) -> Address:
    """'HOST:PORT' (or '[v6]:PORT') as (host, port); a UserError naming ``flag`` otherwise."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{flag} {text!r} is not HOST:PORT: pass e.g. {flag} 127.0.0.1:8000")
    return host, int(port)


class RoundRobin:
    """The order in which to try the backends for the next connection: each starts one further along."""

    def __init__(self, backends: list[Address]) -> None:
        self.backends = backends
        self._starts = itertools.cycle(range(len(backends)))

    def order(self) -> list[Address]:
        start = next(self._starts)
        return self.backends[start:] + self.backends[:start]


async def _connect(order: list[Address]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Address] | None:
    """The first backend of ``order`` that accepts a connection, or None if none does."""
    for backend in order:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*backend), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            why = ("timed out" if isinstance(exc, asyncio.TimeoutError) else
                   "refused the connection" if isinstance(exc, ConnectionRefusedError) else str(exc))
            log.warning("backend %s:%s %s: skipped for the next", *backend, why)
            continue
        return reader, writer, backend
    return None


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, both: list[asyncio.StreamWriter]) -> None:
    """Copy ``src`` to ``dst`` until EOF, then pass the EOF on; on a reset, close both sides (which ends the other
    direction too)."""
    try:
        while data := await src.read(BUFFER):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof() and not dst.is_closing():
            dst.write_eof()
    except (OSError, RuntimeError):  # reset by a peer, or writing to a side already closed
        for writer in both:
            writer.close()


async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, rr: RoundRobin) -> None:
    """One client connection: spliced to the first backend (in round-robin order) that accepts it."""
    peer = client_writer.get_extra_info("peername")
    connected = await _connect(rr.order())
    if connected is None:
        log.error("no backend accepted the connection from %s: answered 502", peer)
        body = json.dumps({"detail": "no gateway behind this proxy accepts connections; try again shortly"})
        client_writer.write(f"HTTP/1.1 502 Bad Gateway\r\nContent-Type: application/json\r\nContent-Length: "
                            f"{len(body)}\r\nConnection: close\r\n\r\n{body}".encode())
        with contextlib.suppress(OSError):
            await client_writer.drain()
        client_writer.close()
        return
    reader, writer, backend = connected
    log.info("connection from %s:%s -> backend %s:%s", *(peer or ("?", "?"))[:2], *backend)
    both = [client_writer, writer]
    try:
        await asyncio.gather(_pipe(client_reader, writer, both), _pipe(reader, client_writer, both))
    finally:
        for w in both:
            w.close()


async def start(listen: Address, backends: list[Address]) -> asyncio.Server:
    """The proxy listening on ``listen`` (reusing a port in TIME_WAIT), passing connections to ``backends``."""
    rr = RoundRobin(backends)
    return await asyncio.start_server(lambda r, w: handle(r, w, rr), *listen, reuse_address=True)


async def _trim_periodically() -> None:
    while True:
        await asyncio.sleep(TRIM_EVERY_S)
        trim_heap()


async def serve(listen: Address, backends: list[Address]) -> None:
    server = await start(listen, backends)
    log.info("listening on %s:%s; round robin over %s", *listen, ", ".join(f"{h}:{p}" for h, p in backends))
    trimming = asyncio.ensure_future(_trim_periodically())
    try:
        async with server:
            await server.serve_forever()
    finally:
        trimming.cancel()


def run_proxy(args: argparse.Namespace) -> int:
    """`tinkerq proxy`: runs until stopped (SIGTERM, Ctrl-C)."""
    from tinkerq.launcher.processes import port_problem

    listen = parse_address(args.listen, "--listen")
    backends = [parse_address(b, "--backend") for b in args.backend]
    if listen in backends:
        raise UserError(f"--listen {args.listen} is also a --backend: the proxy would pass connections to itself")
    problem = port_problem(listen[1], listen[0])
    if problem:
        raise UserError(f"cannot listen on {args.listen} ({problem}): pass --listen with a free port")
    asyncio.run(serve(listen, backends))
    return 0
