"""The optimizer of a :class:`worker.training.TrainingEngine`: how one step turns the (clipped) pending gradients into
new weights, and what state it keeps between steps. One strategy per family a client can be created with
(:mod:`tinkerq.optimizers`); the engine does everything around it (the gradient norm, clipping, metrics, saving).

* :class:`AdamW`: ``torch.optim.AdamW`` itself (Tinker's optimizer "identical to torch.optim.AdamW").
* :class:`Dimuon`: tinkerq's definition of Tinker's Dimuon (docs/optimizers.md): an EMA momentum per parameter; per
  matrix, a damped row/column preconditioner, then the matrix sign ``U V^T`` of the result, a direction of Frobenius
  norm sqrt(rank); the learning rate corrected for the LoRA rank relative to 32.

Each keeps ``state``: parameter -> its tensors (torch's layout for AdamW), which the engine counts, saves and
restores through :meth:`entries` and :meth:`restore`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from tinkerq import optimizers, types
from tinkerq.errors import ValidationError

# Singular values at or below this fraction of a matrix's largest count as zero in Dimuon's matrix sign.
SIGN_CUTOFF = 1e-7


def kinds(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``tensors`` split into whole ones and DTensors, each in order."""
    return [t for t in tensors if not isinstance(t, DTensor)], [t for t in tensors if isinstance(t, DTensor)]


def _bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


