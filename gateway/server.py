"""``tinkerq gateway``: serve Tinker's HTTP API (for the official SDK) in front of a fleet's Redis."""

from __future__ import annotations

import logging

import uvicorn

from tinkerq.errors import TinkerqError
from tinkerq.gateway.app import BodyLimit, create_app
from tinkerq.gateway.service import Gateway
from tinkerq.settings import Settings

log = logging.getLogger("tinkerq.gateway")


def serve(settings: Settings, *, host: str = "127.0.0.1", port: int = 8000) -> int:
    if settings.broker_url is None or settings.broker_url.startswith("memory://"):
        raise TinkerqError("the gateway needs the fleet's Redis: pass --broker redis://... or set TINKERQ_BROKER_URL")
    app = BodyLimit(create_app(lambda: Gateway(settings)), settings.max_message_bytes)
    log.info("tinkerq gateway on http://%s:%d (point the SDK at it: TINKER_BASE_URL=http://%s:%d)",
             host, port, host, port)
    # One process per gateway; run several behind a load balancer (all state is in Redis: docs/gateway.md).
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=False, timeout_keep_alive=75)
    return 0
