"""ServiceClient: the entry point of the Tinker training API over a tinkerq fleet. It connects to the fleet's Redis,
says what the fleet serves, and opens training and sampling clients (producer/training_client.py,
producer/sampling.py).

Names, signatures and return kinds follow the official SDK (``tinker==0.38``), so ``tinkerq.producer.ServiceClient``
stands in for ``tinker.ServiceClient``; tests/test_sdk_surface.py lists, with reasons, every place where they differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from typing import Any, Literal

from tinkerq import keys, optimizers, types
from tinkerq.connection import Connection
from tinkerq.errors import RequestTimeoutError, UnknownModelError, UserError, ValidationError
from tinkerq.producer.dispatch import Dispatcher
from tinkerq.producer.futures import APIFuture, ClientFuture, in_background, off_loop
from tinkerq.producer.sampling import SamplingClient, SamplingClientFuture, SamplingWorkers, check_stability_info
from tinkerq.producer.saved_dirs import normalize_model_name, saved_base_model, saved_marker
from tinkerq.producer.training_client import TrainingClient
from tinkerq.settings import Settings
from tinkerq.validation import validate_lora
from tinkerq.wire import codec, messages

log = logging.getLogger("tinkerq.producer")

LORA_FIELDS = ("rank", "seed", "train_mlp", "train_attn", "train_unembed")


class TrainingClientFuture(ClientFuture["TrainingClient"]):
    """What the ``create_*training_client*`` calls return (Tinker's ``BackcompatTrainingClientFuture``):
    ``.result()`` or ``await`` it for the :class:`TrainingClient`; using it directly as the client also works
    (each attribute waits for the client first)."""


class ServiceClient:
    """Entry point: connects to a fleet and opens training clients on the models it serves.

    ``broker_url`` (or ``TINKERQ_BROKER_URL``) names the fleet's Redis; ``"memory://"`` talks to an
    embedded fleet in this process (see ``tinkerq.worker.core.embedded``). Unlike Tinker's, it takes no API key or
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
        return await off_loop(self.get_server_capabilities)

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
        not stored. ``optimizer``: the client's optimizer, fixed for its life (None or ``AdamOptimizerConfig()``:
        AdamW; ``DimuonOptimizerConfig()``: Dimuon, docs/optimizers.md); tinkerq's types or the SDK's.
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
        """A new training session with the weights of ``save_state``'s directory and a fresh ``optimizer`` (as in
        Tinker: AdamW unless another is named, whatever optimizer the state was saved with;
        ``create_training_client_from_state_with_optimizer`` restores the saved optimizer and its state instead).
        A LoRA state opens a LoRA session with the saved adapter's configuration. ``weights_access_token`` is
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
        """A new training session resumed exactly from ``save_state``'s directory: the optimizer it was saved
        with (AdamW or Dimuon) and its state, the weights and pending gradients (the run continues as if never
        interrupted)."""
        return self._from_state(path, base_model, with_optimizer=True, optimizer=None)

    async def create_training_client_from_state_with_optimizer_async(
        self, path: str, base_model: str | None = None, user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
    ) -> TrainingClient:
        return await self.create_training_client_from_state_with_optimizer(path, base_model, user_metadata,
                                                                           weights_access_token)

    # -- sessions driven by the caller (a tinkerq extension: the HTTP gateway's seam) ---------------------------

    def open_training_client(self, base_model: str, lora: types.LoraConfig | None = None, *,
                             timeout: float | None = None, session_id: str | None = None,
                             optimizer: types.OptimizerConfig | None = None) -> TrainingClient:
        """Open a training session and wait for it, in the calling thread: a LoRA session when ``lora`` is
        given, else a full-parameter one.

        The blocking form of the ``create_*training_client`` calls, for callers that manage their own threads
        and number their own requests (the HTTP gateway; see :meth:`TrainingClient.submit`). Waits at most
        ``timeout`` seconds (None: ``TINKERQ_CREATE_TIMEOUT_S``), then raises RequestTimeoutError. A model no
        worker serves raises UnknownModelError, an invalid ``lora`` ValidationError, before anything is sent.

        ``session_id`` (32 hex digits; default: a new random one) names the worker session. Opening the same
        id again answers with the session already built (workers build one session per id, fleet-wide): a
        caller that may repeat its open (a gateway re-running a dead gateway's create) leaves no orphan.
        ``optimizer``: the session's optimizer (None: AdamW).
        """
        base_model = normalize_model_name(base_model)
        if lora is not None:
            validate_lora(lora, max_rank=self.settings.max_lora_rank)
        if session_id is not None and not _is_session_id(session_id):
            raise ValidationError(f"session_id must be 32 lowercase hex digits, got {session_id!r}")
        self._require_served(base_model)
        return self._create(base_model, lora, timeout, session_id, optimizers.config_of(optimizer))

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
        config = optimizers.config_of(optimizer)
        base_model = normalize_model_name(base_model)
        self._require_served(base_model)  # here, so a model nobody serves fails at the call
        return TrainingClientFuture(in_background(lambda: self._create(base_model, lora, None, optimizer=config)),
                                    f"training client on {base_model}")

    def _from_state(self, path: str, base_model: str | None, *, with_optimizer: bool,
                    optimizer: Any) -> TrainingClientFuture:
        saved = saved_marker(path, "tinkerq_state.json", "save_state()", base_model=base_model)
        # Resuming with the optimizer: the one the state was saved with (absent: AdamW, saved before Dimuon was);
        # weights only: the one asked for (Tinker's optimizer_config of a new weights-only model).
        config = optimizers.config_of(saved.get("optimizer") if with_optimizer else optimizer)
        base_model = normalize_model_name(base_model or str(saved["base_model"]))
        lora = saved.get("lora")
        lora_config = None
        if isinstance(lora, dict):
            lora_config = types.LoraConfig(**{k: lora[k] for k in LORA_FIELDS if k in lora})
            validate_lora(lora_config, max_rank=self.settings.max_lora_rank)
        self._require_served(base_model)

        def resume() -> TrainingClient:
            tc = self._create(base_model, lora_config, None, optimizer=config)
            try:
                tc._load(path, optimizer=with_optimizer).result()
            except BaseException:
                with contextlib.suppress(Exception):  # give the worker its memory back; the load error matters
                    tc.close()
                raise
            return tc

        return TrainingClientFuture(in_background(resume), f"training client from {path}")

    def _require_served(self, base_model: str) -> None:
        if not self.connection.workers_serving(base_model):
            served = self._served_models()
            raise UnknownModelError(
                f"no worker serves {base_model!r}; served now: {served or 'none'}. "
                f"Start one with: tinkerq worker --model {base_model}"
            )

    def _create(self, base_model: str, lora: types.LoraConfig | None, timeout: float | None,
                session_id: str | None = None, optimizer: types.OptimizerConfig | None = None) -> TrainingClient:
        model_id = session_id or uuid.uuid4().hex
        timeout = self.settings.create_timeout_s if timeout is None else timeout
        # The deadline lets a worker that finds this request late (no worker was free) skip it.
        request: dict[str, Any] = {"base_model": base_model, "deadline": time.time() + timeout}
        if lora is not None:
            request["lora"] = messages.encode_lora(lora)
        if optimizer is not None and optimizer != types.AdamOptimizerConfig():  # absent: AdamW (older workers too)
            request["optimizer"] = messages.encode_optimizer(optimizer)
        body = codec.packb(request)
        future = self._dispatch.submit(
            "create_model", body, model_id=model_id, seq_id=0, queue=keys.model_queue(base_model),
            decode=messages.decode_model_info,
            argsrepr=f"base_model={base_model}" + (f", lora_rank={lora.rank}" if lora is not None else "")
            + (f", optimizer={optimizer.type}" if optimizer is not None else ""),
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
        check_stability_info(record_stability_info)
        if model_path is not None:
            if not isinstance(model_path, str) or not model_path:
                raise UserError(f"model_path must be a path returned by save_weights_for_sampler(), got {model_path!r}")
            base_model = base_model or saved_base_model(model_path, "tinkerq_weights.json",
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
        future = await off_loop(self.create_sampling_client, model_path, base_model, retry_config,
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


def _is_session_id(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)
