"""Turning a request's datums into padded tensors, in micro-batches that fit a token budget."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from tinkerq import types


def microbatch_ranges(lengths: list[int], budget_tokens: int) -> Iterator[tuple[int, int]]:
    """Consecutive [start, stop) ranges whose padded size (rows x longest row) stays within the budget."""
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        grown = max(longest, n)
        if i > start and grown * (i + 1 - start) > budget_tokens:
            yield start, i
            start, grown = i, n
        longest = grown
    yield start, len(lengths)


def rank_share(n: int, ranks: int, rank: int) -> tuple[int, int]:
    """The [start, stop) of ``n`` datums that ``rank`` computes: ``ranks`` contiguous runs whose sizes differ by
    at most one (a run may be empty)."""
    sizes = [n // ranks + (1 if r < n % ranks else 0) for r in range(ranks)]
    bounds = [0, *np.cumsum(sizes).tolist()]
    return int(bounds[rank]), int(bounds[rank + 1])


def rank_plans(lengths: list[int], ranks: int, budget_tokens: int) -> list[list[tuple[int, int] | None]]:
    """Each rank's micro-batches for a sharded request, all padded with ``None`` to the same count.

    Datums are split into ``ranks`` contiguous runs whose sizes differ by at most one (a run may be
    empty). Every rank must make the same number of forward/backward passes, because each pass joins
    collectives; a ``None`` is a pass over a dummy input whose loss counts zero.
    """
    per_rank: list[list[tuple[int, int] | None]] = []
    for r in range(ranks):
        lo, hi = rank_share(len(lengths), ranks, r)
        spans = [(lo + a, lo + b) for a, b in microbatch_ranges(lengths[lo:hi], budget_tokens)] if hi > lo else []
        per_rank.append(list(spans))
    most = max(len(p) for p in per_rank)
    return [p + [None] * (most - len(p)) for p in per_rank]


def pad_batch(data: list[types.Datum], device: torch.device) -> dict[str, Any]:
    """Right-pad a batch to (B, T): tokens, mask, and every loss input (zeros at padding)."""
    lengths = [d.model_input.length for d in data]
    B, T = len(data), max(lengths)
    tokens = np.zeros((B, T), dtype=np.int64)
    mask = np.zeros((B, T), dtype=np.float32)
    inputs: dict[str, np.ndarray] = {}
    for row, (d, n) in enumerate(zip(data, lengths, strict=True)):
        tokens[row, :n] = d.model_input.to_numpy()
        mask[row, :n] = 1.0
        for key, tensor in d.loss_fn_inputs.items():
            values = tensor.to_numpy()
            if key not in inputs:
                inputs[key] = np.zeros((B, T), dtype=values.dtype)
            inputs[key][row, :n] = values
    batch: dict[str, Any] = {k: torch.from_numpy(v).to(device) for k, v in inputs.items()}
    batch["tokens"] = torch.from_numpy(tokens).to(device)
    batch["mask"] = torch.from_numpy(mask).to(device)
    batch["lengths"] = lengths
    return batch
