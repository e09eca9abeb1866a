"""LoRA sessions: an adapter trained by the one engine (worker/training/engine.py) over a frozen base shared by all.

:class:`LoraBase` is the worker's base model, hooked for routing once, and what every LoRA session on it
shares. :class:`LoraSession` implements :class:`worker.session.Session`; its loss requests normally run in
mixed passes with other sessions' (worker/lora/batch.py), and ``run_loss`` runs one alone (the same
forward, routed to this adapter only).

Files (docs/lora.md): ``save_weights_for_sampler`` writes a standard PEFT adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``) that ``PeftModel.from_pretrained`` loads, and
optionally the merged full weights (``merged/``); ``save_state`` adds the optimizer state and pending gradients.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from tinkerq import optimizers, types
from tinkerq.worker import checkpoints
from tinkerq.worker.lora import experts, routing
from tinkerq.worker.lora.adapter import Adapter, FrozenAdapter, Target, adaptable, find_targets
from tinkerq.worker.lora.batch import LossItem, run_pass
from tinkerq.worker.training.engine import Collectives, SingleProcess, TrainingEngine
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.session import Runner, execute


class LoraBase:
    """The frozen base model every LoRA session on this worker adapts.

    On a shard group (worker/sharding/host.py) every rank holds one, over its FSDP shards of the base: ``root`` is
    the FSDP root that computes logprobs, ``group`` the ranks, and on rank 0 ``leader`` runs a pass on every rank.
    """

    def __init__(self, model: PreTrainedModel, logprobs: LogprobComputer, *, model_dir: str,
                 microbatch_tokens: int, group: Collectives | None = None,
                 device: torch.device | str | None = None) -> None:
        self.model = model
        self.logprobs = logprobs
        self.model_dir = model_dir
        self.microbatch_tokens = microbatch_tokens
        self.group: Collectives = group or SingleProcess()
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.head = routing.install(model)
        model.requires_grad_(False)  # frozen: backward reaches the adapters only (full sessions train copies)
        self.root: torch.nn.Module | None = None
        # On an expert-parallel group (worker/sharding/experts.py): keeps a new adapter's per-expert factors with
        # their experts, a slice on each rank. None: adapters are whole on every rank.
        self.shard_adapter: Callable[[Adapter], None] | None = None
        self.leader: Callable[[list[LossItem], bool], None] | None = None
        # The base unsharded, for merged files (a shard group's: read from the files by rank 0, on demand).
        self.whole: Callable[[], PreTrainedModel] = lambda: model

    def targets(self, config: types.LoraConfig) -> list[Target]:
        return find_targets(self.model, config)

    def local_bytes(self) -> int:
        """Bytes of the base's weights on this rank (its shards, on a shard group), counted from local tensors."""
        def local(p: torch.Tensor) -> torch.Tensor:
            return p.to_local() if isinstance(p, DTensor) else p

        return sum(local(p).numel() * local(p).element_size() for p in self.model.parameters())

    def _logprobs(self, tokens: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.root is not None:
            return self.root(tokens, mask, targets)
        return self.logprobs(self.model, tokens, mask, targets)

    def forward(self, adapter: Any) -> Any:
        """The engine's forward for ``adapter`` alone: every row routed to it."""
        def run(tokens: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            with routing.routed([(adapter, slice(0, tokens.shape[0]))], self.head, passing=[adapter]):
                return self._logprobs(tokens, mask, targets)
        return run

    def run_pass(self, items: list[LossItem], backward: bool) -> None:
        """One pass over loss requests of several sessions (worker/lora/batch.py); rank 0 of a shard group runs
        it on every rank."""
        if self.leader is not None:
            self.leader(items, backward)
        else:
            self.pass_here(items, backward)

    def pass_here(self, items: list[LossItem], backward: bool) -> None:
        """This rank's part of the pass."""
        run_pass(items, self.model, self.logprobs, head=self.head, microbatch_tokens=self.microbatch_tokens,
                 device=self.device, backward=backward, group=self.group, root=self.root)


def config_dict(config: types.LoraConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


class LoraSession:
    """A LoRA session. On a shard group every rank holds one (the adapter and its optimizer state replicated: whole
    copies that every rank updates alike); rank 0's runs each engine command on every rank (``run``). ``optimizer``:
    AdamW (None) or Dimuon, whose learning rate is corrected for the adapter's rank (docs/optimizers.md)."""

    kind = "lora"

    def __init__(self, model_id: str, base: LoraBase, config: types.LoraConfig, *, base_model: str,
                 run: Runner | None = None, on_close: Callable[[], None] | None = None,
                 optimizer: types.OptimizerConfig | None = None) -> None:
        self.model_id = model_id
        self.optimizer_config: types.OptimizerConfig = optimizer or types.AdamOptimizerConfig()
        self.base = base
        self.base_model = base_model
        self.config = config
        self.adapter = Adapter(base.targets(config), config, base.device)
        self.sharded = base.shard_adapter is not None  # its per-expert factors: this rank's slices
        if base.shard_adapter is not None:
            base.shard_adapter(self.adapter)
        self.engine = TrainingEngine(base.forward(self.adapter), self.adapter.named_pairs(), base.group,
                                     microbatch_tokens=base.microbatch_tokens, device=base.device, replicated=True,
                                     optimizer=self.optimizer_config, lora_rank=config.rank)
        self._run_command: Runner = run or (lambda op, **args: execute(self.engine, op, args, {}))
        self._on_close = on_close
        self.last_used = time.monotonic()

    @property
    def steps(self) -> int:
        return self.engine.steps

    @property
    def pass_group(self) -> LoraBase:
        return self.base  # every LoRA session over this base may share a pass (worker/lora/batch.py)

    def recipe(self) -> dict[str, Any] | None:
        return config_dict(self.config)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lora": {**config_dict(self.config), "trainable_parameters": self.num_parameters(),
                                        "state_bytes": self.state_bytes()},
                               "optimizer": optimizers.encode_config(self.optimizer_config)}
        if self.base.group.world > 1:  # the frozen base each shard holds (rank 0's), beside the adapter's state
            out["base_shard_bytes"] = self.base.local_bytes()
        return out

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.engine.params)

    def state_bytes(self) -> int:
        return self.adapter.state_bytes()

    def unallocated_state_bytes(self) -> int:
        return self.engine.unallocated_state_bytes()

    def _touch(self) -> None:
        self.last_used = time.monotonic()

    def _run(self, op: str, **args: Any) -> Any:
        self._touch()
        return self._run_command(op, **args)

    def run_loss(self, data: list[types.Datum], loss_fn: str, config: dict[str, Any] | None, *,
                 backward: bool, checkpointing: bool = False) -> types.ForwardBackwardOutput:
        out = self._run("run_loss", data=data, loss_fn=loss_fn, config=config, backward=backward,
                        checkpointing=checkpointing)
        assert out is not None
        return out

    def optim_step(self, hyper: types.OptimParams) -> types.OptimStepResponse:
        return cast(types.OptimStepResponse, self._run("optim_step", hyper=hyper))

    def snapshot(self) -> FrozenAdapter:
        """The adapter's current weights, frozen, for sampling over the shared base (worker/sampling/snapshots.py)."""
        self._touch()
        if not self.sharded:
            return self.adapter.frozen()
        # Copies: the gathered dict hands whole (unsharded) factors over as the live parameters themselves.
        frozen = {n: t.detach().clone() for n, t in self._whole_weights().items()}
        return FrozenAdapter.from_tensors(frozen, self.adapter.scaling, self.base.device)

    def _whole_weights(self) -> dict[str, torch.Tensor]:
        """Every A and B whole, by PEFT name: gathered from the ranks where per-expert factors are sharded."""
        if not self.sharded:
            return dict(self.adapter.named_pairs())
        weights = self._run("gather_weights")
        assert weights is not None  # this is the leader
        return cast(dict[str, torch.Tensor], weights)

    # -- files ---------------------------------------------------------------------------------------------

    def _write_adapter(self, directory: Path, base_model: str, weights: dict[str, torch.Tensor]) -> None:
        save_file({checkpoints.PEFT_PREFIX + n: t.detach().cpu().contiguous() for n, t in weights.items()},
                  str(directory / checkpoints.ADAPTER_FILE))
        (directory / "adapter_config.json").write_text(json.dumps(peft_config(self.config, self.adapter.targets,
                                                                              base_model), indent=1))

    def save_weights(self, checkpoint_dir: str, name: str, *, base_model: str, merged: bool = False,
                     expires_at: float | None = None, external: bool = False) -> str:
        """A PEFT adapter directory (and, with ``merged``, the merged full model in ``merged/``)."""
        self._touch()
        final = checkpoints.weights_path(checkpoint_dir, self.model_id, name, external=external)
        weights = self._whole_weights()

        def fill(tmp: Path) -> None:
            self._write_adapter(tmp, base_model, weights)
            checkpoints.copy_tokenizer_files(self.base.model_dir, tmp)
            checkpoints.write_weights_marker(tmp, base_model, lora=config_dict(self.config), expires_at=expires_at)
            if merged:  # loadable by its own path too: it expires with the adapter
                (tmp / "merged").mkdir()
                frozen = FrozenAdapter.from_tensors(weights, self.adapter.scaling, torch.device("cpu")) \
                    if self.sharded else self.adapter.frozen()  # (a group's whole base is read onto the CPU)
                write_merged(self.base.whole(), frozen, tmp / "merged")
                checkpoints.copy_tokenizer_files(self.base.model_dir, tmp / "merged")
                checkpoints.write_weights_marker(tmp / "merged", base_model, expires_at=expires_at)

        checkpoints.write_atomically(final, fill)
        return str(final)

    def save_state(self, checkpoint_dir: str, name: str, *, base_model: str, seq_id: int,
                   expires_at: float | None = None, overwrite: bool = True) -> str:
        self._touch()
        final = checkpoints.state_path(checkpoint_dir, self.model_id, name)
        if not overwrite:  # refused before anything is gathered (and checked again at the rename)
            checkpoints.refuse_existing(final)
        saved = self._run("gather_state")
        assert saved is not None  # this is the leader
        checkpoints.write_atomically(final, lambda tmp: checkpoints.write_state(
            tmp, write_weights=lambda d: self._write_adapter(d, base_model, saved.weights),
            shapes=self.engine.shapes(), moments=saved.moments, grads=saved.grads, base_model=base_model,
            model_id=self.model_id, steps=self.engine.steps, seq_id=seq_id, lora=config_dict(self.config),
            expires_at=expires_at, optimizer=optimizers.encode_config(self.optimizer_config)), overwrite=overwrite)
        return str(final)

    def load_state(self, directory: Path, *, optimizer: bool = True) -> dict[str, Any]:
        """Replace the adapter, its optimizer state and pending gradients with a saved LoRA state's (same base model,
        rank, targets and optimizer); without ``optimizer``, the adapter only: the optimizer and the gradients start
        afresh."""
        self._touch()
        lora = config_dict(self.config)
        checkpoints.check_state(directory, self.engine.shapes(), lora, self.base_model,
                                optimizer=self.optimizer_config if optimizer else None)
        return cast(dict[str, Any], self._run("load_state", path=str(directory), optimizer=optimizer, lora=lora))

    def close(self) -> None:
        """Nothing beyond dropping the session (on every rank of a shard group): the base stays for the others."""
        if self._on_close is not None:
            self._on_close()


