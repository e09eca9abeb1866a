"""The tenants' web console: ``GET /console``, a static page that reads the gateway's JSON with the user's API key.

The page (gateway/console_static/: HTML, CSS and plain JS, no build step, nothing fetched from elsewhere) asks for
an API key, keeps it in the tab's ``sessionStorage`` only (never a cookie, never a URL) and sends it as
``X-API-Key`` like the SDK does, so every number it shows comes from routes that answer per key: the SDK's
REST routes (training runs, their checkpoints, deletion, publishing and downloads where the gateway has them)
and the two console routes here: an overview (the key's runs, sessions, quota and what it uses, its requests
waiting in the queue) and a run's metrics step by step (gateway/run_metrics.py), which the page plots.

Every path under /console serves the same page, so the SDK's console links (tinker.lib.console_urls:
``/training_runs/<id>``, ``/sessions/<id>``, ``/checkpoints/<run>/<checkpoint>``) open the matching view once
their base is the gateway's ``/console`` (tinkerq/sdk_console.py).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.routing import Route

from tinkerq import keys, usage
from tinkerq.gateway import lookups

if TYPE_CHECKING:
    from tinkerq.gateway.service import Gateway

STATIC = {"console.js": "text/javascript", "console.css": "text/css"}  # the only files served besides the page
USAGE_WINDOW_S = 48 * 3600  # the hourly usage the page plots
QUEUE_SHOWN = 50  # waiting requests listed (all are counted)
RUNS_SHOWN = 200  # newest training runs listed (each costs a scan of its checkpoints; all are counted)

# The page runs only its own script and style, talks only to this origin, and is never framed.
HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "cache-control": "no-store",
}

# Checkpoint actions, as the routes that serve them: the page offers an action only when its route exists.
ACTIONS = {
    "delete": ("DELETE", re.compile(r"^/api/v1/training_runs/[^/]+/checkpoints/[^/]+$")),
    "publish": ("POST", re.compile(r"^/api/v1/training_runs/[^/]+/checkpoints/.+/publish$")),
    "unpublish": ("DELETE", re.compile(r"^/api/v1/training_runs/[^/]+/checkpoints/.+/publish$")),
    "download": ("GET", re.compile(r"^/api/v1/training_runs/[^/]+/checkpoints/.+/external_weights_urls$")),
}


def _asset(name: str) -> bytes:
    return resources.files("tinkerq.gateway").joinpath("console_static", name).read_bytes()


def add_routes(app: FastAPI, gateway: Callable[[], Gateway], tenant: Any) -> None:
    """The console's page, its two files, and its two JSON routes (behind ``tenant``, the API-key check)."""
    page = _asset("index.html")

    @app.get("/console/static/{name}")
    async def console_static(name: str) -> Response:
        if name not in STATIC:  # a fixed list: nothing from the URL reaches the filesystem
            return Response(b"not found", status_code=404, media_type="text/plain")
        return Response(_asset(name), media_type=STATIC[name], headers=HEADERS)

    @app.get("/console")
    @app.get("/console/{view:path}")
    async def console_page(view: str = "") -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=HEADERS)

    @app.get("/api/v1/console/overview")
    def console_overview(t: str = tenant) -> dict[str, Any]:  # sync: FastAPI runs it in a thread (Redis reads)
        return overview(gateway(), t, actions(app))

    @app.get("/api/v1/console/training_runs/{run_id}/metrics")
    def console_metrics(run_id: str, t: str = tenant) -> dict[str, Any]:
        gw = gateway()
        gw.lookup(lookups.training_run, t, run_id)  # 404 unless the key's own run
        return {"training_run_id": run_id, "points": gw.run_metrics.points(run_id)}


def actions(app: FastAPI) -> dict[str, bool]:
    """Which checkpoint actions this gateway serves (routes other modules add, or not)."""
    served = {(method, route.path) for route in app.routes if isinstance(route, Route)
              for method in route.methods or ()}
    return {name: any(m == method and pattern.match(path) for m, path in served)
            for name, (method, pattern) in ACTIONS.items()}


def overview(gw: Gateway, tenant: str, served: dict[str, bool]) -> dict[str, Any]:
    """Everything the console's first screen shows, for one API key."""
    records = gw.records
    run_records = sorted(records.scan("run", tenant), key=lambda r: r["created"], reverse=True)
    runs = [{**lookups.training_run_view(records, r), "session_id": r.get("session_id"),
             "created": lookups.iso(r["created"]), "closed": bool(r.get("closed"))} for r in run_records[:RUNS_SHOWN]]
    per_session = Counter(r.get("session_id") for r in run_records)
    found = records.scan_items("session", tenant)
    sessions = sorted((_session_view(sid, s, per_session.get(sid, 0)) for sid, s in found),
                      key=lambda s: str(s["created"]), reverse=True)
    limits = gw.quotas.limits(tenant)
    since = time.time() - USAGE_WINDOW_S
    hourly = [{"hour": lookups.iso(row.hour), **row.counts} for row in gw.usage.rows(tenant, since=since)]
    checkpoints = records.scan("checkpoint", tenant)
    return {
        "tenant": tenant, "training_runs": runs, "training_runs_total": len(run_records), "sessions": sessions,
        "actions": served,
        "quota": {"limits": limits.as_dict(), "in_use": {
            "max_training_clients": len(gw.quotas.training_clients(tenant)),
            "max_sampling_inflight": gw.quotas.samples_inflight(tenant)}},
        "usage": {"since": lookups.iso(since), "totals": usage.sum_counts(row.counts for row in gw.usage.rows(
            tenant, since=since)), "hourly": hourly},
        "storage": {"checkpoints": len(checkpoints), "bytes": sum(int(c.get("bytes") or 0) for c in checkpoints)},
        "queue": queue(gw, tenant),
    }


def queue(gw: Gateway, tenant: str) -> dict[str, Any]:
    """The key's requests not answered yet (by state, as the SDK's polls report them) and the fleet's workers per
    model (counts only: hosts and pids are the operator's)."""
    futures = gw.records.scan_items("future", tenant)
    answered = gw.store.exists_many([keys.gateway_answer(request_id) for request_id, _ in futures])
    now = time.time()
    waiting = sorted((_waiting_view(rid, f, now) for (rid, f), done in zip(futures, answered, strict=True) if not done),
                     key=lambda w: -float(w["age_s"]))
    workers = Counter((w.get("base_model"), w.get("role", "trainer")) for w in gw.service.connection.workers_serving())
    return {"waiting": len(waiting), "by_state": dict(Counter(w["state"] for w in waiting)),
            "oldest": waiting[:QUEUE_SHOWN],
            "workers": [{"base_model": model, "role": role, "count": n}
                        for (model, role), n in sorted(workers.items())]}


def _session_view(session_id: str, record: dict[str, Any], training_runs: int) -> dict[str, Any]:
    beat = record.get("heartbeat_at")
    return {"session_id": session_id, "created": lookups.iso(record["created"]),
            "finished": bool(record.get("finished")), "last_heartbeat": None if beat is None else lookups.iso(beat),
            "tags": record.get("tags") or [], "user_metadata": lookups.str_map(record.get("user_metadata")),
            "training_runs": training_runs}


def _waiting_view(request_id: str, record: dict[str, Any], now: float) -> dict[str, Any]:
    return {"request_id": request_id, "kind": record.get("kind"), "state": record.get("state") or "active",
            "reason": record.get("reason"), "age_s": round(now - float(record.get("created") or now), 1)}
