"""The gateway's sampling sessions (the SDK's ``sampling_session_id``) and their sample requests: each session a
producer :class:`~tinkerq.producer.sampling.SamplingClient` over saved weights, a base model or a training run's
snapshot, its record in Redis (any gateway serves it), the clients served lately kept at hand (LRU); each sample
counted against the key's max_sampling_inflight and claimed by its ``seq_id`` so a resend is never sampled twice."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tinkerq import keys, types
from tinkerq.errors import TinkerqError
from tinkerq.gateway.http_errors import HTTPError, not_found, submit_error
from tinkerq.gateway.request_bodies import model_input, sample_promise, sampling_params
from tinkerq.gateway.sample_options import STABILITY_REFUSAL, sample_options
from tinkerq.gateway.training_runs import ClientCache
from tinkerq.producer.sampling import SamplingClient

if TYPE_CHECKING:
    from tinkerq.gateway.parts import SamplerParts


@dataclass
class Sampler:
    """A sampling session: the SDK's ``sampling_session_id``, a sampler id (``<session>:sample:<n>``, or
    ``<run>:sample:<seq_id>`` for save_weights_and_get_sampling_client), never a model_id."""

    sampler_id: str
    record: dict[str, Any]
    client: SamplingClient


class Samplers:
    def __init__(self, gw: SamplerParts) -> None:
        self.gw = gw
        self._samplers: ClientCache[Sampler] = ClientCache()

    async def create_sampling_session(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        session_id, k = body.get("session_id"), body.get("sampling_session_seq_id")
        self.gw.session(tenant, session_id)
        sampler_id = f"{session_id}:sample:{k}"
        if self.gw.records.get("sampler", sampler_id, tenant) is not None:  # a resend, to any gateway
            return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}
        model_path = body.get("model_path")
        if model_path is not None:
            checkpoint = self.gw.checkpoint(tenant, model_path, segment="sampler_weights", readable=True)
            base_model = str(body.get("base_model") or checkpoint["base_model"])
            source: dict[str, Any] = {"path": checkpoint["directory"]}
        elif body.get("base_model"):
            base_model, source = str(body["base_model"]), {"base": True}
        else:
            raise HTTPError(400, "create_sampling_session needs model_path (a tinker:// sampler path) or base_model")
        await self.gw.check_served(base_model)
        await self.add(tenant, sampler_id, base_model, source, model_path)
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    async def add(self, tenant: str, sampler_id: str, base_model: str, source: dict[str, Any],
                  model_path: str | None) -> None:
        try:
            client = await asyncio.to_thread(SamplingClient, self.gw.service, source, base_model)
        except TinkerqError as exc:
            raise submit_error(exc) from None
        record = {"tenant": tenant, "sampler_id": sampler_id, "base_model": base_model, "model_path": model_path,
                  "source": source, "session_id": sampler_id.split(":", 1)[0]}
        self.gw.records.put("sampler", sampler_id, record)
        self._samplers.put(sampler_id, Sampler(sampler_id, record, client))

    def get(self, tenant: str, sampler_id: Any) -> Sampler:
        sampler = self._samplers.get(str(sampler_id))
        if sampler is None:  # made by another gateway, or before a restart: its weights are still named
            record = self.gw.records.get("sampler", str(sampler_id), tenant)
            if record is not None:
                try:
                    client = SamplingClient(self.gw.service, record["source"], record["base_model"])
                except TinkerqError as exc:
                    raise submit_error(exc) from None
                sampler = self._samplers.put(str(sampler_id), Sampler(str(sampler_id), record, client))
        if sampler is None or sampler.record["tenant"] != tenant:
            raise not_found("sampling session", sampler_id)
        return sampler

    def info(self, tenant: str, sampler_id: str) -> dict[str, Any]:
        record = self.get(tenant, sampler_id).record
        return {"sampler_id": sampler_id, "base_model": record["base_model"], "model_path": record["model_path"]}

    def asample(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        sampler = self.get(tenant, body.get("sampling_session_id"))
        seq_id = body.get("seq_id")
        request_id = uuid.uuid4().hex
        claim = f"sample:{sampler.sampler_id}:{seq_id}" if isinstance(seq_id, int) else None
        if claim is not None:
            prior = self.gw.records.get_claim(claim)
            if prior is not None:  # a resend after a 429 or a lost answer, to any gateway
                return sample_promise(prior, body.get("num_samples", 1))
        prompt, params, options = self.sample_request(body)
        if not self.gw.quotas.try_start_sample(tenant, request_id):
            limit = self.gw.quotas.limits(tenant).max_sampling_inflight
            raise HTTPError(429, f"this API key has {limit} sampling requests in flight (max_sampling_inflight); "
                                 f"retry when some finish", retry_after_s=1.0)
        job = {"type": "sample", "sampler_id": sampler.sampler_id, "request": body}
        # The future's record with the claim (see OrderedRequests.accept), then the post.
        if claim is None:
            record, prior = self.gw.futures.record(tenant, "Sample", job, request_id=request_id), None
        else:
            record, prior = self.gw.futures.record_claimed(tenant, "Sample", job, request_id=request_id,
                                                           claim=claim, value=request_id)
        if prior is not None:
            self.gw.futures.discard(request_id)
            self.gw.quotas.end_sample(tenant, request_id)
            return sample_promise(prior, body.get("num_samples", 1))
        future = sampler.client.sample(prompt, body.get("num_samples", 1), params, **options)
        if future.done():  # refused by the producer's checks: a final 400, not a failed future
            error = future.exception(0)
            if error is not None:
                self.gw.quotas.end_sample(tenant, request_id)
                self.gw.futures.discard(request_id)
                if claim is not None:  # the resend is a new request
                    self.gw.store.with_retry(0).delete(keys.gateway_claim(claim))
                raise HTTPError(400 if error.is_user_error else 503, error.message)
        self.gw.jobs.hint(request_id, future)
        self.gw.futures.begin(request_id, record)
        return sample_promise(request_id, body.get("num_samples", 1))

    def sample_request(self, body: dict[str, Any]) -> tuple[types.ModelInput, types.SamplingParams, dict[str, Any]]:
        """The prompt, parameters and options of an asample body; HTTPError 400 when malformed or unsupported."""
        if body.get("record_stability_info"):
            raise HTTPError(400, STABILITY_REFUSAL)
        try:
            prompt = model_input(body.get("prompt"))
            params = sampling_params(body.get("sampling_params"))
            options = sample_options(body)  # top-k, target and alternative tokens (gateway/sample_options.py)
        except (KeyError, TypeError, ValueError) as exc:
            raise HTTPError(400, f"malformed sample request: {exc}") from None
        return prompt, params, {"include_prompt_logprobs": bool(body.get("prompt_logprobs")),
                                "prompt_logprobs_last_n": body.get("prompt_logprobs_last_n"), **options}

    def end_sample(self, tenant: str, request_id: str) -> None:
        self.gw.quotas.end_sample(tenant, request_id)
