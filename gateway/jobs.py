"""What a gateway future does, from its *job*: a JSON description any gateway can run (gateway/futures.py).

A job is written when the request is accepted, before anything is posted, so that the gateway that runs it
can be any gateway: the one that accepted it, or one that adopted it after that one died. Every job is safe to
run more than once:

* ``ordered``: one request of a training run, posted with the run's worker sequence number. A second post of
  the same number is answered by the worker from its kept reply, never applied twice. Its body (the SDK's
  protobuf for forward_backward) waits in Redis until the answer is stored.
* ``create``: a training run (create_model, or create-via-load). A run already recorded is answered as is; a
  worker session already opened for it (its id comes from the run's) is answered by its worker, not built again.
* ``unload``: closes the run's worker session after its last request.
* ``sample``: one sampling request. Run twice, it samples twice; the first answer stored is the answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import TYPE_CHECKING, Any

from tinkerq import keys, types, usage
from tinkerq.errors import CapacityError, RequestTimeoutError, ServerError, TinkerqError
from tinkerq.gateway import proto
from tinkerq.gateway.futures import Answer, Waiting
from tinkerq.gateway.records import TinkerPath, checkpoint_record
from tinkerq.gateway.sample_options import target_layout
from tinkerq.operations import OPERATIONS, PASS_OPS, PLOTTED
from tinkerq.wire import messages

if TYPE_CHECKING:
    from tinkerq.gateway.parts import JobParts
    from tinkerq.gateway.training_runs import Run

# The worker session of run M is uuid5(RUN_SESSIONS, M): a create re-run by another gateway (its first runner died
# after the worker built the session, before the run was recorded) gets the same session back, not a second one.
RUN_SESSIONS = uuid.UUID("5b0d1c2e-7a43-4f6e-9c1d-0a6f2e8b7c31")
CAPACITY_RETRY_S = 2.0  # how often a create held by a full fleet (or a key's client quota) is tried again
QUOTA_RETRY_S = 1.0


class Jobs:
    def __init__(self, gateway: JobParts) -> None:
        self.gw = gateway
        self._decoded: dict[str, Any] = {}  # request id -> the request as its accepting gateway decoded it

    def hint(self, request_id: str, decoded: Any) -> None:
        """Keep the decoded request for the job about to start here (an adopter decodes the stored body)."""
        self._decoded[request_id] = decoded

    def forget(self, request_id: str) -> None:
        self._decoded.pop(request_id, None)

    async def run(self, request_id: str, tenant: str, job: dict[str, Any]) -> Answer:
        kind = job.get("type")
        try:
            if kind == "ordered":
                return await self._ordered(request_id, tenant, job)
            if kind == "create":
                return await self._create(request_id, tenant, job)
            if kind == "unload":
                return await self._unload(tenant, job)
            if kind == "sample":
                return await self._sample(request_id, tenant, job)
            raise ServerError(f"unknown gateway job {kind!r}")
        finally:
            self._decoded.pop(request_id, None)

    # -- training runs --------------------------------------------------------------------------------------

    async def _create(self, request_id: str, tenant: str, job: dict[str, Any]) -> Answer:
        gw, model_id = self.gw, job["model_id"]
        done = await asyncio.to_thread(gw.records.get, "run", model_id, tenant)
        if done is None:
            lora = None if job.get("lora") is None else messages.decode_lora(job["lora"])
            optimizer = messages.decode_optimizer(job.get("optimizer"))  # absent (a job from before): AdamW
            client = await self._open(request_id, tenant, model_id, job["base_model"], lora, optimizer)
            load = job.get("load")
            if load is not None:  # the load is the worker session's request 1; the SDK's 1, 2... follow as 2, 3...
                try:
                    await client.submit("load_state", {"path": load["directory"], "optimizer": load["optimizer"]},
                                        seq_id=1, argsrepr=f"path={load['path']}")
                except TinkerqError:
                    await asyncio.to_thread(gw.runs.close_quietly, client)
                    raise
            await asyncio.to_thread(gw.runs.add, tenant, model_id, job, lora, client)
        if job.get("load") is not None:
            return Answer(json={"path": job["load"]["path"], "model_id": model_id, "type": "load_weights"})
        return Answer(json={"model_id": model_id, "type": "create_model"})

    async def _open(self, request_id: str, tenant: str, model_id: str, base_model: str,
                    lora: types.LoraConfig | None, optimizer: types.OptimizerConfig) -> Any:
        """A worker session for the run, once the key's quota and the fleet have room for it (waiting, not
        failing, while either is full: the poll says which)."""
        gw = self.gw
        waited_since = time.monotonic()
        while not await asyncio.to_thread(gw.runs.admit, tenant, model_id):
            await asyncio.to_thread(gw.futures.set_waiting, request_id, tenant, Waiting(
                "paused_rate_limit", "this API key holds its maximum of training clients (max_training_clients); "
                                     "it goes on when one of them is unloaded"))
            await asyncio.sleep(QUOTA_RETRY_S)
        session_id = uuid.uuid5(RUN_SESSIONS, model_id).hex
        while True:
            try:
                return await asyncio.to_thread(gw.service.open_training_client, base_model, lora,
                                               session_id=session_id, optimizer=optimizer)
            except (CapacityError, RequestTimeoutError) as exc:
                if isinstance(exc, RequestTimeoutError):
                    # No answer: maybe the worker that claimed this id is gone (its copy went to a dead queue).
                    # Later tries open a new session instead of asking after that one forever.
                    session_id = uuid.uuid4().hex
                if time.monotonic() - waited_since > gw.settings.gateway_capacity_wait_s:
                    await asyncio.to_thread(gw.runs.release, tenant, model_id)
                    raise
                await asyncio.to_thread(gw.futures.set_waiting, request_id, tenant,
                                        Waiting("paused_capacity", exc.message))
                await asyncio.sleep(CAPACITY_RETRY_S)
            except TinkerqError:
                await asyncio.to_thread(gw.runs.release, tenant, model_id)
                raise

    async def _unload(self, tenant: str, job: dict[str, Any]) -> Answer:
        gw = self.gw
        run = await asyncio.to_thread(gw.runs.get, tenant, job["model_id"], closed_ok=True)
        if run is not None:
            await asyncio.to_thread(gw.runs.close, run)
        return Answer(json={"model_id": job["model_id"], "type": "unload_model"})

    async def _ordered(self, request_id: str, tenant: str, job: dict[str, Any]) -> Answer:
        gw = self.gw
        delay = float(job.get("post_at") or 0) - time.time()
        if delay > 0:  # the key's token rate holds it (the poll says so); nothing is dropped
            await asyncio.sleep(delay)
        run = await asyncio.to_thread(gw.runs.get, tenant, job["model_id"])
        assert run is not None
        op, finish = job["op"], job["finish"]
        if op in PASS_OPS:  # a loss request: its body is the SDK's protobuf, kept in Redis until answered
            call = self._decoded.get(request_id)
            if call is None:
                raw = await asyncio.to_thread(gw.records.store.get, keys.gateway_body(request_id))
                if raw is None:
                    raise ServerError("this request's body expired before it was posted; send it again")
                call = proto.decode_forward_backward_request(raw)
            body = messages.encode_loss_request(call.data, call.loss_fn, call.loss_fn_config)
        else:
            body = dict(job["body"])
        # The registry's decoder for the reply (None: the map as it came); an unknown op is refused by submit.
        decode = OPERATIONS[op].decode_reply if op in OPERATIONS else None
        out = await run.client.submit(op, body, seq_id=int(job["worker_seq"]), decode=decode,
                                      argsrepr=str(job.get("argsrepr", "")))
        answer = await self._finish(finish, tenant, run, job, out)
        if op in PLOTTED:  # the console's curves (gateway/run_metrics.py)
            await asyncio.to_thread(gw.run_metrics.record, run.model_id, int(job["seq_id"]), op, out.metrics or {})
        # Usage (docs/operations.md): forward and forward_backward tokens are training tokens.
        counts = {usage.request_counter(op): 1, "training_tokens": int(job.get("tokens") or 0)}
        if finish == "save":
            counts.update(checkpoints=1, checkpoint_bytes=int(out.get("bytes") or 0))
        return dataclasses.replace(answer, usage=usage_of(tenant, run.record.get("session_id", ""), counts))

    async def _finish(self, finish: str, tenant: str, run: Run, job: dict[str, Any], out: Any) -> Answer:
        gw = self.gw
        if finish == "loss":
            return Answer(proto=proto.encode_forward_backward_output(out))
        if finish == "optim":
            return Answer(json={"metrics": dict(out.metrics or {}), "type": "optim_step"})
        if finish == "load":
            return Answer(json={"path": job["args"]["path"], "model_id": run.model_id, "type": "load_weights"})
        if finish == "save":
            args = job["args"]
            path = TinkerPath.parse(args["path"])
            record = checkpoint_record(tenant, path, str(out["path"]), run.record, args.get("ttl"),
                                       args.get("user_metadata"))
            record["bytes"] = int(out.get("bytes") or 0)
            await asyncio.to_thread(gw.records.put, "checkpoint", str(path), record, ttl_s=args.get("ttl"))
            await asyncio.to_thread(gw.audit.record, tenant, "checkpoint_create", model_id=run.model_id,
                                    tinker_path=str(path), ttl_seconds=args.get("ttl"))
            for name in out.get("pruned") or ():  # the key's retention removed these on the worker
                await asyncio.to_thread(gw.records.delete, "checkpoint", str(TinkerPath(run.model_id, path.segment,
                                                                                          str(name))))
            if path.segment == "external_weights":  # Tinker's answer says the archive's size too
                return Answer(json={"path": str(path), "size_bytes": record["bytes"], "type": "save_weights_external"})
            return Answer(json={"path": str(path), "type": "save_weights" if path.segment == "weights"
                                else "save_weights_for_sampler"})
        if finish == "snapshot":  # save_weights_and_get_sampling_client: a sampling session on frozen weights
            sampler_id = f"{run.model_id}:sample:{job['seq_id']}"
            await gw.samplers.add(tenant, sampler_id, run.record["base_model"], {"snapshot": str(out["sampler_id"])},
                                 None)
            return Answer(json={"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})
        raise ServerError(f"unknown way to finish a gateway job: {finish!r}")

    # -- sampling -----------------------------------------------------------------------------------------------

    async def _sample(self, request_id: str, tenant: str, job: dict[str, Any]) -> Answer:
        gw = self.gw
        try:
            sampler = await asyncio.to_thread(gw.samplers.get, tenant, job["sampler_id"])
            prompt, params, options = gw.samplers.sample_request(job["request"])
            future = self._decoded.get(request_id)  # posted by the accepting gateway; an adopter samples again
            if future is None:
                future = sampler.client.sample(prompt, job["request"].get("num_samples", 1), params, **options)
            out: types.SampleResponse = await future
        finally:
            await asyncio.to_thread(gw.samplers.end_sample, tenant, request_id)
        sampled = sum(len(s.tokens) for s in out.sequences)
        cached = int(getattr(out, "prompt_cache_hit_tokens", 0) or 0)
        return Answer(proto=proto.encode_sample_response(out, target_layout(job["request"])), usage=usage_of(
            tenant, sampler.record.get("session_id", ""), {
                usage.request_counter("sample"): 1, "prefill_tokens": prompt.length - cached,
                "cached_prefill_tokens": cached, "sampled_tokens": sampled}))


def usage_of(tenant: str, session_id: str, counts: dict[str, int]) -> dict[str, Any]:
    """What an answer used, stored with it: the usage of the answer the client gets is the one counted."""
    return {"tenant": tenant, "session_id": session_id, "counts": counts}
