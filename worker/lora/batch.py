"""One forward (and backward) pass over the loss requests of many LoRA sessions at once.

The requests' datums are laid out request after request (rows of one adapter are contiguous), cut into
micro-batches of at most ``microbatch_tokens`` padded tokens, and routed to their adapters
(worker/lora/routing.py). Each request keeps Tinker's semantics on its own rows: its loss is the sum of its
own per-token losses, its outputs and metrics are its own, and only its own adapter gets its gradients.

Isolation of failures: a request whose loss is not finite leaves the backward sum; its adapter's fresh
gradients, and those of a request whose gradients are not finite, are discarded by its engine's
``commit`` (worker/training.py), which puts back the pending gradients untouched. The other requests in
the pass are unaffected: rows never mix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tinkerq import types
from tinkerq.errors import NonFiniteError, TinkerqError
from tinkerq.validation import resolve_loss_config
from tinkerq.worker.batching import microbatch_ranges, pad_batch
from tinkerq.worker.logprobs import LogprobComputer
from tinkerq.worker.lora.routing import routed
from tinkerq.worker.losses import LOSSES, score
from tinkerq.worker.training import RequestPart, SingleProcess, TrainingEngine


class LoraTarget(Protocol):
    """What a pass needs of a session: its adapter (for routing) and its engine (for the gradients)."""

    adapter: Any
    engine: TrainingEngine


@dataclass
class LossItem:
    target: LoraTarget
    data: list[types.Datum]
    loss_fn: str
    config: dict[str, Any] | None
    output: types.ForwardBackwardOutput | None = None
    error: TinkerqError | None = None
    problem: str | None = None
    part: RequestPart = field(default_factory=RequestPart)


def run_pass(items: list[LossItem], model: torch.nn.Module, logprobs: LogprobComputer, *, head: str,
             microbatch_tokens: int, device: torch.device, backward: bool) -> None:
    """Run ``items`` (one per session) as one pass; sets each item's ``output`` or ``error``.

    Raises only on a failure of the pass itself (a bug, out of memory): every engine is then put back as it
    was, and the caller fails every item.
    """
    if len({id(item.target) for item in items}) != len(items):
        raise ValueError("a pass holds at most one request per session")
    pendings = [item.target.engine.set_aside() for item in items] if backward else []
    try:
        _run(items, model, logprobs, head, microbatch_tokens, device, backward)
    except BaseException:
        for item, pending in zip(items, pendings, strict=False):
            for p, old in zip(item.target.engine.params, pending, strict=True):
                p.grad = old
        raise
    for i, item in enumerate(items):
        if backward:
            try:
                item.target.engine.commit(pendings[i], item.problem, item.loss_fn)
            except NonFiniteError as exc:
                item.error = exc
                continue
        elif item.problem is not None:
            item.error = NonFiniteError(f"{item.problem}; nothing was applied")
            continue
        item.output = item.part.merged(SingleProcess(), len(item.data), item.loss_fn)


def _run(items: list[LossItem], model: torch.nn.Module, logprobs: LogprobComputer, head: str,
         microbatch_tokens: int, device: torch.device, backward: bool) -> None:
    rows = [(item, index) for item in items for index in range(len(item.data))]  # request after request
    lengths = [item.data[index].model_input.length for item, index in rows]
    for start, stop in microbatch_ranges(lengths, microbatch_tokens):
        chunk = rows[start:stop]
        batch = pad_batch([item.data[index] for item, index in chunk], device)
        groups: list[tuple[LossItem, slice, int]] = []  # (item, its rows in this micro-batch, first datum index)
        for r, (item, index) in enumerate(chunk):
            if groups and groups[-1][0] is item:
                groups[-1] = (item, slice(groups[-1][1].start, r + 1), groups[-1][2])
            else:
                groups.append((item, slice(r, r + 1), index))
        with torch.set_grad_enabled(backward), routed([(g[0].target.adapter, g[1]) for g in groups], head):
            lp = logprobs(model, batch["tokens"], batch["mask"].long(), batch["target_tokens"])  # (B, T)
        total = None
        sizes = [g[1].stop - g[1].start for g in groups]
        lps = torch.split(lp, sizes)  # views; one concatenated gradient on the way back (not one per group)
        for (item, span, first), lp_item in zip(groups, lps, strict=True):
            sub = {k: v[span] for k, v in batch.items()}  # tensors (B, T) and the lengths list
            with torch.set_grad_enabled(backward):
                scored = score(lp_item, sub, LOSSES[item.loss_fn], resolve_loss_config(item.loss_fn, item.config))
            if not torch.isfinite(scored.loss):
                if item.problem is None:
                    item.problem = (f"{item.loss_fn} loss is {scored.loss.item()} on datums "
                                    f"{first}..{first + span.stop - span.start - 1}")
            elif backward and item.problem is None:
                total = scored.loss if total is None else total + scored.loss
            item.part.add(first, scored, sub["lengths"])
        if backward and total is not None:
            total.backward()
