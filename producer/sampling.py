"""SamplingClient: samples from a snapshot, saved weights, or the base model, on any worker of the model.

Sample requests are not part of a training client's ordered stream: each goes to one worker of the base
model (round robin over every live worker, trainers and ``--role sampler`` ones alike), straight to that
worker's sampling intake (not through Celery), and its rows join the batch the worker is decoding.
Sampling has no side effects, so a request whose worker dies is sent again to another worker (up to
``MAX_ATTEMPTS`` workers) instead of failing.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from producer.futures import APIFuture
from tinkerq import keys, types
from tinkerq.errors import TinkerqError, UnknownModelError
from tinkerq.validation import validate_sampling
from tinkerq.wire import codec, messages

if TYPE_CHECKING:
    from producer.client import ServiceClient

MAX_ATTEMPTS = 3  # workers tried for one request before WorkerLostError reaches the caller


class SamplingClient:
    """Made by ``TrainingClient.save_weights_and_get_sampling_client()`` or
    ``ServiceClient.create_sampling_client(model_path=... | base_model=...)``."""

    def __init__(self, service: ServiceClient, source: dict[str, Any], base_model: str) -> None:
        self.service = service
        self.source = source
        self.base_model = base_model
        self.client_id = uuid.uuid4().hex  # names this client's requests (Flower, logs)
        self.model_path = source.get("path")
        self.sampler_id = source.get("snapshot")
        record = service._sampling_workers.pick(base_model, exclude=())
        self.vocab_size = record.get("vocab_size")
        self.max_seq_len = record.get("max_seq_len")

    def sample(self, prompt: types.ModelInput, num_samples: int = 1,
               sampling_params: types.SamplingParams | None = None) -> APIFuture[types.SampleResponse]:
        """``num_samples`` completions of ``prompt``: tokens, per-token logprobs and why each stopped."""
        params = sampling_params or types.SamplingParams()
        s = self.service.settings
        try:
            validate_sampling(prompt, num_samples, params, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len,
                              max_num_samples=s.max_num_samples, max_tokens=s.max_sample_tokens)
            body = codec.packb(messages.encode_sample_request(self.source, prompt, num_samples, params))
            self.service.connection.claim_check().check_size(len(body))
            record = self.service._sampling_workers.pick(self.base_model, exclude=())
        except TinkerqError as exc:
            return APIFuture.failed(exc)
        tried = [record["worker"]]

        def reroute() -> tuple[str, str, float] | None:
            """Another live worker for this request once its worker is lost (None: give up)."""
            if len(tried) >= MAX_ATTEMPTS:
                return None
            try:
                other = self.service._sampling_workers.pick(self.base_model, exclude=tried, refresh=True)
            except UnknownModelError:
                return None
            tried.append(other["worker"])
            return other["worker"], keys.sample_queue(other["worker"]), float(other.get("heartbeat_s") or s.heartbeat_s)

        return self.service._dispatch.submit(
            "sample", body, model_id=self.client_id, seq_id=0, queue=keys.sample_queue(record["worker"]),
            decode=messages.decode_sample_response, worker=record["worker"],
            heartbeat_s=float(record.get("heartbeat_s") or s.heartbeat_s), reroute=reroute, sequenced=False,
            argsrepr=f"prompt_tokens={prompt.length} num_samples={num_samples} max_tokens={params.max_tokens}",
            describe=f"sample ({prompt.length} prompt tokens x {num_samples})",
        )

    async def sample_async(self, prompt: types.ModelInput, num_samples: int = 1,
                           sampling_params: types.SamplingParams | None = None) -> types.SampleResponse:
        """As in Tinker: ``await sampling_client.sample_async(...)`` gives the SampleResponse."""
        return await self.sample(prompt, num_samples, sampling_params)

    def get_base_model(self) -> str:
        return self.base_model


class SamplingWorkers:
    """The live workers of each base model, read from their registrations at most every ``refresh_s``,
    handed out round robin."""

    def __init__(self, service: ServiceClient, refresh_s: float = 2.0) -> None:
        self.service = service
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._records: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        self._turn = itertools.count()

    def pick(self, base_model: str, exclude: Any, refresh: bool = False) -> dict[str, Any]:
        with self._lock:
            read_at, records = self._records.get(base_model, (0.0, []))
        if refresh or not records or time.monotonic() - read_at > self.refresh_s:
            records = sorted(self.service.connection.workers_serving(base_model), key=lambda r: r["worker"])
            with self._lock:
                self._records[base_model] = (time.monotonic(), records)
        usable = [r for r in records if r.get("worker") not in exclude]
        if not usable:
            served = self.service.get_server_capabilities()
            raise UnknownModelError(
                f"no {'other ' if exclude else ''}worker serves {base_model!r}; served now: {served or 'none'}. "
                f"Start one with: tinkerq worker --model {base_model} [--role sampler]"
            )
        return usable[next(self._turn) % len(usable)]
