"""Routing rows of one forward pass to their adapters, over a base model shared by every LoRA session.

The base model gets a forward hook on each module an adapter may target (:func:`install`). A hook does
nothing unless the *current thread* has a routing set (:func:`routed`): then the rows of each group get
their own adapter's ``scaling * (x A^T) B^T`` added, computed on those rows only. Rows never mix, so a
row's outputs, and its adapter's gradients, do not depend on the other rows in the pass; other threads
(full sessions, sampling from the base) and copies of the model (the hooks check the module) see the
plain base.

Groups are contiguous row ranges in training passes (slices are views: no gather) and row index tensors
in the sampling engine, whose rows of many snapshots interleave.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tinkerq.worker.lora.adapter import ATTN, MLP

_local = threading.local()


class AdapterWeights(Protocol):
    scaling: float

    def pair(self, target: str) -> tuple[torch.Tensor, torch.Tensor] | None: ...


Rows = slice | torch.Tensor  # a contiguous range, or row indices (B',)


class Routing:
    def __init__(self, groups: list[tuple[AdapterWeights | None, Rows]], head: str | None = None) -> None:
        self.groups = groups
        self.head = head  # the output projection's name: the fused loss head asks for its pairs
        self.contiguous = all(isinstance(rows, slice) for _, rows in groups)
        if self.contiguous:  # then the groups must cover the batch, in order
            starts = [rows.start or 0 for _, rows in groups]  # type: ignore[union-attr]
            stops = [rows.stop for _, rows in groups]  # type: ignore[union-attr]
            if starts != [0, *stops[:-1]]:
                raise ValueError("contiguous routing groups must cover the batch in order")
            self.sizes = [b - a for a, b in zip(starts, stops, strict=True)]

    def head_groups(self) -> list[tuple[float, tuple[torch.Tensor, torch.Tensor] | None]] | None:
        """For the fused loss head (worker/logprobs.py): each contiguous group's scaling and output projection
        pair (rows: :meth:`split`); None when no group adapts the output projection."""
        if self.head is None or not self.contiguous:
            return None
        out = [(adapter.scaling if adapter else 0.0, adapter.pair(self.head) if adapter else None)
               for adapter, _ in self.groups]
        return out if any(pair is not None for _, pair in out) else None

    def apply(self, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """``out`` (B, ..., out) of module ``name`` on input ``x`` (B, ..., in), with each group's delta."""
        pairs = [adapter.pair(name) if adapter is not None else None for adapter, _ in self.groups]
        if all(pair is None for pair in pairs):
            return None
        if not self.contiguous:  # sampling: no gradients needed
            result = out.clone()
            for (adapter, rows), pair in zip(self.groups, pairs, strict=True):
                if pair is not None:
                    result.index_add_(0, rows, _delta(x.index_select(0, rows), pair, adapter.scaling))
            return result
        # Contiguous groups covering the batch in order: split into views. torch.split's backward concatenates
        # the pieces' gradients once; indexing each slice would fill a whole-batch zero gradient per group.
        pieces = [oi if pair is None else oi + _delta(xi, pair, adapter.scaling)
                  for (adapter, _), pair, xi, oi in zip(self.groups, pairs, torch.split(x, self.sizes),
                                                        torch.split(out, self.sizes), strict=True)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``t`` (B, ...) cut into the groups' rows (contiguous routings only)."""
        return torch.split(t, self.sizes)


def _delta(x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor], scaling: float) -> torch.Tensor:
    """``scaling * (x A^T) B^T`` in ``x``'s dtype (the masters stay float32), in PEFT's order of operations."""
    a, b = pair
    return F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * scaling


def current() -> Routing | None:
    return getattr(_local, "routing", None)


@contextlib.contextmanager
def routed(groups: list[tuple[AdapterWeights | None, Rows]], head: str | None = None) -> Iterator[Routing]:
    """Route this thread's forwards through ``groups`` (adapter, rows) until the block ends."""
    previous = current()
    _local.routing = routing = Routing(groups, head)
    try:
        yield routing
    finally:
        _local.routing = previous


def install(model: torch.nn.Module) -> str:
    """Hook every module of ``model`` an adapter may target (once); returns the output projection's name."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    head_name = next(name for name, module in model.named_modules() if module is head)
    if getattr(model, "_tinkerq_lora_hooks", False):
        return head_name
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (module is head or name.rsplit(".", 1)[-1] in ATTN + MLP):
            module.register_forward_hook(_hook(name, module))
    model._tinkerq_lora_hooks = True  # type: ignore[assignment]
    return head_name


def _hook(name: str, original: torch.nn.Module) -> Any:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        routing = current()
        if routing is None or module is not original:  # a deep copy of the base keeps the hook: inert
            return None
        return routing.apply(name, args[0], out)

    return hook
