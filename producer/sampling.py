"""SamplingClient: samples from a sampling snapshot, saved weights, or the base model, on any worker of the model.

A *sampling snapshot* is the frozen copy of a training session's weights that
``save_weights_and_get_sampling_client()`` makes (source ``{"snapshot": id}``; its id is the client's
``sampler_id``). It has nothing to do with a session's *automatic training snapshot* (the state a worker saves
so that another worker can adopt the session, docs/reliability.md).

Sample requests are not part of a training client's ordered stream: each goes to one worker of the base
model (round robin over every live worker, trainers and ``--role sampler`` ones alike), straight to that
worker's sampling intake (not through Celery), and its rows join the batch the worker is decoding.
Sampling has no side effects, so a request whose worker dies is sent again to another worker (up to
``MAX_ATTEMPTS`` workers) instead of failing.
"""

from __future__ import annotations

import base64
import itertools
import json
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, cast

from tinkerq import keys, types
from tinkerq.errors import ServerError, TinkerqError, UnknownModelError, UserError
from tinkerq.producer.futures import APIFuture, ClientFuture, MappedFuture
from tinkerq.validation import UNDEFINED_BY_SDK, PromptOptions, validate_prompt_options, validate_sampling
from tinkerq.wire import codec, messages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizer

    from tinkerq.producer.service_client import ServiceClient

MAX_ATTEMPTS = 3  # workers tried for one request before WorkerLostError reaches the caller


