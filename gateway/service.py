"""The gateway's logic: Tinker's HTTP requests turned into producer calls on the fleet, per tenant.

Stateless: every record a gateway needs (sessions, training runs, sampling sessions, checkpoints, futures, which
sequence ids are taken) lives in Redis, so any number of gateways serve one fleet behind a plain load balancer
and any of them answers any request or poll (docs/gateway.md). What a gateway holds in memory is a cache: the
producer clients of the runs and sampling sessions it served lately, rebuilt from their records on a miss.

The work is split by responsibility: the training runs and their producer clients (gateway/training_runs.py),
their ordered requests (gateway/ordered_requests.py), sampling sessions and samples (gateway/samplers.py), the
futures every request answers through (gateway/futures.py) and the work behind them (gateway/jobs.py); this
module builds them and answers sessions, model creation, checkpoint lookups and the REST views.

The gateway is a producer (one :class:`producer.ServiceClient`, one Redis connection, shared by every tenant),
and uses its public API only (tests/test_layering.py): ``open_training_client`` / ``attach_training_client`` for
worker sessions, ``TrainingClient.submit(op, body, seq_id=...)`` and ``skip`` for requests. Training requests
keep the SDK's ``seq_id``: a model's request ``n`` is posted as the worker session's sequence number
``n + offset`` (offset 1 for a model made by create-via-load, whose first request was the load), so the
worker's own ordering (worker/core/ordering.py) applies them in the SDK's order, buffers what arrives early (the SDK
sends a forward_backward's chunks last-first, and two gateways post in parallel) and fails a gap after the gap
timeout. A resend of ``(model_id, seq_id)``, to any gateway, gets the original request id (a claim in Redis)
and is never applied twice. A request refused after its ``seq_id`` was read still fills that position (``skip``:
an ``echo``), so the model's later requests are not held up by the hole.

Every id and path belongs to the tenant whose API key made it (gateway/records.py); anything else is 404.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from tinkerq import types, usage
from tinkerq.audit import AuditLog
from tinkerq.errors import TinkerqError, UnknownModelError
from tinkerq.gateway import checkpoint_files, lookups, publishing
from tinkerq.gateway.downloads import ExternalWeights
from tinkerq.gateway.futures import Answer, Futures
from tinkerq.gateway.http_errors import HTTPError, not_found
from tinkerq.gateway.jobs import Jobs
from tinkerq.gateway.ordered_requests import OrderedRequests
from tinkerq.gateway.records import PathError, Records, TinkerPath
from tinkerq.gateway.request_bodies import lora_config, optimizer_config
from tinkerq.gateway.run_metrics import RunMetrics
from tinkerq.gateway.samplers import Samplers
from tinkerq.gateway.session_trace import SessionTrace
from tinkerq.gateway.signing import Signer
from tinkerq.gateway.training_runs import TrainingRuns
from tinkerq.producer import ServiceClient
from tinkerq.quotas import Quotas
from tinkerq.settings import Settings
from tinkerq.store import RedisStore
from tinkerq.usage import Usage
from tinkerq.validation import validate_lora
from tinkerq.wire import messages

log = logging.getLogger("tinkerq.gateway")

FINISH_REASONS = ("success", "errored", "interrupted")  # the SDK's close(status)


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.service = ServiceClient(settings=settings)
        store = self.service.connection.store
        if not isinstance(store, RedisStore):
            raise TinkerqError("the gateway needs a Redis broker (redis://, rediss:// or sentinel://), not memory://")
        self.store = store
        self.records = Records(store)
        self.quotas = Quotas(store)
        self.usage = Usage(store)
        self.audit = AuditLog(store)
        self.signer = Signer(store)  # download URLs and exchanged credentials (gateway/signing.py)
        self.external_weights = ExternalWeights(self.records, self.signer, settings.checkpoint_dir)
        self.run_metrics = RunMetrics(store)
        self.jobs = Jobs(self)
        self.futures = Futures(store, self.records, self.jobs.run, self.account, poll_s=settings.gateway_poll_s,
                               keep_s=settings.gateway_keep_s)
        self.session_trace = SessionTrace(self.records, self.run_metrics)
        self.futures.on_stored = self.session_trace.record
        self.runs = TrainingRuns(self.service, self.records, self.quotas, settings)
        self.ordered = OrderedRequests(self)
        self.samplers = Samplers(self)

    def start(self) -> None:
        self.futures.start()

    def close(self) -> None:
        self.futures.close()
        self.service.close()

    # -- sessions ---------------------------------------------------------------------------------------------

    def create_session(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        session_id = str(uuid.uuid4())
        self.records.put("session", session_id, {
            "tenant": tenant, "created": time.time(), "finished": False,
            "tags": body.get("tags") or [], "user_metadata": body.get("user_metadata"),
            "display_name": body.get("display_name"), "project_id": body.get("project_id"),
        })
        return {"session_id": session_id, "type": "create_session"}

    def session(self, tenant: str, session_id: Any) -> dict[str, Any]:
        record = self.records.get("session", str(session_id), tenant)
        if record is None:
            raise not_found("session", session_id)
        return record

    def heartbeat(self, tenant: str, session_id: str) -> dict[str, Any]:
        def beat(record: dict[str, Any]) -> None:
            if record["finished"]:
                raise HTTPError(410, f"session {session_id} is finished")  # the SDK stops heartbeating
            record["heartbeat_at"] = time.time()  # (and its ttl renewed): TrainingRuns.stale reads it

        # An atomic update: a heartbeat never undoes a finish or a project assignment made meanwhile.
        if self.records.update("session", session_id, tenant, beat) is None:
            raise not_found("session", session_id)
        return {"type": "session_heartbeat"}

    async def finish_session(self, tenant: str, session_id: str, reason: Any = None,
                             detail: Any = None) -> dict[str, Any]:
        """End the session and free its models' memory on the workers (their checkpoints stay). The client's
        reason (success, errored, interrupted) is kept, first one wins, for get_session / search_sessions."""
        def finish(record: dict[str, Any]) -> None:
            if not record["finished"] and isinstance(reason, dict) and reason.get("type") in FINISH_REASONS:
                record.update(finish_reason=reason["type"], finish_detail=None if detail is None else str(detail))
            record["finished"] = True

        if await asyncio.to_thread(self.records.update, "session", session_id, tenant, finish) is None:
            raise not_found("session", session_id)
        for run_record in await asyncio.to_thread(self.records.scan, "run", tenant, f"{session_id}:train:"):
            run = await asyncio.to_thread(self.runs.get, tenant, run_record["model_id"], closed_ok=True)
            if run is not None:
                await asyncio.to_thread(self.runs.close, run)
        return {}

    # -- training runs ----------------------------------------------------------------------------------------

    async def create_model(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        session_id, model_seq_id = body["session_id"], body["model_seq_id"]
        session = self.session(tenant, session_id)
        if session["finished"]:
            raise HTTPError(400, f"session {session_id} is finished; create a new ServiceClient")
        model_id = f"{session_id}:train:{model_seq_id}"
        optimizer = optimizer_config(body.get("optimizer_config"))
        base_model = str(body["base_model"])
        lora = lora_config(body.get("lora_config"))
        if lora is not None:
            validate_lora(lora, max_rank=self.settings.max_lora_rank)  # refused now (400), not in the future
        await self.check_served(base_model)
        job = {"type": "create", "model_id": model_id, "session_id": session_id, "base_model": base_model,
               "lora": None if lora is None else messages.encode_lora(lora),
               "optimizer": messages.encode_optimizer(optimizer), "user_metadata": body.get("user_metadata")}
        return {"request_id": self.create_once(tenant, model_id, "CreateModel", job), "model_id": model_id}

    def create_once(self, tenant: str, model_id: str, kind: str, job: dict[str, Any]) -> str:
        """Start the create of ``model_id`` unless some gateway did (a resend): the request id either way."""
        prior = self.records.get_claim(f"create:{model_id}")
        if prior is not None:
            return prior
        request_id = uuid.uuid4().hex
        record, prior = self.futures.record_claimed(tenant, kind, job, request_id=request_id,  # as OrderedRequests
                                                    claim=f"create:{model_id}", value=request_id)
        if prior is not None:
            self.futures.discard(request_id)
            return prior
        self.futures.begin(request_id, record)
        return request_id

    async def unload_model(self, tenant: str, model_id: str) -> dict[str, Any]:
        self.runs.get(tenant, model_id)
        request_id = self.futures.add(tenant, "UnloadModel", {"type": "unload", "model_id": model_id})
        return {"request_id": request_id, "model_id": model_id}

    def checkpoint(self, tenant: str, path: Any, *, segment: str | None = None,
                    readable: bool = False) -> dict[str, Any]:
        """The checkpoint record at ``path``: the caller's own; with ``readable``, a published one too
        (gateway/publishing.py)."""
        try:
            parsed = TinkerPath.parse(path)
        except PathError as exc:
            raise HTTPError(400, str(exc)) from None
        if segment is not None and parsed.segment != segment:
            what = "save_state (tinker://.../weights/...)" if segment == "weights" else \
                "save_weights_for_sampler (tinker://.../sampler_weights/...)"
            raise HTTPError(400, f"{path} cannot be used here: this needs a checkpoint made by {what}")
        record = publishing.readable(self.records, tenant, parsed) if readable else \
            self.records.get("checkpoint", str(parsed), tenant)
        if record is None:
            raise not_found("checkpoint", path)
        if record["tenant"] != tenant:  # a published checkpoint read by another tenant: its owner's log says so
            self.audit.record(record["tenant"], "checkpoint_read", actor=tenant, model_id=parsed.run,
                              tinker_path=str(parsed))
        return record

    def account(self, request_id: str, answer: Answer) -> None:
        """Count the usage stored with a request's answer, once per request id (any gateway, any number of polls)."""
        if answer.usage is None:
            return
        counts = {name: int(n) for name, n in answer.usage["counts"].items() if n}
        if counts:
            self.usage.record(answer.usage["tenant"], answer.usage["session_id"], counts, once=request_id)

    # -- capabilities and REST lookups ----------------------------------------------------------------------------

    async def capabilities(self) -> dict[str, Any]:
        workers = await asyncio.to_thread(self.service.connection.workers_serving)
        found = types.GetServerCapabilitiesResponse.from_workers(workers)
        return {"supported_models": [dataclasses.asdict(m) for m in found.supported_models]}

    async def check_served(self, base_model: str) -> None:
        if not await asyncio.to_thread(self.service.connection.workers_serving, base_model):
            served = [m["model_name"] for m in (await self.capabilities())["supported_models"]]
            raise HTTPError(400, f"base model {base_model!r} is not served here; served now: {served or 'none'}")

    def lookup(self, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
        try:
            return fn(self.records, *args)
        except lookups.NotFound as exc:
            raise not_found(exc.what, exc.ident) from None

    def billing_usage(self, tenant: str, starting_on: str, ending_before: str) -> dict[str, Any]:
        """SDK 0.38's ``AdminClient.get_billing_usage``: this key's usage, hour by hour, session by session."""
        start, end = usage.billing_window(starting_on, ending_before)
        rows = self.usage.rows(tenant, since=start)
        metadata = {}
        for session_id in {row.session_id for row in rows if row.session_id}:
            record = self.records.get("session", session_id, tenant)
            metadata[session_id] = lookups.str_map(record.get("user_metadata")) if record else None
        return usage.billing_usage_view(rows, starting_on=start, ending_before=end, session_metadata=metadata)

    def checkpoint_storage(self, tenant: str) -> dict[str, Any]:
        found = self.records.scan("checkpoint", tenant)
        return usage.checkpoint_storage_view(tenant, len(found), sum(int(c.get("bytes") or 0) for c in found))

    def delete_checkpoint(self, tenant: str, run_id: str, checkpoint_id: str) -> dict[str, Any]:
        path = f"tinker://{run_id}/{checkpoint_id}"
        record = self.checkpoint(tenant, path)
        self.records.delete("checkpoint", path)
        try:  # the files too (gateway/checkpoint_files.py), where this gateway reaches them
            checkpoint_files.remove(self.settings.checkpoint_dir, str(record.get("directory") or ""))
        except checkpoint_files.Unreachable as exc:
            log.warning("checkpoint %s deleted from the records; its files stay: %s", path, exc)
        self.audit.record(tenant, "checkpoint_delete", model_id=run_id, tinker_path=path)
        return {}

    def weights_info(self, tenant: str, tinker_path: Any) -> dict[str, Any]:
        return lookups.weights_info(self.checkpoint(tenant, tinker_path, readable=True))


__all__ = ["Gateway", "HTTPError", "UnknownModelError"]
