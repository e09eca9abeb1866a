"""The gateway's logic: Tinker's HTTP requests turned into producer calls on the fleet, per tenant.

Stateless: every record a gateway needs (sessions, training runs, sampling sessions, checkpoints, futures, which
sequence ids are taken) lives in Redis, so any number of gateways serve one fleet behind a plain load balancer
and any of them answers any request or poll (docs/gateway.md). What a gateway holds in memory is a cache: the
producer clients of the runs and sampling sessions it served lately, rebuilt from their records on a miss.

The gateway is a producer (one :class:`producer.ServiceClient`, one Redis connection, shared by every tenant),
and uses its public API only (tests/test_layering.py): ``open_training_client`` / ``attach_training_client`` for
worker sessions, ``TrainingClient.submit(op, body, seq_id=...)`` and ``skip`` for requests. Training requests
keep the SDK's ``seq_id``: a model's request ``n`` is posted as the worker session's sequence number
``n + offset`` (offset 1 for a model made by create-via-load, whose first request was the load), so the
worker's own ordering (worker/ordering.py) applies them in the SDK's order, buffers what arrives early (the SDK
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
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tinkerq import keys, types, usage
from tinkerq.audit import AuditLog
from tinkerq.errors import TinkerqError, UnknownModelError
from tinkerq.gateway import checkpoint_files, lifecycle, lookups, proto, publishing
from tinkerq.gateway.downloads import ExternalWeights
from tinkerq.gateway.futures import Answer, Futures, Waiting
from tinkerq.gateway.jobs import Jobs
from tinkerq.gateway.records import PathError, Records, TinkerPath, check_name
from tinkerq.gateway.run_metrics import RunMetrics
from tinkerq.gateway.sample_options import STABILITY_REFUSAL, sample_options
from tinkerq.gateway.session_trace import SessionTrace
from tinkerq.gateway.signing import Signer
from tinkerq.producer.client import ServiceClient, TrainingClient
from tinkerq.producer.sampling import SamplingClient
from tinkerq.quotas import Quotas
from tinkerq.settings import Settings
from tinkerq.store import RedisStore
from tinkerq.usage import Usage
from tinkerq.validation import UNDEFINED_BY_SDK, validate_adam, validate_lora
from tinkerq.wire import messages

log = logging.getLogger("tinkerq.gateway")

FINISH_REASONS = ("success", "errored", "interrupted")  # the SDK's close(status)
CACHED_CLIENTS = 1024  # runs and sampling sessions whose producer clients a gateway keeps at hand (LRU)


class HTTPError(Exception):
    """An answer other than 200, with a JSON ``{"detail": ...}`` body the SDK shows to the user."""

    def __init__(self, status: int, detail: str, *, retry_after_s: float | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.retry_after_s = retry_after_s
        self.headers = headers or {}  # e.g. WWW-Authenticate on a refused token (gateway/auth.py)


def not_found(what: str, ident: Any) -> HTTPError:
    # Another tenant's object gets the same answer as a missing one: ids leak nothing.
    return HTTPError(404, f"{what} {ident!r} not found (unknown, expired, or made with another API key)")


def submit_error(exc: TinkerqError) -> HTTPError:
    """A fleet error met while accepting a request: user errors are final (400), server errors retried (503)."""
    return HTTPError(400 if exc.is_user_error else 503, exc.message)


@dataclass
class Run:
    """A training run: its record, and the producer's client for its worker session."""

    model_id: str  # the SDK's: the training run's id, <session>:train:<n> (the worker session's is client.model_id)
    record: dict[str, Any]
    client: TrainingClient
    offset: int  # worker sequence number = SDK seq_id + offset


