"""A LoRA adapter: which modules of a base model it adapts, and its A/B matrices.

Tinker's layout (../shared/reference/lora-notes.md): ``train_attn`` adapts q/k/v/o_proj, ``train_mlp``
gate/up/down_proj, ``train_unembed`` the output projection (lm_head; on a tied-embedding model the
input embedding stays as it is). For a module ``y = x W^T`` (W: (out, in)) the adapter adds
``scaling * (x A^T) B^T`` with A: (rank, in), B: (out, rank), scaling = 32 / rank. A starts as PEFT
initialises it (kaiming-uniform, a = sqrt(5): U(+-1/sqrt(in))) from the session's seed, B at zero, so a
new adapter leaves the model's outputs exactly unchanged. Masters are float32 whatever the base's dtype.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from tinkerq import types
from tinkerq.errors import ValidationError
from tinkerq.worker.memory import LORA_BYTES_PER_PARAMETER

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Target:
    name: str  # the module's name in the base model, as PEFT keys it (e.g. model.layers.0.self_attn.q_proj)
    component: str  # "attn" | "mlp" | "unembed"
    in_features: int
    out_features: int


def find_targets(model: torch.nn.Module, config: types.LoraConfig) -> list[Target]:
    """The modules ``config`` adapts, in the model's module order (which fixes the initialisation order)."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    found: list[Target] = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        component = "unembed" if module is head else "attn" if leaf in ATTN else "mlp" if leaf in MLP else None
        if component is None or not getattr(config, f"train_{component}"):
            continue
        found.append(Target(name, component, module.in_features, module.out_features))
    wanted = {"attn": ", ".join(ATTN), "mlp": ", ".join(MLP), "unembed": "a Linear output projection"}
    for component, modules in wanted.items():
        if getattr(config, f"train_{component}") and not any(t.component == component for t in found):
            raise ValidationError(f"train_{component}=True, but this model has no {component} modules tinkerq "
                                  f"adapts ({modules}); set train_{component}=False")
    return found


def parameters_per_rank(targets: list[Target]) -> dict[str, int]:
    """LoRA parameters per unit of rank, by component (sum of in + out over the adapted modules)."""
    counts = {"attn": 0, "mlp": 0, "unembed": 0}
    for t in targets:
        counts[t.component] += t.in_features + t.out_features
    return counts


class Adapter(torch.nn.Module):
    """One session's A and B for each target, as float32 parameters (the engine trains exactly these)."""

    def __init__(self, targets: list[Target], config: types.LoraConfig, device: torch.device | str) -> None:
        super().__init__()
        self.targets = targets
        self.config = config
        self.scaling = config.scaling
        self.a = torch.nn.ParameterDict()
        self.b = torch.nn.ParameterDict()
        generator = torch.Generator().manual_seed(int(config.seed or 0))
        for t in targets:
            a = torch.empty(config.rank, t.in_features)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            key = _key(t.name)
            self.a[key] = torch.nn.Parameter(a.to(device))
            self.b[key] = torch.nn.Parameter(torch.zeros(t.out_features, config.rank, device=device))

    def pair(self, target: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = _key(target)
        return (self.a[key], self.b[key]) if key in self.a else None

    def named_pairs(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(PEFT name, parameter) for every A and B, in target order: what the engine, the checkpoints and the
        PEFT export all use (``base_model.model.`` + this name is PEFT's key)."""
        out = []
        for t in self.targets:
            key = _key(t.name)
            out += [(f"{t.name}.lora_A.weight", self.a[key]), (f"{t.name}.lora_B.weight", self.b[key])]
        return out

    def frozen(self) -> FrozenAdapter:
        """A detached copy of the current weights (for sampling), unaffected by later training."""
        return FrozenAdapter({t.name: (self.a[_key(t.name)].detach().clone(), self.b[_key(t.name)].detach().clone())
                              for t in self.targets}, self.scaling)

    def state_bytes(self) -> int:
        """What the session keeps: weights, pending gradients and AdamW's two moments (float32 each)."""
        return LORA_BYTES_PER_PARAMETER * sum(p.numel() for p in self.parameters())


class FrozenAdapter:
    """Adapter weights that no longer train: a LoRA snapshot's, for sampling."""

    def __init__(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        self.pairs = pairs
        self.scaling = scaling

    def pair(self, target: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.pairs.get(target)

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.pairs.values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """By PEFT name (``<module>.lora_A.weight`` / ``.lora_B.weight``), on the CPU, to publish."""
        out = {}
        for name, (a, b) in self.pairs.items():
            out[f"{name}.lora_A.weight"] = a.detach().cpu().contiguous()
            out[f"{name}.lora_B.weight"] = b.detach().cpu().contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], scaling: float, device: torch.device) -> FrozenAdapter:
        """The inverse of :meth:`tensors` (keys may carry PEFT's ``base_model.model.`` prefix)."""
        pairs: dict[str, list[torch.Tensor | None]] = {}
        for key, t in tensors.items():
            key = key.removeprefix("base_model.model.")
            for part, slot in ((".lora_A.weight", 0), (".lora_B.weight", 1)):
                if key.endswith(part):
                    pairs.setdefault(key.removesuffix(part), [None, None])[slot] = t.to(device, torch.float32)
                    break
            else:
                raise ValidationError(f"LoRA weights hold an unexpected tensor {key!r}")
        if any(a is None or b is None for a, b in pairs.values()):
            raise ValidationError("LoRA weights hold an A without its B (or the reverse)")
        return cls({k: (v[0], v[1]) for k, v in pairs.items()}, scaling)  # type: ignore[misc]

    @classmethod
    def from_peft_directory(cls, directory: Path, device: torch.device) -> FrozenAdapter:
        """A ``save_weights_for_sampler`` directory of a LoRA session (a standard PEFT adapter)."""
        try:
            config = json.loads((directory / "adapter_config.json").read_text())
            scaling = float(config["lora_alpha"]) / float(config["r"])
            if config.get("use_rslora") or config.get("use_dora"):
                raise ValueError("rsLoRA / DoRA adapters are not supported")
            tensors = load_file(str(directory / "adapter_model.safetensors"))
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
            raise ValidationError(f"{directory} is not a usable LoRA adapter ({exc}): pass a path returned by "
                                  f"save_weights_for_sampler()") from None
        return cls.from_tensors(tensors, scaling, device)


def _key(name: str) -> str:
    return name.replace(".", "__")  # ParameterDict keys cannot hold dots
