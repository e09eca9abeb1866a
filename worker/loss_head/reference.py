"""The plain computation: full (N, V) logits, log-softmax, gather. Memory grows with tokens x vocab."""

from __future__ import annotations

import torch


def reference_target_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(hidden @ weight.T)[i, targets[i]] for hidden (N, H), weight (V, H), targets (N,) -> (N,)."""
    logits = (hidden @ weight.t()).float()  # (N, V)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