class SamplingClientFuture(ClientFuture["SamplingClient"]):
    """What ``create_sampling_client`` and ``save_weights_and_get_sampling_client`` return (Tinker's
    ``BackcompatSamplingClientFuture``): ``.result()`` or ``await`` it for the :class:`SamplingClient`; using
    it directly as the client also works (each attribute waits for the client first)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.result().__reduce__()  # pickled as the client it holds (as the SDK's future is)


class SamplingClient:
    """Made by ``TrainingClient.save_weights_and_get_sampling_client()`` or
    ``ServiceClient.create_sampling_client(model_path=... | base_model=...)``."""

    def __init__(self, service: ServiceClient, source: dict[str, Any], base_model: str, *,
                 retry_config: Any = None) -> None:
        self.service = service
        self.source = source
        self.base_model = base_model
        self.retry_config = retry_config  # Tinker's; unused: lost workers' requests are resent (MAX_ATTEMPTS)
        # Names this client's requests (Flower, logs); sent in the envelope field a training request fills with
        # its session's model_id (a sample belongs to no training session).
        self.client_id = uuid.uuid4().hex
        self.model_path = source.get("path")  # saved weights (save_weights_for_sampler), or None
        self.sampler_id = source.get("snapshot")  # the sampling snapshot's id, or None (saved weights, base model)
        record = service._sampling_workers.pick(base_model, exclude=())
        self.vocab_size = record.get("vocab_size")
        self.max_seq_len = record.get("max_seq_len")

    def sample(self, prompt: types.ModelInput, num_samples: int = 1,
               sampling_params: types.SamplingParams | None = None, include_prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0, target_prompt_logprobs: Any = None,
               prompt_alt_tokens_k: int = 0,
               prompt_logprobs_last_n: int | None = None) -> APIFuture[types.SampleResponse]:
        """``num_samples`` completions of ``prompt``: tokens, per-token logprobs and why each stopped.

        ``include_prompt_logprobs``: also ``prompt_logprobs``, log p(prompt[i] | prompt[:i]) at every position
        (None at 0); ``prompt_logprobs_last_n``: only the last N of them (earlier entries None, and likewise the
        top-k rows). Tinker's per-position options, as its SDK defines them (log p at temperature 1):
        ``topk_prompt_logprobs=k`` (the k most likely tokens at every prompt position), ``topk_sample_logprobs=k``
        (at every sampled position, in each sequence's ``topk_logprobs``), ``target_prompt_logprobs`` (a
        (len(prompt) - 1, K) tensor of token ids, -1 for none: row i is scored at prompt position i + 1) and
        ``prompt_alt_tokens_k=k`` (k draws at the request's temperature per prompt position after the first).
        """
        prompt = types.as_model_input(prompt)  # a tinker.ModelInput / SamplingParams works too
        params = types.as_sampling_params(sampling_params) or types.SamplingParams()
        s = self.service.settings
        options = PromptOptions(topk_prompt=topk_prompt_logprobs, topk_sample=topk_sample_logprobs,
                                targets=types.target_ids(target_prompt_logprobs), alt_k=prompt_alt_tokens_k)
        try:
            validate_sampling(prompt, num_samples, params, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len,
                              max_num_samples=s.max_num_samples, max_tokens=s.max_sample_tokens)
            validate_prompt_options(options, prompt.length, params.max_tokens, vocab_size=self.vocab_size)
            _check_last_n(prompt_logprobs_last_n, include_prompt_logprobs, prompt.length)
            # Asked only when wanted, so a plain sample request stays what it always was on the wire.
            extra = {"prompt_logprobs": True} if include_prompt_logprobs else {}
            body = codec.packb(messages.encode_sample_request(self.source, prompt, num_samples, params,
                                                              options=options, **extra))
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

        future: APIFuture[types.SampleResponse] = self.service._dispatch.submit(
            "sample", body, model_id=self.client_id, seq_id=0, queue=keys.sample_queue(record["worker"]),
            decode=messages.decode_sample_response, worker=record["worker"],
            heartbeat_s=float(record.get("heartbeat_s") or s.heartbeat_s), reroute=reroute, sequenced=False,
            argsrepr=f"prompt_tokens={prompt.length} num_samples={num_samples} max_tokens={params.max_tokens}",
            describe=f"sample ({prompt.length} prompt tokens x {num_samples})",
        )
        if not include_prompt_logprobs and not options.topk_sample and not options.asks_prompt():
            return future
        return MappedFuture(future, lambda response: _with_prompt_answers(response, include_prompt_logprobs, options,
                                                                          prompt_logprobs_last_n))

    async def sample_async(self, prompt: types.ModelInput, num_samples: int = 1,
                           sampling_params: types.SamplingParams | None = None, include_prompt_logprobs: bool = False,
                           topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0,
                           target_prompt_logprobs: Any = None, prompt_alt_tokens_k: int = 0,
                           prompt_logprobs_last_n: int | None = None) -> types.SampleResponse:
        """As in Tinker: ``await sampling_client.sample_async(...)`` gives the SampleResponse."""
        return await self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs,
                                 topk_sample_logprobs, target_prompt_logprobs, prompt_alt_tokens_k,
                                 prompt_logprobs_last_n)

    def compute_logprobs(self, prompt: types.ModelInput,
                         prompt_logprobs_last_n: int | None = None) -> APIFuture[list[float | None]]:
        """log p(prompt[i] | prompt[:i]) for every position of ``prompt`` (None at 0, and before the last
        ``prompt_logprobs_last_n`` when given): what ``forward`` computes for the same tokens. As in the SDK, a
        one-token sample request with the prompt's logprobs."""
        future = self.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                             prompt_logprobs_last_n=prompt_logprobs_last_n)
        return MappedFuture(future, lambda response: list(response.prompt_logprobs))

    async def compute_logprobs_async(self, prompt: types.ModelInput,
                                     prompt_logprobs_last_n: int | None = None) -> list[float | None]:
        return await self.compute_logprobs(prompt, prompt_logprobs_last_n)

    def get_base_model(self) -> str:
        return self.base_model

    async def get_base_model_async(self) -> str:
        return self.base_model

    def get_tokenizer(self) -> PreTrainedTokenizer:
        """The base model's tokenizer (``transformers.AutoTokenizer``), when its directory is visible here."""
        return load_tokenizer(self.base_model)

    # -- to other processes -----------------------------------------------------------------------------------

    def get_sampler_handle(self) -> str:
        """A string naming this client's weights (no credentials in it):
        ``SamplingClient.from_sampler_handle(handle)`` in any process makes a client of the same weights."""
        state = {"source": self.source, "base_model": self.base_model}
        return base64.urlsafe_b64encode(json.dumps(state, separators=(",", ":")).encode()).decode()

    @staticmethod
    def from_sampler_handle(handle: str, *, api_key: str | None = None) -> SamplingClient:
        """A client for the weights ``handle`` names, on the fleet of ``TINKERQ_BROKER_URL`` (one shared
        ServiceClient per process). tinkerq has no API keys: ``api_key`` must be None."""
        if api_key is not None:
            raise UserError("tinkerq has no API keys: the fleet is the one TINKERQ_BROKER_URL names; pass api_key=None")
        try:
            state = json.loads(base64.urlsafe_b64decode(handle.encode()))
            source, base_model = messages.check_source(state["source"]), str(state["base_model"])
        except (ValueError, TypeError, KeyError, AttributeError, TinkerqError):
            raise UserError(f"{handle!r:.80} is not a handle from SamplingClient.get_sampler_handle()") from None
        return SamplingClient(_shared_service(None), source, base_model)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Copied or pickled by the user (multiprocessing), it travels as its handle: no credentials in the
        # bytes (the broker URL may hold Redis's password); the other process joins TINKERQ_BROKER_URL's fleet.
        return SamplingClient.from_sampler_handle, (self.get_sampler_handle(),)


