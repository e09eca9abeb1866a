"""A LoRA adapter: which parts of a base model it adapts, and its A/B matrices.

Targets are found from the model's structure (:func:`adaptable`), not from a list of leaf names: every
``nn.Linear`` inside a token-mixing module (attention, MLA, gated-delta-net linear attention, Mamba) is ``attn``;
every ``nn.Linear`` inside a channel-mixing module (a dense MLP, a shared expert) and every fused-experts module's
projections (worker/lora/experts.py) are ``mlp``; the output projection is ``unembed`` (on a tied-embedding
model the input embedding stays as it is). A MoE block's router is never adapted (Tinker: routers are not).

For a Linear ``y = x W^T`` (W: (out, in)) the adapter adds ``scaling * (x A^T) B^T`` with A: (rank, in),
B: (out, rank), scaling = 32 / rank; an expert projection has Tinker's shared-outer 3-D factors
(worker/lora/experts.py). A starts as PEFT initialises it (kaiming-uniform, a = sqrt(5): U(+-1/sqrt(in)), each
expert's slice alike) from the session's seed, B at zero, so a new adapter leaves the model's outputs exactly
unchanged. Masters are float32 whatever the base's dtype.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from tinkerq import types
from tinkerq.errors import ValidationError
from tinkerq.worker.lora import experts as fused
from tinkerq.worker.memory import LORA_BYTES_PER_PARAMETER

# What a decoder layer's sub-modules are, from their classes: token mixing (attention of every kind, linear
# attention, state-space mixers) or channel mixing (MLPs, MoE blocks, experts).
_TOKEN_MIXING = re.compile(r"attention|attn|mamba|deltanet|ssm|mixer", re.IGNORECASE)
_CHANNEL_MIXING = re.compile(r"mlp|moe|expert|feedforward|ffn", re.IGNORECASE)
# A sparse-attention indexer (DeepSeek-V3.2's, GLM-5's DSA): its projections reach the loss only through a top-k
# choice of columns, which has no gradient, so an adapter there would never train. Not adapted.
_INDEXER = re.compile(r"Indexer$")


@dataclass(frozen=True)
class Part:
    """One adapter target in the base model: a Linear (or rows of one), or one projection of fused experts."""

    name: str  # the adapter's name: a Linear's module name (PEFT's key, e.g. model.layers.0.self_attn.q_proj);
    # a part of a fused Linear under Tinker's name (…linear_attn.in_proj_q: rows of in_proj_qkv); an experts
    # module's name + "." + Tinker's projection (w1 gate, w3 up, w2 down), e.g. model.layers.1.mlp.experts.w1
    module_name: str  # the module it lives in
    module: torch.nn.Module
    component: str  # "attn" | "mlp" | "unembed"
    rows: tuple[int, int] | None = None  # the output rows of the Linear it adapts (None: all)


@dataclass(frozen=True)
class Target:
    name: str  # Part.name
    component: str  # "attn" | "mlp" | "unembed"
    in_features: int
    out_features: int
    experts: int = 0  # 0 for a Linear; else E: the factors are 3-D (worker/lora/experts.py)

    @property
    def shared_a(self) -> bool:
        """Experts: A (on the hidden size) is shared by all experts (w1, w3); else B is (w2)."""
        return not self.name.endswith("." + fused.DOWN)

    def shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of A and B."""
        if not self.experts:
            return (rank, self.in_features), (self.out_features, rank)
        e_a, e_b = (1, self.experts) if self.shared_a else (self.experts, 1)
        return (e_a, rank, self.in_features), (e_b, self.out_features, rank)

    def parameters_per_rank(self) -> int:
        a, b = self.shapes(1)
        return math.prod(a) + math.prod(b)

    def expert_parameters_per_rank(self) -> int:
        """Of :meth:`parameters_per_rank`, the per-expert factor's (w1/w3's B, w2's A): what an expert-parallel group
        splits with the experts (worker/sharding/experts.py); 0 for a Linear."""
        if not self.experts:
            return 0
        a, b = self.shapes(1)
        return math.prod(b) if self.shared_a else math.prod(a)


