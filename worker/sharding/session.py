"""One training session's shard on one rank: FSDP2 (``fully_shard``) over the model, with AdamW.

Every rank runs the same method for each command, in the same order. Each parameter, its gradient and
its AdamW moments are DTensors sharded along dim 0, so a rank holds about 1/N of each. A request's datums
are split across the ranks (:func:`worker.batching.rank_plans`); FSDP gathers each layer's weights for
the forward and reduce-scatters its gradients on the way back.

What must match one unsharded worker, and how it does:

* FSDP averages gradients over ranks while the Tinker API sums over datums: each rank's loss is scaled
  by N before ``backward`` (exact for N a power of two; otherwise within float rounding).
* A forward_backward either adds all of its gradients or none: the pending gradients are set aside,
  the new ones computed, every rank votes on whether they are finite, and only then are they added.
* Per-datum outputs travel back to rank 0 and are put in input order there.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import PreTrainedModel

from tinkerq import types
from tinkerq.errors import NonFiniteError
from tinkerq.validation import resolve_loss_config
from tinkerq.wire import codec
from worker.batching import pad_batch, rank_plans
from worker.checkpoints import SavedState, optimizer_entries
from worker.logprobs import LogprobComputer
from worker.losses import LOSSES, MetricTotals, score
from worker.session import adam_state, tied_names
from worker.sharding.group import ShardGroup


class LogprobModule(torch.nn.Module):
    """The model and its loss head as one module, so FSDP's root gathers the embeddings and the output
    weight around exactly the computation that uses them."""

    def __init__(self, lm: PreTrainedModel, logprobs: LogprobComputer) -> None:
        super().__init__()
        self.lm = lm
        self.logprobs = logprobs

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.logprobs(self.lm, tokens, mask, targets)  # (B, T)


def decoder_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The repeated blocks of the backbone (the first ModuleList under it), each sharded on its own."""
    for child in model.base_model.children():
        if isinstance(child, torch.nn.ModuleList):
            return list(child)
    return []


