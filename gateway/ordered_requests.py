"""A training run's ordered requests (forward_backward, optim_step, the saves and loads), each accepted once on
any gateway: the SDK's ``seq_id`` is claimed in Redis, so a resend gets the original request id and is never
applied twice, and a request refused after its ``seq_id`` was read still fills that position (an ``echo``), so the
run's later requests are not held up by the hole. Each is posted as the worker session's sequence number
``seq_id + offset`` (gateway/service.py explains)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tinkerq import keys, optimizers
from tinkerq.errors import TinkerqError
from tinkerq.gateway import lookups, proto
from tinkerq.gateway.futures import Waiting
from tinkerq.gateway.http_errors import HTTPError
from tinkerq.gateway.records import PathError, TinkerPath, check_name, top_raised
from tinkerq.gateway.request_bodies import optim_params, optimizer_config, ttl_seconds
from tinkerq.gateway.training_runs import Run
from tinkerq.wire import messages

if TYPE_CHECKING:
    from tinkerq.gateway.parts import OrderedParts

log = logging.getLogger("tinkerq.gateway")


class OrderedRequests:
    def __init__(self, gw: OrderedParts) -> None:
        self.gw = gw

    def accept(self, tenant: str, model_id: Any, seq_id: Any, kind: str,
                 prepare: Callable[[Run, str], dict[str, Any]], *, tokens: int = 0) -> dict[str, Any]:
        """Accept request ``seq_id`` of a model once, on any gateway: ``prepare(run, request_id)`` checks it and
        returns its job (it may raise a user error, answered 400 after the position is filled)."""
        run = self.gw.runs.get(tenant, model_id)
        assert run is not None
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 1:
            raise HTTPError(400, f"seq_id must be an integer >= 1, got {seq_id!r}")
        claim = f"seq:{run.model_id}:{seq_id}"
        prior = self.gw.records.get_claim(claim)
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
            if not self.fill(run, seq_id, message):
                prior = self.gw.records.get_claim(claim)
                if prior is not None:
                    return self._resent(prior, kind, run, seq_id)
            raise (exc if isinstance(exc, HTTPError) else HTTPError(400, message)) from None
        post_at = self.gw.quotas.schedule(tenant, run.model_id, tokens)
        job.update(type="ordered", model_id=run.model_id, seq_id=seq_id, worker_seq=worker_seq, tokens=tokens,
                   post_at=post_at)
        waiting = None
        if post_at > time.time() + 0.05:
            waiting = Waiting("paused_rate_limit", f"this API key's max_tokens_per_minute holds it until "
                                                   f"{lookups.iso(post_at)}")
        # The future's record with the claim (one step): a claim must never name a future that does not exist.
        record, prior = self.gw.futures.record_claimed(tenant, kind, job, request_id=request_id, claim=claim,
                                                       value=f"{kind}|{request_id}", waiting=waiting,
                                                       after=top_raised(run.model_id, seq_id))
        if prior is not None:  # an earlier copy got there first, on another gateway
            self.gw.futures.discard(request_id)
            self.gw.jobs.forget(request_id)
            return self._resent(prior, kind, run, seq_id)
        self.gw.futures.begin(request_id, record)
        return {"request_id": request_id, "model_id": run.model_id}

    def fill(self, run: Run, seq_id: int, message: str) -> bool:
        """Claim position ``seq_id`` of ``run`` as refused with ``message`` and fill it on the worker (an ``echo``),
        so the run's later requests are not held up by it; the resend of that request gets the same refusal.
        False when the position was claimed already (the request was accepted, or refused, before)."""
        if self.gw.records.claim(f"seq:{run.model_id}:{seq_id}", f"refused|{message}") is not None:
            return False
        self.gw.records.raise_top(run.model_id, seq_id)
        run.client.skip(seq_id + run.offset, "refused by the gateway")
        return True

    def fill_refused(self, tenant: str, model_id: str, seq_id: int, message: str) -> bool:
        """Fill position ``seq_id`` of the tenant's run ``model_id`` after its request was answered without being
        taken (an unknown route or method, a malformed body, a refusal before the position was read: the app's
        SequenceGuard); nothing when the run is not the tenant's or the position is taken. True when filled."""
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 1:
            return False
        run = self.gw.runs.get(tenant, model_id, closed_ok=True)
        if run is None:
            return False
        filled = self.fill(run, seq_id, message)
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
            self.gw.store.with_retry(0).set(keys.gateway_body(request_id), body, self.gw.settings.gateway_keep_s * 6)
            self.gw.jobs.hint(request_id, call)
            return {"op": op, "finish": "loss",
                    "argsrepr": f"loss_fn={call.loss_fn} datums={len(call.data)} tokens={tokens}"}

        return self.accept(tenant, call.model_id, call.seq_id, kind, prepare, tokens=tokens)

    def optim_step(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        def prepare(run: Run, _request_id: str) -> dict[str, Any]:
            params = optim_params(body)
            # The run's optimizer, fixed at its creation (the worker checks it too).
            optimizers.check_matches(optimizers.config_of(run.record.get("optimizer")), params)
            return {"op": "optim_step", "finish": "optim", "body": messages.encode_optim(params),
                    "argsrepr": f"{params.type} lr={params.learning_rate:g}"}

        return self.accept(tenant, body.get("model_id"), body.get("seq_id"), "OptimStep", prepare)

    def save_weights(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        """save_state: weights + optimizer state, at ``tinker://<model>/weights/<name>``."""
        return self._save(tenant, body, "weights", "SaveWeights")

    def save_weights_for_sampler(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("path") is None:  # save_weights_and_get_sampling_client: a sampling snapshot, in memory
            return self.accept(tenant, body.get("model_id"), body.get("seq_id"), "SaveWeightsForSampler",
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
            ttl = ttl_seconds(body.get("ttl_seconds"))
            path = TinkerPath(run.model_id, segment, name)
            overwrite = body.get("overwrite", False)
            keep = self.gw.quotas.limits(tenant).keep_checkpoints
            if segment == "weights":
                if not isinstance(overwrite, bool):
                    raise HTTPError(400, f"overwrite must be true or false, got {overwrite!r}")
                if not overwrite and self.gw.records.get("checkpoint", str(path), tenant) is not None:
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

        return self.accept(tenant, body.get("model_id"), body.get("seq_id"), kind, prepare)

    # -- loading ----------------------------------------------------------------------------------------------

    async def load_weights(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        optimizer = body.get("optimizer")
        if not isinstance(optimizer, bool):
            raise HTTPError(400, f"optimizer must be true or false, got {optimizer!r}")
        if body.get("session_id") is None:  # legacy TrainingClient.load_state: an ordered request
            def prepare(_run: Run, _request_id: str) -> dict[str, Any]:
                checkpoint = self.gw.checkpoint(tenant, body.get("path"), segment="weights", readable=True)
                return {"op": "load_state", "finish": "load", "argsrepr": f"path={body.get('path')}",
                        "body": {"path": checkpoint["directory"], "optimizer": optimizer},
                        "args": {"path": body.get("path")}}

            return self.accept(tenant, body.get("model_id"), body.get("seq_id"), "LoadWeights", prepare)
        # create_training_client_from_state[_with_optimizer]: a new model whose first request is the load.
        session_id, model_seq_id = str(body.get("session_id")), body.get("model_seq_id")
        session = self.gw.session(tenant, session_id)
        if session["finished"]:
            raise HTTPError(400, f"session {session_id} is finished; create a new ServiceClient")
        model_id = f"{session_id}:train:{model_seq_id}"
        asked = optimizer_config(body.get("optimizer_config"))
        checkpoint = self.gw.checkpoint(tenant, body.get("path"), segment="weights", readable=True)
        # With its optimizer state: the optimizer it was saved with (absent: AdamW); weights only: the one asked for
        # (the SDK's optimizer_config "cannot override restored optimizer state").
        config = optimizers.config_of(checkpoint.get("optimizer")) if optimizer else asked
        if optimizer and body.get("optimizer_config") is not None and asked != config:
            raise HTTPError(400, f"{body.get('path')} holds the state of {optimizers.describe(config)}: "
                                 f"optimizer_config {optimizers.describe(asked)} cannot override a restored "
                                 f"optimizer's state (load the weights only to train them with another optimizer)")
        base_model = str(body.get("base_model") or checkpoint["base_model"])
        await self.gw.check_served(base_model)
        job = {"type": "create", "model_id": model_id, "session_id": session_id, "base_model": base_model,
               "lora": checkpoint.get("lora"), "optimizer": messages.encode_optimizer(config),
               "user_metadata": body.get("user_metadata"),
               "load": {"directory": checkpoint["directory"], "optimizer": optimizer, "path": body["path"]}}
        return {"request_id": self.gw.create_once(tenant, model_id, "LoadWeights", job), "model_id": model_id}