def adaptable(model: torch.nn.Module) -> list[Part]:
    """Every part an adapter may target, in module order.

    A Linear's component is that of its nearest ancestor whose class is token- or channel-mixing (a Linear in
    neither is left alone); a fused-experts module is ``mlp``. A Linear that sits directly in a MoE block (next
    to its ``experts``) is a router or a shared-expert gate: not adapted. Inside a token-mixing module,
    :func:`_linear_parts` applies Tinker's choices (per-head gates and MLA's latent up-projections are not
    adapted; fused linear-attention and Mamba input projections are adapted in parts).
    """
    head = model.get_output_embeddings()  # type: ignore[operator]
    modules = dict(model.named_modules())
    found: list[Part] = []
    for name, module in modules.items():
        if module is head:
            if isinstance(module, torch.nn.Linear):
                found.append(Part(name, name, module, "unembed"))
            continue
        if fused.is_fused_experts(module) or _holds_expert_tables(module, name, modules, model):
            try:
                projections = fused.layout(module, name).projections()
            except ValidationError:  # a layout tinkerq cannot adapt: an error only if train_mlp asks for it
                found.append(Part(name, name, module, "mlp"))
                continue
            found += [Part(f"{name}.{proj}", name, module, "mlp") for proj in projections]
            continue
        if not isinstance(module, torch.nn.Linear):
            continue
        if type(module).forward is not torch.nn.Linear.forward:
            # A Linear subclass with a forward of its own applies its weight in another geometry (DeepSeek-V4's
            # o_a_proj: block-diagonal per head group): a hook's x A^T B^T would not be that weight's delta.
            continue
        parent = name.rpartition(".")[0]
        if any(_INDEXER.search(type(modules[p]).__name__) for p in _ancestors(name)):
            continue
        if isinstance(getattr(modules.get(parent), "experts", None), torch.nn.Module):
            continue  # a router / shared-expert gate beside the experts
        component, path = None, name
        while path and component is None:
            path = path.rpartition(".")[0]
            kind = type(modules[path]).__name__ if path else ""
            # Token mixing first: class names carry the family's name ("Qwen3_5MoeGatedDeltaNet").
            component = "attn" if _TOKEN_MIXING.search(kind) else "mlp" if _CHANNEL_MIXING.search(kind) else None
        if component == "attn":
            found += [Part(n, name, module, component, rows) for n, rows in _linear_parts(name, module, modules[path])]
        elif component is not None:
            found.append(Part(name, name, module, component))
    return found


def _ancestors(name: str) -> list[str]:
    """The dotted names of the modules that hold ``name``, nearest first (the model itself, "", excluded)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _holds_expert_tables(module: torch.nn.Module, name: str, modules: dict[str, torch.nn.Module],
                         model: torch.nn.Module) -> bool:
    """Routed experts kept in a form no adapter reaches: an ``nn.Embedding`` inside a channel-mixing module (Doge's
    retrieval experts: one row per expert) or a module whose class names experts holding 2-D parameters of its own
    that are not a Linear's (DBRX's experts stacked (E * I, H)). train_mlp would leave them frozen unnoticed, so they
    are parts whose layout :func:`fused.layout` refuses (a user error only when train_mlp asks for them)."""
    if isinstance(module, torch.nn.Embedding):
        if module is model.get_input_embeddings():  # type: ignore[operator]
            return False
        path = name
        while path:
            path = path.rpartition(".")[0]
            kind = type(modules[path]).__name__ if path else ""
            if _TOKEN_MIXING.search(kind):
                return False
            if _CHANNEL_MIXING.search(kind):
                return True
        return False
    return not isinstance(module, torch.nn.Linear) and "expert" in type(module).__name__.lower() and \
        any(p.dim() == 2 for p in module.parameters(recurse=False))


def _linear_parts(name: str, linear: torch.nn.Linear,
                  mixer: torch.nn.Module) -> list[tuple[str, tuple[int, int] | None]]:
    """The adapters a Linear of a token-mixing module takes, as Tinker lays them out (model-families.md): its
    per-unit-of-rank parameter counts match only with these choices.

    - A projection to one scalar per head (a gated-delta-net's decay and beta gates) is not adapted.
    - A projection out of a compressed latent (MLA's q_b_proj, kv_b_proj: the input is the q or kv LoRA rank) is
      already low-rank: not adapted; nor are a Mamba-1 mixer's (Jamba's) x_proj (its dt, B and C rows) and dt_proj
      (out of the dt rank; Jamba multiplies by its weight directly, past any hook).
    - A linear-attention layer's fused q/k/v projection takes one adapter per part (in_proj_q, in_proj_k,
      in_proj_v: rows key_dim, key_dim, value_dim).
    - A Mamba mixer's fused input projection [gate | x | B | C | dt] takes adapters on its gate and x rows
      (gate_proj, x_proj); the small B, C and dt rows are not adapted.
    """
    attr = lambda key: getattr(mixer, key, None)  # noqa: E731
    heads = {attr(k) for k in ("num_heads", "num_v_heads", "num_k_heads")} - {None}
    if linear.out_features in heads:
        return []
    if linear.in_features in {attr("q_lora_rank"), attr("kv_lora_rank"), attr("time_step_rank")} - {None}:
        return []  # already low-rank: out of MLA's compressed latents, or a Mamba-1 dt_proj out of the dt rank
    dt_rank, state = attr("time_step_rank"), attr("ssm_state_size")
    if isinstance(dt_rank, int) and isinstance(state, int) and linear.out_features == dt_rank + 2 * state:
        return []  # a Mamba-1 x_proj: the small dt, B and C rows (Jamba), as on Mamba-2's fused in_proj
    prefix = name.rpartition(".")[0]
    from_hidden = linear.in_features == attr("hidden_size")  # an input projection (not e.g. out_proj)
    key_dim, value_dim = attr("key_dim"), attr("value_dim")
    if from_hidden and isinstance(key_dim, int) and isinstance(value_dim, int) and \
            linear.out_features == 2 * key_dim + value_dim:
        bounds = [0, key_dim, 2 * key_dim, 2 * key_dim + value_dim]
        return [(f"{prefix}.in_proj_{p}", (bounds[i], bounds[i + 1])) for i, p in enumerate("qkv")]
    inner, state = attr("intermediate_size"), attr("ssm_state_size")
    if from_hidden and isinstance(inner, int) and isinstance(state, int) and linear.out_features > 2 * inner:
        return [(f"{prefix}.gate_proj", (0, inner)), (f"{prefix}.x_proj", (inner, 2 * inner))]
    return [(name, None)]


def find_targets(model: torch.nn.Module, config: types.LoraConfig) -> list[Target]:
    """The parts ``config`` adapts, in the model's module order (which fixes the initialisation order).

    A user error names what was found when a flag asks for something the model does not have, when nothing
    at all is adapted, or when the rank exceeds a target's smaller dimension."""
    candidates = adaptable(model)
    found: list[Target] = []
    for part in candidates:
        if not getattr(config, f"train_{part.component}"):
            continue
        if isinstance(part.module, torch.nn.Linear):
            n_out = part.module.out_features if part.rows is None else part.rows[1] - part.rows[0]
            found.append(Target(part.name, part.component, part.module.in_features, n_out))
            continue
        lay = fused.layout(part.module, part.module_name)  # the user error for a layout tinkerq cannot adapt
        n_in, n_out = lay.projections()[part.name.rsplit(".", 1)[1]]
        found.append(Target(part.name, part.component, n_in, n_out, lay.num_experts))
    seen = {p.component for p in candidates}
    wanted = {"attn": "attention, linear-attention or Mamba projections", "mlp": "MLP or expert projections",
              "unembed": "a Linear output projection"}
    for component, what in wanted.items():
        if getattr(config, f"train_{component}") and component not in seen:
            raise ValidationError(f"train_{component}=True, but this model has no {what} tinkerq can adapt "
                                  f"(found: {_summary(candidates)}); set train_{component}=False")
    if not found:
        raise ValidationError(f"this LoRA config adapts nothing in this model (found: {_summary(candidates)}): "
                              f"set at least one of train_attn, train_mlp, train_unembed to True")
    for t in found:
        if config.rank > min(t.in_features, t.out_features):
            raise ValidationError(f"LoRA rank {config.rank} is larger than {t.name} ({t.in_features} -> "
                                  f"{t.out_features}) allows: use rank <= {min(t.in_features, t.out_features)}")
    return found