@dataclass
class Sampler:
    """A sampling session: the SDK's ``sampling_session_id``, a sampler id (``<session>:sample:<n>``, or
    ``<run>:sample:<seq_id>`` for save_weights_and_get_sampling_client), never a model_id."""

    sampler_id: str
    record: dict[str, Any]
    client: SamplingClient


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
        self.runs: OrderedDict[str, Run] = OrderedDict()
        self.samplers: OrderedDict[str, Sampler] = OrderedDict()

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
            record["heartbeat_at"] = time.time()  # (and its ttl renewed): stale_runs() reads it

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
            run = await asyncio.to_thread(self.run, tenant, run_record["model_id"], closed_ok=True)
            if run is not None:
                await asyncio.to_thread(self.close_run, run)
        return {}

    # -- training runs ----------------------------------------------------------------------------------------

    async def create_model(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        session_id, model_seq_id = body["session_id"], body["model_seq_id"]
        session = self.session(tenant, session_id)
        if session["finished"]:
            raise HTTPError(400, f"session {session_id} is finished; create a new ServiceClient")
        model_id = f"{session_id}:train:{model_seq_id}"
        _check_optimizer(body.get("optimizer_config"))
        base_model = str(body["base_model"])
        lora = _lora_config(body.get("lora_config"))
        if lora is not None:
            validate_lora(lora, max_rank=self.settings.max_lora_rank)  # refused now (400), not in the future
        await self._check_served(base_model)
        job = {"type": "create", "model_id": model_id, "session_id": session_id, "base_model": base_model,
               "lora": None if lora is None else messages.encode_lora(lora), "user_metadata": body.get("user_metadata")}
        return {"request_id": self._create_once(tenant, model_id, "CreateModel", job), "model_id": model_id}

    def _create_once(self, tenant: str, model_id: str, kind: str, job: dict[str, Any]) -> str:
        """Start the create of ``model_id`` unless some gateway did (a resend): the request id either way."""
        prior = self.records.get_claim(f"create:{model_id}")
        if prior is not None:
            return prior
        request_id = self.futures.record(tenant, kind, job)  # before the claim: see _ordered
        prior = self.records.claim(f"create:{model_id}", request_id)
        if prior is not None:
            self.futures.discard(request_id)
            return prior
        self.futures.begin(request_id, tenant, kind, job)
        return request_id

    def admit_training_client(self, tenant: str, model_id: str) -> bool:
        """Count the new run against the key's max_training_clients; at the cap, first close the key's runs whose
        SDK stopped heartbeating (a process that exited without unloading) and try again."""
        if self.quotas.try_open_training_client(tenant, model_id):
            return True
        stale = self.stale_runs(tenant)
        for record in stale:
            log.warning("closing training run %s of %s: its session has not sent a heartbeat for over %g s",
                        record["model_id"], tenant, self.settings.gateway_session_stale_s)
            lifecycle.close_run(self.service, self.records, self.quotas, record)
        return bool(stale) and self.quotas.try_open_training_client(tenant, model_id)

    def stale_runs(self, tenant: str) -> list[dict[str, Any]]:
        """The key's counted runs whose session is gone, finished, or silent for TINKERQ_GATEWAY_SESSION_STALE_S."""
        stale = []
        for model_id in self.quotas.training_clients(tenant):
            record = self.records.get("run", model_id, tenant)
            if record is None:
                continue  # being created now
            session = self.records.get("session", record["session_id"], tenant)
            last = None if session is None else session.get("heartbeat_at", session.get("created"))
            if session is None or last is None or time.time() - float(last) > self.settings.gateway_session_stale_s \
                    or session.get("finished"):
                stale.append(record)
        return stale

    def quotas_release_training_client(self, tenant: str, model_id: str) -> None:
        self.quotas.close_training_client(tenant, model_id)

    def add_run(self, tenant: str, model_id: str, job: dict[str, Any], lora: types.LoraConfig | None,
                client: TrainingClient) -> Run:
        offset = 0 if job.get("load") is None else 1
        record = {
            "tenant": tenant, "model_id": model_id, "session_id": job["session_id"], "base_model": job["base_model"],
            "lora": None if lora is None else messages.encode_lora(lora), "created": time.time(),
            "user_metadata": job.get("user_metadata"),
            # What any gateway needs to drive the same worker session (see run()).
            "info": dataclasses.asdict(client.info), "offset": offset, "closed": False,
        }
        self.records.put("run", model_id, record)
        return self._cache(self.runs, model_id, Run(model_id, record, client, offset))

    def run(self, tenant: str, model_id: Any, *, closed_ok: bool = False) -> Run | None:
        """The run, driven from its record (made here or by another gateway: the worker session is the same)."""
        run = self.runs.get(str(model_id))
        if run is None:
            record = self.records.get("run", str(model_id), tenant)
            if record is not None and not record.get("closed") and isinstance(record.get("info"), dict):
                client = self.service.attach_training_client(types.ModelInfo(**record["info"]))
                run = self._cache(self.runs, str(model_id), Run(str(model_id), record, client, int(record["offset"])))
        if run is None or run.record["tenant"] != tenant:
            if closed_ok:
                return None
            raise not_found("model", model_id)
        return run

    def close_run(self, run: Run) -> None:
        """Close the run's worker session after every request taken for it (on any gateway), and forget it."""
        self.runs.pop(run.model_id, None)
        lifecycle.close_run(self.service, self.records, self.quotas, run.record, run.client)

    @staticmethod
    def close_quietly(client: TrainingClient) -> None:
        try:
            client.close()
        except TinkerqError as exc:  # the worker may be gone already: nothing left to free
            log.info("closing %s: %s", client.model_id, exc.message)

    @staticmethod
    def _cache(cache: OrderedDict[str, Any], key: str, value: Any) -> Any:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > CACHED_CLIENTS:
            cache.popitem(last=False)
        return value

    def get_info(self, tenant: str, model_id: str) -> dict[str, Any]:
        run = self.run(tenant, model_id)
        assert run is not None
        lora = run.record["lora"]
        base_model = run.record["base_model"]
        return {
            "model_id": model_id, "type": "get_info", "is_lora": lora is not None,
            "lora_rank": None if lora is None else lora["rank"], "model_name": base_model,
            "model_data": {"model_name": base_model, "tokenizer_id": base_model, "arch": run.client.info.extra.get(
                "arch", "transformers")},
            "optimizer_config": {"type": "adamw"},
        }

    async def unload_model(self, tenant: str, model_id: str) -> dict[str, Any]:
        self.run(tenant, model_id)
        request_id = self.futures.add(tenant, "UnloadModel", {"type": "unload", "model_id": model_id})
        return {"request_id": request_id, "model_id": model_id}

    # -- ordered training requests ------------------------------------------------------------------------------

    def _ordered(self, tenant: str, model_id: Any, seq_id: Any, kind: str,
                 prepare: Callable[[Run, str], dict[str, Any]], *, tokens: int = 0) -> dict[str, Any]:
        """Accept request ``seq_id`` of a model once, on any gateway: ``prepare(run, request_id)`` checks it and
        returns its job (it may raise a user error, answered 400 after the position is filled)."""
        run = self.run(tenant, model_id)
        assert run is not None
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 1:
            raise HTTPError(400, f"seq_id must be an integer >= 1, got {seq_id!r}")
        claim = f"seq:{run.model_id}:{seq_id}"
        prior = self.records.get_claim(claim)
        if prior is not None:  # a resend, to this gateway or another
            return self._resent(prior, kind, run, seq_id)
        request_id = uuid.uuid4().hex
        worker_seq = seq_id + run.offset
        try:
            job = prepare(run, request_id)
        except (TinkerqError, PathError, HTTPError, KeyError, TypeError, ValueError) as exc:
            # A malformed body (a missing field, a wrong type) is the caller's error too: answered 400, as the app
            # answers one outside this path.
            message = exc.message if isinstance(exc, TinkerqError) else exc.detail if isinstance(exc, HTTPError) \
                else str(exc) if isinstance(exc, PathError) \
                else f"the request lacks the field {exc.args[0]!r}" if isinstance(exc, KeyError) \
                else f"malformed request: {exc}"
            if not self._fill(run, seq_id, message):
                prior = self.records.get_claim(claim)
                if prior is not None:
                    return self._resent(prior, kind, run, seq_id)
            raise (exc if isinstance(exc, HTTPError) else HTTPError(400, message)) from None
        post_at = self.quotas.schedule(tenant, run.model_id, tokens)
        job.update(type="ordered", model_id=run.model_id, seq_id=seq_id, worker_seq=worker_seq, tokens=tokens,
                   post_at=post_at)
        waiting = None
        if post_at > time.time() + 0.05:
            waiting = Waiting("paused_rate_limit", f"this API key's max_tokens_per_minute holds it until "
                                                   f"{lookups.iso(post_at)}")
        # The future's record first, then the claim: a claim must never name a future that does not exist.
        self.records.raise_top(run.model_id, seq_id)
        self.futures.record(tenant, kind, job, request_id=request_id, waiting=waiting)
        prior = self.records.claim(claim, f"{kind}|{request_id}")
        if prior is not None:  # an earlier copy got there first, on another gateway
            self.futures.discard(request_id)
            self.jobs.forget(request_id)
            return self._resent(prior, kind, run, seq_id)
        self.futures.begin(request_id, tenant, kind, job)
        return {"request_id": request_id, "model_id": run.model_id}

    def _fill(self, run: Run, seq_id: int, message: str) -> bool:
        """Claim position ``seq_id`` of ``run`` as refused with ``message`` and fill it on the worker (an ``echo``),
        so the run's later requests are not held up by it; the resend of that request gets the same refusal.
        False when the position was claimed already (the request was accepted, or refused, before)."""
        if self.records.claim(f"seq:{run.model_id}:{seq_id}", f"refused|{message}") is not None:
            return False
        self.records.raise_top(run.model_id, seq_id)
        run.client.skip(seq_id + run.offset, "refused by the gateway")
        return True

    def fill_refused(self, tenant: str, model_id: str, seq_id: int, message: str) -> bool:
        """Fill position ``seq_id`` of the tenant's run ``model_id`` after its request was answered without being
        taken (an unknown route or method, a malformed body, a refusal before the position was read: the app's
        SequenceGuard); nothing when the run is not the tenant's or the position is taken. True when filled."""
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 1:
            return False
        run = self.run(tenant, model_id, closed_ok=True)
        if run is None:
            return False
        filled = self._fill(run, seq_id, message)
        if filled:
            log.info("model %s: seq_id %d filled (its request was refused: %s)", run.model_id, seq_id, message)
        return filled

    @staticmethod
    def _resent(prior: str, kind: str, run: Run, seq_id: int) -> dict[str, Any]:
        """The answer to a request whose seq_id was claimed already: its request id, or its refusal."""
        seen_kind, _, seen = prior.partition("|")
        if seen_kind == "refused":
            raise HTTPError(400, seen)
        if seen_kind != kind:
            raise HTTPError(400, f"seq_id {seq_id} of model {run.model_id} was already used by a {seen_kind} request")
        return {"request_id": seen, "model_id": run.model_id}

    def forward_backward(self, tenant: str, body: bytes) -> dict[str, Any]:
        call = proto.decode_forward_backward_request(body)  # a user error here: no seq_id to fill
        kind = "Forward" if call.forward_only else "ForwardBackward"
        op = "forward" if call.forward_only else "forward_backward"
        tokens = sum(d.model_input.length for d in call.data)

        def prepare(run: Run, request_id: str) -> dict[str, Any]:
            run.client.check_loss_request(call.data, call.loss_fn, call.loss_fn_config)
            # Kept until answered: a gateway that adopts this future posts it from here.
            self.store.with_retry(0).set(keys.gateway_body(request_id), body, self.settings.gateway_keep_s * 6)
            self.jobs.hint(request_id, call)
            return {"op": op, "finish": "loss",
                    "argsrepr": f"loss_fn={call.loss_fn} datums={len(call.data)} tokens={tokens}"}

        return self._ordered(tenant, call.model_id, call.seq_id, kind, prepare, tokens=tokens)

    def optim_step(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        def prepare(_run: Run, _request_id: str) -> dict[str, Any]:
            optimizer = body.get("optimizer_params")
            if isinstance(optimizer, dict) and optimizer.get("type") == "dimuon":
                raise HTTPError(400, UNDEFINED_BY_SDK["dimuon"])
            if optimizer is not None:
                raise HTTPError(400, "only AdamW is served: send adam_params (optimizer_params is not supported)")
            raw = body.get("adam_params") or {}
            params = types.AdamParams(**{k: raw[k] for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay",
                                                             "grad_clip_norm") if k in raw})
            validate_adam(params)
            return {"op": "optim_step", "finish": "optim", "body": messages.encode_adam(params),
                    "argsrepr": f"lr={params.learning_rate:g}"}

        return self._ordered(tenant, body.get("model_id"), body.get("seq_id"), "OptimStep", prepare)

    def save_weights(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        """save_state: weights + optimizer state, at ``tinker://<model>/weights/<name>``."""
        return self._save(tenant, body, "weights", "SaveWeights")

    def save_weights_for_sampler(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("path") is None:  # save_weights_and_get_sampling_client: a sampling snapshot, in memory
            return self._ordered(tenant, body.get("model_id"), body.get("seq_id"), "SaveWeightsForSampler",
                                 lambda _run, _rid: {"op": "create_sampler", "finish": "snapshot", "body": {}})
        return self._save(tenant, body, "sampler_weights", "SaveWeightsForSampler")

    def save_weights_external(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        """The run's weights archive at ``tinker://<model>/external_weights/<name>``, served behind signed URLs
        (gateway/downloads.py)."""
        return self._save(tenant, body, "external_weights", "SaveWeightsExternal")

    def _save(self, tenant: str, body: dict[str, Any], segment: str, kind: str) -> dict[str, Any]:
        def prepare(run: Run, _request_id: str) -> dict[str, Any]:
            if body.get("age_encryption_recipients"):
                raise HTTPError(400, "age_encryption_recipients is not supported by this server: leave it unset (the "
                                     "download URLs are signed, expire, and are answered to their tenant only)")
            name = check_name(body.get("path"))
            ttl = _ttl(body.get("ttl_seconds"))
            path = TinkerPath(run.model_id, segment, name)
            overwrite = body.get("overwrite", False)
            keep = self.quotas.limits(tenant).keep_checkpoints
            if segment == "weights":
                if not isinstance(overwrite, bool):
                    raise HTTPError(400, f"overwrite must be true or false, got {overwrite!r}")
                if not overwrite and self.records.get("checkpoint", str(path), tenant) is not None:
                    raise HTTPError(400, f"checkpoint {path} exists; pass overwrite=True or choose another name")
                op, request = "save_state", {"name": name, "ttl_seconds": ttl, "overwrite": overwrite}
            elif segment == "external_weights":  # the sampler archive, in a folder of its own; no retention
                op, keep = "save_weights_for_sampler", None
                request = {"name": name, "ttl_seconds": ttl, "external": True}
            else:
                op, request = "save_weights_for_sampler", {"name": name, "merged": False, "ttl_seconds": ttl}
            if keep is not None:
                request["keep_newest"] = keep
            return {"op": op, "finish": "save", "body": request, "argsrepr": f"name={name}",
                    "args": {"path": str(path), "ttl": ttl, "user_metadata": body.get("user_metadata")}}

        return self._ordered(tenant, body.get("model_id"), body.get("seq_id"), kind, prepare)

    # -- loading ----------------------------------------------------------------------------------------------

    async def load_weights(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        optimizer = body.get("optimizer")
        if not isinstance(optimizer, bool):
            raise HTTPError(400, f"optimizer must be true or false, got {optimizer!r}")
        if body.get("session_id") is None:  # legacy TrainingClient.load_state: an ordered request
            def prepare(_run: Run, _request_id: str) -> dict[str, Any]:
                checkpoint = self._checkpoint(tenant, body.get("path"), segment="weights", readable=True)
                return {"op": "load_state", "finish": "load", "argsrepr": f"path={body.get('path')}",
                        "body": {"path": checkpoint["directory"], "optimizer": optimizer},
                        "args": {"path": body.get("path")}}

            return self._ordered(tenant, body.get("model_id"), body.get("seq_id"), "LoadWeights", prepare)
        # create_training_client_from_state[_with_optimizer]: a new model whose first request is the load.
        session_id, model_seq_id = str(body.get("session_id")), body.get("model_seq_id")
        session = self.session(tenant, session_id)
        if session["finished"]:
            raise HTTPError(400, f"session {session_id} is finished; create a new ServiceClient")
        model_id = f"{session_id}:train:{model_seq_id}"
        _check_optimizer(body.get("optimizer_config"))
        checkpoint = self._checkpoint(tenant, body.get("path"), segment="weights", readable=True)
        base_model = str(body.get("base_model") or checkpoint["base_model"])
        await self._check_served(base_model)
        job = {"type": "create", "model_id": model_id, "session_id": session_id, "base_model": base_model,
               "lora": checkpoint.get("lora"), "user_metadata": body.get("user_metadata"),
               "load": {"directory": checkpoint["directory"], "optimizer": optimizer, "path": body["path"]}}
        return {"request_id": self._create_once(tenant, model_id, "LoadWeights", job), "model_id": model_id}

    def _checkpoint(self, tenant: str, path: Any, *, segment: str | None = None,
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

    # -- sampling ---------------------------------------------------------------------------------------------

    async def create_sampling_session(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        session_id, k = body.get("session_id"), body.get("sampling_session_seq_id")
        self.session(tenant, session_id)
        sampler_id = f"{session_id}:sample:{k}"
        if self.records.get("sampler", sampler_id, tenant) is not None:  # a resend, to any gateway
            return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}
        model_path = body.get("model_path")
        if model_path is not None:
            checkpoint = self._checkpoint(tenant, model_path, segment="sampler_weights", readable=True)
            base_model = str(body.get("base_model") or checkpoint["base_model"])
            source: dict[str, Any] = {"path": checkpoint["directory"]}
        elif body.get("base_model"):
            base_model, source = str(body["base_model"]), {"base": True}
        else:
            raise HTTPError(400, "create_sampling_session needs model_path (a tinker:// sampler path) or base_model")
        await self._check_served(base_model)
        await self.add_sampler(tenant, sampler_id, base_model, source, model_path)
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    async def add_sampler(self, tenant: str, sampler_id: str, base_model: str, source: dict[str, Any],
                          model_path: str | None) -> None:
        try:
            client = await asyncio.to_thread(SamplingClient, self.service, source, base_model)
        except TinkerqError as exc:
            raise submit_error(exc) from None
        record = {"tenant": tenant, "sampler_id": sampler_id, "base_model": base_model, "model_path": model_path,
                  "source": source, "session_id": sampler_id.split(":", 1)[0]}
        self.records.put("sampler", sampler_id, record)
        self._cache(self.samplers, sampler_id, Sampler(sampler_id, record, client))

    def sampler(self, tenant: str, sampler_id: Any) -> Sampler:
        sampler = self.samplers.get(str(sampler_id))
        if sampler is None:  # made by another gateway, or before a restart: its weights are still named
            record = self.records.get("sampler", str(sampler_id), tenant)
            if record is not None:
                try:
                    client = SamplingClient(self.service, record["source"], record["base_model"])
                except TinkerqError as exc:
                    raise submit_error(exc) from None
                sampler = self._cache(self.samplers, str(sampler_id), Sampler(str(sampler_id), record, client))
        if sampler is None or sampler.record["tenant"] != tenant:
            raise not_found("sampling session", sampler_id)
        return sampler

    def get_sampler(self, tenant: str, sampler_id: str) -> dict[str, Any]:
        record = self.sampler(tenant, sampler_id).record
        return {"sampler_id": sampler_id, "base_model": record["base_model"], "model_path": record["model_path"]}

    def asample(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        sampler = self.sampler(tenant, body.get("sampling_session_id"))
        seq_id = body.get("seq_id")
        request_id = uuid.uuid4().hex
        claim = f"sample:{sampler.sampler_id}:{seq_id}" if isinstance(seq_id, int) else None
        if claim is not None:
            prior = self.records.get_claim(claim)
            if prior is not None:  # a resend after a 429 or a lost answer, to any gateway
                return _sample_promise(prior, body.get("num_samples", 1))
        prompt, params, options = self.sample_request(body)
        if not self.quotas.try_start_sample(tenant, request_id):
            limit = self.quotas.limits(tenant).max_sampling_inflight
            raise HTTPError(429, f"this API key has {limit} sampling requests in flight (max_sampling_inflight); "
                                 f"retry when some finish", retry_after_s=1.0)
        job = {"type": "sample", "sampler_id": sampler.sampler_id, "request": body}
        # The future's record first, then the claim (see _ordered), then the post.
        self.futures.record(tenant, "Sample", job, request_id=request_id)
        prior = None if claim is None else self.records.claim(claim, request_id)
        if prior is not None:
            self.futures.discard(request_id)
            self.quotas.end_sample(tenant, request_id)
            return _sample_promise(prior, body.get("num_samples", 1))
        future = sampler.client.sample(prompt, body.get("num_samples", 1), params, **options)
        if future.done():  # refused by the producer's checks: a final 400, not a failed future
            error = future.exception(0)
            if error is not None:
                self.quotas.end_sample(tenant, request_id)
                self.futures.discard(request_id)
                if claim is not None:  # the resend is a new request
                    self.store.with_retry(0).delete(keys.gateway_claim(claim))
                raise HTTPError(400 if error.is_user_error else 503, error.message)
        self.jobs.hint(request_id, future)
        self.futures.begin(request_id, tenant, "Sample", job)
        return _sample_promise(request_id, body.get("num_samples", 1))

    def sample_request(self, body: dict[str, Any]) -> tuple[types.ModelInput, types.SamplingParams, dict[str, Any]]:
        """The prompt, parameters and options of an asample body; HTTPError 400 when malformed or unsupported."""
        if body.get("record_stability_info"):
            raise HTTPError(400, STABILITY_REFUSAL)
        try:
            prompt = _model_input(body.get("prompt"))
            params = _sampling_params(body.get("sampling_params"))
            options = sample_options(body)  # top-k, target and alternative tokens (gateway/sample_options.py)
        except (KeyError, TypeError, ValueError) as exc:
            raise HTTPError(400, f"malformed sample request: {exc}") from None
        return prompt, params, {"include_prompt_logprobs": bool(body.get("prompt_logprobs")),
                                "prompt_logprobs_last_n": body.get("prompt_logprobs_last_n"), **options}

    def end_sample(self, tenant: str, request_id: str) -> None:
        self.quotas.end_sample(tenant, request_id)

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

    async def _check_served(self, base_model: str) -> None:
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
        record = self._checkpoint(tenant, path)
        self.records.delete("checkpoint", path)
        try:  # the files too (gateway/checkpoint_files.py), where this gateway reaches them
            checkpoint_files.remove(self.settings.checkpoint_dir, str(record.get("directory") or ""))
        except checkpoint_files.Unreachable as exc:
            log.warning("checkpoint %s deleted from the records; its files stay: %s", path, exc)
        self.audit.record(tenant, "checkpoint_delete", model_id=run_id, tinker_path=path)
        return {}

    def weights_info(self, tenant: str, tinker_path: Any) -> dict[str, Any]:
        return lookups.weights_info(self._checkpoint(tenant, tinker_path, readable=True))


# -- helpers ----------------------------------------------------------------------------------------------------


def _sample_promise(request_id: str, num_samples: Any) -> dict[str, Any]:
    n = num_samples if isinstance(num_samples, int) else 0
    return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(n)]}


def _check_optimizer(config: Any) -> None:
    if isinstance(config, dict) and config.get("type") == "dimuon":
        raise HTTPError(400, UNDEFINED_BY_SDK["dimuon"])
    if config is not None and (not isinstance(config, dict) or config.get("type", "adamw") != "adamw"):
        raise HTTPError(400, f"optimizer {config!r} is not supported; this server trains with AdamW")


def _lora_config(raw: Any) -> types.LoraConfig | None:
    """Tinker's lora_config; None means a full fine-tune (a tinkerq extension the protocol allows)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise HTTPError(400, f"lora_config must be a map, got {raw!r}")
    known = {"rank", "seed", "train_mlp", "train_attn", "train_unembed"}
    try:
        return types.LoraConfig(**{k: v for k, v in raw.items() if k in known})
    except TypeError as exc:
        raise HTTPError(400, f"lora_config: {exc}") from None


def _ttl(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HTTPError(400, f"ttl_seconds must be a positive integer (seconds), got {value!r}")
    return value


def _model_input(raw: Any) -> types.ModelInput:
    chunks = raw["chunks"]
    tokens: list[int] = []
    for chunk in chunks:
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise ValueError(f"only encoded_text prompt chunks are served, got {chunk.get('type')!r}")
        tokens.extend(chunk["tokens"])
    return types.ModelInput.from_ints(tokens)


def _sampling_params(raw: Any) -> types.SamplingParams:
    known = {"max_tokens", "seed", "stop", "temperature", "top_k", "top_p"}
    return types.SamplingParams(**{k: v for k, v in dict(raw).items() if k in known})


__all__ = ["Gateway", "HTTPError", "UnknownModelError"]