def peft_config(config: types.LoraConfig, targets: list[Target], base_model: str) -> dict[str, Any]:
    """PEFT's adapter_config.json for this adapter (explicit target modules: PEFT's defaults differ)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": config.rank, "lora_alpha": types.LoraConfig.ALPHA, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted({t.name.rsplit(".", 1)[-1] for t in targets}),
        "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None,
    }


def write_merged(model: PreTrainedModel, adapter: FrozenAdapter, directory: Path) -> None:
    """The base with ``W + scaling * B @ A`` (in float32) for every adapted module, as a plain HF directory.

    A tied-embedding model whose output projection is adapted is written untied: the input embedding keeps
    the base weights, as the adapter never changes it.
    """
    state = {n: t.detach() for n, t in model.state_dict().items()}
    parts = {p.name: p for p in adaptable(model)}
    by_module: dict[str, list[str]] = {}  # a module's adapted parts (q/k/v of a fused Linear, w1/w2/w3 of experts)
    for name in adapter.pairs:
        by_module.setdefault(parts[name].module_name, []).append(name)
    # One module at a time: its weights merged in float32, then back in their dtype before the next one, so the
    # float32 copies never add up (worker/memory/estimates.py merged_save_bytes).
    for module_name, names in by_module.items():
        merged: dict[str, torch.Tensor] = {}  # parameter -> float32 merged copy
        for name in names:
            part = parts[name]
            a, b = adapter.pairs[name]
            if a.dim() == 3:  # an expert projection: <experts module>.<w1|w2|w3>
                lay = experts.layout(part.module, part.module_name)
                experts.merge(part.module, name.rsplit(".", 1)[1], experts.delta_weight(a, b, adapter.scaling), lay,
                              merged)
                continue
            linear: Any = part.module
            if "weight" not in merged:
                merged["weight"] = linear.weight.detach().float().clone()
            weight = merged["weight"]
            rows = slice(*part.rows) if part.rows is not None else slice(None)
            weight[rows] += adapter.scaling * (b.float() @ a.float())
        for param, value in merged.items():
            key = f"{module_name}.{param}"
            state[key] = value.to(state[key].dtype)
    head = model.get_output_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head)
    untie = head_name in adapter.pairs and getattr(model.config, "tie_word_embeddings", False)
    if untie:
        model.config.tie_word_embeddings = False
    try:
        model.save_pretrained(directory, state_dict={k: v.contiguous() for k, v in state.items()})
    finally:
        if untie:
            model.config.tie_word_embeddings = True
