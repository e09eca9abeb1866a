"""A training session: one copy of the weights, its pending gradients and its AdamW state.

Every operation either completes or leaves the session exactly as it was: a forward_backward computes
all of its gradients into fresh buffers, checks them, and only then adds them to the pending gradients;
an optim_step checks the gradient norm before touching a weight.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from tinkerq import types
from tinkerq.errors import NonFiniteError
from tinkerq.validation import resolve_loss_config
from worker import checkpoints
from worker.batching import microbatch_ranges, pad_batch
from worker.logprobs import LogprobComputer
from worker.losses import LOSSES, MetricTotals, score


class TrainingSession:
    def __init__(self, model_id: str, model: PreTrainedModel, *, base_dir: str, microbatch_tokens: int,
                 logprobs: LogprobComputer, blank_model: Callable[[], PreTrainedModel] | None = None,
                 ) -> None:
        self.model_id = model_id
        self.model = model
        self.logprobs = logprobs
        self._blank_model = blank_model
        self.base_dir = base_dir
        self.microbatch_tokens = microbatch_tokens
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        # Pending gradients start at zero so every optim_step updates every parameter, as torch.optim.AdamW
        # does after a backward pass that reached all of them.
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer = torch.optim.AdamW(self.params, lr=0.0, weight_decay=0.0)
        self.steps = 0
        self.last_used = time.monotonic()
        self.device = next(model.parameters()).device

    # -- forward / forward_backward --------------------------------------------------------------------

    def run_loss(
        self, data: list[types.Datum], loss_fn: str, config: dict[str, Any] | None, *, backward: bool
    ) -> types.ForwardBackwardOutput:
        loss_impl = LOSSES[loss_fn]
        resolved = resolve_loss_config(loss_fn, config)
        totals = MetricTotals()
        outputs: list[dict[str, types.TensorData]] = [{} for _ in data]
        loss_sum = 0.0
        grads = [torch.zeros_like(p) for p in self.params] if backward else None
        for start, stop in microbatch_ranges([d.model_input.length for d in data], self.microbatch_tokens):
            batch = pad_batch(data[start:stop], self.device)
            with torch.set_grad_enabled(backward):
                logprobs = self.logprobs(self.model, batch["tokens"], batch["mask"].long(), batch["target_tokens"])
                scored = score(logprobs, batch, loss_impl, resolved)
            if not torch.isfinite(scored.loss):
                raise NonFiniteError(
                    f"{loss_fn} loss is {scored.loss.item()} on datums {start}..{stop - 1}; nothing was applied. "
                    f"The weights may have diverged (lower the learning rate) or the inputs are extreme"
                )
            if backward:
                assert grads is not None
                new_grads = torch.autograd.grad(scored.loss, self.params, allow_unused=True)
                for g, new in zip(grads, new_grads, strict=True):
                    if new is not None:
                        g.add_(new)
            loss_sum += float(scored.loss.detach())
            totals.add(scored.metrics)
            for row, (lp, el) in enumerate(scored.rows(batch["lengths"])):
                outputs[start + row] = {"logprobs": types.TensorData.from_numpy(lp),
                                        "elementwise_loss": types.TensorData.from_numpy(el)}
        if grads is not None:
            bad = next((i for i, g in enumerate(grads) if not torch.isfinite(g).all()), None)
            if bad is not None:
                raise NonFiniteError(
                    f"the gradient of {loss_fn} is not finite (parameter #{bad}); nothing was applied"
                )
            for p, g in zip(self.params, grads, strict=True):
                p.grad.add_(g)
        self.last_used = time.monotonic()
        return types.ForwardBackwardOutput(
            loss_fn_output_type=loss_fn,
            loss_fn_outputs=outputs,
            metrics={"loss:sum": loss_sum, **totals.result()},
        )

    # -- optim_step --------------------------------------------------------------------------------------------

    def optim_step(self, adam: types.AdamParams) -> types.OptimStepResponse:
        grads = [p.grad for p in self.params]
        norm = float(torch.nn.utils.get_total_norm(grads, norm_type=2.0))
        if not math.isfinite(norm):
            for g in grads:
                g.zero_()
            raise NonFiniteError(
                f"gradient norm is {norm} at step {self.steps + 1}: the step was refused, the weights are "
                f"unchanged and the pending gradients were discarded"
            )
        if adam.grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, adam.grad_clip_norm, torch.tensor(norm))
        for group in self.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        self.optimizer.step()
        for g in grads:
            g.zero_()
        self.steps += 1
        self.last_used = time.monotonic()
        return types.OptimStepResponse(
            metrics={"grad_norm:mean": norm, "learning_rate:mean": adam.learning_rate, "step:max": self.steps}
        )

    # -- sampling ---------------------------------------------------------------------------------------------------

    def snapshot(self) -> PreTrainedModel:
        """A frozen copy of the current weights, for sampling (worker/snapshots.py keeps and publishes it)."""
        snapshot = self._blank_model() if self._blank_model else copy.deepcopy(self.model)
        snapshot.load_state_dict(self.model.state_dict())
        snapshot.requires_grad_(False)
        self.last_used = time.monotonic()
        return snapshot

    # -- weights out -------------------------------------------------------------------------------------------

    def save_weights(self, checkpoint_dir: str, name: str, *, base_model: str) -> str:
        """Write a plain Hugging Face model directory (from_pretrained loads it without tinkerq)."""
        final = checkpoints.weights_path(checkpoint_dir, self.model_id, name)

        def fill(tmp: Path) -> None:
            self.model.save_pretrained(tmp)
            checkpoints.copy_tokenizer_files(self.base_dir, tmp)
            checkpoints.write_weights_marker(tmp, base_model)

        checkpoints.write_atomically(final, fill)
        self.last_used = time.monotonic()
        return str(final)

    def save_state(self, checkpoint_dir: str, name: str, *, base_model: str, seq_id: int) -> str:
        """Weights + AdamW state + pending gradients + request position, for load_state."""
        final = checkpoints.state_path(checkpoint_dir, self.model_id, name)
        moments: dict[str, torch.Tensor] = {}
        for n, p in zip(self.param_names, self.params, strict=True):
            moments.update(checkpoints.optimizer_entries(n, self.optimizer.state.get(p, {}), lambda t: t))
        pending = any(bool(p.grad.any()) for p in self.params)
        grads = {n: p.grad for n, p in zip(self.param_names, self.params, strict=True)} if pending else {}
        checkpoints.write_atomically(final, lambda tmp: checkpoints.write_state(
            tmp, write_weights=self.model.save_pretrained, shapes=self.shapes(), moments=moments, grads=grads,
            base_model=base_model, model_id=self.model_id, steps=self.steps, seq_id=seq_id))
        self.last_used = time.monotonic()
        return str(final)

    def load_state(self, directory: Path) -> dict[str, Any]:
        """Replace the weights, AdamW state and pending gradients with a saved state's (any shard count)."""
        tied = tied_names(self.model)
        saved = checkpoints.read_state(directory, self.shapes(), tied)
        with torch.no_grad():
            for n, p in zip(self.param_names, self.params, strict=True):
                p.copy_(saved.weights[n] if n in saved.weights else saved.weights[tied[n]])
                p.grad.copy_(saved.grads[n]) if n in saved.grads else p.grad.zero_()
                state = adam_state(n, saved.moments, p.device, p.dtype, lambda t: t)
                if state:
                    self.optimizer.state[p] = state
                else:
                    self.optimizer.state.pop(p, None)
        self.steps = int(saved.meta["optimizer_steps"])
        self.last_used = time.monotonic()
        return saved.meta

    def shapes(self) -> dict[str, list[int]]:
        return {n: list(p.shape) for n, p in zip(self.param_names, self.params, strict=True)}

    def close(self) -> None:
        """Nothing to release beyond dropping the session (its tensors are freed with it)."""


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """For each parameter name, the other names of the same tensor (tied embeddings), one level deep."""
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return {n: other for names in by_id.values() for n in names for other in names if other != n}


def adam_state(name: str, moments: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
               place: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """One parameter's AdamW state from a checkpoint; ``place`` turns a full moment into this rank's piece.

    torch keeps AdamW's step counter on the CPU (unless capturable); the moments live with the parameter.
    """
    state = {k: place(moments[f"{name}::{k}"].to(device, dtype)) for k in ("exp_avg", "exp_avg_sq")
             if f"{name}::{k}" in moments}
    if f"{name}::step" in moments:
        state["step"] = moments[f"{name}::step"]
    return state
