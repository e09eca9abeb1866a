"""The gateway's logic: Tinker's HTTP requests turned into producer calls on the fleet, per tenant.

The gateway is a producer (one :class:`producer.ServiceClient`, one Redis connection, shared by every
tenant), and uses its public API only (tests/test_layering.py): ``open_training_client`` /
``attach_training_client`` for worker sessions, ``TrainingClient.submit(op, body, seq_id=...)`` and ``skip``
for requests. Training requests keep the SDK's ``seq_id``: a model's request ``n`` is posted as the worker
session's sequence number ``n + offset`` (offset 1 for a model made by create-via-load, whose first
request was the load), so the worker's own ordering (worker/ordering.py) applies them in the SDK's order,
buffers what arrives early (the SDK sends a forward_backward's chunks last-first) and fails a gap after the
gap timeout. A resend of ``(model_id, seq_id)`` gets the original request id and is never applied twice.
A request the gateway refuses after reading its ``seq_id`` still fills that position (``skip``: an ``echo``), so
the model's later requests are not held up by the hole.

Every id and path belongs to the tenant whose API key made it (gateway/records.py); anything else is 404.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from tinkerq import types
from tinkerq.errors import TinkerqError, UnknownModelError
from tinkerq.gateway import proto
from tinkerq.gateway.futures import Answer, Futures
from tinkerq.gateway.records import PathError, Records, TinkerPath, check_name, checkpoint_record
from tinkerq.producer.client import ServiceClient, TrainingClient
from tinkerq.producer.futures import APIFuture
from tinkerq.producer.sampling import SamplingClient
from tinkerq.settings import Settings
from tinkerq.store import RedisStore
from tinkerq.validation import validate_adam, validate_lora
from tinkerq.wire import messages

log = logging.getLogger("tinkerq.gateway")

KEPT_SEQ_IDS = 4096  # per model / sampler: resends older than this many requests are not recognised


class HTTPError(Exception):
    """An answer other than 200, with a JSON ``{"detail": ...}`` body the SDK shows to the user."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def not_found(what: str, ident: Any) -> HTTPError:
    # Another tenant's object gets the same answer as a missing one: ids leak nothing.
    return HTTPError(404, f"{what} {ident!r} not found (unknown, expired, or made with another API key)")


def submit_error(exc: TinkerqError) -> HTTPError:
    """A fleet error met while accepting a request: user errors are final (400), server errors retried (503)."""
    return HTTPError(400 if exc.is_user_error else 503, exc.message)


@dataclass
class Run:
    """A live training run: the producer's client for its worker session, and its recent sequence ids."""

    model_id: str  # the SDK's: the training run's id, <session>:train:<n> (the worker session's is client.model_id)
    record: dict[str, Any]
    client: TrainingClient
    offset: int  # worker sequence number = SDK seq_id + offset
    seen: OrderedDict[int, tuple[str, str]] = field(default_factory=OrderedDict)  # seq_id -> (request id, type)


