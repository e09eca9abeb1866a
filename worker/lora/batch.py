"""One forward (and backward) pass over the loss requests of many LoRA sessions at once, batch-invariant.

A request's numbers in a mixed pass are bitwise the numbers it gets alone in a pass (``tests/test_lora_invariance.py``:
outputs, loss, metrics and adapter gradients, dense and MoE models, float32 on the CPU). The layout:

* **Micro-batches per request.** Each request's datums are cut into micro-batches from its own rows only, as if
  it were alone (:func:`tinkerq.worker.training.batching.microbatch_ranges` on its own padded lengths). A micro-batch is
  padded to :func:`padded_length` of its longest row: a function of that micro-batch alone (rounded up to a
  bucket, so micro-batches of different requests share a length more often).
* **Steps stack micro-batches of different requests along the batch dimension.** Micro-batches of the same
  padded length (and the same "has padding or not", which decides the model's attention-mask path) run as one
  forward, at most one micro-batch per request per step, each request's micro-batches in their own order, and
  at most ``microbatch_tokens`` padded tokens per step (a micro-batch that fills the budget runs alone).
* **Every product a request's rows go through is its own** (worker/lora/routing.py, worker/lora/experts.py):
  the base's matrix products on token rows run per request (a BLAS picks its kernel, and on several threads how
  it splits the sum, by the shape of a product: measured on this CPU), so do the experts' dispatch and the loss
  head; what the stacked rows share are the operations computed row by row (attention, norms, activations).
  (``routing.PRODUCTS = "tiles"`` runs them in fixed-shape tiles instead, worker/lora/head.py: bitwise too.)
* **Every reduction is per request, in the order it has alone:** its loss and metrics are summed per micro-batch
  (:func:`tinkerq.worker.training.losses.score` on its own rows) and merged micro-batch after micro-batch
  (:class:`tinkerq.worker.training.engine.RequestPart`); its gradients accumulate micro-batch after micro-batch (one
  backward per step: another request's loss adds nothing to this adapter's gradient).

Each request keeps Tinker's semantics on its own rows: its loss is the sum of its own per-token losses, its
outputs and metrics are its own, and only its own adapter gets its gradients.

Isolation of failures: a request whose loss is not finite leaves the backward sum; its adapter's fresh
gradients, and those of a request whose gradients are not finite, are discarded by its engine's
``commit`` (worker/training/engine.py), which puts back the pending gradients untouched. The other requests in
the pass are unaffected: rows never mix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F

from tinkerq import types
from tinkerq.errors import NonFiniteError, TinkerqError
from tinkerq.validation import resolve_loss_config
from tinkerq.worker.lora.routing import Rows, routed
from tinkerq.worker.training import checkpointing as activation_checkpointing
from tinkerq.worker.training.batching import microbatch_ranges, pad_batch, rank_share
from tinkerq.worker.training.engine import Collectives, RequestPart, SingleProcess, TrainingEngine
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.losses import LOSSES, score

# Padded lengths are rounded up to a multiple of max(PAD_MIN, 2**floor(log2(n)) / PAD_STEPS_PER_OCTAVE): 16 up to
# 128 tokens, then 8 buckets per doubling (at most 1/8 more tokens), so micro-batches of different requests share
# a length (and stack) more often. Alone or mixed, the same rounding.
PAD_MIN = 16
PAD_STEPS_PER_OCTAVE = 8


class LoraTarget(Protocol):
    """What a pass needs of a session: its adapter (for routing) and its engine (for the gradients)."""

    adapter: Any
    engine: TrainingEngine

    @property
    def pass_group(self) -> Any:
        """The base the session's passes run over (:class:`worker.lora.session.LoraBase`)."""
        ...


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
    checkpointing: bool = False  # its pass checkpoints the decoder layers (worker/training/checkpointing.py)


@dataclass
class Micro:
    """One request's micro-batch: its datums ``start..stop - 1``, padded to ``length`` tokens."""

    item: LossItem
    start: int
    stop: int
    length: int
    padded: bool  # some row is shorter than ``length`` (the model then gets a padding mask)

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def key(self) -> tuple[int, bool]:
        """Micro-batches with equal keys may share a forward."""
        return self.length, self.padded