_shared_lock = threading.Lock()
_shared_services: dict[str | None, ServiceClient] = {}


def _shared_service(broker_url: str | None) -> ServiceClient:
    """One ServiceClient per broker for the clients made from handles (it lives as long as the process: those
    clients may be anywhere)."""
    from tinkerq.producer.service_client import ServiceClient  # a cycle at import time otherwise

    with _shared_lock:
        if broker_url not in _shared_services:
            _shared_services[broker_url] = ServiceClient(broker_url)
        return _shared_services[broker_url]


def _check_last_n(last_n: Any, include_prompt_logprobs: bool, prompt_length: int) -> None:
    if last_n is None:
        return
    if not include_prompt_logprobs:
        raise UserError("prompt_logprobs_last_n applies to prompt logprobs; set include_prompt_logprobs=True")
    if not isinstance(last_n, int) or isinstance(last_n, bool) or not 1 <= last_n <= prompt_length - 1:
        raise UserError(f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {prompt_length - 1}, "
                        f"got {last_n!r}")


def _with_prompt_answers(response: types.SampleResponse, prompt_logprobs: bool, options: PromptOptions,
                         last_n: int | None) -> types.SampleResponse:
    """The answer to a request that asked for prompt logprobs or per-position options: checked (a worker that
    predates an option ignores it), and the prompt's logprobs and top-k cut to the last ``last_n`` (here, on the
    client: the worker computes them all in the same prefill anyway)."""
    missing = [name for name, asked, got in (
        ("prompt logprobs", prompt_logprobs, response.prompt_logprobs),
        ("topk_prompt_logprobs", options.topk_prompt, response.topk_prompt_logprobs),
        ("target_prompt_logprobs", options.targets is not None, response.target_prompt_logprobs),
        ("prompt_alt_tokens", options.alt_k, response.prompt_alt_tokens),
        ("topk_sample_logprobs", options.topk_sample,
         all(s.topk_logprobs is not None for s in response.sequences) or None)) if asked and got is None]
    if missing:
        raise ServerError(f"the worker returned no {', '.join(missing)}; it may predate that option "
                          f"(upgrade the fleet's workers)")
    logprobs = response.prompt_logprobs
    if last_n is not None and logprobs is not None:
        keep = len(logprobs) - last_n
        cut: list[float | None] = [None] * keep
        response.prompt_logprobs = cut + list(logprobs[keep:])
        if response.topk_prompt_logprobs is not None:  # the SDK: last_n applies to the top-k rows too
            response.topk_prompt_logprobs.token_ids[:keep] = 0
            response.topk_prompt_logprobs.logprobs[:keep] = types.TOPK_MASK_LOGPROB
    return response


def load_tokenizer(base_model: str) -> PreTrainedTokenizer:
    """``AutoTokenizer`` of a served model, whose directory must be readable here."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError("get_tokenizer() needs transformers: pip install 'tinkerq[jobs]'") from None
    try:
        return cast("PreTrainedTokenizer", AutoTokenizer.from_pretrained(base_model))
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load the tokenizer of {base_model!r} on this machine ({exc}); the model "
            f"directory must be readable here"
        ) from None


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
            served = self.service._served_models()
            raise UnknownModelError(
                f"no {'other ' if exclude else ''}worker serves {base_model!r}; served now: {served or 'none'}. "
                f"Start one with: tinkerq worker --model {base_model} [--role sampler]"
            )
        return usable[next(self._turn) % len(usable)]


def check_stability_info(record_stability_info: bool) -> None:
    if record_stability_info:
        raise UserError(UNDEFINED_BY_SDK["record_stability_info"])
