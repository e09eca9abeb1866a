"""`tinkerq proxy` (launcher/proxy.py) against two tiny asyncio HTTP servers: round robin per connection, a
backend that refuses is skipped, 502 only when none accepts, and bodies pass untouched both ways.
`tests/test_fleet.py` runs it in front of real gateways (`fleet up --gateways 2`)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.test_fleet import hold_port
from tinkerq.launcher import proxy
from tinkerq.launcher.main import main as tinkerq_in_process
from tinkerq.launcher.processes import free_port

pytestmark = pytest.mark.timeout(60)


async def _backend(name: str) -> asyncio.Server:
    """An HTTP server answering each request with its own name, the request body's length and its last bytes."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await reader.readexactly(length)
        out = json.dumps({"backend": name, "length": len(body), "tail": body[-8:].decode()}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (len(out), out))
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", free_port())


async def _request(port: int, body: bytes = b"") -> tuple[int, dict]:
    """POST ``body`` through a new connection to 127.0.0.1:``port``: the status and the JSON answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /api/v1/healthz HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    raw = await reader.read()  # the server closes after its answer
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def _port(server: asyncio.Server) -> int:
    return int(server.sockets[0].getsockname()[1])


def test_round_robin_skips_a_refusing_backend_and_answers_502_when_none_accepts():
    async def scenario() -> None:
        a, b = await _backend("a"), await _backend("b")
        listen = ("127.0.0.1", free_port())
        front = await proxy.start(listen, [("127.0.0.1", _port(a)), ("127.0.0.1", _port(b))])
        try:
            # One connection each, in turn.
            answers = [await _request(listen[1]) for _ in range(4)]
            assert [(status, out["backend"]) for status, out in answers] == [(200, "a"), (200, "b")] * 2

            # A body larger than the proxy's buffer, both ways intact.
            body = bytes(range(256)) * 4096 + b"the-end!"
            status, out = await _request(listen[1], body)
            assert status == 200 and out["length"] == len(body) and out["tail"] == "the-end!"

            # Backend a stops listening (a gateway being restarted): every connection is served by b.
            a.close()
            await a.wait_closed()
            answers = [await _request(listen[1]) for _ in range(4)]
            assert [(status, out["backend"]) for status, out in answers] == [(200, "b")] * 4

            # None accepts: the client gets an HTTP answer it can retry on, not a reset.
            b.close()
            await b.wait_closed()
            status, out = await _request(listen[1])
            assert status == 502 and "no gateway behind this proxy" in out["detail"]
        finally:
            front.close()
            await front.wait_closed()

    asyncio.run(scenario())


def test_the_serving_proxy_gives_freed_memory_back_periodically(monkeypatch):
    """`tinkerq proxy` (serve) trims its heap every TRIM_EVERY_S while it serves, and stops when it stops."""
    trims: list[float] = []
    monkeypatch.setattr(proxy, "TRIM_EVERY_S", 0.05)
    monkeypatch.setattr(proxy, "trim_heap", lambda: trims.append(asyncio.get_running_loop().time()))

    async def scenario() -> None:
        b = await _backend("b")
        listen = ("127.0.0.1", free_port())
        serving = asyncio.ensure_future(proxy.serve(listen, [("127.0.0.1", _port(b))]))
        await asyncio.sleep(0.5)
        status, out = await _request(listen[1])  # still serving between trims
        assert status == 200 and out["backend"] == "b"
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving
        after_stop = len(trims)
        await asyncio.sleep(0.2)
        assert len(trims) == after_stop  # the trims stopped with the proxy
        b.close()
        await b.wait_closed()

    asyncio.run(scenario())
    assert len(trims) >= 3, trims


def test_trim_heap_returns_freed_memory_on_glibc():
    from tinkerq import allocator
    from tinkerq.worker.memory.free import rss_bytes

    if allocator.GLIBC is None:
        pytest.skip("malloc_trim is glibc's")
    allocator.trim_heap()
    before = rss_bytes()
    blocks = [bytearray(1000 + i % 3000) for i in range(60_000)]  # ~150 MB of small heap blocks
    del blocks[::2]
    kept = blocks[::50]  # scattered survivors pin pages: what a fragmented heap looks like
    del blocks
    grown = rss_bytes() - before
    allocator.trim_heap()
    assert rss_bytes() - before < grown / 2, (grown, rss_bytes() - before)
    del kept


def test_proxy_command_line_mistakes_are_one_line(capsys):
    port = free_port()
    cases = [
        (["--listen", "nowhere", "--backend", "127.0.0.1:1"], "--listen 'nowhere' is not HOST:PORT"),
        (["--listen", "127.0.0.1:1", "--backend", "127.0.0.1:99999"], "--backend '127.0.0.1:99999' is not HOST:PORT"),
        ([f"--listen=127.0.0.1:{port}", f"--backend=127.0.0.1:{port}"], "is also a --backend"),
    ]
    held = hold_port(port)
    assert held is not None
    try:
        cases.append(([f"--listen=127.0.0.1:{port}", "--backend=127.0.0.1:1"], f"cannot listen on 127.0.0.1:{port} "
                                                                               f"(taken)"))
        for args, expected in cases:
            assert tinkerq_in_process(["proxy", *args]) == 2
            err = capsys.readouterr().err
            assert expected in err and err.count("\n") == 1, err
    finally:
        held.close()
