"""The HTTP routes of Tinker's protocol (what SDK 0.38 sends; ../docs/gateway.md lists them).

Thin: each route authenticates the caller's API key, reads the body, and hands it to
:class:`gateway.service.Gateway`. Errors are ``{"detail": ...}`` bodies with the status the SDK treats as
final (400, 401, 404, 413, 422) or retryable (503) as fits.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import prometheus_client
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinkerq.errors import TinkerqError
from tinkerq.gateway import console, lookups
from tinkerq.gateway.auth import Credentials, Refused, credentials
from tinkerq.gateway.downloads import answer_file, answer_urls, stream
from tinkerq.gateway.futures import Waiting
from tinkerq.gateway.http_errors import HTTPError
from tinkerq.gateway.positions import SequenceGuard
from tinkerq.gateway.rest_routes import add_routes as add_rest_routes
from tinkerq.gateway.service import Gateway
from tinkerq.store import UNREACHABLE
from tinkerq.tenants import ApiKeys

log = logging.getLogger("tinkerq.gateway")

PROTOBUF = "application/x-protobuf"
AUTH_CACHE_S = 1.0  # a revoked key stops working within this long

# What /client/config tells the SDK besides the token exchange and the transport (those come from settings):
# uncompressed protobuf forward_backward bodies, the SDK's default chunking, and the plain sampling path (no
# retrieve_futures / join_sampling_session).
CLIENT_CONFIG = {
    "proto_compress_fwdbwd": False, "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False, "custom_loss_server_side": False,
}


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 before it is read into memory."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await _too_large(send, self.limit)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await _too_large(send, self.limit)


class _BodyTooLarge(Exception):
    pass


async def _too_large(send: Send, limit: int) -> None:
    body = json.dumps({"detail": f"request body over the gateway's limit of {limit} bytes; send fewer datums "
                                 f"per request"}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def create_app(gateway_factory: Callable[[], Gateway]) -> FastAPI:
    """The ASGI app; ``gateway_factory`` runs at start-up (inside the server's event loop)."""
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        gw = gateway_factory()
        gw.start()
        state["gateway"], state["keys"] = gw, ApiKeys(gw.store, cache_s=AUTH_CACHE_S)
        state["credentials"] = Credentials(state["keys"], gw.signer, cache_s=AUTH_CACHE_S)
        try:
            yield
        finally:
            gw.close()

    app = FastAPI(title="tinkerq gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def gateway() -> Gateway:
        return state["gateway"]  # type: ignore[no-any-return]

    async def tenant(request: Request) -> str:
        # An API key, or the token the SDK exchanged one for (gateway/auth.py); 401 otherwise. Most requests are
        # decided from the caches, on the loop; the rest read Redis on a thread (a sync dependency would take a
        # thread for every request: ~80 us of CPU each, measured).
        header = request.headers.get("x-api-key")
        cached = state["credentials"].cached_tenant(header)
        if cached is not None:
            return cached
        return await asyncio.to_thread(credentials, state["credentials"].tenant, header)

    Tenant = Depends(tenant)

    async def fill_refused(api_key: str | None, model_id: str, seq_id: int, why: str) -> None:
        try:  # another tenant's run, or no key: nothing to fill
            name = state["credentials"].tenant(api_key)
        except Refused:
            return
        if name is not None:
            await asyncio.to_thread(gateway().ordered.fill_refused, name, model_id, seq_id, why)

    # Any numbered request answered without being taken fills its position in the run (gateway/positions.py).
    app.add_middleware(SequenceGuard, fill=fill_refused, ordered_paths=frozenset(
        f"/api/v1/{op}" for op in ("forward_backward", "optim_step", "save_weights", "save_weights_for_sampler",
                                   "save_weights_external", "load_weights")))

    async def json_body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError as exc:
            raise HTTPError(400, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        return body

    Body = Depends(json_body)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
        # Operators see every refusal (what, to whom, why); a user sees the same reason in the SDK's error.
        log.info("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.detail)
        headers = {} if exc.retry_after_s is None else {"retry-after": f"{exc.retry_after_s:g}"}
        headers.update(exc.headers)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=headers)

    @app.exception_handler(TinkerqError)
    async def _fleet_error(request: Request, exc: TinkerqError) -> JSONResponse:
        status = 400 if exc.is_user_error else 503
        log.log(logging.INFO if exc.is_user_error else logging.WARNING, "%s %s -> %d: %s", request.method,
                request.url.path, status, exc.message)
        return JSONResponse({"detail": exc.message}, status_code=status,
                            headers={} if exc.is_user_error else {"retry-after": "2"})

    async def _redis_away(request: Request, exc: Exception) -> JSONResponse:
        # A Redis call outside the store seam (a library's own) while Redis restarts: retryable, as the SDK does
        # 5xx. (The gateway's records and API keys raise BrokerUnavailableError instead: _fleet_error.)
        log.warning("%s %s -> 503: Redis unreachable (%s)", request.method, request.url.path, exc)
        return JSONResponse({"detail": "the fleet's Redis is unreachable; retry shortly"}, status_code=503,
                            headers={"retry-after": "2"})

    for unreachable in UNREACHABLE:
        app.add_exception_handler(unreachable, _redis_away)

    @app.exception_handler(KeyError)
    async def _missing_field(_request: Request, exc: KeyError) -> JSONResponse:
        return JSONResponse({"detail": f"the request lacks the field {exc.args[0]!r}"}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": str(exc.errors())[:2000]}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if exc.status_code != 404 else "no such endpoint in this server's Tinker API"
        return JSONResponse({"detail": detail}, status_code=exc.status_code)

    v1 = "/api/v1"

    # -- bootstrap and sessions ---------------------------------------------------------------------------------

    @app.get(f"{v1}/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    @app.post(f"{v1}/client/config")
    async def client_config(_t: str = Tenant) -> dict[str, Any]:
        settings = gateway().settings
        return {**CLIENT_CONFIG, "pjwt_auth_enabled": bool(settings.gateway_token_exchange),
                "use_pyqwest_transport": bool(settings.gateway_sdk_pyqwest)}

    @app.post(f"{v1}/auth/token")
    async def auth_token(request: Request) -> dict[str, Any]:
        # The SDK's exchange (pjwt_auth_enabled): its API key for a short-lived signed token (gateway/auth.py).
        creds = state["credentials"]
        who = await asyncio.to_thread(credentials, creds.key_tenant, request.headers.get("x-api-key"))
        return {"jwt": await asyncio.to_thread(credentials, creds.mint, who)}

    @app.get(f"{v1}/auth/apikey/me")
    async def api_key_me(request: Request) -> dict[str, Any]:
        # `tinker auth login` checks the key it was given here before storing it.
        creds = state["credentials"]
        who = await asyncio.to_thread(credentials, creds.key_tenant, request.headers.get("x-api-key"))
        return await asyncio.to_thread(credentials, creds.describe, who)

    @app.delete(f"{v1}/auth/apikey/me")
    async def delete_api_key_me(request: Request) -> dict[str, Any]:
        # `tinker auth logout` of a key the CLI was issued: the presented key revokes itself (only itself), and its
        # tenant's runs and sessions end, as `tinkerq keys revoke` does (gateway/auth.py).
        creds = state["credentials"]
        who = await asyncio.to_thread(credentials, creds.key_tenant, request.headers.get("x-api-key"))
        await asyncio.to_thread(creds.revoke, who, gateway())
        return {}

    @app.post(f"{v1}/client/dynamic_config")
    async def dynamic_config(_t: str = Tenant) -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}

    @app.post(f"{v1}/telemetry")
    async def telemetry(_t: str = Tenant) -> dict[str, Any]:
        return {"status": "accepted"}

    @app.get(f"{v1}/get_server_capabilities")
    async def capabilities(_t: str = Tenant) -> dict[str, Any]:
        return await gateway().capabilities()

    @app.post(f"{v1}/create_session")
    async def create_session(t: str = Tenant, body: dict[str, Any] = Body) -> dict[str, Any]:
        return gateway().create_session(t, body)

    @app.post(f"{v1}/session_heartbeat")
    async def heartbeat(t: str = Tenant, body: dict[str, Any] = Body) -> dict[str, Any]:
        return gateway().heartbeat(t, str(body.get("session_id")))

    @app.post(f"{v1}/sessions/{{session_id}}/finish")
    async def finish(session_id: str, t: str = Tenant, body: dict[str, Any] = Body) -> dict[str, Any]:
        return await gateway().finish_session(t, session_id, body.get("reason"), body.get("detail"))

    # -- training ---------------------------------------------------------------------------------------------

    @app.post(f"{v1}/create_model")
    async def create_model(t: str = Tenant, body: dict[str, Any] = Body) -> dict[str, Any]:
        return await gateway().create_model(t, body)

    @app.post(f"{v1}/get_info")
    async def get_info(t: str = Tenant, body: dict[str, Any] = Body) -> dict[str, Any]:
        return gateway().runs.info(t, str(body.get("model_id")))

    @app.post(f"{v1}/unload_model")
    async def unload_model(t: str = Tenant, body: dict[str, Any] = Body) -> dict[str, Any]:
        return await gateway().unload_model(t, str(body.get("model_id")))

    @app.post(f"{v1}/forward_backward")
    async def forward_backward(request: Request, t: str = Tenant) -> dict[str, Any]:
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise HTTPError(400, "compressed forward_backward bodies are not accepted (proto_compress_fwdbwd is off)")
        if not request.headers.get("content-type", "").startswith(PROTOBUF):
            raise HTTPError(400, f"forward_backward takes a protobuf body (Content-Type: {PROTOBUF}), as SDK 0.25+")
        return gateway().ordered.forward_backward(t, await request.body())

    @app.post(f"{v1}/forward")
    async def forward_json(_t: str = Tenant) -> dict[str, Any]:
        raise HTTPError(400, "JSON /forward is not served: use a tinker SDK >= 0.25 (forward goes through "
                             "/forward_backward as protobuf)")

    @app.post(f"{v1}/optim_step")
    async def optim_step(t: str = Tenant, body: dict[str, Any] = Body) -> dict[str, Any]:
        return gateway().ordered.optim_step(t, body)

    @app.post(f"{v1}/save_weights")
    async def save_weights(t: str = Tenant, body: dict[str, Any] = Body) -> dict[str, Any]:
        return gateway().ordered.save_weights(t, body)

    @app.post(f"{v1}/save_weights_for_sampler")
    async def save_weights_for_sampler(t: str = Tenant, body: dict[str, Any] = Body) -> dict[str, Any]:
        return gateway().ordered.save_weights_for_sampler(t, body)

    @app.post(f"{v1}/save_weights_external")
    async def save_weights_external(t: str = Tenant, body: dict[str, Any] = Body) -> dict[str, Any]:
        return gateway().ordered.save_weights_external(t, body)

    @app.post(f"{v1}/load_weights")
    async def load_weights(t: str = Tenant, body: dict[str, Any] = Body) -> dict[str, Any]:
        return await gateway().ordered.load_weights(t, body)

    # -- sampling ---------------------------------------------------------------------------------------------

    @app.post(f"{v1}/create_sampling_session")
    async def create_sampling_session(t: str = Tenant, body: dict[str, Any] = Body) -> dict[str, Any]:
        return await gateway().samplers.create_sampling_session(t, body)

    @app.get(f"{v1}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, t: str = Tenant) -> dict[str, Any]:
        return gateway().samplers.info(t, sampler_id)

    @app.post(f"{v1}/asample")
    async def asample(t: str = Tenant, body: dict[str, Any] = Body) -> dict[str, Any]:
        return gateway().samplers.asample(t, body)

    # -- futures ----------------------------------------------------------------------------------------------

    @app.post(f"{v1}/retrieve_future")
    async def retrieve_future(t: str = Tenant, body: dict[str, Any] = Body) -> Response:
        request_id = str(body.get("request_id"))
        record, stored = await asyncio.to_thread(gateway().futures.get, request_id, t)
        if record is None:
            raise HTTPError(404, f"request {request_id!r} not found (unknown, expired, or made with another API key)")
        answer = await gateway().futures.wait(request_id, record, stored)
        if isinstance(answer, Waiting):  # 408 + try_again: the SDK polls again at once, quietly
            waiting: dict[str, Any] = {"type": "try_again", "request_id": request_id, "queue_state": answer.state}
            if answer.reason:
                waiting["queue_state_reason"] = answer.reason
            return JSONResponse(waiting, status_code=408)
        if answer.proto is not None:
            return Response(answer.proto, media_type=PROTOBUF)
        return JSONResponse(answer.json)

    # -- REST lookups -----------------------------------------------------------------------------------------

    @app.get(f"{v1}/training_runs")
    async def training_runs(limit: int = 20, offset: int = 0, project_id: str | None = None,
                            t: str = Tenant) -> dict[str, Any]:
        return gateway().lookup(lookups.training_runs, t, max(1, min(limit, 1000)), max(0, offset), project_id)

    @app.get(f"{v1}/training_runs/{{run_id}}")
    async def training_run(run_id: str, t: str = Tenant) -> dict[str, Any]:
        return gateway().lookup(lookups.training_run, t, run_id)

    @app.get(f"{v1}/training_runs/{{run_id}}/checkpoints")
    async def checkpoints(run_id: str, t: str = Tenant) -> dict[str, Any]:
        return gateway().lookup(lookups.list_checkpoints, t, run_id)

    @app.get(f"{v1}/training_runs/{{run_id}}/checkpoints/{{segment}}/{{name}}/external_weights_urls")
    async def external_weights_urls(run_id: str, segment: str, name: str, request: Request,
                                    t: str = Tenant) -> dict[str, Any]:
        return await asyncio.to_thread(answer_urls, gateway().external_weights, t, run_id, f"{segment}/{name}",
                                       str(request.base_url))

    @app.get(f"{v1}/external_weights/{{token}}/{{file:path}}")
    async def external_weights_file(token: str, file: str) -> Response:
        # No API key: the signed token in the URL is the permission (gateway/downloads.py).
        fd, size = await asyncio.to_thread(answer_file, gateway().external_weights, token, file)
        return StreamingResponse(stream(fd, size), media_type="application/octet-stream",
                                 headers={"content-length": str(size)})

    # Sessions, checkpoints across runs, publish / ttl / copy, the audit log (gateway/rest_routes.py); before the
    # deletion route below, whose {checkpoint_id:path} would take ".../publish" too.
    add_rest_routes(app, gateway, Tenant, Body)

    @app.delete(f"{v1}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str, t: str = Tenant) -> dict[str, Any]:
        return await asyncio.to_thread(gateway().delete_checkpoint, t, run_id, checkpoint_id)  # removes files

    # -- usage ---------------------------------------------------------------------------------------------------

    @app.get(f"{v1}/billing/usage/events")
    async def billing_usage(starting_on: str = "", ending_before: str = "", t: str = Tenant) -> dict[str, Any]:
        return await asyncio.to_thread(gateway().billing_usage, t, starting_on, ending_before)

    @app.get(f"{v1}/billing/usage/checkpoints/current")
    async def checkpoint_storage(t: str = Tenant) -> dict[str, Any]:
        return await asyncio.to_thread(gateway().checkpoint_storage, t)

    @app.get("/metrics")
    async def metrics(_t: str = Tenant) -> Response:
        # Per-key counters (tinkerq.usage) for Prometheus; behind a key, as tenants' names are not public.
        return Response(prometheus_client.generate_latest(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.post(f"{v1}/weights_info")
    async def weights_info(t: str = Tenant, body: dict[str, Any] = Body) -> dict[str, Any]:
        return gateway().weights_info(t, body.get("tinker_path"))

    console.add_routes(app, gateway, Tenant)  # the tenants' web console: GET /console (gateway/console.py)

    return app