@dataclass
class Sampler:
    """A sampling session: the SDK's ``sampling_session_id``, a sampler id (``<session>:sample:<n>``, or
    ``<run>:sample:<seq_id>`` for save_weights_and_get_sampling_client), never a model_id."""

    sampler_id: str
    record: dict[str, Any]
    client: SamplingClient
    seen: OrderedDict[int, dict[str, Any]] = field(default_factory=OrderedDict)  # seq_id -> promise


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.service = ServiceClient(settings=settings)
        store = self.service.connection.store
        if not isinstance(store, RedisStore):
            raise TinkerqError("the gateway needs a Redis broker (redis://, rediss:// or sentinel://), not memory://")
        self.store = store
        self.records = Records(store)
        self.futures = Futures(poll_s=settings.gateway_poll_s, keep_s=settings.gateway_keep_s)
        self.runs: dict[str, Run] = {}
        self.samplers: dict[str, Sampler] = {}
        self.creating: dict[str, str] = {}  # model id -> request id of its create_model / create-via-load

    def close(self) -> None:
        self.futures.cancel_all()
        self.service.close()

    # -- sessions ---------------------------------------------------------------------------------------------

    def create_session(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        session_id = str(uuid.uuid4())
        self.records.put("session", session_id, {
            "tenant": tenant, "created": time.time(), "finished": False,
            "tags": body.get("tags") or [], "user_metadata": body.get("user_metadata"),
        })
        return {"session_id": session_id, "type": "create_session"}

    def session(self, tenant: str, session_id: Any) -> dict[str, Any]:
        record = self.records.get("session", str(session_id), tenant)
        if record is None:
            raise not_found("session", session_id)
        return record

    def heartbeat(self, tenant: str, session_id: str) -> dict[str, Any]:
        record = self.session(tenant, session_id)
        if record["finished"]:
            raise HTTPError(410, f"session {session_id} is finished")  # the SDK stops heartbeating
        self.records.touch("session", session_id)
        return {"type": "session_heartbeat"}

    async def finish_session(self, tenant: str, session_id: str) -> dict[str, Any]:
        """End the session and free its models' memory on the workers (their checkpoints stay)."""
        record = self.session(tenant, session_id)
        record["finished"] = True
        self.records.put("session", session_id, record)
        for run in [r for r in self.runs.values() if r.record["session_id"] == session_id]:
            self._drop_run(run)
            await asyncio.to_thread(_close_quietly, run.client)
        return {}

    # -- training runs ----------------------------------------------------------------------------------------

    async def create_model(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        session_id, model_seq_id = body["session_id"], body["model_seq_id"]
        session = self.session(tenant, session_id)
        if session["finished"]:
            raise HTTPError(400, f"session {session_id} is finished; create a new ServiceClient")
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.creating:  # a resend
            return {"request_id": self.creating[model_id], "model_id": model_id}
        _check_optimizer(body.get("optimizer_config"))
        base_model = str(body["base_model"])
        lora = _lora_config(body.get("lora_config"))
        if lora is not None:
            validate_lora(lora, max_rank=self.settings.max_lora_rank)  # refused now (400), not in the future
        await self._check_served(base_model)

        async def work() -> Answer:
            client = await asyncio.to_thread(self.service.open_training_client, base_model, lora)
            self._add_run(tenant, model_id, session_id, base_model, lora, client, offset=0,
                          user_metadata=body.get("user_metadata"))
            return Answer(json={"model_id": model_id, "type": "create_model"})

        request_id = self.futures.add(tenant, "CreateModel", work())
        self.creating[model_id] = request_id
        return {"request_id": request_id, "model_id": model_id}

    def _add_run(self, tenant: str, model_id: str, session_id: str, base_model: str, lora: types.LoraConfig | None,
                 client: TrainingClient, *, offset: int, user_metadata: Any) -> Run:
        record = {
            "tenant": tenant, "model_id": model_id, "session_id": session_id, "base_model": base_model,
            "lora": None if lora is None else messages.encode_lora(lora), "created": time.time(),
            "last_request_time": time.time(), "user_metadata": user_metadata,
            # What a restarted gateway needs to drive the same worker session again (see run()).
            "info": dataclasses.asdict(client.info), "offset": offset, "closed": False,
        }
        self.records.put("run", model_id, record)
        run = Run(model_id, record, client, offset)
        self.runs[model_id] = run
        return run

    def run(self, tenant: str, model_id: Any) -> Run:
        run = self.runs.get(str(model_id))
        if run is None:
            run = self._reopen(tenant, str(model_id))
        if run is None or run.record["tenant"] != tenant:
            raise not_found("model", model_id)
        return run

    def _reopen(self, tenant: str, model_id: str) -> Run | None:
        """A run this gateway does not hold (it restarted, or another gateway made it): its worker session
        lives on, so drive it again from its record. Resends of requests already applied are safe: the
        worker answers a repeated sequence number from its kept replies, never applying it twice."""
        record = self.records.get("run", model_id, tenant)
        if record is None or record.get("closed") or not isinstance(record.get("info"), dict):
            return None
        client = self.service.attach_training_client(types.ModelInfo(**record["info"]))
        run = Run(model_id, record, client, int(record["offset"]))
        self.runs[model_id] = run
        return run

    def _drop_run(self, run: Run) -> None:
        self.runs.pop(run.model_id, None)
        self.creating.pop(run.model_id, None)
        run.record["closed"] = True
        self.records.put("run", run.model_id, run.record)

    def get_info(self, tenant: str, model_id: str) -> dict[str, Any]:
        run = self.run(tenant, model_id)
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
        run = self.run(tenant, model_id)

        async def work() -> Answer:
            await asyncio.to_thread(run.client.close)
            self._drop_run(run)
            return Answer(json={"model_id": model_id, "type": "unload_model"})

        return {"request_id": self.futures.add(tenant, "UnloadModel", work()), "model_id": model_id}

    # -- ordered training requests ------------------------------------------------------------------------------

    def _ordered(self, tenant: str, model_id: Any, seq_id: Any, kind: str,
                 prepare: Callable[[Run, int], Awaitable[Answer]]) -> dict[str, Any]:
        """Accept request ``seq_id`` of a model once: ``prepare(run, worker_seq)`` checks and posts it (and
        may raise a user error, which is answered 400 after the position is filled)."""
        run = self.run(tenant, model_id)
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 1:
            raise HTTPError(400, f"seq_id must be an integer >= 1, got {seq_id!r}")
        if seq_id in run.seen:
            request_id, seen_kind = run.seen[seq_id]
            if seen_kind != kind:
                raise HTTPError(400, f"seq_id {seq_id} of model {model_id} was already used by a {seen_kind} request")
            if request_id.startswith("refused:"):
                raise HTTPError(400, request_id.removeprefix("refused:"))
            return {"request_id": request_id, "model_id": run.model_id}
        worker_seq = seq_id + run.offset
        try:
            work = prepare(run, worker_seq)
        except (TinkerqError, PathError, HTTPError) as exc:
            message = exc.message if isinstance(exc, TinkerqError) else str(exc)
            # Fill the position so the requests after it run; the resend of this one gets the same answer.
            run.client.skip(worker_seq, "refused by the gateway")
            self._remember(run.seen, seq_id, (f"refused:{message}", kind))
            raise (exc if isinstance(exc, HTTPError) else HTTPError(400, message)) from None
        request_id = self.futures.add(tenant, kind, work)
        self._remember(run.seen, seq_id, (request_id, kind))
        run.record["last_request_time"] = time.time()
        return {"request_id": request_id, "model_id": run.model_id}

    @staticmethod
    def _remember(seen: OrderedDict[int, Any], seq_id: int, value: Any) -> None:
        seen[seq_id] = value
        while len(seen) > KEPT_SEQ_IDS:
            seen.popitem(last=False)

    def forward_backward(self, tenant: str, body: bytes) -> dict[str, Any]:
        call = proto.decode_forward_backward_request(body)  # a user error here: no seq_id to fill
        kind = "Forward" if call.forward_only else "ForwardBackward"

        def prepare(run: Run, worker_seq: int) -> Awaitable[Answer]:
            run.client.check_loss_request(call.data, call.loss_fn, call.loss_fn_config)
            tokens = sum(d.model_input.length for d in call.data)
            future = run.client.submit(
                "forward" if call.forward_only else "forward_backward",
                messages.encode_loss_request(call.data, call.loss_fn, call.loss_fn_config),
                seq_id=worker_seq, decode=messages.decode_forward_backward_output,
                argsrepr=f"loss_fn={call.loss_fn} datums={len(call.data)} tokens={tokens}",
            )
            return _proto_answer(future, proto.encode_forward_backward_output)

        return self._ordered(tenant, call.model_id, call.seq_id, kind, prepare)

    def optim_step(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        def prepare(run: Run, worker_seq: int) -> Awaitable[Answer]:
            if body.get("optimizer_params") is not None:
                raise HTTPError(400, "only AdamW is served: send adam_params (optimizer_params is not supported)")
            raw = body.get("adam_params") or {}
            params = types.AdamParams(**{k: raw[k] for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay",
                                                             "grad_clip_norm") if k in raw})
            validate_adam(params)
            future = run.client.submit("optim_step", messages.encode_adam(params), seq_id=worker_seq,
                                       decode=messages.decode_optim_step_response,
                                       argsrepr=f"lr={params.learning_rate:g}")

            async def answer() -> Answer:
                out = await future
                return Answer(json={"metrics": dict(out.metrics or {}), "type": "optim_step"})

            return answer()

        return self._ordered(tenant, body.get("model_id"), body.get("seq_id"), "OptimStep", prepare)

    def save_weights(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        """save_state: weights + optimizer state, at ``tinker://<model>/weights/<name>``."""
        return self._save(tenant, body, "weights", "SaveWeights")

    def save_weights_for_sampler(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("path") is None:  # save_weights_and_get_sampling_client: a sampling snapshot, in memory
            return self._ordered(tenant, body.get("model_id"), body.get("seq_id"), "SaveWeightsForSampler",
                                 lambda run, worker_seq: self._sampling_snapshot(tenant, run, worker_seq, body))
        return self._save(tenant, body, "sampler_weights", "SaveWeightsForSampler")

    def _save(self, tenant: str, body: dict[str, Any], segment: str, kind: str) -> dict[str, Any]:
        def prepare(run: Run, worker_seq: int) -> Awaitable[Answer]:
            name = check_name(body.get("path"))
            ttl = _ttl(body.get("ttl_seconds"))
            path = TinkerPath(run.model_id, segment, name)
            overwrite = body.get("overwrite", False)
            if segment == "weights":
                if not isinstance(overwrite, bool):
                    raise HTTPError(400, f"overwrite must be true or false, got {overwrite!r}")
                if not overwrite and self.records.get("checkpoint", str(path), tenant) is not None:
                    raise HTTPError(400, f"checkpoint {path} exists; pass overwrite=True or choose another name")
                op, request = "save_state", {"name": name, "ttl_seconds": ttl, "overwrite": overwrite}
            else:
                op, request = "save_weights_for_sampler", {"name": name, "merged": False, "ttl_seconds": ttl}
            future = run.client.submit(op, request, seq_id=worker_seq, argsrepr=f"name={name}")

            async def answer() -> Answer:
                out = await future
                record = checkpoint_record(tenant, path, str(out["path"]), run.record, ttl, body.get("user_metadata"))
                self.records.put("checkpoint", str(path), record, ttl_s=ttl)
                return Answer(json={"path": str(path), "type": "save_weights" if segment == "weights"
                                    else "save_weights_for_sampler"})

            return answer()

        return self._ordered(tenant, body.get("model_id"), body.get("seq_id"), kind, prepare)

    def _sampling_snapshot(self, tenant: str, run: Run, worker_seq: int,
                           body: dict[str, Any]) -> Awaitable[Answer]:
        """Freeze the run's weights on its worker (create_sampler) and open a sampling session on them."""
        seq_id = body["seq_id"]
        future = run.client.submit("create_sampler", {}, seq_id=worker_seq, decode=lambda b: str(b["sampler_id"]))

        async def answer() -> Answer:
            snapshot_id = await future  # the worker's name for the frozen weights
            sampler_id = f"{run.model_id}:sample:{seq_id}"
            await self._add_sampler(tenant, sampler_id, run.record["base_model"], {"snapshot": snapshot_id}, None)
            return Answer(json={"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})

        return answer()

    # -- loading ----------------------------------------------------------------------------------------------

    async def load_weights(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        optimizer = body.get("optimizer")
        if not isinstance(optimizer, bool):
            raise HTTPError(400, f"optimizer must be true or false, got {optimizer!r}")
        if body.get("session_id") is None:  # legacy TrainingClient.load_state: an ordered request
            def prepare(run: Run, worker_seq: int) -> Awaitable[Answer]:
                checkpoint = self._checkpoint(tenant, body.get("path"), segment="weights")
                future = run.client.submit("load_state", {"path": checkpoint["directory"], "optimizer": optimizer},
                                           seq_id=worker_seq, argsrepr=f"path={body.get('path')}")
                return _json_answer(future, lambda _out: {"path": body["path"], "model_id": run.model_id,
                                                          "type": "load_weights"})

            return self._ordered(tenant, body.get("model_id"), body.get("seq_id"), "LoadWeights", prepare)
        return await self._create_from_state(tenant, body, optimizer)

    async def _create_from_state(self, tenant: str, body: dict[str, Any], optimizer: bool) -> dict[str, Any]:
        """create_training_client_from_state[_with_optimizer]: a new model whose first request is the load."""
        session_id, model_seq_id = str(body.get("session_id")), body.get("model_seq_id")
        session = self.session(tenant, session_id)
        if session["finished"]:
            raise HTTPError(400, f"session {session_id} is finished; create a new ServiceClient")
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.creating:
            return {"request_id": self.creating[model_id], "model_id": model_id}
        _check_optimizer(body.get("optimizer_config"))
        checkpoint = self._checkpoint(tenant, body.get("path"), segment="weights")
        base_model = str(body.get("base_model") or checkpoint["base_model"])
        await self._check_served(base_model)
        lora = None if checkpoint.get("lora") is None else messages.decode_lora(checkpoint["lora"])

        async def work() -> Answer:
            client = await asyncio.to_thread(self.service.open_training_client, base_model, lora)
            # The load is the worker session's request 1; the SDK's requests 1, 2... follow as 2, 3...
            load = client.submit("load_state", {"path": checkpoint["directory"], "optimizer": optimizer}, seq_id=1,
                                 argsrepr=f"path={body['path']}")
            try:
                await load
            except TinkerqError:
                await asyncio.to_thread(_close_quietly, client)
                raise
            self._add_run(tenant, model_id, session_id, base_model, lora, client, offset=1,
                          user_metadata=body.get("user_metadata"))
            return Answer(json={"path": body["path"], "model_id": model_id, "type": "load_weights"})

        request_id = self.futures.add(tenant, "LoadWeights", work())
        self.creating[model_id] = request_id
        return {"request_id": request_id, "model_id": model_id}

    def _checkpoint(self, tenant: str, path: Any, *, segment: str | None = None) -> dict[str, Any]:
        try:
            parsed = TinkerPath.parse(path)
        except PathError as exc:
            raise HTTPError(400, str(exc)) from None
        if segment is not None and parsed.segment != segment:
            what = "save_state (tinker://.../weights/...)" if segment == "weights" else \
                "save_weights_for_sampler (tinker://.../sampler_weights/...)"
            raise HTTPError(400, f"{path} cannot be used here: this needs a checkpoint made by {what}")
        record = self.records.get("checkpoint", str(parsed), tenant)
        if record is None:
            raise not_found("checkpoint", path)
        return record

    # -- sampling ---------------------------------------------------------------------------------------------

    async def create_sampling_session(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        session_id, k = body.get("session_id"), body.get("sampling_session_seq_id")
        self.session(tenant, session_id)
        sampler_id = f"{session_id}:sample:{k}"
        if sampler_id in self.samplers:  # a resend
            return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}
        model_path = body.get("model_path")
        if model_path is not None:
            checkpoint = self._checkpoint(tenant, model_path, segment="sampler_weights")
            base_model = str(body.get("base_model") or checkpoint["base_model"])
            source: dict[str, Any] = {"path": checkpoint["directory"]}
        elif body.get("base_model"):
            base_model, source = str(body["base_model"]), {"base": True}
        else:
            raise HTTPError(400, "create_sampling_session needs model_path (a tinker:// sampler path) or base_model")
        await self._check_served(base_model)
        await self._add_sampler(tenant, sampler_id, base_model, source, model_path)
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    async def _add_sampler(self, tenant: str, sampler_id: str, base_model: str, source: dict[str, Any],
                           model_path: str | None) -> None:
        try:
            client = await asyncio.to_thread(SamplingClient, self.service, source, base_model)
        except TinkerqError as exc:
            raise submit_error(exc) from None
        record = {"tenant": tenant, "sampler_id": sampler_id, "base_model": base_model, "model_path": model_path,
                  "source": source}
        self.records.put("sampler", sampler_id, record)
        self.samplers[sampler_id] = Sampler(sampler_id, record, client)

    def sampler(self, tenant: str, sampler_id: Any) -> Sampler:
        sampler = self.samplers.get(str(sampler_id))
        if sampler is None:  # made before a restart, or by another gateway: its weights are still named
            record = self.records.get("sampler", str(sampler_id), tenant)
            if record is not None:
                try:
                    client = SamplingClient(self.service, record["source"], record["base_model"])
                except TinkerqError as exc:
                    raise submit_error(exc) from None
                sampler = self.samplers[str(sampler_id)] = Sampler(str(sampler_id), record, client)
        if sampler is None or sampler.record["tenant"] != tenant:
            raise not_found("sampling session", sampler_id)
        return sampler

    def get_sampler(self, tenant: str, sampler_id: str) -> dict[str, Any]:
        record = self.sampler(tenant, sampler_id).record
        return {"sampler_id": sampler_id, "base_model": record["base_model"], "model_path": record["model_path"]}

    def asample(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        sampler = self.sampler(tenant, body.get("sampling_session_id"))
        seq_id = body.get("seq_id")
        if isinstance(seq_id, int) and seq_id in sampler.seen:  # a resend after a 429 or a lost answer
            return sampler.seen[seq_id]
        for option, default in (("topk_prompt_logprobs", 0), ("topk_sample_logprobs", 0), ("prompt_alt_tokens_k", 0),
                                ("target_prompt_logprobs", None), ("record_stability_info", False)):
            if body.get(option) not in (default, None):
                raise HTTPError(400, f"{option} is not supported by this server; leave it at its default "
                                     f"(record_stability_info is for stable_reinforce: use importance_sampling)")
        try:
            prompt = _model_input(body.get("prompt"))
            params = _sampling_params(body.get("sampling_params"))
        except (KeyError, TypeError, ValueError) as exc:
            raise HTTPError(400, f"malformed sample request: {exc}") from None
        num_samples = body.get("num_samples", 1)
        future = sampler.client.sample(prompt, num_samples, params,
                                       include_prompt_logprobs=bool(body.get("prompt_logprobs")),
                                       prompt_logprobs_last_n=body.get("prompt_logprobs_last_n"))
        if future.done():  # refused by the producer's checks: a final 400, not a failed future
            error = future.exception(0)
            if error is not None:
                raise HTTPError(400 if error.is_user_error else 503, error.message)
        request_id = self.futures.add(tenant, "Sample", _proto_answer(future, proto.encode_sample_response))
        n = num_samples if isinstance(num_samples, int) else 0
        promise = {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(n)]}
        if isinstance(seq_id, int):
            self._remember(sampler.seen, seq_id, promise)
        return promise

    # -- capabilities and REST lookups ----------------------------------------------------------------------------

    async def capabilities(self) -> dict[str, Any]:
        workers = await asyncio.to_thread(self.service.connection.workers_serving)
        models: dict[str, dict[str, Any]] = {}
        for w in workers:
            entry = models.setdefault(w["base_model"], {"model_name": w["base_model"], "trainable": False,
                                                        "sampleable": True, "max_context_length": w.get("max_seq_len")})
            entry["trainable"] = entry["trainable"] or w.get("role", "trainer") != "sampler"
        return {"supported_models": [models[name] for name in sorted(models)]}

    async def _check_served(self, base_model: str) -> None:
        if not await asyncio.to_thread(self.service.connection.workers_serving, base_model):
            served = [m["model_name"] for m in (await self.capabilities())["supported_models"]]
            raise HTTPError(400, f"base model {base_model!r} is not served here; served now: {served or 'none'}")

    def training_run(self, tenant: str, run_id: str) -> dict[str, Any]:
        record = self.records.get("run", run_id, tenant)
        if record is None:
            raise not_found("training run", run_id)
        return self._training_run_view(record)

    def training_runs(self, tenant: str, limit: int, offset: int) -> dict[str, Any]:
        records = sorted(self.records.scan("run", tenant), key=lambda r: r["created"], reverse=True)
        page = records[offset:offset + limit]
        return {"training_runs": [self._training_run_view(r) for r in page],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(records)}}

    def _training_run_view(self, record: dict[str, Any]) -> dict[str, Any]:
        lora = record.get("lora")
        checkpoints = self.records.scan("checkpoint", record["tenant"], f"tinker://{record['model_id']}/")
        last = {kind: max((c for c in checkpoints if c["checkpoint_type"] == kind), key=lambda c: c["time"],
                          default=None) for kind in ("training", "sampler")}
        run = self.runs.get(record["model_id"])
        last_request = (run.record if run is not None else record)["last_request_time"]
        return {
            "training_run_id": record["model_id"], "base_model": record["base_model"], "model_owner": record["tenant"],
            "is_lora": lora is not None, "lora_rank": None if lora is None else lora["rank"], "corrupted": False,
            "last_request_time": _iso(last_request), "user_metadata": _str_map(record.get("user_metadata")),
            "last_checkpoint": None if last["training"] is None else _checkpoint_view(last["training"]),
            "last_sampler_checkpoint": None if last["sampler"] is None else _checkpoint_view(last["sampler"]),
        }

    def list_checkpoints(self, tenant: str, run_id: str) -> dict[str, Any]:
        self.training_run(tenant, run_id)
        records = sorted(self.records.scan("checkpoint", tenant, f"tinker://{run_id}/"), key=lambda c: c["time"])
        return {"checkpoints": [_checkpoint_view(c) for c in records]}

    def delete_checkpoint(self, tenant: str, run_id: str, checkpoint_id: str) -> dict[str, Any]:
        path = f"tinker://{run_id}/{checkpoint_id}"
        self._checkpoint(tenant, path)
        self.records.delete("checkpoint", path)
        return {}

    def weights_info(self, tenant: str, tinker_path: Any) -> dict[str, Any]:
        record = self._checkpoint(tenant, tinker_path)
        lora = record.get("lora")
        info: dict[str, Any] = {"base_model": record["base_model"], "is_lora": lora is not None,
                                "optimizer_config": {"type": "adamw"}}
        if lora is not None:
            info.update({"lora_rank": lora["rank"], "train_unembed": lora.get("train_unembed"),
                         "train_mlp": lora.get("train_mlp"), "train_attn": lora.get("train_attn")})
        return info


# -- helpers ----------------------------------------------------------------------------------------------------


async def _proto_answer(future: APIFuture[Any], encode: Callable[[Any], bytes]) -> Answer:
    return Answer(proto=encode(await future))


async def _json_answer(future: APIFuture[Any], view: Callable[[Any], dict[str, Any]]) -> Answer:
    return Answer(json=view(await future))


def _close_quietly(client: TrainingClient) -> None:
    try:
        client.close()
    except TinkerqError as exc:  # the worker may be gone already: nothing left to free
        log.info("closing %s: %s", client.model_id, exc.message)


def _check_optimizer(config: Any) -> None:
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


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()


def _str_map(value: Any) -> dict[str, str] | None:
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else None


def _checkpoint_view(record: dict[str, Any]) -> dict[str, Any]:
    return {
        "checkpoint_id": record["checkpoint_id"], "checkpoint_type": record["checkpoint_type"],
        "time": _iso(record["time"]), "tinker_path": record["tinker_path"], "public": False,
        "user_metadata": _str_map(record.get("user_metadata")),
        "expires_at": None if record.get("expires_at") is None else _iso(record["expires_at"]),
    }


__all__ = ["Gateway", "HTTPError", "UnknownModelError"]
