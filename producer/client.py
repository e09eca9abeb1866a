"""ServiceClient and TrainingClient: the Tinker training API over a tinkerq fleet.

Every call encodes its request once (msgpack), claim-checks it if large, and posts it as a Celery task
to the queue of the worker that holds the training session. Requests of one training client carry
increasing ``seq_id``s; the worker applies them strictly in that order, so callers may submit many
forward_backward / optim_step pairs without waiting.

Names, signatures and return kinds follow the official SDK (``tinker==0.38``), so ``producer.ServiceClient``
stands in for ``tinker.ServiceClient``; tests/test_sdk_surface.py lists, with reasons, every place where
they differ.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from tinkerq import keys, operations, types
from tinkerq.connection import Connection
from tinkerq.errors import RequestTimeoutError, TinkerqError, UnknownModelError, UserError, ValidationError
from tinkerq.producer.dispatch import Dispatcher
from tinkerq.producer.futures import APIFuture, ClientFuture, MappedFuture
from tinkerq.producer.sampling import SamplingClient, SamplingClientFuture, SamplingWorkers, load_tokenizer
from tinkerq.settings import Settings
from tinkerq.validation import (
    UNDEFINED_BY_SDK,
    Limits,
    validate_adam,
    validate_lora,
    validate_loss_request,
    validate_ttl_seconds,
)
from tinkerq.wire import codec, messages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizer

log = logging.getLogger("tinkerq.producer")

C = TypeVar("C")
LORA_FIELDS = ("rank", "seed", "train_mlp", "train_attn", "train_unembed")


class TrainingClientFuture(ClientFuture["TrainingClient"]):
    """What the ``create_*training_client*`` calls return (Tinker's ``BackcompatTrainingClientFuture``):
    ``.result()`` or ``await`` it for the :class:`TrainingClient`; using it directly as the client also works
    (each attribute waits for the client first)."""


class ServiceClient:
    """Entry point: connects to a fleet and opens training clients on the models it serves.

    ``broker_url`` (or ``TINKERQ_BROKER_URL``) names the fleet's Redis; ``"memory://"`` talks to an
    embedded fleet in this process (see ``tinkerq.worker.embedded``). Unlike Tinker's, it takes no API key or
    HTTP ``base_url``: a tinkerq producer talks to Redis (use ``tinkerq gateway`` for HTTP clients).
    """

    def __init__(self, broker_url: str | None = None, *, settings: Settings | None = None) -> None:
        settings = settings or Settings.from_env(broker_url=broker_url)
        if settings.broker_url is None:
            raise UserError(
                "no broker configured: pass ServiceClient(broker_url='redis://host:6379/0') or set "
                "TINKERQ_BROKER_URL (use 'memory://' with an embedded fleet in this process)"
            )
        self.settings = settings
        self.connection = Connection.open(settings)
        self._dispatch = Dispatcher(self.connection)
        self._sampling_workers = SamplingWorkers(self)

    # -- what the fleet serves ------------------------------------------------------------------------------

    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        """The base models some live worker serves now: trainable where a trainer worker serves it,
        sampleable always (trainers sample too)."""
        return types.GetServerCapabilitiesResponse.from_workers(self.connection.workers_serving())

    async def get_server_capabilities_async(self) -> types.GetServerCapabilitiesResponse:
        return await _off_loop(self.get_server_capabilities)

    def _served_models(self) -> list[str]:
        """Names of the served base models (for error messages)."""
        return sorted({w["base_model"] for w in self.connection.workers_serving()})

    # -- training clients -----------------------------------------------------------------------------------

    def create_lora_training_client(
        self, base_model: str, rank: int = 32, seed: int | None = None, train_mlp: bool = True,
        train_attn: bool = True, train_unembed: bool = True, user_metadata: dict[str, str] | None = None,
        optimizer: Any = None,
    ) -> TrainingClientFuture:
        """Open a LoRA training session: an adapter of ``rank`` over ``base_model``, which stays frozen and is
        shared with the worker's other LoRA sessions (docs/lora.md).

        Tinker's semantics: adapters on the attention projections (``train_attn``), the MLP (``train_mlp``) and
        the output projection (``train_unembed``), scaling 32 / rank; the same ``seed`` gives the same initial
        adapter (None: a random one, reported in ``get_info().extra["lora"]``). A new adapter leaves the
        model's outputs unchanged. LoRA usually wants a learning rate about 10x a full fine-tune's.

        Returns at once with a future of the client (``.result()`` / ``await``; it can also be used as the
        client). Bad arguments and a model no worker serves raise here. ``user_metadata`` is accepted and
        not stored; ``optimizer`` may only name AdamW (tinkerq's one optimizer).
        """
        config = types.LoraConfig(rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn,
                                  train_unembed=train_unembed)
        validate_lora(config, max_rank=self.settings.max_lora_rank)
        return self._create_async(base_model, config, optimizer)

    async def create_lora_training_client_async(
        self, base_model: str, rank: int = 32, seed: int | None = None, train_mlp: bool = True,
        train_attn: bool = True, train_unembed: bool = True, user_metadata: dict[str, str] | None = None,
        optimizer: Any = None,
    ) -> TrainingClient:
        return await self.create_lora_training_client(base_model, rank, seed, train_mlp, train_attn, train_unembed,
                                                      user_metadata, optimizer)

    def create_training_client(self, base_model: str, user_metadata: dict[str, str] | None = None,
                               optimizer: Any = None) -> TrainingClientFuture:
        """Open a new full-parameter training session on a fresh copy of ``base_model``'s weights (a tinkerq
        extension: Tinker trains LoRA adapters only). Returns a future of the client, as the LoRA call does.

        ``base_model`` is the model a worker serves: the local Hugging Face directory it was started with.
        """
        return self._create_async(base_model, None, optimizer)

    async def create_training_client_async(self, base_model: str, user_metadata: dict[str, str] | None = None,
                                           optimizer: Any = None) -> TrainingClient:
        return await self.create_training_client(base_model, user_metadata, optimizer)

    def create_training_client_from_state(
        self, path: str, base_model: str | None = None, user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None, optimizer: Any = None,
    ) -> TrainingClientFuture:
        """A new training session with the weights of ``save_state``'s directory and a fresh optimizer (as in
        Tinker; ``create_training_client_from_state_with_optimizer`` also restores the AdamW state). A LoRA
        state opens a LoRA session with the saved adapter's configuration. ``weights_access_token`` is
        accepted and unused: every path under the fleet's checkpoint directory is readable to its clients.
        """
        return self._from_state(path, base_model, with_optimizer=False, optimizer=optimizer)

    async def create_training_client_from_state_async(
        self, path: str, base_model: str | None = None, user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None, optimizer: Any = None,
    ) -> TrainingClient:
        return await self.create_training_client_from_state(path, base_model, user_metadata, weights_access_token,
                                                            optimizer)

    def create_training_client_from_state_with_optimizer(
        self, path: str, base_model: str | None = None, user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
    ) -> TrainingClientFuture:
        """A new training session resumed exactly from ``save_state``'s directory: weights, AdamW state and
        pending gradients (the run continues as if never interrupted)."""
        return self._from_state(path, base_model, with_optimizer=True, optimizer=None)

    async def create_training_client_from_state_with_optimizer_async(
        self, path: str, base_model: str | None = None, user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
    ) -> TrainingClient:
        return await self.create_training_client_from_state_with_optimizer(path, base_model, user_metadata,
                                                                           weights_access_token)

    # -- sessions driven by the caller (a tinkerq extension: the HTTP gateway's seam) ---------------------------

    def open_training_client(self, base_model: str, lora: types.LoraConfig | None = None, *,
                             timeout: float | None = None, session_id: str | None = None) -> TrainingClient:
        """Open a training session and wait for it, in the calling thread: a LoRA session when ``lora`` is
        given, else a full-parameter one.

        The blocking form of the ``create_*training_client`` calls, for callers that manage their own threads
        and number their own requests (the HTTP gateway; see :meth:`TrainingClient.submit`). Waits at most
        ``timeout`` seconds (None: ``TINKERQ_CREATE_TIMEOUT_S``), then raises RequestTimeoutError. A model no
        worker serves raises UnknownModelError, an invalid ``lora`` ValidationError, before anything is sent.

        ``session_id`` (32 hex digits; default: a new random one) names the worker session. Opening the same
        id again answers with the session already built (workers build one session per id, fleet-wide): a
        caller that may repeat its open (a gateway re-running a dead gateway's create) leaves no orphan.
        """
        base_model = normalize_model_name(base_model)
        if lora is not None:
            validate_lora(lora, max_rank=self.settings.max_lora_rank)
        if session_id is not None and not _is_session_id(session_id):
            raise ValidationError(f"session_id must be 32 lowercase hex digits, got {session_id!r}")
        self._require_served(base_model)
        return self._create(base_model, lora, timeout, session_id)

    def attach_training_client(self, info: types.ModelInfo) -> TrainingClient:
        """A client for a training session opened earlier, here or in another process (a restarted gateway),
        from the :class:`~tinkerq.types.ModelInfo` its opener got (``tc.info``; ``dataclasses.asdict`` of it
        and back travels as JSON). Sends nothing.

        Its requests go to the worker holding the session now: the one ``info`` names, or the one that adopted
        the session since (its session home record says which). Submit them with explicit sequence ids
        (:meth:`TrainingClient.submit`): this client's own counter starts at 1 and knows nothing of the
        requests sent before (its ``close()`` comes after the ids submitted through it). A session that was
        closed, or whose worker is gone for good, answers its requests with an error, as for any client.
        """
        home = self._dispatch.session_home(info.model_id)
        if home is not None and home.worker != info.worker:
            info = dataclasses.replace(info, worker=home.worker)
        return TrainingClient(self, info)

    def _create_async(self, base_model: str, lora: types.LoraConfig | None, optimizer: Any) -> TrainingClientFuture:
        _check_optimizer(optimizer)
        base_model = normalize_model_name(base_model)
        self._require_served(base_model)  # here, so a model nobody serves fails at the call
        return TrainingClientFuture(_background(lambda: self._create(base_model, lora, None)),
                                    f"training client on {base_model}")

    def _from_state(self, path: str, base_model: str | None, *, with_optimizer: bool,
                    optimizer: Any) -> TrainingClientFuture:
        _check_optimizer(optimizer)
        saved = _saved_marker(path, "tinkerq_state.json", "save_state()", base_model=base_model)
        base_model = normalize_model_name(base_model or str(saved["base_model"]))
        lora = saved.get("lora")
        config = None
        if isinstance(lora, dict):
            config = types.LoraConfig(**{k: lora[k] for k in LORA_FIELDS if k in lora})
            validate_lora(config, max_rank=self.settings.max_lora_rank)
        self._require_served(base_model)

        def resume() -> TrainingClient:
            tc = self._create(base_model, config, None)
            try:
                tc._load(path, optimizer=with_optimizer).result()
            except BaseException:
                with contextlib.suppress(Exception):  # give the worker its memory back; the load error matters
                    tc.close()
                raise
            return tc

        return TrainingClientFuture(_background(resume), f"training client from {path}")

    def _require_served(self, base_model: str) -> None:
        if not self.connection.workers_serving(base_model):
            served = self._served_models()
            raise UnknownModelError(
                f"no worker serves {base_model!r}; served now: {served or 'none'}. "
                f"Start one with: tinkerq worker --model {base_model}"
            )

    def _create(self, base_model: str, lora: types.LoraConfig | None, timeout: float | None,
                session_id: str | None = None) -> TrainingClient:
        model_id = session_id or uuid.uuid4().hex
        timeout = self.settings.create_timeout_s if timeout is None else timeout
        # The deadline lets a worker that finds this request late (no worker was free) skip it.
        request: dict[str, Any] = {"base_model": base_model, "deadline": time.time() + timeout}
        if lora is not None:
            request["lora"] = messages.encode_lora(lora)
        body = codec.packb(request)
        future = self._dispatch.submit(
            "create_model", body, model_id=model_id, seq_id=0, queue=keys.model_queue(base_model),
            decode=messages.decode_model_info,
            argsrepr=f"base_model={base_model}" + (f", lora_rank={lora.rank}" if lora is not None else ""),
        )
        try:
            info = future.result(timeout=timeout)
        except RequestTimeoutError:
            self._dispatch.abandon(future)
            raise RequestTimeoutError(
                f"no worker opened a session on {base_model!r} within {timeout:g} s "
                f"(registered workers may be busy or gone); check `tinkerq fleet status`"
            ) from None
        return TrainingClient(self, info)

    # -- sampling clients -----------------------------------------------------------------------------------

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config: Any = None, record_stability_info: bool = False) -> SamplingClientFuture:
        """Sample from saved weights (a ``save_weights_for_sampler`` path) or from ``base_model`` itself.

        Requests go to every live worker of the base model (trainers and ``--role sampler`` workers).
        With ``model_path``, ``base_model`` is read from the directory when omitted. Returns a future of the
        client, already resolved (nothing to wait for), usable as the client. ``retry_config`` is accepted and
        unused: tinkerq resends a sample whose worker is lost to another worker by itself.
        """
        _check_stability_info(record_stability_info)
        if model_path is not None:
            if not isinstance(model_path, str) or not model_path:
                raise UserError(f"model_path must be a path returned by save_weights_for_sampler(), got {model_path!r}")
            base_model = base_model or _saved_base_model(model_path, "tinkerq_weights.json",
                                                          "save_weights_for_sampler()")
            source: dict[str, Any] = {"path": model_path}
        elif base_model is None:
            raise UserError("create_sampling_client needs model_path= (saved weights) or base_model=")
        else:
            source = {"base": True}
        client = SamplingClient(self, source, normalize_model_name(base_model), retry_config=retry_config)
        return SamplingClientFuture.of(client, f"sampling client on {model_path or base_model}")

    async def create_sampling_client_async(self, model_path: str | None = None, base_model: str | None = None,
                                           retry_config: Any = None,
                                           record_stability_info: bool = False) -> SamplingClient:
        future = await _off_loop(self.create_sampling_client, model_path, base_model, retry_config,
                                 record_stability_info)
        return future.result()

    # -- lifetime -------------------------------------------------------------------------------------------

    def close(self, status: Literal["success", "errored", "interrupted"] | None = None,
              detail: str | None = None) -> APIFuture[None]:
        """Stop this client's dispatcher and connection; the returned future is already done.

        Tinker's ``status`` and ``detail`` (how the session ended) are optional and only logged: training
        sessions on the workers are closed by ``TrainingClient.close()``, not by this.
        """
        if status is not None:
            log.info("service client closed: %s%s", status, f" ({detail})" if detail else "")
        self._dispatch.close()
        self.connection.close()
        return APIFuture.completed(None)

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass
class ModelData:
    """Tinker's ``GetInfoResponse.model_data``."""

    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


@dataclasses.dataclass
class GetInfoResponse(types.ModelInfo):
    """``TrainingClient.get_info()``: tinkerq's :class:`tinkerq.types.ModelInfo` (vocab_size, max_seq_len,
    worker, extra...) that also reads as Tinker's ``GetInfoResponse`` (model_data.model_name, is_lora,
    lora_rank, model_name)."""

    @classmethod
    def of(cls, info: types.ModelInfo) -> GetInfoResponse:
        if isinstance(info, cls):
            return info
        return cls(**{f.name: getattr(info, f.name) for f in dataclasses.fields(types.ModelInfo)})

    @property
    def model_data(self) -> ModelData:
        # The tokenizer is loaded from the model's directory (get_tokenizer()), so that is its id too.
        return ModelData(arch=self.extra.get("arch"), model_name=self.base_model, tokenizer_id=self.base_model)

    @property
    def model_name(self) -> str:
        return self.base_model

    @property
    def is_lora(self) -> bool:
        return isinstance(self.extra.get("lora"), dict)

    @property
    def lora_rank(self) -> int | None:
        lora = self.extra.get("lora")
        return int(lora["rank"]) if isinstance(lora, dict) and "rank" in lora else None


class TrainingClient:
    """One training session: a model's weights, pending gradients and optimizer state on one worker."""

    def __init__(self, service: ServiceClient, info: types.ModelInfo) -> None:
        self.service = service
        self.info = GetInfoResponse.of(info)
        self.model_id = info.model_id
        self._next_seq = 1  # this client's own counter: past every seq_id given to submit() too
        self._seq_lock = threading.Lock()
        # Which worker holds the session is kept by the dispatcher: another one once it adopts the session.
        service._dispatch.set_home(self.model_id, info.worker)
        s = service.settings
        self._limits = Limits(max_datums=s.max_datums, max_batch_tokens=s.max_batch_tokens)

    # -- the training API ---------------------------------------------------------------------------------

    def forward_backward(
        self, data: Sequence[types.Datum], loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """Compute the loss and per-token outputs; gradients ADD to the session's pending gradients."""
        return self._loss_call("forward_backward", data, loss_fn, loss_fn_config)

    async def forward_backward_async(
        self, data: Sequence[types.Datum], loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """As in Tinker: ``await`` gives the future (submitted in call order), to await again."""
        return self.forward_backward(data, loss_fn, loss_fn_config)

    def forward(
        self, data: Sequence[types.Datum], loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """Like forward_backward, without gradients."""
        return self._loss_call("forward", data, loss_fn, loss_fn_config)

    async def forward_async(
        self, data: Sequence[types.Datum], loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        return self.forward(data, loss_fn, loss_fn_config)

    def forward_backward_custom(
        self, data: Sequence[types.Datum], loss_fn: Callable[..., Any], *,
        loss_type_input: Literal["logprobs"] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """A loss computed here, with torch, from the per-token logprobs: ``loss_fn(data, logprobs_list)``
        returns ``(loss, metrics)``.

        As the SDK does it: a ``forward`` gives the logprobs; the loss's gradient with respect to them,
        ``dC/dlogprobs``, becomes the weights of a ``cross_entropy`` forward_backward (whose loss is
        ``-sum(weights * logprobs)``), which gives the model the same gradients. Unlike the SDK, this call
        waits for the forward before it returns (so requests submitted after it are ordered after the
        backward without reserving sequence numbers); an error in ``loss_fn`` is raised here and leaves the
        session untouched. Needs torch on this machine.
        """
        if loss_type_input not in (None, "logprobs"):
            return APIFuture.failed(UserError(f"loss_type_input must be 'logprobs' or None, got {loss_type_input!r}"))
        if not callable(loss_fn):
            return APIFuture.failed(UserError(
                "loss_fn must be a callable (data, logprobs_list) -> (loss, metrics); tinkerq has no server-side "
                "custom losses (ServiceClient.create_custom_loss)"))
        data = [types.as_datum(d) for d in data]
        try:
            forward_data = [_custom_forward_datum(i, d) for i, d in enumerate(data)]
        except TinkerqError as exc:
            return APIFuture.failed(exc)
        forward = self.forward(forward_data, "cross_entropy")
        try:
            outputs = forward.result()
        except TinkerqError as exc:
            return APIFuture.failed(exc)
        import torch  # lazy: the producer does not depend on torch (tests/test_layering.py)

        logprobs_list = [out["logprobs"].to_torch().float().requires_grad_(True) for out in outputs.loss_fn_outputs]
        loss, custom_metrics = loss_fn(data, logprobs_list)
        custom_loss_sum = float(loss.detach().sum().item())
        loss.backward()
        backward_data = []
        for datum, forward_datum, logprobs in zip(data, forward_data, logprobs_list, strict=True):
            grad = logprobs.grad if logprobs.grad is not None else torch.zeros_like(logprobs)
            # cross_entropy's loss is -sum(weights * logprobs): weights = -dC/dlogprobs give C's gradients.
            weights = types.TensorData.from_numpy((-grad).detach().numpy().astype("float32"))
            backward_data.append(types.Datum(model_input=datum.model_input, loss_fn_inputs={
                "target_tokens": forward_datum.loss_fn_inputs["target_tokens"], "weights": weights}))

        def with_custom_metrics(out: types.ForwardBackwardOutput) -> types.ForwardBackwardOutput:
            metrics = dict(out.metrics)
            metrics["surrogate_loss:sum"] = metrics.pop("loss:sum", 0.0)
            metrics.update({str(k): float(v) for k, v in dict(custom_metrics or {}).items()})
            metrics["loss:sum"] = custom_loss_sum
            return dataclasses.replace(out, metrics=metrics)

        return MappedFuture(self.forward_backward(backward_data, "cross_entropy"), with_custom_metrics)

    async def forward_backward_custom_async(
        self, data: Sequence[types.Datum], loss_fn: Callable[..., Any], *,
        loss_type_input: Literal["logprobs"] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        return await _off_loop(self.forward_backward_custom, data, loss_fn, loss_type_input=loss_type_input)

    def optim_step(self, optim_params: types.AdamParams | None = None, *,
                   adam_params: types.AdamParams | None = None) -> APIFuture[types.OptimStepResponse]:
        """Apply AdamW to the gradients of every forward_backward submitted before this call, then zero them.

        ``optim_params`` (Tinker's name) or ``adam_params=`` (its legacy keyword, and tinkerq's positional
        argument before) give the hyperparameters; neither: ``types.AdamParams()``.
        """
        try:
            params = _adam_params(optim_params, adam_params)
            validate_adam(params)
        except TinkerqError as exc:
            return APIFuture.failed(exc)
        return self._submit(
            "optim_step", messages.encode_adam(params), messages.decode_optim_step_response,
            argsrepr=f"lr={params.learning_rate:g}",
        )

    async def optim_step_async(self, optim_params: types.AdamParams | None = None, *,
                               adam_params: types.AdamParams | None = None) -> APIFuture[types.OptimStepResponse]:
        return self.optim_step(optim_params, adam_params=adam_params)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None, *,
                                 merged: bool = False) -> APIFuture[types.SaveWeightsForSamplerResponse]:
        """Write the current weights; the future holds the directory's path.

        A full-parameter session writes a plain Hugging Face model directory. A LoRA session writes a standard
        PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``; ``PeftModel.from_pretrained``
        loads it); ``merged=True`` (a tinkerq extension) also writes the base with the adapter merged in, as a
        plain model directory in ``<path>/merged`` (for serving engines that reject an adapter on the output
        projection). ``ttl_seconds``: the directory expires that long after writing (None: kept until deleted).
        ``user_metadata`` is accepted and not stored.
        """
        try:
            validate_ttl_seconds(ttl_seconds)
        except TinkerqError as exc:
            return APIFuture.failed(exc)
        return self._submit(
            "save_weights_for_sampler", {"name": name, "merged": merged, "ttl_seconds": ttl_seconds},
            _saved_path, argsrepr=f"name={name}",
        )

    async def save_weights_for_sampler_async(
        self, name: str, ttl_seconds: int | None = None, user_metadata: dict[str, str] | None = None, *,
        merged: bool = False,
    ) -> APIFuture[types.SaveWeightsForSamplerResponse]:
        return self.save_weights_for_sampler(name, ttl_seconds, user_metadata, merged=merged)

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None) -> APIFuture[types.SaveWeightsResponse]:
        """Save weights, AdamW state and pending gradients after every earlier request; the future holds the path.

        ``create_training_client_from_state_with_optimizer(path)`` (or ``load_state_with_optimizer``) resumes
        from it exactly; the ``load_state`` forms take its weights only. ``ttl_seconds``: it expires that long
        after writing (None: kept until deleted); ``overwrite``: replace an existing state of that name instead
        of failing. ``user_metadata`` is accepted and not stored.
        """
        try:
            validate_ttl_seconds(ttl_seconds)
            if not isinstance(overwrite, bool):
                raise UserError(f"overwrite must be True or False, got {overwrite!r}")
        except TinkerqError as exc:
            return APIFuture.failed(exc)
        return self._submit("save_state", {"name": name, "ttl_seconds": ttl_seconds, "overwrite": overwrite},
                            _saved_path, argsrepr=f"name={name}")

    async def save_state_async(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                               user_metadata: dict[str, str] | None = None) -> APIFuture[types.SaveWeightsResponse]:
        return self.save_state(name, ttl_seconds, overwrite, user_metadata)

    def load_state(self, path: str, weights_access_token: str | None = None) -> APIFuture[types.LoadWeightsResponse]:
        """Replace this session's weights with a saved state's, in request order. The optimizer starts afresh
        (no AdamW moments, step 0) and pending gradients are dropped, as in a new session from those weights.
        ``load_state_with_optimizer`` restores the saved AdamW state and pending gradients too."""
        return self._load(path, optimizer=False)

    async def load_state_async(self, path: str,
                               weights_access_token: str | None = None) -> APIFuture[types.LoadWeightsResponse]:
        return self.load_state(path, weights_access_token)

    def load_state_with_optimizer(self, path: str,
                                  weights_access_token: str | None = None) -> APIFuture[types.LoadWeightsResponse]:
        """Replace this session's weights, AdamW state and pending gradients with a saved state's: the run
        continues exactly where the saved one was."""
        return self._load(path, optimizer=True)

    async def load_state_with_optimizer_async(
        self, path: str, weights_access_token: str | None = None,
    ) -> APIFuture[types.LoadWeightsResponse]:
        return self.load_state_with_optimizer(path, weights_access_token)

    def _load(self, path: str, *, optimizer: bool) -> APIFuture[types.LoadWeightsResponse]:
        model_id = self.model_id
        return self._submit(
            "load_state", {"path": path, "optimizer": optimizer},
            lambda body: types.LoadWeightsResponse(path=str(body["path"]), model_id=model_id),
            argsrepr=f"path={path} optimizer={optimizer}",
        )

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: Any = None,
                                             record_stability_info: bool = False,
                                             kind: Literal["snapshot", "inflight"] = "snapshot",
                                             ) -> SamplingClientFuture:
        """Freeze the weights as of every request submitted so far (a sampling snapshot, kept in the worker's
        memory); the future gives a client that samples them (its ``sampler_id`` names the snapshot).

        Returns at once (the snapshot is ordered with the training requests; later ones do not wait for it or
        its samples). Any worker of the model can serve the snapshot (docs/sampling.md). ``name`` is ignored,
        as in Tinker (use save_weights_for_sampler for a directory on disk); ``kind`` must be ``"snapshot"``.
        """
        _check_stability_info(record_stability_info)
        if kind != "snapshot":
            raise UserError(f"kind={kind!r} is not supported by tinkerq: every sampling client made here samples "
                            f"a fixed snapshot (kind='snapshot')")
        future = self._submit("create_sampler", {}, lambda body: str(body["sampler_id"]), argsrepr="")
        service, base_model = self.service, self.info.base_model
        return SamplingClientFuture(
            _background(lambda: SamplingClient(service, {"snapshot": future.result()}, base_model,
                                               retry_config=retry_config)),
            f"sampling snapshot of training client {self.model_id[:8]}")

    async def save_weights_and_get_sampling_client_async(
        self, name: str | None = None, retry_config: Any = None, record_stability_info: bool = False,
        kind: Literal["snapshot", "inflight"] = "snapshot",
    ) -> SamplingClient:
        return await self.save_weights_and_get_sampling_client(name, retry_config, record_stability_info, kind)

    def create_sampling_client(self, model_path: str, retry_config: Any = None,
                               record_stability_info: bool = False) -> SamplingClientFuture:
        """A sampling client on saved weights of this client's base model (``save_weights_for_sampler``)."""
        return self.service.create_sampling_client(model_path=model_path, base_model=self.info.base_model,
                                                   retry_config=retry_config,
                                                   record_stability_info=record_stability_info)

    async def create_sampling_client_async(self, model_path: str, retry_config: Any = None,
                                           record_stability_info: bool = False) -> SamplingClient:
        future = await _off_loop(self.create_sampling_client, model_path, retry_config, record_stability_info)
        return future.result()

    def echo(self, body: dict[str, Any]) -> APIFuture[dict[str, Any]]:
        """Send ``body`` through the fleet and back, untouched (latency probes, benchmarks)."""
        return self._submit("echo", body, lambda b: b, argsrepr="")

    def get_info(self) -> GetInfoResponse:
        """What the worker said about the session when it opened it (no request)."""
        return self.info

    async def get_info_async(self) -> GetInfoResponse:
        return self.info

    def get_tokenizer(self) -> PreTrainedTokenizer:
        """The base model's tokenizer (``transformers.AutoTokenizer``), when its directory is visible here."""
        return load_tokenizer(self.info.base_model)

    def close(self, timeout: float = 30.0) -> None:
        """Release the session's memory on the worker (after every earlier request has been applied)."""
        self._submit("close_model", {}, lambda b: b, argsrepr="").result(timeout=timeout)

    # -- ordered submission with explicit sequence ids (a tinkerq extension: the HTTP gateway's seam) -------------

    def submit(self, op: str, body: dict[str, Any], *, seq_id: int | None = None,
               decode: Callable[[Any], Any] | None = None, argsrepr: str = "") -> APIFuture[Any]:
        """Post one request of this session's ordered stream, as the methods above do, and return its future.

        For callers that number requests themselves (the HTTP gateway passes the SDK's ``seq_id`` through).
        ``op`` is one of :data:`tinkerq.operations.ORDERED`; ``body`` is its request map as the worker reads it (what
        :mod:`tinkerq.wire.messages` encodes: ``encode_loss_request``, ``encode_adam``; ``{"path", "optimizer"}``
        for ``load_state``...). ``decode`` turns the answer's body into the future's result (None: the body as
        it came). ``argsrepr``: a short description for Flower and logs, never tensors.

        ``seq_id`` is the request's position in the session (>= 1; None: the next one of this client's own
        counter, which stays past every explicit ``seq_id`` submitted here, so :meth:`close` comes after them).
        The worker applies requests strictly in ``seq_id``
        order, holds one that arrives early until its predecessors have run (for up to
        ``TINKERQ_GAP_TIMEOUT_S``, after which the session fails), and answers a repeated ``seq_id`` from its
        kept reply without applying it twice: a resend is safe, even from another client attached to the
        session (:meth:`ServiceClient.attach_training_client`).

        A request refused here (an unknown ``op``, a body that cannot be encoded or is over
        ``TINKERQ_MAX_MESSAGE_BYTES``) gets a failed future; with an explicit ``seq_id`` its position is then
        filled (:meth:`skip`), so the requests after it still run.
        """
        if seq_id is not None and not _is_position(seq_id):
            return APIFuture.failed(UserError(f"seq_id must be an integer >= 1 (0 opens the session), got {seq_id!r}"))
        try:
            # A training session's ordered requests: not create_model, which opens the session at seq_id 0, nor
            # sample, which is no part of any session's order.
            if op not in operations.ORDERED:
                raise UserError(f"{op!r} is not a request of a training session's ordered stream; one of "
                                f"{', '.join(operations.ORDERED)}")
            encoded = self._encode(body)
        except TinkerqError as exc:
            if seq_id is not None:
                self.skip(seq_id, "refused by the client")
            return APIFuture.failed(exc)
        if seq_id is not None:
            self._passed(seq_id)
        return self._post(op, encoded, decode or _as_is, argsrepr=argsrepr, seq_id=seq_id)

    def skip(self, seq_id: int, reason: str = "") -> APIFuture[None]:
        """Fill position ``seq_id`` of the session with a request that changes nothing (an ``echo``).

        For a request refused before it was sent (by the caller's own checks) whose ``seq_id`` is taken: the
        session's later requests would otherwise wait for it and fail after ``TINKERQ_GAP_TIMEOUT_S``. The
        future completes (with None) once the worker has passed that position. ``reason`` shows in Flower.
        """
        if not _is_position(seq_id):
            return APIFuture.failed(UserError(f"seq_id must be an integer >= 1 (0 opens the session), got {seq_id!r}"))
        self._passed(seq_id)
        return self._post("echo", self._encode({}), _nothing, argsrepr=f"skipped: {reason}" if reason else "skipped",
                          seq_id=seq_id)

    def check_loss_request(self, data: Sequence[types.Datum], loss_fn: str = "cross_entropy",
                           loss_fn_config: dict[str, Any] | None = None) -> None:
        """The checks ``forward`` and ``forward_backward`` make before sending (the fleet's limits, this model's
        vocabulary and context length, the loss's inputs): raises ValidationError / UserError. For callers that
        send the request themselves with :meth:`submit`."""
        validate_loss_request(data, loss_fn, loss_fn_config, limits=self._limits,
                              vocab_size=self.info.vocab_size, max_seq_len=self.info.max_seq_len)

    # -- plumbing ---------------------------------------------------------------------------------------------

    def _loss_call(
        self, op: str, data: Sequence[types.Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None
    ) -> APIFuture[types.ForwardBackwardOutput]:
        data = [types.as_datum(d) for d in data] if isinstance(data, (list, tuple)) else data
        try:
            self.check_loss_request(data, loss_fn, loss_fn_config)
        except TinkerqError as exc:
            return APIFuture.failed(exc)  # refused here: no sequence number used, the model is untouched
        tokens = sum(d.model_input.length for d in data)
        return self._submit(
            op, messages.encode_loss_request(list(data), loss_fn, loss_fn_config),
            messages.decode_forward_backward_output,
            argsrepr=f"loss_fn={loss_fn} datums={len(data)} tokens={tokens}",
        )

    def _submit(self, op: str, body: dict[str, Any], decode: Callable[[Any], Any], *, argsrepr: str,
                seq_id: int | None = None) -> APIFuture[Any]:
        """Post one ordered request (the SDK's methods; tests that replay or reorder requests give ``seq_id``).
        Unlike :meth:`submit`, a refused body leaves an explicit ``seq_id``'s position empty."""
        try:  # encode first: a body that cannot be sent must not use up a sequence number
            encoded = self._encode(body)
        except TinkerqError as exc:
            return APIFuture.failed(exc)
        return self._post(op, encoded, decode, argsrepr=argsrepr, seq_id=seq_id)

    def _encode(self, body: dict[str, Any]) -> bytes:
        encoded = codec.packb(body)
        self.service.connection.claim_check().check_size(len(encoded))
        return encoded

    def _post(self, op: str, encoded: bytes, decode: Callable[[Any], Any], *, argsrepr: str,
              seq_id: int | None) -> APIFuture[Any]:
        if seq_id is None:
            seq_id = self.next_seq_id()
        # Posted now, or by the dispatcher once Redis is reachable: an outage costs time, not the session.
        worker, queue = self.service._dispatch.home(self.model_id)
        return self.service._dispatch.submit(
            op, encoded, model_id=self.model_id, seq_id=seq_id, queue=queue, decode=decode,
            argsrepr=argsrepr, worker=worker,
            heartbeat_s=float(self.info.extra.get("heartbeat_s") or self.service.settings.heartbeat_s),
        )

    @property
    def _queue(self) -> str:
        """The queue of the worker holding the session now."""
        return self.service._dispatch.home(self.model_id)[1]

    def next_seq_id(self) -> int:
        """Take the next sequence id of this client's own counter (what a request submitted without one gets)."""
        with self._seq_lock:
            self._next_seq += 1
            return self._next_seq - 1

    def _passed(self, seq_id: int) -> None:
        """Counted ids come after every explicit one: close() after submit(seq_id=n) is request n + 1."""
        with self._seq_lock:
            self._next_seq = max(self._next_seq, seq_id + 1)


def _background(make: Callable[[], C]) -> concurrent.futures.Future[C]:
    """Run ``make`` in a daemon thread; its result or error lands in the returned future. Client creation
    waits on the fleet (minutes when workers are busy), so it must not hold the caller."""
    future: concurrent.futures.Future[C] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(make())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="tinkerq-create", daemon=True).start()
    return future


async def _off_loop(fn: Callable[..., C], *args: Any, **kwargs: Any) -> C:
    """``fn(*args, **kwargs)`` in a thread: it reads Redis or waits, which must not stall the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))


def _check_optimizer(optimizer: Any) -> None:
    """Tinker's ``optimizer=`` (an OptimizerConfig): tinkerq trains with AdamW only."""
    kind = optimizer.get("type") if isinstance(optimizer, dict) else getattr(optimizer, "type", None)
    if optimizer is not None and kind == "dimuon":
        raise UserError(UNDEFINED_BY_SDK["dimuon"])
    if optimizer is not None and kind != "adamw":
        raise UserError(f"tinkerq trains with AdamW only; optimizer={optimizer!r} is not supported "
                        f"(pass None or an AdamOptimizerConfig)")


def _check_stability_info(record_stability_info: bool) -> None:
    if record_stability_info:
        raise UserError(UNDEFINED_BY_SDK["record_stability_info"])


def _is_session_id(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)


def _is_position(seq_id: Any) -> bool:
    return isinstance(seq_id, int) and not isinstance(seq_id, bool) and seq_id >= 1


def _as_is(body: Any) -> Any:
    return body


def _nothing(body: Any) -> None:
    return None


def _saved_path(body: Any) -> types.SaveWeightsResponse:
    return types.SaveWeightsResponse(path=str(body["path"]))


def _adam_params(optim_params: Any, adam_params: Any) -> types.AdamParams:
    """The AdamParams of an optim_step call; Tinker's own ``types.AdamParams`` (same fields) is accepted too."""
    if optim_params is not None and adam_params is not None:
        raise UserError("pass optim_params or adam_params=, not both")
    params = optim_params if optim_params is not None else adam_params
    if params is None or isinstance(params, types.AdamParams):
        return params or types.AdamParams()
    if getattr(params, "type", "adamw") != "adamw":
        raise UserError(f"tinkerq trains with AdamW only; got {type(params).__name__} (pass types.AdamParams)")
    names = [f.name for f in dataclasses.fields(types.AdamParams)]
    if not all(hasattr(params, n) for n in names):
        raise UserError(f"optim_params must be types.AdamParams, got {type(params).__name__}")
    return types.AdamParams(**{n: getattr(params, n) for n in names})


def _custom_forward_datum(index: int, datum: types.Datum) -> types.Datum:
    """The forward of forward_backward_custom: cross_entropy on the datum's target_tokens (its weights, or
    zeros, only set the forward's loss, which is not reported)."""
    if not isinstance(datum, types.Datum) or "target_tokens" not in datum.loss_fn_inputs:
        raise UserError(f"datum {index}: forward_backward_custom needs a types.Datum with "
                        f"loss_fn_inputs['target_tokens']")
    targets = datum.loss_fn_inputs["target_tokens"]
    weights = datum.loss_fn_inputs.get("weights")
    if weights is None:
        weights = types.TensorData([0.0] * len(targets.tolist()), dtype="float32", shape=targets.shape)
    return types.Datum(model_input=datum.model_input, loss_fn_inputs={"target_tokens": targets, "weights": weights})


def _saved_base_model(path: str, marker: str, returned_by: str) -> str:
    """The base model a saved directory belongs to (see :func:`_saved_marker`)."""
    return str(_saved_marker(path, marker, returned_by)["base_model"])


def _saved_marker(path: str, marker: str, returned_by: str, *, base_model: str | None = None) -> dict[str, Any]:
    """A saved directory's ``marker`` file (tinkerq_state.json after save_state, tinkerq_weights.json after
    save_weights_for_sampler), when the directory is readable here; else ``{"base_model": base_model}`` when
    that is given."""
    import json

    meta = os.path.join(path, marker)
    try:
        with open(meta) as f:
            saved = json.load(f)
        if not isinstance(saved, dict) or not isinstance(saved.get("base_model"), str):
            raise ValueError("no base_model in it")
        return saved
    except (OSError, ValueError) as exc:
        if base_model is not None:
            return {"base_model": base_model}
        raise UserError(
            f"cannot read {meta} ({exc}); pass base_model= explicitly, or a path returned by {returned_by}"
        ) from None


def normalize_model_name(base_model: str) -> str:
    """Local model directories are named by their absolute path, so relative paths match the worker's."""
    if not isinstance(base_model, str) or not base_model:
        raise UserError(f"base_model must be a non-empty string, got {base_model!r}")
    if os.path.isdir(base_model):
        return os.path.abspath(base_model)
    return base_model


def wait_all(futures: Sequence[APIFuture[Any]], timeout: float | None = None) -> list[Any]:
    """Results of several futures, in order, with one overall deadline."""
    deadline = None if timeout is None else time.monotonic() + timeout
    out = []
    for f in futures:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        out.append(f.result(timeout=remaining))
    return out
