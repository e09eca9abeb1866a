"""FSDP2 (``fully_shard``) over a model, so a :class:`worker.training.TrainingEngine` trains one shard per rank.

Each parameter, its gradient and its AdamW moments become DTensors sharded along dim 0, so a rank holds
about 1/N of each. A request's datums are split across the ranks (:func:`tinkerq.worker.training.batching.rank_plans`);
FSDP gathers each layer's weights for the forward and reduce-scatters its gradients on the way back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard
from transformers import PreTrainedModel

from tinkerq.worker.loading.layers import decoder_layers
from tinkerq.worker.sharding.experts import distribute_experts
from tinkerq.worker.sharding.group import ShardGroup
from tinkerq.worker.training.engine import TrainingEngine, model_weights
from tinkerq.worker.training.logprobs import LogprobComputer


class LogprobModule(torch.nn.Module):
    """The model and its loss head as one module, so FSDP's root gathers the embeddings and the output
    weight around exactly the computation that uses them."""

    def __init__(self, lm: PreTrainedModel, logprobs: LogprobComputer) -> None:
        super().__init__()
        self.lm = lm
        self.logprobs = logprobs

    def forward(self, tokens: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, *, sample: dict[str, Any] | None = None) -> Any:
        """Target logprobs (B, T); or, with ``sample`` (the sampling engine's keyword arguments), the model's own
        output for them (worker/sharding/sampling.py)."""
        if sample is not None:
            return self.lm(**sample)
        assert tokens is not None and mask is not None and targets is not None
        return self.logprobs(self.lm, tokens, mask, targets)  # (B, T)


# Gives a model sharded on the meta device (under the root passed) its weights (worker/sharding/streaming.py).
Fill = Callable[[torch.nn.Module, PreTrainedModel], None]


def shard(model: PreTrainedModel, group: ShardGroup, logprobs: LogprobComputer, fill: Fill, *,
          expert_parallel: bool = False, kept_from: str | None = None) -> LogprobModule:
    """Shard ``model`` (this rank's copy of the skeleton: parameters on the meta device) over the group, layer by
    layer, then ``fill`` its local shards; returns the root to call. ``expert_parallel``: the routed experts are
    split by expert instead, left out of FSDP (worker/sharding/experts.py); ``kept_from``: with them, a frozen base's
    checkpoint whose quantized experts stay as stored."""
    assert group.mesh is not None
    module = LogprobModule(model, logprobs)
    by_expert = distribute_experts(model, group.mesh, kept_from=kept_from) if expert_parallel else None
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=group.mesh, ignored_params=by_expert)
    fully_shard(module, mesh=group.mesh, ignored_params=by_expert)  # the root: embeddings, final norm, output weight
    fill(module, model)
    return module


def shard_frozen(model: PreTrainedModel, group: ShardGroup, logprobs: LogprobComputer, fill: Fill, *,
                 expert_parallel: bool = False, kept_from: str | None = None) -> LogprobModule:
    """Shard a frozen base (LoRA sessions' shared base: no gradients, no optimizer state, 1/N per rank).

    Its input embeddings' output requires grad in every backward, so a backward always runs through every
    layer, on every rank, whatever the adapters (attention, MLP or unembed only) of the rows each rank holds:
    FSDP gathers each layer's weights in the backward, a collective every rank must join.
    """
    model.requires_grad_(False)

    def through(module: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor | None:
        if torch.is_grad_enabled() and not out.requires_grad:
            return out.detach().requires_grad_(True)
        return None

    model.get_input_embeddings().register_forward_hook(through)
    return shard(model, group, logprobs, fill, expert_parallel=expert_parallel, kept_from=kept_from)


def sharded_engine(model: PreTrainedModel, group: ShardGroup, *, logprobs: LogprobComputer, fill: Fill,
                   microbatch_tokens: int, expert_parallel: bool = False) -> TrainingEngine:
    """Shard ``model`` (this rank's copy of the skeleton) over the group, fill it, and train it with the one
    engine."""
    module = shard(model, group, logprobs, fill, expert_parallel=expert_parallel)
    named, fixed = model_weights(model)  # after sharding: DTensor parameters; buffers (whole) where FSDP put them
    return TrainingEngine(module, named, group, microbatch_tokens=microbatch_tokens,
                          device=torch.device(group.spec.device), fixed=fixed)
