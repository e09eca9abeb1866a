"""The training engine: one set of trainable parameters, their pending gradients and their optimizer's state.

The same engine serves every session kind and shard count:

* a full session on one process: the model's parameters, :class:`SingleProcess` collectives;
* a full session sharded over N ranks: every rank runs an engine over its FSDP2 shards (DTensors), in
  lock step, with the shard group as collectives (worker/sharding/);
* a LoRA session: the adapter's parameters over a frozen base (worker/lora/), possibly sharing one
  forward/backward pass with other LoRA sessions (:func:`tinkerq.worker.lora.batch.run_mixed`).

Every operation either completes or leaves the engine exactly as it was: a forward_backward sets the
pending gradients aside, computes its own, has every rank agree they are finite, and only then adds
them; an optim_step checks the gradient norm before touching a weight.

The optimizer (AdamW or Dimuon, fixed at creation) is a strategy (worker/training/optimizers.py): the engine norms
and clips the gradients, the strategy turns them into new weights and keeps its state.

What must match one unsharded run, and how it does:

* FSDP averages gradients over ranks while the Tinker API sums over datums: each rank's loss is scaled
  by N before ``backward`` (exact for N a power of two; otherwise within float rounding).
* Per-datum outputs travel back to rank 0 and are put in input order there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from tinkerq import optimizers, types
from tinkerq.errors import NonFiniteError, TinkerqError
from tinkerq.validation import resolve_loss_config
from tinkerq.wire import codec
from tinkerq.worker.checkpoints import SavedState
from tinkerq.worker.training import checkpointing as activation_checkpointing
from tinkerq.worker.training import optimizers as strategies
from tinkerq.worker.training.batching import pad_batch, rank_plans
from tinkerq.worker.training.losses import LOSSES, MetricTotals, ScoredBatch, score

_NOTHING_APPLIED = ("nothing was applied. The weights may have diverged (lower the learning rate) or the inputs "
                    "are extreme")

# (tokens (B, T), mask (B, T), targets (B, T)) -> target logprobs (B, T)
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Collectives(Protocol):
    """What the engine needs from its group of ranks (worker/sharding/group.py; :class:`SingleProcess`)."""

    world: int
    rank: int

    @property
    def is_leader(self) -> bool: ...

    def agree(self, error: TinkerqError | None) -> None: ...

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]: ...

    def gather_bytes(self, data: bytes) -> list[bytes]: ...

    def sum_tensors(self, tensors: list[torch.Tensor]) -> None: ...


class SingleProcess:
    """The collectives of a group of one: nothing to exchange."""

    world = 1
    rank = 0
    is_leader = True

    def agree(self, error: TinkerqError | None) -> None:
        if error is not None:
            raise error

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        return list(values)

    def gather_bytes(self, data: bytes) -> list[bytes]:
        return [data]

    def sum_tensors(self, tensors: list[torch.Tensor]) -> None:
        pass


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TrainingEngine:
    def __init__(self, forward: Forward, named_params: Sequence[tuple[str, torch.nn.Parameter]],
                 collectives: Collectives, *, microbatch_tokens: int, device: torch.device,
                 replicated: bool = False, fixed: Sequence[tuple[str, torch.Tensor]] = (),
                 optimizer: types.OptimizerConfig | None = None, lora_rank: int | None = None) -> None:
        self.forward = forward
        self.group = collectives
        # Whole copies of the parameters on every rank (LoRA adapters on a shard group), not FSDP shards: each
        # rank's fresh gradients are summed over the ranks (:meth:`sum_fresh`), and every rank then takes the
        # same optimizer step, so the copies stay equal.
        self.replicated = replicated
        self.microbatch_tokens = microbatch_tokens
        self.device = device
        self.param_names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        # The rest of the model's weights (:func:`model_weights`): saved, gathered and loaded with the parameters,
        # never trained. Empty for a LoRA adapter (its base's buffers are the base checkpoint's).
        self.fixed_names = [n for n, _ in fixed]
        self.fixed = [t for _, t in fixed]
        # Pending gradients start at zero so every optim_step updates every parameter, as torch.optim.AdamW
        # does after a backward pass that reached all of them.
        for p in self.params:
            p.grad = torch.zeros_like(p)
        # Whole tensors and DTensors together: a LoRA adapter's per-expert factors on an expert-parallel group.
        self.mixed = all(strategies.kinds(self.params))
        self.optimizer = strategies.make(optimizer or types.AdamOptimizerConfig(), self.params, lora_rank=lora_rank)
        self.steps = 0

    def shapes(self) -> dict[str, list[int]]:
        return {n: list(p.shape) for n, p in zip(self.param_names, self.params, strict=True)}  # global shapes

    # -- forward / forward_backward ----------------------------------------------------------------------

    def run_loss(self, data: list[types.Datum], loss_fn: str, config: dict[str, Any] | None, *,
                 backward: bool, checkpointing: bool = False) -> types.ForwardBackwardOutput | None:
        """This rank's part of the request; the merged output on the leader, None elsewhere. ``checkpointing``:
        the decoder layers' activations are computed again in the backward instead of kept
        (worker/training/checkpointing.py; every rank of a group gets the same)."""
        loss_impl = LOSSES[loss_fn]
        resolved = resolve_loss_config(loss_fn, config)
        plan = rank_plans([d.model_input.length for d in data], self.group.world, self.microbatch_tokens)
        part = RequestPart()
        problem = None
        pending = self.set_aside() if backward else None
        for span in plan[self.group.rank]:
            if span is None:
                self._idle_pass(backward, checkpointing)
                continue
            start, stop = span
            batch = pad_batch(data[start:stop], self.device)
            with torch.set_grad_enabled(backward), activation_checkpointing.enabled(checkpointing):
                logprobs = self.forward(batch["tokens"], batch["mask"].long(), batch["target_tokens"])  # (B, T)
                scored = score(logprobs, batch, loss_impl, resolved)
            if problem is None and not torch.isfinite(scored.loss):
                problem = f"{loss_fn} loss is {scored.loss.item()} on datums {start}..{stop - 1}"
            if backward:  # even a non-finite loss goes backward: every rank must join the same collectives
                # FSDP averages shards' gradients over the ranks; replicated gradients are summed (sum_fresh).
                (scored.loss * (1 if self.replicated else self.group.world)).backward()
            part.add(start, scored, batch["lengths"])
        if pending is not None:
            self.sum_fresh()
            self.commit(pending, problem, loss_fn)
        elif problem is not None or self.group.world > 1:
            self.group.agree(NonFiniteError(f"{problem}; {_NOTHING_APPLIED}") if problem else None)
        return part.merged(self.group, len(data), loss_fn)

    def _idle_pass(self, backward: bool, checkpointing: bool = False) -> None:
        """A pass over one dummy token whose loss counts zero: it joins the collectives of a real pass."""
        one = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        with torch.set_grad_enabled(backward), activation_checkpointing.enabled(checkpointing):
            loss = self.forward(one, torch.ones_like(one), one).sum() * 0.0
        if backward:
            loss.backward()

    def grads(self) -> list[torch.Tensor]:
        """The pending gradients (always allocated, but between :meth:`set_aside` and :meth:`commit`)."""
        grads = [p.grad for p in self.params]
        assert all(g is not None for g in grads)
        return cast(list[torch.Tensor], grads)

    def sum_fresh(self) -> None:
        """Replicated parameters on several ranks: each rank's fresh gradients (zeros where its rows did not reach
        a parameter) become their sum over the ranks, so every rank holds the gradient of the whole request."""
        if not self.replicated or self.group.world == 1:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # A DTensor's gradient is already whole for its shard: the ranks that hold it computed every rank's rows.
        self.group.sum_tensors([p.grad for p in self.params if not isinstance(p, DTensor)])  # type: ignore[misc]

    def set_aside(self) -> list[torch.Tensor]:
        """Take the pending gradients out of ``p.grad`` so the next backward fills fresh ones."""
        pending = self.grads()
        for p in self.params:
            p.grad = None
        return pending

    def commit(self, pending: list[torch.Tensor], problem: str | None, loss_fn: str) -> None:
        """Add the fresh gradients to ``pending`` if every rank finds them (and the loss) finite; otherwise
        put ``pending`` back unchanged and raise NonFiniteError."""
        if problem is None:
            bad = next((n for n, p in zip(self.param_names, self.params, strict=True)
                        if p.grad is not None and not torch.isfinite(_local(p.grad)).all()), None)
            if bad is not None:
                problem = f"the gradient of {loss_fn} is not finite ({bad})"
        try:
            self.group.agree(NonFiniteError(f"{problem}; {_NOTHING_APPLIED}") if problem else None)
        except NonFiniteError:
            for p, old in zip(self.params, pending, strict=True):
                p.grad = old
            raise
        with torch.no_grad():
            for p, old in zip(self.params, pending, strict=True):
                if p.grad is not None:
                    old.add_(p.grad)
                p.grad = old

    # -- optim_step ---------------------------------------------------------------------------------------------

    def optim_step(self, hyper: types.OptimParams) -> types.OptimStepResponse:
        """One step of the engine's optimizer with ``hyper`` (its family's hyperparameters: a user error else)."""
        optimizers.check_matches(self.optimizer.config, hyper)  # before anything changes
        grads = self.grads()
        total = _total_norm(grads)
        norm = float(total)
        if not math.isfinite(norm):
            for g in grads:
                g.zero_()
            raise NonFiniteError(
                f"gradient norm is {norm} at step {self.steps + 1}: the step was refused, the weights are "
                f"unchanged and the pending gradients were discarded"
            )
        if hyper.grad_clip_norm > 0:
            if self.mixed:  # torch's clip takes one kind of tensor: each kind, by the same coefficient
                for kind in strategies.kinds(self.params):
                    torch.nn.utils.clip_grads_with_norm_(kind, hyper.grad_clip_norm, total)
            else:
                torch.nn.utils.clip_grads_with_norm_(self.params, hyper.grad_clip_norm, total)
        learning_rate = self.optimizer.step(self.params, hyper)
        for g in grads:
            g.zero_()
        self.steps += 1
        metrics = {"grad_norm:mean": norm, "learning_rate:mean": learning_rate, "step:max": self.steps}
        if self.group.world > 1:
            (largest,) = self.group.all_reduce([float(self.state_bytes())], op="max")
            metrics["shard_state_bytes:max"] = largest
        return types.OptimStepResponse(metrics=metrics)

    def state_bytes(self) -> int:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        def size(t: torch.Tensor) -> int:
            local = _local(t)
            return local.numel() * local.element_size()

        total = sum(size(p) + (size(p.grad) if p.grad is not None else 0) for p in self.params)
        for state in self.optimizer.state.values():
            total += sum(size(v) for v in state.values() if isinstance(v, torch.Tensor))
        return total

    def unallocated_state_bytes(self) -> int:
        """This rank's optimizer state not allocated yet (it comes at the first optim_step: AdamW's moments are
        2 x the weights, Dimuon's float32 momentum 4 bytes a parameter)."""
        return self.optimizer.unallocated_bytes(self.params)

    # -- whole tensors out, for the leader -------------------------------------------------------------------

    def _full(self, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor (a collective for a shard: every rank must call it, in order). A plain
        tensor is returned as is, not copied: callers copy what they keep."""
        with torch.no_grad():
            return t.full_tensor().cpu() if isinstance(t, DTensor) else t.detach()

    def gather_weights(self) -> dict[str, torch.Tensor] | None:
        """Every weight of the model, whole, on the leader (None elsewhere): the parameters, then the fixed
        tensors (persistent buffers), so a save or a snapshot is the session's model and not only what trains."""
        weights = {n: self._full(p) for n, p in zip(self.param_names, self.params, strict=True)}
        weights.update({n: self._full(t) for n, t in zip(self.fixed_names, self.fixed, strict=True)})
        return weights if self.group.is_leader else None

    def gather_state(self) -> SavedState | None:
        weights = self.gather_weights()
        moments: dict[str, torch.Tensor] = {}
        for n, p in zip(self.param_names, self.params, strict=True):
            moments.update(self.optimizer.entries(n, p, self._full))
        local_pending = float(any(bool(_local(g).any()) for g in self.grads()))
        (pending,) = self.group.all_reduce([local_pending], op="max")
        grads = {n: self._full(g) for n, g in zip(self.param_names, self.grads(), strict=True)} if pending else {}
        if not self.group.is_leader:
            return None
        assert weights is not None
        return SavedState(weights, moments, grads, {"optimizer_steps": self.steps})

    # -- whole tensors in --------------------------------------------------------------------------------------

    def load(self, saved: SavedState, tied: dict[str, str], *, optimizer: bool = True) -> None:
        """Take this rank's piece of every tensor of a (full) saved state; no communication needed.

        Without ``optimizer`` (Tinker's ``load_state``, weights only) the optimizer state and the pending gradients
        become those of a fresh session: no moments or momentum, step 0, zero gradients, whatever the state holds
        (the caller checked that a state loaded with its optimizer was saved with this engine's:
        worker/checkpoints/files.py ``check_state``).
        """
        def place(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            full = full.to(like.device, like.dtype)
            if isinstance(like, DTensor):
                return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
            return full

        grads, moments = (saved.grads, saved.moments) if optimizer else ({}, {})
        with torch.no_grad():
            for n, t in zip(self.fixed_names, self.fixed, strict=True):
                if n in saved.weights:  # states saved before buffers were saved keep the model's own
                    t.copy_(place(saved.weights[n], t))
            for n, p, g in zip(self.param_names, self.params, self.grads(), strict=True):
                p.copy_(place(saved.weights[n] if n in saved.weights else saved.weights[tied[n]], p))
                if n in grads:
                    g.copy_(place(grads[n], p))
                else:
                    g.zero_()
                self.optimizer.restore(n, p, moments, functools.partial(place, like=p))
        self.steps = int(saved.meta["optimizer_steps"]) if optimizer else 0


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of every gradient together, a plain tensor (a collective where some are DTensor shards: every rank
    calls it). Whole tensors and DTensors (an adapter on an expert-parallel group) are normed apart, then joined."""
    norms = []
    for kind in strategies.kinds(grads):
        if kind:
            n = torch.nn.utils.get_total_norm(kind, norm_type=2.0)
            norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


class RequestPart:
    """One request's per-datum outputs and metrics as this rank computed them."""

    def __init__(self) -> None:
        self.rows: list[list[Any]] = []
        self.loss_sum = 0.0
        self.totals = MetricTotals()

    def add(self, start: int, scored: ScoredBatch, lengths: list[int]) -> None:
        self.loss_sum += float(scored.loss.detach())
        self.totals.add(scored.metrics)
        self.rows += [[start + i, lp, el] for i, (lp, el) in enumerate(scored.rows(lengths))]

    def merged(self, group: Collectives, n_datums: int, loss_fn: str) -> types.ForwardBackwardOutput | None:
        """Every rank's part, in input order, on the leader (None elsewhere)."""
        if group.world == 1:
            parts = [(self.rows, self.loss_sum, self.totals.raw())]
        else:
            raw = group.gather_bytes(codec.packb({"rows": self.rows, "loss_sum": self.loss_sum,
                                                  "totals": self.totals.raw()}))
            if not group.is_leader:
                return None
            parts = [(p["rows"], p["loss_sum"], p["totals"]) for p in map(codec.unpackb, raw)]
        outputs: list[dict[str, types.TensorData]] = [{} for _ in range(n_datums)]
        totals = MetricTotals()
        loss_sum = 0.0
        for rows, part_loss, part_totals in parts:
            for index, lp, el in rows:
                outputs[int(index)] = {"logprobs": types.TensorData.from_numpy(lp),
                                       "elementwise_loss": types.TensorData.from_numpy(el)}
            loss_sum += float(part_loss)
            totals.merge(part_totals)
        return types.ForwardBackwardOutput(loss_fn_output_type=loss_fn, loss_fn_outputs=outputs,
                                           metrics={"loss:sum": loss_sum, **totals.result()})


def model_weights(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Parameter]],
                                                  list[tuple[str, torch.Tensor]]]:
    """What a full session's weights are: every entry of ``model.state_dict()``, as the module's own tensors, each
    once (a tied twin under named_parameters' first name). Returns (trained: the parameters that require grad,
    fixed: the rest, never trained: persistent buffers such as DeepSeek-V3's and Nemotron-H's
    ``mlp.gate.e_score_correction_bias``, which steers routing, and any frozen parameter). A save without the
    fixed ones is another model: ``from_pretrained`` re-creates a missing buffer as zeros, with a warning only.
    Non-persistent buffers (rotary ``inv_freq``) are not in the state dict: the config rebuilds them."""
    saved = model.state_dict(keep_vars=True).keys()
    trained: list[tuple[str, torch.nn.Parameter]] = []
    fixed: list[tuple[str, torch.Tensor]] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            trained.append((name, p))
        else:
            fixed.append((name, p))
    seen = {id(t) for _, t in trained + fixed}
    for name, b in model.named_buffers():
        if name in saved and id(b) not in seen:
            seen.add(id(b))
            fixed.append((name, b))
    return trained, fixed


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """For each parameter name, the other names of the same tensor (tied embeddings), one level deep."""
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return {n: other for names in by_id.values() for n in names for other in names if other != n}
