"""Training sessions as the request handling (worker/core/service.py) sees them.

:class:`Session` is the protocol every session kind implements. :class:`FullSession` is a full-parameter
session on one process or on a shard group: either way its math runs in :class:`worker.training.TrainingEngine`
(on every rank), driven through a *runner* that executes one engine command (:func:`execute`) locally, or
broadcasts it to every rank first (worker/sharding/host.py). Files are written here, by rank 0 alone,
from tensors gathered to it. LoRA sessions are in worker/lora/session.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from transformers import PreTrainedModel

from tinkerq import optimizers, types
from tinkerq.errors import ServerError, TinkerqError
from tinkerq.worker import checkpoints
from tinkerq.worker.training.engine import SingleProcess, TrainingEngine, model_weights, tied_names
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.optimizers import Optimizer

# (op, **args) -> the command's result on rank 0
Runner = Callable[..., Any]


class Session(Protocol):
    model_id: str
    last_used: float
    kind: str  # "full" or "lora": which count limit and memory admission apply (worker/training/sessions.py)
    optimizer_config: types.OptimizerConfig  # chosen at creation, fixed for the session's life

    @property
    def pass_group(self) -> Any:
        """Sessions whose loss requests may share one pass have the same non-None group (the frozen base of
        LoRA sessions); None: each request runs alone."""
        ...

    def recipe(self) -> dict[str, Any] | None:
        """How to make the same session again on another worker (its LoRA config with the effective seed;
        None for a full-parameter session), beside its ``optimizer_config``."""
        ...

    def describe(self) -> dict[str, Any]:
        """What create_model reports of this session beyond the worker's own facts."""
        ...

    @property
    def steps(self) -> int: ...

    def run_loss(self, data: list[types.Datum], loss_fn: str, config: dict[str, Any] | None, *,
                 backward: bool, checkpointing: bool = False) -> types.ForwardBackwardOutput: ...

    def optim_step(self, hyper: types.OptimParams) -> types.OptimStepResponse: ...

    def snapshot(self) -> Any:
        """Frozen weights to sample from: a model copy (full), or an adapter over the shared base (LoRA)."""
        ...

    def save_weights(self, checkpoint_dir: str, name: str, *, base_model: str, merged: bool = False,
                     expires_at: float | None = None, external: bool = False) -> str: ...

    def save_state(self, checkpoint_dir: str, name: str, *, base_model: str, seq_id: int,
                   expires_at: float | None = None, overwrite: bool = True) -> str: ...

    def load_state(self, directory: Path, *, optimizer: bool = True) -> dict[str, Any]: ...

    def close(self) -> None: ...

    def unallocated_state_bytes(self) -> int:
        """Optimizer memory (on rank 0) this session will allocate at its first optim_step (worker/memory/)."""
        ...


def execute(engine: TrainingEngine, op: str, args: dict[str, Any], tied: dict[str, str]) -> Any:
    """Run one engine command on this rank (every rank of a group runs the same ones, in the same order)."""
    if op == "run_loss":
        return engine.run_loss(args["data"], args["loss_fn"], args["config"], backward=bool(args["backward"]),
                               checkpointing=bool(args.get("checkpointing", False)))
    if op == "optim_step":
        return engine.optim_step(args["hyper"])
    if op == "gather_weights":
        return engine.gather_weights()
    if op == "gather_state":
        return engine.gather_state()
    if op == "load_state":
        # Each rank reads the files itself (the checkpoint directory is shared); all agree before any applies.
        error, saved = None, None
        directory = Path(str(args["path"]))
        optimizer = bool(args.get("optimizer", True))
        try:
            saved = checkpoints.read_state(directory, engine.shapes(), tied, args.get("lora"), optimizer=optimizer)
        except TinkerqError as exc:
            error = exc
        except OSError as exc:
            error = ServerError(f"shard {engine.group.rank} cannot read checkpoint {directory}: {exc}")
        engine.group.agree(error)
        assert saved is not None
        engine.load(saved, tied, optimizer=optimizer)
        return saved.meta
    raise ServerError(f"unknown engine command {op!r}")