class ShardedSession:
    def __init__(self, model_id: str, model: PreTrainedModel, group: ShardGroup, *, logprobs: LogprobComputer,
                 microbatch_tokens: int) -> None:
        assert group.mesh is not None
        self.model_id = model_id
        self.group = group
        self.model = model
        self.module = LogprobModule(model, logprobs)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=group.mesh)
        fully_shard(self.module, mesh=group.mesh)  # the root: embeddings, final norm, output weight
        self.device = torch.device(group.spec.device)
        self.microbatch_tokens = microbatch_tokens
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.tied = tied_names(model)
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer = torch.optim.AdamW(self.params, lr=0.0, weight_decay=0.0)
        self.steps = 0

    def shapes(self) -> dict[str, list[int]]:
        return {n: list(p.shape) for n, p in zip(self.param_names, self.params, strict=True)}  # global shapes

    # -- forward / forward_backward ----------------------------------------------------------------------

    def run_loss(self, data: list[types.Datum], loss_fn: str, config: dict[str, Any] | None, *,
                 backward: bool) -> types.ForwardBackwardOutput | None:
        """This rank's part of the request; the merged output on rank 0, None elsewhere."""
        loss_impl = LOSSES[loss_fn]
        resolved = resolve_loss_config(loss_fn, config)
        plan = rank_plans([d.model_input.length for d in data], self.group.world, self.microbatch_tokens)
        totals = MetricTotals()
        rows: list[list[Any]] = []
        loss_sum, problem = 0.0, None
        pending = [p.grad for p in self.params]
        if backward:
            for p in self.params:
                p.grad = None
        for span in plan[self.group.rank]:
            if span is None:
                self._idle_pass(backward)
                continue
            start, stop = span
            batch = pad_batch(data[start:stop], self.device)
            with torch.set_grad_enabled(backward):
                logprobs = self.module(batch["tokens"], batch["mask"].long(), batch["target_tokens"])  # (B, T)
                scored = score(logprobs, batch, loss_impl, resolved)
            if problem is None and not torch.isfinite(scored.loss):
                problem = f"{loss_fn} loss is {scored.loss.item()} on datums {start}..{stop - 1}"
            if backward:  # even a non-finite loss goes backward: every rank must join the same collectives
                (scored.loss * self.group.world).backward()
            loss_sum += float(scored.loss.detach())
            totals.add(scored.metrics)
            rows += [[start + i, lp, el] for i, (lp, el) in enumerate(scored.rows(batch["lengths"]))]
        if backward and problem is None:
            bad = next((n for n, p in zip(self.param_names, self.params, strict=True)
                        if p.grad is not None and not torch.isfinite(p.grad.to_local()).all()), None)
            if bad is not None:
                problem = f"the gradient of {loss_fn} is not finite ({bad})"
        try:
            self.group.agree(NonFiniteError(f"{problem}; nothing was applied") if problem else None)
        except NonFiniteError:
            if backward:
                for p, old in zip(self.params, pending, strict=True):
                    p.grad = old
            raise
        if backward:
            with torch.no_grad():
                for p, old in zip(self.params, pending, strict=True):
                    if p.grad is not None:
                        old.add_(p.grad)
                    p.grad = old
        parts = self.group.gather_bytes(codec.packb({"rows": rows, "loss_sum": loss_sum, "totals": totals.raw()}))
        if not self.group.is_leader:
            return None
        return _merge(parts, len(data), loss_fn)

    def _idle_pass(self, backward: bool) -> None:
        """A pass over one dummy token whose loss counts zero: it joins the collectives of a real pass."""
        one = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        with torch.set_grad_enabled(backward):
            loss = self.module(one, torch.ones_like(one), one).sum() * 0.0
        if backward:
            loss.backward()

    # -- optim_step ---------------------------------------------------------------------------------------------

    def optim_step(self, adam: types.AdamParams) -> types.OptimStepResponse:
        local_sq = sum(float(p.grad.to_local().double().pow(2).sum()) for p in self.params)
        (total_sq,) = self.group.all_reduce([local_sq])
        norm = math.sqrt(total_sq)
        if not math.isfinite(norm):
            for p in self.params:
                p.grad.zero_()
            raise NonFiniteError(
                f"gradient norm is {norm} at step {self.steps + 1}: the step was refused, the weights are "
                f"unchanged and the pending gradients were discarded"
            )
        with torch.no_grad():
            if adam.grad_clip_norm > 0:
                coef = min(1.0, adam.grad_clip_norm / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
                for p in self.params:
                    p.grad.mul_(coef)
        for group in self.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        self.optimizer.step()
        for p in self.params:
            p.grad.zero_()
        self.steps += 1
        (largest,) = self.group.all_reduce([float(self.state_bytes())], op="max")
        return types.OptimStepResponse(metrics={
            "grad_norm:mean": norm, "learning_rate:mean": adam.learning_rate, "step:max": self.steps,
            "shard_state_bytes:max": largest,
        })

    def state_bytes(self) -> int:
        """Bytes this rank holds for parameters, gradients and AdamW state."""
        def size(t: torch.Tensor) -> int:
            local = t.to_local() if isinstance(t, DTensor) else t
            return local.numel() * local.element_size()

        total = sum(size(p) + (size(p.grad) if p.grad is not None else 0) for p in self.params)
        for state in self.optimizer.state.values():
            total += sum(size(v) for v in state.values() if isinstance(v, torch.Tensor))
        return total

    # -- whole tensors out, for rank 0 -------------------------------------------------------------------------

    def _full(self, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor on the CPU (a collective for a shard: every rank must call it, in order)."""
        with torch.no_grad():
            return (t.full_tensor() if isinstance(t, DTensor) else t.detach()).cpu()

    def gather_weights(self) -> dict[str, torch.Tensor] | None:
        weights = {n: self._full(p) for n, p in zip(self.param_names, self.params, strict=True)}
        return weights if self.group.is_leader else None

    def gather_state(self) -> SavedState | None:
        weights = self.gather_weights()
        moments: dict[str, torch.Tensor] = {}
        for n, p in zip(self.param_names, self.params, strict=True):
            moments.update(optimizer_entries(n, self.optimizer.state.get(p, {}), self._full))
        local_pending = float(any(bool(p.grad.to_local().any()) for p in self.params))
        (pending,) = self.group.all_reduce([local_pending], op="max")
        grads = {n: self._full(p.grad) for n, p in zip(self.param_names, self.params, strict=True)} if pending else {}
        if not self.group.is_leader:
            return None
        assert weights is not None
        return SavedState(weights, moments, grads, {"optimizer_steps": self.steps})

    # -- whole tensors in --------------------------------------------------------------------------------------

    def load(self, saved: SavedState) -> None:
        """Take this rank's piece of every tensor of a (full) saved state; no communication needed."""
        def place(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            return distribute_tensor(full.to(self.device, like.dtype), like.device_mesh, like.placements,
                                     src_data_rank=None)

        with torch.no_grad():
            for n, p in zip(self.param_names, self.params, strict=True):
                p.copy_(place(saved.weights[n] if n in saved.weights else saved.weights[self.tied[n]], p))
                if n in saved.grads:
                    p.grad.copy_(place(saved.grads[n], p))
                else:
                    p.grad.zero_()
                state = adam_state(n, saved.moments, self.device, p.dtype, lambda t, p=p: place(t, p))
                if state:
                    self.optimizer.state[p] = state
                else:
                    self.optimizer.state.pop(p, None)
        self.steps = int(saved.meta["optimizer_steps"])


def _merge(parts: list[bytes], n_datums: int, loss_fn: str) -> types.ForwardBackwardOutput:
    outputs: list[dict[str, types.TensorData]] = [{} for _ in range(n_datums)]
    totals = MetricTotals()
    loss_sum = 0.0
    for raw in parts:
        part = codec.unpackb(raw)
        for index, lp, el in part["rows"]:
            outputs[int(index)] = {"logprobs": types.TensorData.from_numpy(lp),
                                   "elementwise_loss": types.TensorData.from_numpy(el)}
        loss_sum += float(part["loss_sum"])
        totals.merge(part["totals"])
    return types.ForwardBackwardOutput(loss_fn_output_type=loss_fn, loss_fn_outputs=outputs,
                                       metrics={"loss:sum": loss_sum, **totals.result()})
