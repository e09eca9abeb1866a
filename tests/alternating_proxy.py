"""A test-only HTTP reverse proxy that sends each request to the next gateway in turn (per request, not per
connection, so one SDK client alternates between gateways on every call; each path takes its own turns, so two
forward_backward submissions always reach two gateways, whatever polls came between them). A gateway that refuses the
connection is skipped, as a load balancer's health check would. Counts what each gateway served."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import Counter

import httpx
import uvicorn
from starlette.requests import Request
from starlette.responses import Response

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class AlternatingProxy:
    def __init__(self, backends: list[str], port: int) -> None:
        self.backends = backends
        self.port = port
        self.served: Counter[str] = Counter()
        self.log: list[tuple[str, str]] = []  # (path, gateway) of every request served
        self._turns: dict[str, itertools.count[int]] = {}  # path -> its own turn counter
        self._server = uvicorn.Server(uvicorn.Config(self._app, host="127.0.0.1", port=port, log_level="warning",
                                                     interface="asgi3", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> AlternatingProxy:
        self._thread.start()
        while not self._server.started:
            threading.Event().wait(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    async def _app(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        start = next(self._turns.setdefault(request.url.path, itertools.count()))
        response: Response = Response(b'{"detail": "no gateway is up"}', status_code=503)
        async with httpx.AsyncClient(timeout=60) as client:
            for i in range(len(self.backends)):
                backend = self.backends[(start + i) % len(self.backends)]
                try:
                    r = await client.request(request.method, backend + request.url.path + (
                        "?" + request.url.query if request.url.query else ""), content=body, headers=headers)
                except httpx.ConnectError:
                    await asyncio.sleep(0)
                    continue
                self.served[backend] += 1
                self.log.append((request.url.path, backend))
                response = Response(r.content, status_code=r.status_code, headers={
                    k: v for k, v in r.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}})
                break
        await response(scope, receive, send)
