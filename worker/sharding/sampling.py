"""Sampling over a shard group's base: the LoRA base sharded once (worker/sharding/host.py), on the group's devices.

Rank 0's sampling engine (worker/sampling/) holds every running row, its KV cache and its sampling state, as on an
unsharded worker; only the weights are sharded. Each forward the engine makes (a prefill or a decode step) runs
through the FSDP root, which gathers each layer's weights from the ranks as it reaches it; every follower joins
those collectives with a one-token forward of its own (``ShardHost.execute("sample_forward")``), so a group
samples with 1/N of the base on each device. The base and every LoRA snapshot of the group's sessions (adapters
over that base) are sampled this way; a full-parameter snapshot is a whole copy on rank 0 (worker/training/session.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tinkerq.worker.sharding.host import ShardHost


class GroupSampling:
    """What rank 0's sampling engine calls as its model: the sharded base, each forward run on every rank."""

    # Prompt logprobs come from the model's own logits: the fused head would read the output weight outside a
    # forward, where FSDP holds only this rank's shard of it.
    fused_head = False

    def __init__(self, host: ShardHost, root: torch.nn.Module, lm: torch.nn.Module) -> None:
        self._host = host
        self._root = root
        self._lm = lm

    def __call__(self, **kwargs: Any) -> Any:
        return self._host.run("sample_forward", call=lambda: self._root(sample=kwargs))

    def __getattr__(self, name: str) -> Any:  # config, forward's signature, parameters(): the model's own
        return getattr(self._lm, name)


def join_forward(root: torch.nn.Module, device: torch.device | str) -> None:
    """A follower's part of one of rank 0's sampling forwards: a one-token forward, for its collectives."""
    one = torch.zeros((1, 1), dtype=torch.long, device=device)
    with torch.no_grad():
        root(sample={"input_ids": one, "use_cache": False, "logits_to_keep": 1})
