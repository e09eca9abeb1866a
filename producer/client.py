"""ServiceClient and TrainingClient: the Tinker training API over a tinkerq fleet.

Every call encodes its request once (msgpack), claim-checks it if large, and posts it as a Celery task
to the queue of the worker that holds the training session. Requests of one training client carry
increasing ``seq_id``s; the worker applies them strictly in that order, so callers may submit many
forward_backward / optim_step pairs without waiting.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from producer.dispatch import Dispatcher
from producer.futures import APIFuture
from producer.sampling import SamplingClient, SamplingWorkers
from tinkerq import keys, types
from tinkerq.connection import Connection
from tinkerq.errors import RequestTimeoutError, TinkerqError, UnknownModelError, UserError
from tinkerq.settings import Settings
from tinkerq.validation import Limits, validate_adam, validate_lora, validate_loss_request
from tinkerq.wire import codec, messages

log = logging.getLogger("tinkerq.producer")


class ServiceClient:
    """Entry point: connects to a fleet and opens training clients on the models it serves.

    ``broker_url`` (or ``TINKERQ_BROKER_URL``) names the fleet's Redis; ``"memory://"`` talks to an
    embedded fleet in this process (see ``worker.embedded``).
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

    def get_server_capabilities(self) -> list[str]:
        """Base models some live worker currently serves."""
        return sorted({w["base_model"] for w in self.connection.workers_serving()})

    def create_training_client(self, base_model: str, *, timeout: float | None = None) -> TrainingClient:
        """Open a new full-parameter training session on a fresh copy of ``base_model``'s weights.

        ``base_model`` is the model a worker serves: the local Hugging Face directory it was started with.
        """
        return self._open(base_model, None, timeout)

    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True, *,
                                    timeout: float | None = None, **_tinker_extras: Any) -> TrainingClient:
        """Open a LoRA training session: an adapter of ``rank`` over ``base_model``, which stays frozen and is
        shared with the worker's other LoRA sessions (docs/lora.md).

        Tinker's semantics: adapters on the attention projections (``train_attn``), the MLP (``train_mlp``) and
        the output projection (``train_unembed``), scaling 32 / rank; the same ``seed`` gives the same initial
        adapter (None: a random one, reported in ``get_info().extra["lora"]``). A new adapter leaves the
        model's outputs unchanged. LoRA usually wants a learning rate about 10x a full fine-tune's.
        """
        config = types.LoraConfig(rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn,
                                  train_unembed=train_unembed)
        validate_lora(config, max_rank=self.settings.max_lora_rank)
        return self._open(base_model, config, timeout)

    def _open(self, base_model: str, lora: types.LoraConfig | None, timeout: float | None) -> TrainingClient:
        base_model = normalize_model_name(base_model)
        if not self.connection.workers_serving(base_model):
            served = self.get_server_capabilities()
            raise UnknownModelError(
                f"no worker serves {base_model!r}; served now: {served or 'none'}. "
                f"Start one with: tinkerq worker --model {base_model}"
            )
        model_id = uuid.uuid4().hex
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

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None) -> SamplingClient:
        """Sample from saved weights (a ``save_weights_for_sampler`` path) or from ``base_model`` itself.

        Requests go to every live worker of the base model (trainers and ``--role sampler`` workers).
        With ``model_path``, ``base_model`` is read from the directory when omitted.
        """
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
        return SamplingClient(self, source, normalize_model_name(base_model))

    def create_training_client_from_state(self, path: str, base_model: str | None = None, *,
                                          timeout: float | None = None) -> TrainingClient:
        """A new training session resumed from ``save_state``'s directory (weights + optimizer state); a LoRA
        state opens a LoRA session with the saved adapter's configuration."""
        saved = _saved_marker(path, "tinkerq_state.json", "save_state()", base_model=base_model)
        base_model = base_model or str(saved["base_model"])
        lora = saved.get("lora")
        if isinstance(lora, dict):
            options: dict[str, Any] = {k: lora.get(k) for k in ("rank", "seed", "train_mlp", "train_attn",
                                                               "train_unembed")}
            tc = self.create_lora_training_client(base_model, **options, timeout=timeout)
        else:
            tc = self.create_training_client(base_model, timeout=timeout)
        tc.load_state(path).result(timeout=timeout)
        return tc

    def close(self) -> None:
        self._dispatch.close()
        self.connection.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TrainingClient:
    """One training session: a model's weights, pending gradients and optimizer state on one worker."""

    def __init__(self, service: ServiceClient, info: types.ModelInfo) -> None:
        self.service = service
        self.info = info
        self.model_id = info.model_id
        self._seq = itertools.count(1)
        self._seq_lock = threading.Lock()
        self._queue = keys.worker_queue(info.worker)
        s = service.settings
        self._limits = Limits(max_datums=s.max_datums, max_batch_tokens=s.max_batch_tokens)

    # -- the training API ---------------------------------------------------------------------------------

    def forward_backward(
        self, data: Sequence[types.Datum], loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """Compute the loss and per-token outputs; gradients ADD to the session's pending gradients."""
        return self._loss_call("forward_backward", data, loss_fn, loss_fn_config)

    def forward(
        self, data: Sequence[types.Datum], loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        """Like forward_backward, without gradients."""
        return self._loss_call("forward", data, loss_fn, loss_fn_config)

    def optim_step(self, adam_params: types.AdamParams | None = None) -> APIFuture[types.OptimStepResponse]:
        """Apply AdamW to the gradients of every forward_backward submitted before this call, then zero them."""
        adam_params = adam_params or types.AdamParams()
        try:
            validate_adam(adam_params)
        except TinkerqError as exc:
            return APIFuture.failed(exc)
        return self._submit(
            "optim_step", messages.encode_adam(adam_params), messages.decode_optim_step_response,
            argsrepr=f"lr={adam_params.learning_rate:g}",
        )

    def save_weights_for_sampler(self, name: str, *, merged: bool = False) -> APIFuture[types.SaveWeightsResponse]:
        """Write the current weights; the future holds the directory's path.

        A full-parameter session writes a plain Hugging Face model directory. A LoRA session writes a standard
        PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``; ``PeftModel.from_pretrained``
        loads it); ``merged=True`` (a tinkerq extension) also writes the base with the adapter merged in, as a
        plain model directory in ``<path>/merged`` (for serving engines that reject an adapter on the output
        projection).
        """
        return self._submit(
            "save_weights_for_sampler", {"name": name, "merged": merged},
            lambda body: types.SaveWeightsResponse(path=str(body["path"])), argsrepr=f"name={name}",
        )

    def save_state(self, name: str) -> APIFuture[types.SaveWeightsResponse]:
        """Save weights, AdamW state and pending gradients after every earlier request; the future holds the path.

        ``load_state(path)`` or ``ServiceClient.create_training_client_from_state(path)`` resume from it exactly.
        """
        return self._submit("save_state", {"name": name},
                            lambda body: types.SaveWeightsResponse(path=str(body["path"])), argsrepr=f"name={name}")

    def load_state(self, path: str) -> APIFuture[dict[str, Any]]:
        """Replace this session's weights and optimizer state with a saved state (in request order)."""
        return self._submit("load_state", {"path": path}, lambda body: body, argsrepr=f"path={path}")

    def save_weights_and_get_sampling_client(self, name: str | None = None, *,
                                             timeout: float | None = None) -> SamplingClient:
        """Freeze the weights as of every request submitted so far and return a client that samples them.

        Waits for the earlier requests to be applied (later training requests do not wait for its samples).
        Any worker of the model can serve the snapshot (docs/sampling.md). ``name`` is accepted for
        Tinker compatibility; use save_weights_for_sampler for a directory on disk.
        """
        future = self._submit("create_sampler", {}, lambda body: str(body["sampler_id"]), argsrepr="")
        return SamplingClient(self.service, {"snapshot": future.result(timeout=timeout)}, self.info.base_model)

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None) -> SamplingClient:
        return await asyncio.get_running_loop().run_in_executor(None, self.save_weights_and_get_sampling_client, name)

    def create_sampling_client(self, model_path: str) -> SamplingClient:
        """A sampling client on saved weights of this client's base model (``save_weights_for_sampler``)."""
        return self.service.create_sampling_client(model_path=model_path, base_model=self.info.base_model)

    def echo(self, body: dict[str, Any]) -> APIFuture[dict[str, Any]]:
        """Send ``body`` through the fleet and back, untouched (latency probes, benchmarks)."""
        return self._submit("echo", body, lambda b: b, argsrepr="")

    def get_info(self) -> types.ModelInfo:
        return self.info

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer (``transformers.AutoTokenizer``), when its directory is visible here."""
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise UserError("get_tokenizer() needs transformers: pip install 'tinkerq[jobs]'") from None
        try:
            return AutoTokenizer.from_pretrained(self.info.base_model)
        except (OSError, ValueError) as exc:
            raise UserError(
                f"cannot load the tokenizer of {self.info.base_model!r} on this machine ({exc}); the model "
                f"directory must be readable here"
            ) from None

    def close(self, timeout: float = 30.0) -> None:
        """Release the session's memory on the worker (after every earlier request has been applied)."""
        self._submit("close_model", {}, lambda b: b, argsrepr="").result(timeout=timeout)

    # Tinker's async spellings: `await tc.forward_backward_async(...)` gives the future to await again.
    async def forward_backward_async(self, *args: Any, **kwargs: Any) -> APIFuture[types.ForwardBackwardOutput]:
        return self.forward_backward(*args, **kwargs)

    async def forward_async(self, *args: Any, **kwargs: Any) -> APIFuture[types.ForwardBackwardOutput]:
        return self.forward(*args, **kwargs)

    async def optim_step_async(self, *args: Any, **kwargs: Any) -> APIFuture[types.OptimStepResponse]:
        return self.optim_step(*args, **kwargs)

    # -- plumbing ---------------------------------------------------------------------------------------------

    def _loss_call(
        self, op: str, data: Sequence[types.Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None
    ) -> APIFuture[types.ForwardBackwardOutput]:
        data = list(data) if isinstance(data, (list, tuple)) else data
        try:
            validate_loss_request(
                data, loss_fn, loss_fn_config, limits=self._limits,
                vocab_size=self.info.vocab_size, max_seq_len=self.info.max_seq_len,
            )
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
        """Post one ordered request. ``seq_id`` is given only by tests that replay or reorder requests."""
        try:  # encode first: a body that cannot be sent must not use up a sequence number
            encoded = codec.packb(body)
            self.service.connection.claim_check().check_size(len(encoded))
        except TinkerqError as exc:
            return APIFuture.failed(exc)
        if seq_id is None:
            seq_id = self.next_seq_id()
        # Posted now, or by the dispatcher once Redis is reachable: an outage costs time, not the session.
        return self.service._dispatch.submit(
            op, encoded, model_id=self.model_id, seq_id=seq_id, queue=self._queue, decode=decode,
            argsrepr=argsrepr, worker=self.info.worker,
            heartbeat_s=float(self.info.extra.get("heartbeat_s") or self.service.settings.heartbeat_s),
        )

    def next_seq_id(self) -> int:
        with self._seq_lock:
            return next(self._seq)


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