class FullSession:
    """A full-parameter session: every weight trains.

    ``engine`` returns rank 0's engine (its ``steps`` are the session's); ``blank`` makes an untrained copy of
    the model on rank 0, to become a snapshot; ``template`` is a model of the same architecture whose
    ``save_pretrained`` writes the files (with the gathered weights).
    """

    kind = "full"
    pass_group = None  # each request runs alone on the session's own weights

    def __init__(self, model_id: str, run: Runner, engine: Callable[[], TrainingEngine | None], *,
                 blank: Callable[[], PreTrainedModel], template: PreTrainedModel, model_dir: str,
                 shapes: dict[str, list[int]], world: int = 1, device: torch.device | str = "cpu",
                 optimizer: types.OptimizerConfig | None = None) -> None:
        self.model_id = model_id
        self.optimizer_config: types.OptimizerConfig = optimizer or types.AdamOptimizerConfig()
        self._run_command = run
        self._engine = engine
        self._blank = blank
        self.template = template
        self.model_dir = model_dir
        self.world = world
        self.device = torch.device(device)
        self._shapes = shapes
        self.last_used = time.monotonic()

    def recipe(self) -> dict[str, Any] | None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"optimizer": optimizers.encode_config(self.optimizer_config)}

    @property
    def steps(self) -> int:
        engine = self._engine()
        return engine.steps if engine is not None else 0

    def shapes(self) -> dict[str, list[int]]:
        return self._shapes

    def unallocated_state_bytes(self) -> int:
        engine = self._engine()
        return engine.unallocated_state_bytes() if engine is not None else 0

    def _run(self, op: str, **args: Any) -> Any:
        self.last_used = time.monotonic()
        return self._run_command(op, **args)

    def run_loss(self, data: list[types.Datum], loss_fn: str, config: dict[str, Any] | None, *,
                 backward: bool, checkpointing: bool = False) -> types.ForwardBackwardOutput:
        return self._run("run_loss", data=data, loss_fn=loss_fn, config=config, backward=backward,
                         checkpointing=checkpointing)

    def optim_step(self, hyper: types.OptimParams) -> types.OptimStepResponse:
        return self._run("optim_step", hyper=hyper)

    def snapshot(self) -> PreTrainedModel:
        """A frozen copy of the current weights, for sampling (worker/sampling/snapshots.py keeps and publishes it)."""
        weights = self._run("gather_weights")
        snapshot = self._blank()
        trained, fixed = model_weights(snapshot)
        with torch.no_grad():  # the buffers too: the blank's are the base's, the session's may have been loaded
            for name, t in [*trained, *fixed]:
                t.copy_(weights[name])
        snapshot.requires_grad_(False)
        return cast(Any, snapshot).to(self.device)  # transformers types .to as a decorated method

    def save_weights(self, checkpoint_dir: str, name: str, *, base_model: str, merged: bool = False,
                     expires_at: float | None = None, external: bool = False) -> str:
        """Write a plain Hugging Face model directory (from_pretrained loads it without tinkerq): every parameter
        and persistent buffer (:func:`worker.training.model_weights`); a full session's weights are merged
        already, so ``merged`` changes nothing."""
        final = checkpoints.weights_path(checkpoint_dir, self.model_id, name, external=external)
        weights = self._run("gather_weights")

        def fill(tmp: Path) -> None:
            self.template.save_pretrained(tmp, state_dict=weights)
            checkpoints.copy_tokenizer_files(self.model_dir, tmp)
            checkpoints.write_weights_marker(tmp, base_model, expires_at=expires_at)

        checkpoints.write_atomically(final, fill)
        return str(final)

    def save_state(self, checkpoint_dir: str, name: str, *, base_model: str, seq_id: int,
                   expires_at: float | None = None, overwrite: bool = True) -> str:
        """Weights + optimizer state + pending gradients + request position, for load_state (any shard count)."""
        final = checkpoints.state_path(checkpoint_dir, self.model_id, name)
        if not overwrite:  # refused before every shard gathers the whole state (and checked again at the rename)
            checkpoints.refuse_existing(final)
        saved = self._run("gather_state")
        # The weights under the names the engine reads back (read_state): transformers 5 would otherwise write
        # them in the checkpoint layout it converts from at load (per-expert MoE tensors, renamed keys).
        checkpoints.write_atomically(final, lambda tmp: checkpoints.write_state(
            tmp, write_weights=lambda d: self.template.save_pretrained(d, state_dict=saved.weights,
                                                                       save_original_format=False),
            shapes=self._shapes, moments=saved.moments, grads=saved.grads, base_model=base_model,
            model_id=self.model_id, steps=int(saved.meta["optimizer_steps"]), seq_id=seq_id, shards=self.world,
            expires_at=expires_at, optimizer=optimizers.encode_config(self.optimizer_config)), overwrite=overwrite)
        return str(final)

    def load_state(self, directory: Path, *, optimizer: bool = True) -> dict[str, Any]:
        """Replace the weights, optimizer state and pending gradients with a saved state's (any shard count; saved
        with this session's optimizer); without ``optimizer``, the weights only: the optimizer and the pending
        gradients start afresh."""
        # User errors before any shard is involved.
        checkpoints.check_state(directory, self._shapes, optimizer=self.optimizer_config if optimizer else None)
        return self._run("load_state", path=str(directory), optimizer=optimizer)

    def close(self) -> None:
        """Overridden where a session holds resources beyond itself (a shard group's pieces)."""


class TrainingSession(FullSession):
    """A full-parameter session on this process: ``model`` is its own copy of the weights."""

    def __init__(self, model_id: str, model: PreTrainedModel, *, base_dir: str, microbatch_tokens: int,
                 logprobs: LogprobComputer, blank_model: Callable[[], PreTrainedModel],
                 optimizer: types.OptimizerConfig | None = None) -> None:
        self.model = model
        self.logprobs = logprobs
        device = next(model.parameters()).device
        named, fixed = model_weights(model)
        self.engine = TrainingEngine(lambda tokens, mask, targets: logprobs(model, tokens, mask, targets), named,
                                     SingleProcess(), microbatch_tokens=microbatch_tokens, device=device, fixed=fixed,
                                     optimizer=optimizer)
        tied = tied_names(model)
        super().__init__(model_id, lambda op, **args: execute(self.engine, op, args, tied), lambda: self.engine,
                         blank=blank_model, template=model, model_dir=base_dir,
                         shapes=self.engine.shapes(), device=device, optimizer=optimizer)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.engine.params

    @property
    def optimizer(self) -> Optimizer:
        return self.engine.optimizer

