"""TrainingClient: one training session's API (the official SDK's names), its requests numbered in order.

Every call encodes its request once (msgpack), claim-checks it if large, and posts it as a Celery task to the
queue of the worker that holds the session (the dispatcher, producer/dispatch.py, keeps it until answered).
Requests carry increasing ``seq_id``s; the worker applies them strictly in that order, so callers may submit many
forward_backward / optim_step pairs without waiting. :meth:`TrainingClient.submit` and :meth:`~TrainingClient.skip`
let a caller number requests itself (the HTTP gateway).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from tinkerq import operations, optimizers, types
from tinkerq.errors import TinkerqError, UserError
from tinkerq.producer.custom_loss import custom_forward_backward
from tinkerq.producer.futures import APIFuture, in_background, off_loop
from tinkerq.producer.model_info import GetInfoResponse
from tinkerq.producer.sampling import SamplingClient, SamplingClientFuture, check_stability_info, load_tokenizer
from tinkerq.validation import Limits, validate_loss_request, validate_ttl_seconds
from tinkerq.wire import codec, messages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizer

    from tinkerq.producer.service_client import ServiceClient


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
        return custom_forward_backward(self, data, loss_fn, loss_type_input)

    async def forward_backward_custom_async(
        self, data: Sequence[types.Datum], loss_fn: Callable[..., Any], *,
        loss_type_input: Literal["logprobs"] | None = None,
    ) -> APIFuture[types.ForwardBackwardOutput]:
        return await off_loop(self.forward_backward_custom, data, loss_fn, loss_type_input=loss_type_input)

    def optim_step(self, optim_params: types.AdamParams | types.DimuonParams | None = None, *,
                   adam_params: types.AdamParams | None = None) -> APIFuture[types.OptimStepResponse]:
        """Apply the client's optimizer to the gradients of every forward_backward submitted before this call, then
        zero them.

        ``optim_params`` (Tinker's name) or ``adam_params=`` (its legacy keyword, and tinkerq's positional
        argument before) give the hyperparameters of the optimizer the client was created with: ``AdamParams``
        (neither: ``types.AdamParams()``) for AdamW, ``DimuonParams`` for Dimuon (docs/optimizers.md). The SDK's
        own classes are taken too, and a raw ``OptimParamsBase(type="dimuon", ...)`` with ``damping`` or
        ``rank_lr_correction_exponent``.
        """
        try:
            params = _optim_params(optim_params, adam_params)
            optimizers.check_matches(self.optimizer_config, params)
        except TinkerqError as exc:
            return APIFuture.failed(exc)
        return self._submit(
            "optim_step", messages.encode_optim(params), messages.decode_optim_step_response,
            argsrepr=f"{params.type} lr={params.learning_rate:g}",
        )

    async def optim_step_async(self, optim_params: types.AdamParams | types.DimuonParams | None = None, *,
                               adam_params: types.AdamParams | None = None) -> APIFuture[types.OptimStepResponse]:
        return self.optim_step(optim_params, adam_params=adam_params)

    @property
    def optimizer_config(self) -> types.OptimizerConfig:
        """The optimizer this client was created with (fixed for its life), as its worker reported it."""
        return self.info.optimizer_config

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
        """Save weights, optimizer state (AdamW's moments or Dimuon's momentum) and pending gradients after every
        earlier request; the future holds the path.

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
        (no AdamW moments or Dimuon momentum, step 0) and pending gradients are dropped, as in a new session from
        those weights (saved with either optimizer). ``load_state_with_optimizer`` restores the saved optimizer state
        and pending gradients too."""
        return self._load(path, optimizer=False)

    async def load_state_async(self, path: str,
                               weights_access_token: str | None = None) -> APIFuture[types.LoadWeightsResponse]:
        return self.load_state(path, weights_access_token)

    def load_state_with_optimizer(self, path: str,
                                  weights_access_token: str | None = None) -> APIFuture[types.LoadWeightsResponse]:
        """Replace this session's weights, optimizer state and pending gradients with a saved state's: the run
        continues exactly where the saved one was. The state must have been saved with this client's optimizer."""
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
        check_stability_info(record_stability_info)
        if kind != "snapshot":
            raise UserError(f"kind={kind!r} is not supported by tinkerq: every sampling client made here samples "
                            f"a fixed snapshot (kind='snapshot')")
        future = self._submit("create_sampler", {}, lambda body: str(body["sampler_id"]), argsrepr="")
        service, base_model = self.service, self.info.base_model
        return SamplingClientFuture(
            in_background(lambda: SamplingClient(service, {"snapshot": future.result()}, base_model,
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
        future = await off_loop(self.create_sampling_client, model_path, retry_config, record_stability_info)
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
        :mod:`tinkerq.wire.messages` encodes: ``encode_loss_request``, ``encode_optim``; ``{"path", "optimizer"}``
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


def _is_position(seq_id: Any) -> bool:
    return isinstance(seq_id, int) and not isinstance(seq_id, bool) and seq_id >= 1


def _as_is(body: Any) -> Any:
    return body


def _nothing(body: Any) -> None:
    return None


def _saved_path(body: Any) -> types.SaveWeightsResponse:
    return types.SaveWeightsResponse(path=str(body["path"]))


def _optim_params(optim_params: Any, adam_params: Any) -> types.OptimParams:
    """The hyperparameters of an optim_step call, checked (tinkerq's types, the SDK's, or a raw OptimParamsBase)."""
    if optim_params is not None and adam_params is not None:
        raise UserError("pass optim_params or adam_params=, not both")
    return optimizers.params_of(optim_params if optim_params is not None else adam_params)