class Optimizer(Protocol):
    config: types.OptimizerConfig
    state: Any  # parameter -> {name: tensor}

    def step(self, params: list[torch.nn.Parameter], hyper: Any) -> float:
        """Update ``params`` from their ``.grad`` (already clipped); returns the learning rate applied."""
        ...

    def entries(self, name: str, p: torch.Tensor,
                full: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """``p``'s state as ``{"<name>::<key>": whole tensor}`` for optimizer.safetensors (``full`` gathers a shard)."""
        ...

    def restore(self, name: str, p: torch.Tensor, saved: dict[str, torch.Tensor],
                place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``p``'s state from a checkpoint's entries (none there: afresh); ``place`` makes this rank's piece."""
        ...

    def unallocated_bytes(self, params: list[torch.nn.Parameter]) -> int:
        """State this rank will allocate at the first step, not allocated yet."""
        ...


class AdamW:
    config: types.OptimizerConfig = types.AdamOptimizerConfig()

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        # A LoRA adapter on an expert-parallel group mixes whole tensors and DTensors (its per-expert factors,
        # worker/sharding/experts.py): AdamW's fused loops take one kind per parameter group.
        split = kinds(params)
        groups: Any = [{"params": ps} for ps in split if ps] if all(split) else params
        self.torch = torch.optim.AdamW(groups, lr=0.0, weight_decay=0.0)
        self.state = self.torch.state

    def step(self, params: list[torch.nn.Parameter], hyper: types.AdamParams) -> float:
        for group in self.torch.param_groups:
            group.update(lr=hyper.learning_rate, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                         weight_decay=hyper.weight_decay)
        self.torch.step()
        return hyper.learning_rate

    def entries(self, name: str, p: torch.Tensor,
                full: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        state = self.state.get(p, {})
        return {f"{name}::{key}": full(state[key]) for key in ("exp_avg", "exp_avg_sq", "step") if key in state}

    def restore(self, name: str, p: torch.Tensor, saved: dict[str, torch.Tensor],
                place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        # torch keeps AdamW's step counter on the CPU (unless capturable); the moments live with the parameter.
        state = {k: place(saved[f"{name}::{k}"]) for k in ("exp_avg", "exp_avg_sq") if f"{name}::{k}" in saved}
        if f"{name}::step" in saved:
            state["step"] = saved[f"{name}::step"]
        if state:
            self.state[p] = state
        else:  # AdamW starts this parameter afresh at its next step, as in a new session
            self.state.pop(p, None)

    def unallocated_bytes(self, params: list[torch.nn.Parameter]) -> int:
        return sum(2 * _bytes(p) for p in params if "exp_avg" not in self.state.get(p, {}))


class Dimuon:
    """Dimuon as docs/optimizers.md defines it. ``rank``: the LoRA rank its learning rate is corrected for (a
    full-parameter session: 32, no correction). Every parameter must be whole on this rank (the SVD of a matrix
    needs all of it): a shard group's full sessions and expert-parallel adapters are refused at creation."""

    config: types.OptimizerConfig = types.DimuonOptimizerConfig()

    def __init__(self, params: list[torch.nn.Parameter], *, rank: int = optimizers.REFERENCE_RANK) -> None:
        if any(isinstance(p, DTensor) for p in params):
            raise ValidationError("Dimuon needs every trained matrix whole on a rank, and this session's are sharded "
                                  "(DTensors): train it with AdamW")
        self.rank = rank
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def step(self, params: list[torch.nn.Parameter], hyper: types.DimuonParams) -> float:
        lr = optimizers.corrected_learning_rate(hyper.learning_rate, self.rank, hyper.rank_lr_correction_exponent)
        with torch.no_grad():
            for p in params:
                assert p.grad is not None  # the engine keeps every gradient allocated
                state = self.state.setdefault(p, {})
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
                momentum = state["momentum"]
                momentum.mul_(hyper.beta1).add_(p.grad.float(), alpha=1.0 - hyper.beta1)
                p.add_(direction(momentum, hyper.damping).to(p.dtype), alpha=-lr)
        return lr

    def entries(self, name: str, p: torch.Tensor,
                full: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        state = self.state.get(p, {})
        return {f"{name}::momentum": full(state["momentum"])} if "momentum" in state else {}

    def restore(self, name: str, p: torch.Tensor, saved: dict[str, torch.Tensor],
                place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        key = f"{name}::momentum"
        if key in saved:  # float32 as saved (``place`` would cast it to p's dtype; p is never a shard here)
            self.state[p] = {"momentum": saved[key].to(device=p.device, dtype=torch.float32, copy=True)}
        else:  # a fresh momentum (zeros) at the next step
            self.state.pop(p, None)

    def unallocated_bytes(self, params: list[torch.nn.Parameter]) -> int:
        return sum(4 * p.numel() for p in params if p not in self.state)


def direction(momentum: torch.Tensor, damping: float) -> torch.Tensor:
    """Dimuon's update direction for one parameter's momentum, in float64 and its shape: per matrix (a 2-D tensor;
    each (a, b) slice of a tensor with more dimensions, an expert's of an (E, a, b) one; a 1-D or 0-D tensor as one
    row), ``P = diag(r + damping)^-1/4 M diag(c + damping)^-1/4`` with ``r``, ``c`` the mean squares of M's rows and
    columns, then ``msign(P) = U V^T`` over P's singular values above ``SIGN_CUTOFF`` of its largest (a zero matrix
    gives zero): Frobenius norm sqrt(rank(P)).

    In float64: a float32 SVD's own error puts the singular values a rank-deficient matrix does not have at 1e-7 to
    7e-7 of its largest (measured: rank 3 to 50, 4 x 96 to 1000 x 1000), above the cut, so noise would count as
    directions of norm 1 each; in float64 those of a float32 momentum stay at its rounding, 2e-8 to 5e-8."""
    m = momentum.double()
    matrices = m.reshape(-1, *m.shape[-2:]) if m.dim() >= 2 else m.reshape(1, 1, -1)
    squares = matrices.square()
    rows = (squares.mean(dim=-1, keepdim=True) + damping).pow(-0.25)  # (B, a, 1)
    cols = (squares.mean(dim=-2, keepdim=True) + damping).pow(-0.25)  # (B, 1, b)
    u, s, vh = torch.linalg.svd(rows * matrices * cols, full_matrices=False)
    kept = (s > SIGN_CUTOFF * s.amax(dim=-1, keepdim=True)).to(u.dtype)  # (B, k)
    return ((u * kept.unsqueeze(-2)) @ vh).reshape(momentum.shape)


def make(config: types.OptimizerConfig, params: list[torch.nn.Parameter], *, lora_rank: int | None = None) -> Optimizer:
    """The strategy for a client's optimizer; ``lora_rank``: the adapter's rank (None: a full-parameter session)."""
    if isinstance(config, types.DimuonOptimizerConfig):
        return Dimuon(params, rank=lora_rank or optimizers.REFERENCE_RANK)
    return AdamW(params)
