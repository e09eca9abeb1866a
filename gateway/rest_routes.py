"""The HTTP routes of Tinker's session, checkpoint-management and audit REST calls (docs/gateway.md, "Sessions",
"Checkpoints across runs", "Publishing and expiry", "Copies", "The audit log").

Thin, as gateway/app.py: authenticate, read, hand to gateway/sessions.py, gateway/checkpoint_rest.py,
gateway/session_trace.py or tinkerq/audit.py (each call a Redis round trip or a file operation: on a thread).
Added before app.py's checkpoint deletion route, whose ``{checkpoint_id:path}`` would otherwise take
``.../publish`` for a checkpoint id.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import date
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tinkerq.audit import EVENT_TYPES
from tinkerq.gateway import checkpoint_rest, lookups, session_trace, sessions
from tinkerq.gateway.http_errors import HTTPError, not_found
from tinkerq.gateway.service import Gateway
from tinkerq.gateway.signing import BadToken

PFTRACE = "application/octet-stream"


def add_routes(app: FastAPI, gateway: Callable[[], Gateway], tenant: Any, body: Any) -> None:
    v1 = "/api/v1"

    async def call(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except lookups.NotFound as exc:
            raise not_found(exc.what, exc.ident) from None
        except ValueError as exc:  # a malformed query (gateway/sessions.py)
            raise HTTPError(400, str(exc)) from None

    # -- sessions -------------------------------------------------------------------------------------------

    @app.get(f"{v1}/sessions")
    async def list_sessions(limit: int = 20, offset: int = 0, t: str = tenant) -> dict[str, Any]:
        return await call(sessions.list_sessions, gateway().records, t, max(1, min(limit, 1000)), max(0, offset))

    @app.post(f"{v1}/sessions/search")
    async def search_sessions(t: str = tenant, query: dict[str, Any] = body) -> dict[str, Any]:
        return await call(sessions.search_sessions, gateway().records, t, query)

    @app.get(f"{v1}/sessions/{{session_id}}")
    async def get_session(session_id: str, t: str = tenant) -> dict[str, Any]:
        return await call(sessions.get_session, gateway().records, t, session_id)

    @app.put(f"{v1}/sessions/{{session_id}}/project")
    async def assign_project(session_id: str, t: str = tenant, request: dict[str, Any] = body) -> dict[str, Any]:
        project_id = request.get("project_id")
        await call(sessions.assign_project, gateway().records, t, session_id, project_id)
        await asyncio.to_thread(gateway().audit.record, t, "session_project_set", session_id=session_id,
                                project_id=project_id)
        return {}

    @app.get(f"{v1}/sessions/{{session_id}}/trace_export")
    async def trace_export(session_id: str, request: Request, t: str = tenant) -> dict[str, Any]:
        gw = gateway()
        await call(sessions.owned, gw.records, t, session_id)
        token, _ = await asyncio.to_thread(gw.signer.sign, session_trace.PURPOSE, t, session_trace.URL_LIFETIME_S,
                                           session_id=session_id)
        # Built when downloaded, from what is kept then: always up to date, nothing stored.
        return {"status": "ready", "url": f"{str(request.base_url).rstrip('/')}{v1}/session_traces/{token}"}

    @app.get(f"{v1}/session_traces/{{token}}")
    async def trace_file(token: str) -> Response:
        # No API key: the signed token in the URL is the permission (gateway/signing.py).
        gw = gateway()
        try:
            claims = await asyncio.to_thread(gw.signer.verify, token, session_trace.PURPOSE)
        except BadToken as exc:
            raise HTTPError(403, f"{exc}; ask for a new URL (export_session_trace)") from None
        session_id = str(claims["session_id"])
        await call(sessions.owned, gw.records, str(claims["sub"]), session_id)
        lines = await asyncio.to_thread(gw.session_trace.lines, session_id)
        return Response(session_trace.build(session_id, lines), media_type=PFTRACE,
                        headers={"content-disposition": f'attachment; filename="{session_id}.pftrace"'})

    # -- checkpoints across runs, publishing, expiry, copies ---------------------------------------------------

    @app.get(f"{v1}/checkpoints")
    async def user_checkpoints(limit: int = 100, offset: int = 0, t: str = tenant) -> dict[str, Any]:
        return await call(checkpoint_rest.list_user_checkpoints, gateway().records, t, max(1, min(limit, 1000)),
                          max(0, offset))

    @app.post(f"{v1}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/publish")
    async def publish(run_id: str, checkpoint_id: str, t: str = tenant) -> dict[str, Any]:
        gw = gateway()
        await call(checkpoint_rest.set_public, gw.records, gw.audit, t, run_id, checkpoint_id, True)
        return {}

    @app.delete(f"{v1}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/publish")
    async def unpublish(run_id: str, checkpoint_id: str, t: str = tenant) -> dict[str, Any]:
        gw = gateway()
        await call(checkpoint_rest.set_public, gw.records, gw.audit, t, run_id, checkpoint_id, False)
        return {}

    @app.put(f"{v1}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/ttl")
    async def set_ttl(run_id: str, checkpoint_id: str, t: str = tenant,
                      request: dict[str, Any] = body) -> dict[str, Any]:
        gw = gateway()
        await call(checkpoint_rest.set_ttl, gw.records, gw.audit, gw.settings.checkpoint_dir, t, run_id,
                   checkpoint_id, request.get("ttl_seconds"))
        return {}

    @app.post(f"{v1}/copy_weights")
    async def copy_weights(http: Request, t: str = tenant, request: dict[str, Any] = body) -> dict[str, Any]:
        gw = gateway()
        return await call(checkpoint_rest.copy, gw.records, gw.audit, gw.settings.checkpoint_dir, t, request,
                          http.headers.get("x-idempotency-key"))

    # -- the audit log -------------------------------------------------------------------------------------------

    @app.get(f"{v1}/audit")
    async def audit(event_type: str = "all", day: str | None = None, t: str = tenant) -> dict[str, Any]:
        if event_type not in EVENT_TYPES:
            raise HTTPError(400, f"event_type must be one of {sorted(EVENT_TYPES)}, got {event_type!r}")
        try:
            when = None if day is None else date.fromisoformat(day)
        except ValueError:
            raise HTTPError(400, f"day must be a date (YYYY-MM-DD), got {day!r}") from None
        return {"entries": await asyncio.to_thread(gateway().audit.entries, t, event_type, when)}
