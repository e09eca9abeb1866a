"""A TCP proxy that delays every byte by a fixed time in each direction: a slow network link on one machine.

``with DelayProxy(target_port, delay_s=0.010) as proxy:`` listens on ``proxy.port`` and forwards each connection
to ``127.0.0.1:target_port``; whatever one side sends reaches the other ``delay_s`` later (so a round trip through
it costs ``2 * delay_s`` more), in order, without limiting bandwidth. It runs an asyncio loop on its own thread.

Used by benchmarks/slow_link.py (a worker whose Redis sits behind such a link).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

BUFFER = 256 * 1024


class DelayProxy:
    def __init__(self, target_port: int, delay_s: float, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.delay_s = delay_s
        self.host = host
        self.port = 0  # set once listening
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, self.host, 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for task in list(self._tasks):
            task.cancel()

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._cut(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            self._tasks.discard(task)
            return
        try:
            await asyncio.gather(self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer))
        except asyncio.CancelledError:
            pass
        finally:
            for writer in (client_writer, server_writer):
                writer.close()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward ``reader`` to ``writer``, each chunk ``delay_s`` after it was read (a FIFO of due times)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(OSError):
                writer.write_eof()

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(BUFFER):
                queue.put_nowait((time.monotonic() + self.delay_s, data))
            queue.put_nowait((0.0, b""))
            await sender
        except OSError:  # a side went away (a worker stopped): the connection ends
            pass
        finally:
            sender.cancel()