def padded_length(n: int, cap: int | None = None) -> int:
    """The padded length of a micro-batch whose longest row has ``n`` tokens: ``n`` rounded up to its bucket, at
    most ``cap`` (the model's positions, the token budget) but never below ``n``."""
    step = max(PAD_MIN, (1 << (max(n, 1).bit_length() - 1)) // PAD_STEPS_PER_OCTAVE)
    rounded = -(-n // step) * step
    return max(n, min(rounded, cap)) if cap is not None else rounded


def plan(items: list[LossItem], microbatch_tokens: int, cap: int | None = None,
         shares: list[tuple[int, int]] | None = None) -> list[list[Micro]]:
    """The pass's steps: each a list of micro-batches of one key, at most one per request, in request order.

    Each request's micro-batches are cut from its own rows and come in its own order; which ones share a step
    changes nothing in any request's numbers, only the number of forwards. At each step the key held by the most
    requests' next micro-batches runs (ties: the earliest request's), filling up to ``microbatch_tokens``.
    ``shares``: the [start, stop) of each request's datums this rank computes (a shard group); all by default."""
    queues: list[list[Micro]] = []
    for item, (lo, hi) in zip(items, shares or [(0, len(item.data)) for item in items], strict=True):
        lengths = [d.model_input.length for d in item.data[lo:hi]]
        rounded = [padded_length(n, cap) for n in lengths]  # monotone: the budget counts padded tokens
        micros = []
        for start, stop in microbatch_ranges(rounded, microbatch_tokens) if lengths else ():
            longest = max(lengths[start:stop])
            length = padded_length(longest, cap)
            micros.append(Micro(item, lo + start, lo + stop, length, any(n < length for n in lengths[start:stop])))
        queues.append(micros)
    steps: list[list[Micro]] = []
    at = [0] * len(queues)
    while True:
        heads = [(r, q[i]) for r, (q, i) in enumerate(zip(queues, at, strict=True)) if i < len(q)]
        if not heads:
            return steps
        counts: dict[tuple[int, bool], int] = {}
        for _, m in heads:
            counts[m.key] = counts.get(m.key, 0) + 1
        key = max(counts, key=lambda k: counts[k])  # first-seen wins ties: dicts keep insertion order
        step: list[Micro] = []
        tokens = 0
        for r, m in heads:
            if m.key == key and (not step or tokens + m.rows * m.length <= microbatch_tokens):
                step.append(m)
                tokens += m.rows * m.length
                at[r] += 1
        steps.append(step)


def run_pass(items: list[LossItem], model: torch.nn.Module, logprobs: LogprobComputer, *, head: str,
             microbatch_tokens: int, device: torch.device, backward: bool, group: Collectives | None = None,
             root: torch.nn.Module | None = None) -> None:
    """Run ``items`` (one per session) as one pass; sets each item's ``output`` (on the leader) or ``error``.

    On a shard group (``group``; ``root``: the FSDP root that computes the base's logprobs,
    worker/sharding/fsdp.py) every rank runs this with the same items: each computes its share of every request's
    datums (:func:`tinkerq.worker.training.batching.rank_share`), in as many steps as the busiest rank (the others join
    the collectives with idle steps), then each adapter's gradients are summed over the ranks. Raises only on a
    failure of the pass itself (a bug, out of memory, a lost shard): every engine is then put back as it was,
    and the caller fails every item.
    """
    group = group or SingleProcess()
    if len({id(item.target) for item in items}) != len(items):
        raise ValueError("a pass holds at most one request per session")
    pendings = [item.target.engine.set_aside() for item in items] if backward else []
    try:
        _run(items, model, logprobs, head, microbatch_tokens, device, backward, group, root)
    except BaseException:
        for item, pending in zip(items, pendings, strict=False):
            for p, old in zip(item.target.engine.params, pending, strict=True):
                p.grad = old
        raise
    for i, item in enumerate(items):  # the same items, in the same order, on every rank: collectives pair up
        try:
            if backward:
                item.target.engine.sum_fresh()
                item.target.engine.commit(pendings[i], item.problem, item.loss_fn)
            else:
                group.agree(NonFiniteError(f"{item.problem}; nothing was applied") if item.problem else None)
        except NonFiniteError as exc:
            item.error = exc
            continue
        item.output = item.part.merged(group, len(item.data), item.loss_fn)


def _cap(model: torch.nn.Module, microbatch_tokens: int) -> int:
    """The longest padding: the token budget, and the model's positions (absolute position embeddings)."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return min(microbatch_tokens, positions) if isinstance(positions, int) and positions > 0 else microbatch_tokens


def _padded(m: Micro, device: torch.device) -> dict[str, Any]:
    """``m``'s rows as a padded batch of ``m.length`` tokens (:func:`tinkerq.worker.training.batching.pad_batch`)."""
    batch = pad_batch(m.item.data[m.start:m.stop], device)
    extra = m.length - batch["tokens"].shape[1]
    if extra:
        batch = {k: F.pad(v, (0, extra)) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch


def _run(items: list[LossItem], model: torch.nn.Module, logprobs: LogprobComputer, head: str,
         microbatch_tokens: int, device: torch.device, backward: bool, group: Collectives,
         root: torch.nn.Module | None) -> None:
    def forward(tokens: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return root(tokens, mask, targets) if root is not None else logprobs(cast(Any, model), tokens, mask, targets)

    shares = [rank_share(len(item.data), group.world, group.rank) for item in items]
    steps: list[list[Micro] | None] = list(plan(items, microbatch_tokens, _cap(model, microbatch_tokens), shares))
    if group.world > 1:  # every rank runs as many forwards (and backwards) as the busiest: each joins collectives
        (most,) = group.all_reduce([float(len(steps))], op="max")
        steps += [None] * (int(most) - len(steps))
    # One request that needs its layers checkpointed (worker/memory/ admit_batch) checkpoints its whole pass: the
    # numbers are the same either way, only the memory differs.
    checkpointed = backward and any(item.checkpointing for item in items)
    passing = [item.target.adapter for item in items]  # the same on every rank: an adapter's index is global
    for step in steps:
        with activation_checkpointing.enabled(checkpointed):
            _run_step(step, forward, head, device, backward, group, passing)


def _run_step(step: list[Micro] | None, forward: Any, head: str, device: torch.device, backward: bool,
              group: Collectives, passing: list[Any]) -> None:
    """One forward (and backward) of a pass: its micro-batches stacked, each routed to its own adapter. Every
    adapter of the pass is ``passing``: an expert-parallel group's ranks compute each other's rows of them
    (worker/sharding/experts.py), an idle step's rank too."""
    if step is None:
        with routed([], head, passing=passing):
            _idle_step(forward, device, backward)
        return
    batches = [_padded(m, device) for m in step]
    tokens, mask, targets = (torch.cat([b[k] for b in batches]) if len(batches) > 1 else batches[0][k]
                             for k in ("tokens", "mask", "target_tokens"))
    groups: list[tuple[Any, Rows]] = []
    at = 0
    for m in step:
        groups.append((m.item.target.adapter, slice(at, at + m.rows)))
        at += m.rows
    with torch.set_grad_enabled(backward), routed(groups, head, length=step[0].length, passing=passing):
        lp = forward(tokens, mask.long(), targets)  # (B, T)
    total = None
    lps = torch.split(lp, [m.rows for m in step])  # views; one concatenated gradient on the way back
    for m, batch, lp_m in zip(step, batches, lps, strict=True):
        item = m.item
        with torch.set_grad_enabled(backward):
            scored = score(lp_m, batch, LOSSES[item.loss_fn], resolve_loss_config(item.loss_fn, item.config))
        if not torch.isfinite(scored.loss):
            if item.problem is None:
                item.problem = f"{item.loss_fn} loss is {scored.loss.item()} on datums {m.start}..{m.stop - 1}"
        elif backward and item.problem is None:
            total = scored.loss if total is None else total + scored.loss
        item.part.add(m.start, scored, batch["lengths"])
    if backward and total is None and group.world > 1:  # every row's loss failed: still join the backward
        total = lp.sum() * 0.0
    if backward and total is not None:
        total.backward()


def _idle_step(forward: Any, device: torch.device, backward: bool) -> None:
    """A forward (and backward) over one dummy token routed to no adapter: it joins a step's collectives. The
    sharded base's embeddings make every backward reach every layer (worker/sharding/fsdp.py), so it joins those
    of the backward too."""
    one = torch.zeros((1, 1), dtype=torch.long, device=device)
    with torch.set_grad_enabled(backward):
        loss = forward(one, torch.ones_like(one), one).sum() * 0.0
    if backward:
        loss.backward()
