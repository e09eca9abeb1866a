"""Per-token target logprobs of a causal LM over a right-padded batch."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def target_logprobs(
    model: PreTrainedModel, tokens: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """log p(targets[b, t] | tokens[b, :t+1]) for every position, shape (B, T).

    Rows are right-padded, so a row's real tokens keep positions 0..n-1 and causal attention never sees
    the padding after them; padding positions get garbage the caller masks out.
    """
    logits = model(input_ids=tokens, attention_mask=attention_mask, use_cache=False).logits  # (B, T, V)
    logits = logits.float()
    # log_softmax(x)[y] = x[y] - logsumexp(x): no (B, T, V) log-probability tensor is kept.
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)
