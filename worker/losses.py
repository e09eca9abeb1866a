"""Loss functions over per-token tensors. Every loss is a SUM over tokens and datums (Tinker semantics).

Each function takes the model's per-token target logprobs and the batch's loss inputs, all padded to
(B, T) with zeros at padding positions, and returns the per-token loss (B, T) (zero at padding) plus
loss-specific metrics. The caller sums the per-token loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# (logprobs (B, T), inputs {name: (B, T)}, config) -> (elementwise loss (B, T), metrics)
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]


def cross_entropy(
    logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted negative log-likelihood: ``-logprob * weight`` per token."""
    weights = inputs["weights"]  # (B, T)
    return -logprobs * weights, {}


LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy}
