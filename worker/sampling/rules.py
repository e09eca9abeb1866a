"""The per-request sampling rules every engine applies: the top-k / top-p filter and the stop rule."""

from __future__ import annotations

from typing import Any

import torch


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (with -inf) the tokens outside top-k and outside the top-p nucleus; logits (B, V)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked before it already cover top_p (the first one always stays).
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class StopRule:
    """When a sequence is finished: a stop token, or a stop string appearing in the decoded completion."""

    def __init__(self, stop: Any, default_stop_ids: list[int], tokenizer: Any | None) -> None:
        self.ids: set[int] = set()
        self.strings: list[str] = []
        self.tokenizer = tokenizer
        if stop is None:
            self.ids = set(default_stop_ids)
        elif isinstance(stop, str):
            self.strings = [stop]
        elif all(isinstance(x, str) for x in stop):
            self.strings = list(stop)
        else:
            self.ids = {int(x) for x in stop}

    def done(self, tokens: list[int]) -> bool:
        if tokens[-1] in self.ids:
            return True
        if self.strings and self.tokenizer is not None:
            text = self.tokenizer.decode(tokens[-64:], skip_special_tokens=False)
            return any(s in text for s in self.strings)
        return False