def _summary(candidates: list[Part]) -> str:
    counts: dict[str, int] = {}
    for part in candidates:
        counts[part.component] = counts.get(part.component, 0) + 1
    return ", ".join(f"{n} {c}" for c, n in counts.items()) or "no Linear or expert modules"


def parameters_per_rank(targets: list[Target]) -> dict[str, int]:
    """LoRA parameters per unit of rank, by component."""
    counts = {"attn": 0, "mlp": 0, "unembed": 0}
    for t in targets:
        counts[t.component] += t.parameters_per_rank()
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
            a_shape, b_shape = t.shapes(config.rank)
            a = torch.empty(a_shape)
            for piece in a.view(-1, config.rank, t.in_features):  # each expert's (r, in) drawn as a dense A
                torch.nn.init.kaiming_uniform_(piece, a=math.sqrt(5), generator=generator)
            key = adapter_key(t.name)
            self.a[key] = torch.nn.Parameter(a.to(device))
            self.b[key] = torch.nn.Parameter(torch.zeros(b_shape, device=device))

    def pair(self, target: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = adapter_key(target)
        return (self.a[key], self.b[key]) if key in self.a else None

    def named_pairs(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(PEFT name, parameter) for every A and B, in target order: what the engine, the checkpoints and the
        PEFT export all use (``base_model.model.`` + this name is PEFT's key)."""
        out = []
        for t in self.targets:
            key = adapter_key(t.name)
            out += [(f"{t.name}.lora_A.weight", self.a[key]), (f"{t.name}.lora_B.weight", self.b[key])]
        return out

    def frozen(self) -> FrozenAdapter:
        """A detached copy of the current weights (for sampling), unaffected by later training."""
        return FrozenAdapter({t.name: (self.a[key].detach().clone(), self.b[key].detach().clone())
                              for t in self.targets for key in [adapter_key(t.name)]}, self.scaling)

    def state_bytes(self) -> int:
        """What the session keeps: weights, pending gradients and AdamW's two moments (float32 each)."""
        def local(p: torch.Tensor) -> int:  # per-expert factors sharded with their experts: this rank's slice
            return p.to_local().numel() if isinstance(p, DTensor) else p.numel()

        return LORA_BYTES_PER_PARAMETER * sum(local(p) for p in self.parameters())


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


def adapter_key(name: str) -> str:
    return name.replace(".", "__")  # ParameterDict keys cannot hold dots
