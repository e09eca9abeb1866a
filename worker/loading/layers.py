"""A causal LM's repeated decoder layers: the units FSDP shards one by one (worker/sharding/fsdp.py), the memory
estimates size (worker/memory/estimates.py) and activation checkpointing recomputes
(worker/training/checkpointing.py)."""

from __future__ import annotations

from typing import Any

import torch


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The repeated blocks of the backbone (the first ModuleList under it)."""
    for child in model.base_model.children():
        if isinstance(child, torch.nn.ModuleList):
            return list(child)
    return []
