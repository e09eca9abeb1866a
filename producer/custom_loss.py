"""``TrainingClient.forward_backward_custom``: a loss computed in the caller's process, with torch, from the
per-token logprobs a ``forward`` returns, turned into the weights of a ``cross_entropy`` forward_backward that gives
the model the same gradients (as the official SDK does it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from tinkerq import types
from tinkerq.errors import TinkerqError, UserError
from tinkerq.producer.futures import APIFuture, MappedFuture

if TYPE_CHECKING:
    from tinkerq.producer.training_client import TrainingClient


def custom_forward_backward(tc: TrainingClient, data: Sequence[types.Datum], loss_fn: Callable[..., Any],
                            loss_type_input: Literal["logprobs"] | None) -> APIFuture[types.ForwardBackwardOutput]:
    """What :meth:`TrainingClient.forward_backward_custom` does (its docstring says how)."""
    if loss_type_input not in (None, "logprobs"):
        return APIFuture.failed(UserError(f"loss_type_input must be 'logprobs' or None, got {loss_type_input!r}"))
    if not callable(loss_fn):
        return APIFuture.failed(UserError(
            "loss_fn must be a callable (data, logprobs_list) -> (loss, metrics); tinkerq has no server-side "
            "custom losses (ServiceClient.create_custom_loss)"))
    data = [types.as_datum(d) for d in data]
    try:
        forward_data = [custom_forward_datum(i, d) for i, d in enumerate(data)]
    except TinkerqError as exc:
        return APIFuture.failed(exc)
    forward = tc.forward(forward_data, "cross_entropy")
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

    return MappedFuture(tc.forward_backward(backward_data, "cross_entropy"), with_custom_metrics)


def custom_forward_datum(index: int, datum: types.Datum) -> types.Datum:
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
