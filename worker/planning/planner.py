"""What fits where: ``tinkerq plan`` (docs/planning.md).

For a model (a Hugging Face model directory, a config.json, or a name from the lineup shipped in
``worker/planning/lineup/``) and a kind of device, it says how many shards a full-parameter session and a LoRA group
need,
the memory of each shard part by part, and how many LoRA tenants fit. The model is built from its config on the
meta device (``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``): every parameter is counted
exactly, module by module, and no weight is read or allocated.

Every figure comes from worker/memory/estimates.py, the estimates the worker's admission uses
(worker/memory/); this module only picks the shard counts and lays the figures out.

The lineup's config.json files are written by hand from the published configs or model cards (hyperparameters
only; nothing is downloaded; docs/planning.md#the-lineup names the source of each). Kimi-K2's card says
``model_type: kimi_k2`` with custom code: its architecture is DeepSeek-V3's, so its file says ``deepseek_v3``, which
transformers knows. A vision-language checkpoint (Kimi-K2.6, Inkling, Qwen3.5) is planned as its text model.

A plan never names a layout the worker refuses for the model (:func:`refusal`: worker/loading/support.py per class,
and a shard group of a vision-language checkpoint whose text model its ranks cannot stream, as load_skeleton refuses
it): such a layout is planned on one process, and where none the worker serves fits, the plan says so and why.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tinkerq import types
from tinkerq.errors import UserError
from tinkerq.settings import Settings
from tinkerq.worker.loading.dtypes import resolve_dtype
from tinkerq.worker.memory.estimates import (
    ModelShape,
    activation_bytes,
    gather_bytes,
    lora_base_bytes,
    lora_snapshot_bytes,
    lora_state_bytes,
    rank_lengths,
    request_bytes,
    session_state_parts,
    shards_needed,
    snapshot_bytes,
    streamed_load_bytes,
    training_working_bytes,
)

LINEUP_DIR = Path(__file__).resolve().parent / "lineup"
# The models Tinker users train today (tinker-cookbook 0.6.1's list; docs/planning.md#the-lineup names each config's
# source), in the order of the lineup's tables: dense, then mixtures of experts, small to large.
LINEUP = ("qwen3.6-27b", "gpt-oss-20b", "nemotron-3-nano-30b-a3b", "qwen3.6-35b-a3b", "gpt-oss-120b",
          "nemotron-3-super-120b-a12b", "inkling-small", "qwen3.5-397b-a17b", "inkling-2-small", "deepseek-v3.1",
          "glm-5.3", "inkling", "kimi-k2.6")
# The earlier lineup's models, not in today's (Llama left Tinker's list, Qwen3-30B-A3B was retired on 2026-06-12;
# Qwen3.5/3.6 and Kimi-K2.6 stand for Qwen3 and Kimi-K2-Thinking): still planned by name (--model llama-3.1-8b),
# not by --lineup; the tests and docs/planning.md use them.
EARLIER = ("llama-3.1-8b", "qwen3-8b", "llama-3.3-70b", "qwen3-30b-a3b", "qwen3-235b-a22b", "kimi-k2-thinking")
GiB = 1 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_SHARDS = 4096
# What a plan's devices are: GPUs, whose activations are counted as the tensors hold them (no CPU heap to fragment;
# worker/memory/estimates.py activation_bytes).
DEVICE_TYPE = "cuda"


class PlanError(UserError):
    """The planner cannot answer: no config, an architecture transformers does not know, a bad number."""


# -- the model, from its config alone ----------------------------------------------------------------------------


def read_config(spec: str) -> tuple[str, dict[str, Any]]:
    """(a name for it, its config.json as a dict) for a lineup name, a model directory or a config.json file."""
    path = Path(spec)
    if spec in LINEUP + EARLIER or (not path.exists() and (LINEUP_DIR / spec / "config.json").is_file()):
        path, name = LINEUP_DIR / spec / "config.json", spec
    elif path.is_dir():
        name, path = path.name, path / "config.json"
        if not path.is_file():
            raise PlanError(f"{spec} has no config.json: pass a Hugging Face model directory, a config.json, or "
                            f"a lineup name ({', '.join(LINEUP)})")
    elif path.is_file():
        name = path.parent.name if path.name == "config.json" else path.stem
    else:
        raise PlanError(f"--model {spec}: no such directory or file, and not a lineup name "
                        f"({', '.join(LINEUP)})")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read {path} as JSON: {exc}") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise PlanError(f"{path} is not a model config: it has no model_type")
    return name, config


def hf_config(config: dict[str, Any]) -> Any:
    """The transformers config of ``config`` (a config.json's dict), as a worker's ``AutoConfig`` reads the file: a
    vision-language checkpoint's top-level config, its ``text_config`` inside; without a ``quantization_config``."""
    import transformers
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
    if isinstance(fields.get("text_config"), dict):  # a multimodal config may keep it with its text model
        fields["text_config"] = {k: v for k, v in fields["text_config"].items() if k != "quantization_config"}
    model_type = fields.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as exc:
        raise PlanError(f"unknown architecture {model_type!r}: transformers {transformers.__version__} has no "
                        f"config for it ({str(exc).splitlines()[0]})") from None


def meta_model(config: dict[str, Any], dtype: str = "bfloat16") -> torch.nn.Module:
    """The causal LM of ``config`` on the meta device, its parameters in ``dtype`` (no memory, no weights).

    A ``quantization_config`` is left out: the model is planned as a worker serves it, dequantized to ``dtype``
    on load (:func:`quantized_checkpoint` says what the checkpoint itself holds)."""
    import transformers
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

    model_type = config["model_type"]
    model_config = hf_config(config)
    # A vision-language (or audio) checkpoint whose top-level config has no causal LM of its own (Kimi-K2.6's
    # kimi_k25, Inkling's inkling_mm_model, Inkling-2's inkling2): the text model is planned, its towers left out.
    if type(model_config) not in MODEL_FOR_CAUSAL_LM_MAPPING and hasattr(model_config, "get_text_config"):
        text = model_config.get_text_config()
        if text is not model_config and type(text) in MODEL_FOR_CAUSAL_LM_MAPPING:
            model_config = text
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(model_config, dtype=DTYPES[dtype])
    except (ValueError, KeyError, TypeError) as exc:
        raise PlanError(f"transformers {transformers.__version__} cannot build a causal LM of "
                        f"{model_type!r} from this config: {str(exc).splitlines()[0]}") from None


@functools.lru_cache(maxsize=16)
def _load(spec: str, dtype: str) -> tuple[str, dict[str, Any], torch.nn.Module]:
    """(name, config, meta model) of ``spec``, kept for the next plan of the same model (other device sizes)."""
    name, config = read_config(spec)
    return name, config, meta_model(config, dtype)


# -- what a worker serves of it (worker/loading/support.py) -------------------------------------------------------


def refusal(config: dict[str, Any], model: torch.nn.Module, path: str) -> str | None:
    """The user error a worker gives for ``path`` (one of worker/loading/support.py's PATHS) of this model, or None
    where it serves it. The class is the one a worker loads (``model``: :func:`meta_model` builds a vision-language
    checkpoint's text model, as worker/loading/models.py load_causal_lm does). A shard group, expert-parallel or
    not, is refused besides where worker/loading/models.py load_skeleton refuses the checkpoint itself: one whose
    text model its ranks cannot stream (its ``text_model_class``: Kimi-K2.5/2.6's ``kimi_k25``, Inkling's
    ``inkling_mm_model``, Inkling-2's ``inkling2``); the line is load_skeleton's (tests/test_planner.py checks they
    are the same)."""
    from tinkerq.worker.loading import support
    from tinkerq.worker.loading.models import text_model_class

    if path in ("shard_group", "expert_parallel"):
        top = hf_config(config)
        if text_model_class(top) is not None:
            return (f"{type(top).__name__} is a vision-language checkpoint whose text model a shard group cannot "
                    f"stream from its files yet; serve it on a single worker (without --shards)")
    return support.message(type(model).__name__, path)


def group_refusal(config: dict[str, Any], model: torch.nn.Module, expert_parallel: bool) -> str | None:
    """Why a worker refuses a shard group of this model (with --expert-parallel where ``expert_parallel``), or None
    where it serves one: the planner plans such a layout on one process only."""
    return refusal(config, model, "shard_group") or (
        refusal(config, model, "expert_parallel") if expert_parallel else None)


def lora_targets(model: torch.nn.Module) -> tuple[types.LoraConfig, str]:
    """The rank-1 LoRA config a plan counts: Tinker's defaults (attention, MLP, output) where tinkerq adapts them;
    where it refuses the MLP (routed experts in a layout it cannot adapt: DBRX's, JetMoe's, LongCat-Flash's;
    docs/families.md) the adapter a user can create, with a note saying why ("" otherwise): train_mlp=False, and
    train_attn=False too where the model has no attention tinkerq adapts (JetMoe's and LongCat-Flash's, whose
    find_targets would refuse train_attn next)."""
    from tinkerq.errors import ValidationError
    from tinkerq.worker.lora.adapter import adaptable, find_targets

    try:
        find_targets(model, types.LoraConfig(rank=1))
        return types.LoraConfig(rank=1), ""
    except ValidationError as exc:
        if "set train_mlp=False" not in str(exc):
            raise
        why = str(exc).split(":")[0].removeprefix("[user error] ")
    attn = any(part.component == "attn" for part in adaptable(model))
    config = types.LoraConfig(rank=1, train_mlp=False, train_attn=attn)
    find_targets(model, config)
    planned = "train_mlp=False (attention and output only)" if attn else \
        "train_mlp=False and train_attn=False (the output projection only: no attention tinkerq adapts)"
    return config, f"LoRA planned with {planned}: tinkerq refuses this model's MLP ({why})"


def lora_parameters(model: torch.nn.Module, rank: int) -> int:
    """A rank-``rank`` adapter's parameters on every target (Tinker's defaults: attention, MLP, output; without
    the MLP where tinkerq refuses it: :func:`lora_targets`)."""
    from tinkerq.worker.lora.adapter import find_targets

    return rank * sum(t.parameters_per_rank() for t in find_targets(model, lora_targets(model)[0]))


def lora_expert_parameters(model: torch.nn.Module, rank: int) -> int:
    """Of :func:`lora_parameters`, the per-expert factors': split with the experts on an expert-parallel group."""
    from tinkerq.worker.lora.adapter import find_targets

    return rank * sum(t.expert_parameters_per_rank() for t in find_targets(model, lora_targets(model)[0]))


# -- quantized checkpoints (docs/planning.md#quantized-checkpoints) ------------------------------------------------


@dataclass(frozen=True)
class Quantized:
    method: str  # the config's quant_method
    what: str  # which tensors the checkpoint keeps quantized
    bits: float  # stored bits per quantized parameter, scales included
    parameters: int  # how many parameters are quantized
    checkpoint_bytes: int  # the whole model as the checkpoint stores it (the rest in the planned dtype)
    dequantized_bytes: int  # the whole model dequantized on load (what the planner plans by default)
    layer_bytes: int = 0  # the largest decoder layer's quantized weights dequantized: a kept base's working set
    expert_parameters: int = 0  # of ``parameters``, the routed experts' (what an expert-parallel group keeps)
    expert_layer_bytes: int = 0  # the largest layer's quantized routed experts, dequantized


def _routed_expert(name: str, p: torch.Tensor) -> bool:
    # shared_experts are "_experts."; the experts' biases (2-D: one row per expert) stay unquantized
    return ".experts." in name and p.dim() >= 2 and not name.endswith("bias")


def _layer_matrix(name: str, p: torch.Tensor) -> bool:
    return (".layers." in name and p.dim() >= 2 and not name.endswith("bias")
            and not name.endswith("mlp.gate.weight"))  # not the router


# method: (what, predicate, bits per parameter with scales). MXFP4: 4-bit values + one 8-bit (E8M0) scale per 32.
# FP8 (DeepSeek): 1 byte + one float32 scale per 128 x 128 block. INT4 (compressed-tensors pack-quantized,
# Kimi-K2-Thinking): 4 bits + one bfloat16 scale per group of 32.
_QUANTIZED: dict[str, tuple[str, Callable[[str, torch.Tensor], bool], float]] = {
    "mxfp4": ("routed experts' matrices", _routed_expert, 4 + 8 / 32),
    "fp8": ("every matrix in the decoder layers but the router", _layer_matrix, 8 + 32 / (128 * 128)),
    "compressed-tensors": ("routed experts' matrices", _routed_expert, 4 + 16 / 32),
}


def quantized_checkpoint(config: dict[str, Any], model: torch.nn.Module) -> Quantized | None:
    """What a quantized checkpoint stores, against the dequantized model the worker holds; None if not quantized."""
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not isinstance(quant, dict):
        return None
    method = str(quant.get("quant_method", "?"))
    what, chosen, bits = _QUANTIZED.get(method, ("unknown tensors (not counted)", lambda n, p: False, 0.0))
    if method == "compressed-tensors":  # the group size and bits are in the config
        groups: dict[str, Any] = quant.get("config_groups") or {}
        first: dict[str, Any] = next(iter(groups.values()), {})
        weights: dict[str, Any] = first.get("weights") or {}
        bits = float(weights.get("num_bits", 4)) + 16 / float(weights.get("group_size", 32))
    quantized = whole = experts = 0
    per_layer: dict[str, int] = {}
    experts_per_layer: dict[str, int] = {}
    for name, p in model.named_parameters():
        whole += p.numel() * p.element_size()
        if chosen(name, p):
            quantized += p.numel()
            layer = re.search(r"\.layers\.\d+\.", name)
            key = layer.group(0) if layer else name
            per_layer[key] = per_layer.get(key, 0) + p.numel() * p.element_size()
            if _routed_expert(name, p):
                experts += p.numel()
                experts_per_layer[key] = experts_per_layer.get(key, 0) + p.numel() * p.element_size()
    size = next(model.parameters()).element_size()
    return Quantized(method, what, bits, quantized, whole - quantized * size + math.ceil(quantized * bits / 8), whole,
                     max(per_layer.values(), default=0), experts, max(experts_per_layer.values(), default=0))


# A kept base's working set per layer, in units of that layer's dequantized weights: the weights built for the
# forward (or rebuilt in the backward) and the dequantization's temporaries beside them (docs/quantized.md: 70-76
# MiB peak for 24 MiB layers on the CPU, activations included).
KEPT_LAYER_FACTOR = 2


def kept_lora_parts(shape: ModelShape, q: Quantized, workload: Workload, chunk: int,
                    checkpointing: bool = False) -> dict[str, int]:
    """A LoRA worker whose base is kept quantized (--quantized-base keep, one process): the base as stored, one
    layer dequantized at a time, and the batch's activations."""
    lengths = workload.lengths()
    return {
        "frozen base as stored (shared)": q.checkpoint_bytes + shape.buffer_bytes,
        "one layer dequantized (working)": KEPT_LAYER_FACTOR * q.layer_bytes,
        "activations": activation_bytes(shape, lengths, microbatch_tokens=workload.microbatch_tokens,
                                        device_type=DEVICE_TYPE, backward=True, chunk_tokens=chunk,
                                        checkpointing=checkpointing)
        + request_bytes(lengths),
    }


def kept_group_lora_parts(shape: ModelShape, q: Quantized, shards: int, workload: Workload, chunk: int,
                          checkpointing: bool = False) -> dict[str, int]:
    """An expert-parallel LoRA group whose routed experts are kept as stored (--expert-parallel --quantized-base
    keep, worker/sharding/experts.py): each rank holds its E/N experts' stored parts and 1/N of the rest
    dequantized, gathers layers without their experts, dequantizes its experts of one layer at a time, and plans a
    rank's experts for every rank's rows."""
    lengths = rank_lengths(workload.lengths(), shards)
    size = shape.param_bytes // max(1, shape.parameters)
    rest = shape.param_bytes - q.expert_parameters * size  # attention, dense layers, shared experts: dequantized
    stored = math.ceil(q.expert_parameters * q.bits / 8)
    return {
        "frozen base, experts as stored (shared)": (rest + stored) // shards + shape.buffer_bytes,
        "FSDP gather room": gather_bytes(shape, shards, weight_grads=False, expert_parallel=True),
        "a layer's experts dequantized (working)": KEPT_LAYER_FACTOR * q.expert_layer_bytes // shards,
        "activations": activation_bytes(shape, lengths, microbatch_tokens=workload.microbatch_tokens,
                                        device_type=DEVICE_TYPE, backward=True, chunk_tokens=chunk,
                                        checkpointing=checkpointing,
                                        expert_ranks=shards, request_tokens=workload.batch_tokens)
        + request_bytes(lengths),
    }


# -- the plan ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    batch_tokens: int = 8192  # one forward_backward's tokens, split over the ranks
    seq_len: int = 2048  # the length of its datums
    microbatch_tokens: int = Settings.microbatch_tokens  # TINKERQ_MICROBATCH_TOKENS
    lora_rank: int = 32

    def lengths(self) -> list[int]:
        full, rest = divmod(self.batch_tokens, self.seq_len)
        return [self.seq_len] * full + ([rest] if rest else [])


@dataclass
class KindPlan:
    kind: str  # "full" | "lora"
    shards: int | None  # the fewest that fit (None: no count up to MAX_SHARDS does, or none the worker serves)
    fits: bool  # within --devices
    at: int  # the shard count the parts are given for: ``shards``, else --devices
    parts: dict[str, int]  # per shard, at ``at``
    total: int  # per shard: the sum of parts (LoRA: with one tenant)
    host_bytes: int  # host memory per rank besides the device's (a sharded rank streams its shards from the files)
    adapter_bytes: int = 0  # LoRA: one tenant's adapter, on every shard
    tenants: int = 0  # LoRA: how many tenants fit at ``at``
    tenants_all_devices: int = 0  # LoRA: with the base sharded over all --devices
    snapshot_bytes: int = 0  # LoRA: one sampler snapshot of a tenant (its adapter frozen, float32, whole on rank 0)
    sampling_tenants: int = 0  # LoRA: tenants that fit at ``at`` each with one sampler snapshot (RL)
    sampling_tenants_all_devices: int = 0  # LoRA: the same over all --devices
    longest_datum: int = 0  # tokens of the longest datum whose activations fit on --devices shards (0: none)
    checkpointing: bool = False  # the activations at ``at`` are planned with each decoder layer checkpointed
    flags: str = ""  # how to start the group planned: `tinkerq worker` flags (--shards, --expert-parallel, ...)
    # The worker's refusal of this kind of session on this model (worker/loading/support.py "full" / "lora"): not
    # served in any layout (shards None, no tenants); "" where served.
    refused: str = ""
    # The worker's refusal of a shard group of this layout (:func:`group_refusal`): planned on one process only
    # (shards 1 or None, "all devices" figures on one); "" where a group is served.
    group_refused: str = ""


@dataclass
class Plan:
    model: str
    architecture: str
    dtype: str
    parameters: int
    param_bytes: int
    devices: int
    device_bytes: int
    usable_bytes: int
    workload: Workload
    lora_parameters: int
    full: KindPlan
    lora: KindPlan
    quantized: Quantized | None = None
    quantized_base: str = "dequantize"  # "keep": the LoRA column plans the base as stored (kept_lora_parts)
    max_lora_sessions: int = Settings.max_lora_sessions
    activation_checkpointing: str = "auto"  # the worker's TINKERQ_ACTIVATION_CHECKPOINTING planned for
    expert_parallel: bool = False  # the LoRA group planned with its routed experts split by expert (a MoE model)
    notes: list[str] = field(default_factory=list)
    chosen: bool = False  # the layouts were chosen by the planner (expert parallelism / a kept base: "auto")


def full_parts(shape: ModelShape, shards: int, workload: Workload, chunk: int,
               checkpointing: bool = False, expert_parallel: bool = False) -> dict[str, int]:
    """A full session's memory on each of ``shards`` devices, part by part. ``expert_parallel``: a MoE layer is
    gathered without its routed experts, and a rank's experts may get every rank's rows (worker/sharding/experts.py)."""
    lengths = rank_lengths(workload.lengths(), shards)
    ep = expert_parallel and shards > 1
    return {
        # One worker holds the base model on its device beside the session's copy; a shard group keeps it on the
        # CPU (docs/sharding.md#memory).
        "base model (worker's copy)": snapshot_bytes(shape) if shards == 1 else 0,
        **{f"session {k}": v for k, v in session_state_parts(shape, shards).items()},
        "forward_backward working": training_working_bytes(shape, shards),
        "FSDP gather room": gather_bytes(shape, shards, weight_grads=True, expert_parallel=ep),
        "activations": activation_bytes(shape, lengths, microbatch_tokens=workload.microbatch_tokens,
                                        device_type=DEVICE_TYPE, backward=True, chunk_tokens=chunk,
                                        checkpointing=checkpointing,
                                        expert_ranks=shards if ep else 1, request_tokens=workload.batch_tokens)
        + request_bytes(lengths),
    }


def lora_parts(shape: ModelShape, shards: int, workload: Workload, chunk: int,
               checkpointing: bool = False, expert_parallel: bool = False) -> dict[str, int]:
    """A LoRA group's memory on each of ``shards`` devices, without its tenants' adapters. ``expert_parallel``: as
    for :func:`full_parts` (the frozen base's MoE layers gathered without their routed experts; a rank's experts
    planned for every rank's rows)."""
    lengths = rank_lengths(workload.lengths(), shards)
    ep = expert_parallel and shards > 1
    return {
        "frozen base (shared)": lora_base_bytes(shape, shards),
        "FSDP gather room": gather_bytes(shape, shards, weight_grads=False, expert_parallel=ep),
        "activations": activation_bytes(shape, lengths, microbatch_tokens=workload.microbatch_tokens,
                                        device_type=DEVICE_TYPE, backward=True, chunk_tokens=chunk,
                                        checkpointing=checkpointing,
                                        expert_ranks=shards if ep else 1, request_tokens=workload.batch_tokens)
        + request_bytes(lengths),
    }


def _worker_flags(shards: int | None, expert_parallel: bool, kept: bool) -> str:
    """The `tinkerq worker` flags of a group of the ``shards`` needed planned so (one process: no --shards), also
    where they are more than --devices."""
    if shards is None:
        return "(never fits)"
    flags = [f"--shards {shards}"] if shards > 1 else []
    if expert_parallel and shards > 1:
        flags.append("--expert-parallel")
    if kept:
        flags.append("--quantized-base keep")
    return " ".join(flags) or "(one process, no flags)"


def _served(kind: KindPlan, refused: str | None, grouped: str | None) -> KindPlan:
    """``kind`` as the worker serves it: with its shard group's refusal (it was planned on one process: not served
    where one device is too small), or, where the worker refuses this kind of session on the model, not served at
    all (no shards, tenants or datums; its figures stay, for what they would be)."""
    kind = replace(kind, group_refused=grouped or "")
    if refused:
        return replace(kind, shards=None, fits=False, tenants=0, tenants_all_devices=0, sampling_tenants=0,
                       sampling_tenants_all_devices=0, longest_datum=0, flags="(not served)", refused=refused)
    if grouped and kind.shards is None:
        return replace(kind, flags="(not served: one device too small)")
    return kind


def _fewest_devices(kind: KindPlan) -> tuple:
    """The order in which the planner prefers one layout's plan of a kind over another's: it fits, on the fewest
    shards, with the most tenants (LoRA), then the longest datum; among layouts the worker serves nowhere here (a
    refused group, one device too small), the one needing the least of one device."""
    return (not kind.fits, kind.shards if kind.shards is not None else MAX_SHARDS + 1, -kind.tenants,
            -kind.tenants_all_devices, -kind.longest_datum, kind.total if kind.shards is None else 0)


def plan(spec: str, *, devices: int, device_gb: float, dtype: str = "auto", headroom_gb: float = 2.0,
         workload: Workload | None = None, quantized_base: str = "auto",
         activation_checkpointing: str = "auto", expert_parallel: bool | str = "auto",
         at_shards: int | None = None) -> Plan:
    """The plan of ``spec`` (a lineup name, a model directory or a config.json) on ``devices`` devices of
    ``device_gb`` GiB each, ``headroom_gb`` of which stay free (CUDA context, allocator slack, NCCL buffers).
    ``quantized_base="keep"``: a quantized checkpoint's LoRA base kept as stored, on one device (a kept base is
    served by one process; a group keeps its routed experts under expert parallelism); full sessions are still
    planned dequantized (they need float weights). ``"dequantize"``: dequantized on load.
    ``activation_checkpointing``: the worker's setting; "auto" plans a batch's activations checkpointed where they
    would not fit otherwise, as the worker's admission decides (worker/memory/ admit_batch).
    ``expert_parallel`` (True/"on", False/"off"): a MoE model's group with --expert-parallel: full sessions and the
    LoRA base split by expert, each tenant's per-expert factors with their experts.
    "auto" (the defaults of both): every layout the model allows is planned (a MoE model with and without expert
    parallelism, a quantized checkpoint's LoRA base dequantized and kept), and each column takes the one needing the
    fewest devices (then: the most tenants, the longest datum); its ``flags`` say how to start that group.
    Only layouts the worker serves are planned so: one whose shard group it refuses for this model (:func:`refusal`:
    worker/loading/support.py's table for the class it loads, and a vision-language checkpoint whose text model a
    shard group cannot stream) is planned on one process, and a kind of session it refuses is not served; the plan's
    notes give each refusal's line, and say so where no layout it serves fits (never a refused group's flags).
    ``at_shards``: the parts given at that many shards instead of at the fewest that fit (the CLI's --at-shards)."""
    ep = expert_parallel if isinstance(expert_parallel, str) else ("on" if expert_parallel else "off")
    if ep not in ("auto", "on", "off"):
        raise PlanError(f"--expert-parallel {expert_parallel}: auto, on or off")
    if quantized_base not in ("auto", "dequantize", "keep"):
        raise PlanError(f"--quantized-base {quantized_base}: auto, dequantize or keep")
    if at_shards is not None and not 0 < at_shards <= MAX_SHARDS:
        raise PlanError(f"--at-shards {at_shards}: between 1 and {MAX_SHARDS}")
    kwargs = dict(devices=devices, device_gb=device_gb, dtype=dtype, headroom_gb=headroom_gb, workload=workload,
                  activation_checkpointing=activation_checkpointing, at_shards=at_shards)
    options, refusals = [], []
    for split in ((False, True) if ep == "auto" else (ep == "on",)):
        for base in (("dequantize", "keep") if quantized_base == "auto" else (quantized_base,)):
            p = _plan(spec, quantized_base=base, expert_parallel=split, **kwargs)  # type: ignore[arg-type]
            # Each refusal that shaped a layout is said, whichever layout is shown (an expert-parallel group refused
            # and planned on one process is the same plan as the one without: skipped below).
            refusals += [k.refused or k.group_refused for k in (p.full, p.lora)]
            if (split and not p.expert_parallel and ep == "auto") or (
                    base == "keep" and p.quantized is None and quantized_base == "auto"):
                continue  # a dense model split by expert, or an unquantized one kept: the same plan again
            options.append(p)
    full = min(options, key=lambda p: _fewest_devices(p.full)).full
    lora = min(options, key=lambda p: _fewest_devices(p.lora))
    notes = [*lora.notes, *refusals, _not_served(lora.devices, lora.device_bytes, lora.usable_bytes, full, lora.lora)]
    return replace(lora, full=full, chosen=len(options) > 1, notes=[n for n in dict.fromkeys(notes) if n])


def _not_served(devices: int, device_bytes: int, usable: int, *kinds: KindPlan) -> str:
    """The plan's line for columns the worker serves on no layout here: their shard groups refused and one device
    too small for a single worker (what that worker would need of its device); "" where there are none."""
    needs = [f"{'a full session' if k.kind == 'full' else 'LoRA with one tenant'} {_size(k.total)}"
             + (" (its base kept as stored: --quantized-base keep)" if "frozen base as stored (shared)" in k.parts
                else "")
             for k in kinds if k.group_refused and k.shards is None and not k.refused]
    if not needs:
        return ""
    return (f"not served on {devices} x {_size(device_bytes)}: the worker refuses the shard group it would need, "
            f"and a single worker needs more than one device's {_size(usable)} usable ({'; '.join(needs)})")


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:,.1f} GiB" if nbytes >= GiB else f"{nbytes / (1 << 20):,.1f} MiB"


def _plan(spec: str, *, devices: int, device_gb: float, dtype: str, headroom_gb: float, workload: Workload | None,
          quantized_base: str, activation_checkpointing: str, expert_parallel: bool, at_shards: int | None) -> Plan:
    """The plan of one layout (see :func:`plan`)."""
    from tinkerq.worker.training.logprobs import chunk_tokens

    workload = workload or Workload()
    for what, value in (("--devices", devices), ("--device-memory", device_gb), ("--batch-tokens",
                        workload.batch_tokens), ("--seq-len", workload.seq_len),
                        ("--microbatch-tokens", workload.microbatch_tokens), ("--lora-rank", workload.lora_rank)):
        if not value > 0:
            raise PlanError(f"{what} must be positive, not {value}")
    if not 0 <= headroom_gb < device_gb:
        raise PlanError(f"--headroom {headroom_gb} must be at least 0 and less than --device-memory {device_gb}")
    if activation_checkpointing not in ("auto", "on", "off"):
        raise PlanError(f"--activation-checkpointing {activation_checkpointing}: auto, on or off")
    if dtype != "auto" and dtype not in DTYPES:
        raise PlanError(f"--dtype {dtype}: auto or one of {', '.join(DTYPES)}")
    # "auto" as a worker resolves it on the GPU planned for (one with bfloat16): the planner and the worker agree.
    dtype = resolve_dtype(dtype, read_config(spec)[1], "cuda", bf16_supported=True)
    name, config, model = _load(spec, dtype)
    shape = ModelShape.of(model)
    chunk = chunk_tokens(shape.vocab)
    device_bytes = int(device_gb * GiB)
    usable = device_bytes - int(headroom_gb * GiB)

    def checkpointed(parts: Callable[[bool], dict[str, int]], extra: int = 0) -> tuple[dict[str, int], bool]:
        """The parts, and whether a batch's layers are checkpointed in them: always (on), never (off), or when
        the plain parts (with ``extra`` more) do not fit (auto)."""
        if activation_checkpointing != "auto":
            on = activation_checkpointing == "on"
            return parts(on), on
        plain = parts(False)
        if sum(plain.values()) + extra <= usable:
            return plain, False
        return parts(True), True

    ep = expert_parallel and shape.top_k > 0  # a dense model: nothing to split by expert
    # A layout whose shard group the worker refuses is planned on one process (nothing split): the fewest shards
    # are 1 or none, and the "all devices" figures are on one.
    grouped = group_refusal(config, model, ep)
    if grouped:
        ep, at_shards = False, None
    span = 1 if grouped else devices  # the most devices a group of this layout spans
    limit = 1 if grouped else MAX_SHARDS

    def longest_datum(fixed: int, expert_ranks: int = 1) -> int:
        """The most tokens one datum may have for its activations to fit beside ``fixed`` bytes (a datum is never
        split: it runs alone in a micro-batch when longer than the budget), checkpointed unless that is off."""
        on = activation_checkpointing != "off"
        lo, hi = 0, 1 << 22
        while lo < hi:
            mid = (lo + hi + 1) // 2
            acts = activation_bytes(shape, [mid], microbatch_tokens=workload.microbatch_tokens, backward=True,
                                    device_type=DEVICE_TYPE,
                                    chunk_tokens=chunk, checkpointing=on, expert_ranks=expert_ranks,
                                    request_tokens=max(mid, workload.batch_tokens)) + request_bytes([mid])
            lo, hi = (mid, hi) if fixed + acts <= usable else (lo, mid - 1)
        return lo

    def full_at(n: int) -> tuple[dict[str, int], bool]:
        return checkpointed(lambda on: full_parts(shape, n, workload, chunk, on, expert_parallel=ep))

    n_full = shards_needed(lambda n: sum(full_at(n)[0].values()), usable, limit=limit)
    at = at_shards or (n_full if n_full is not None and n_full <= devices else span)
    parts, on = full_at(at)
    every = full_parts(shape, span, workload, chunk, expert_parallel=ep)
    full = KindPlan("full", n_full, n_full is not None and n_full <= devices, at, parts, sum(parts.values()),
                    host_bytes=streamed_load_bytes(shape) if at > 1 else 0,
                    longest_datum=longest_datum(sum(every.values()) - every["activations"],
                                                span if ep and span > 1 else 1), checkpointing=on,
                    flags=_worker_flags(n_full, ep, kept=False))

    adapter_parameters = lora_parameters(model, workload.lora_rank)
    expert_parameters = lora_expert_parameters(model, workload.lora_rank) if ep else 0

    def adapter_at(n: int) -> int:
        """One tenant's adapter on each of ``n`` ranks (its per-expert factors split with the experts under EP)."""
        return max(1, lora_state_bytes(adapter_parameters, expert_parameters=expert_parameters, expert_ranks=n))

    def lora_at(n: int) -> tuple[dict[str, int], bool]:
        return checkpointed(lambda on: lora_parts(shape, n, workload, chunk, on, expert_parallel=ep), adapter_at(n))

    # A tenant's sampler snapshot (save_weights_and_get_sampling_client): its adapter frozen, float32, whole on
    # rank 0 (followers of an expert-parallel group keep slices of its expert factors besides; worker/memory/
    # admit_lora_snapshot admits it when it is made).
    snapshot = lora_snapshot_bytes(adapter_parameters)

    def tenants(n: int, sampling: bool = False) -> int:
        """Adapters that fit beside the base and a batch; the batch checkpointed unless that is off (under auto the
        worker checkpoints a batch once the tenants leave too little room for it plainly). ``sampling``: each
        tenant with one sampler snapshot too (RL)."""
        parts = lora_parts(shape, n, workload, chunk, activation_checkpointing != "off", expert_parallel=ep)
        return max(0, (usable - sum(parts.values())) // (adapter_at(n) + (snapshot if sampling else 0)))

    n_lora = shards_needed(lambda n: sum(lora_at(n)[0].values()) + adapter_at(n), usable, limit=limit)
    at = at_shards or (n_lora if n_lora is not None and n_lora <= devices else span)
    parts, on = lora_at(at)
    every = lora_parts(shape, span, workload, chunk, expert_parallel=ep)
    adapter = adapter_at(at)
    lora = KindPlan("lora", n_lora, n_lora is not None and n_lora <= devices, at, parts, sum(parts.values()) + adapter,
                    host_bytes=streamed_load_bytes(shape) if at > 1 else 0, adapter_bytes=adapter,
                    tenants=tenants(at),
                    tenants_all_devices=tenants(span), snapshot_bytes=snapshot,
                    sampling_tenants=tenants(at, sampling=True),
                    sampling_tenants_all_devices=tenants(span, sampling=True),
                    longest_datum=longest_datum(sum(every.values()) + adapter_at(span) - every["activations"],
                                                span if ep and span > 1 else 1),
                    checkpointing=on, flags=_worker_flags(n_lora, ep, kept=False))
    quantized = quantized_checkpoint(config, model)
    if quantized_base == "keep" and quantized is not None and ep and quantized.expert_parameters:
        # An expert-parallel group keeps its routed experts as stored, each rank its own (one process: n = 1).
        q = quantized

        def kept_parts(n: int, c: bool) -> dict[str, int]:
            return kept_lora_parts(shape, q, workload, chunk, c) if n == 1 else \
                kept_group_lora_parts(shape, q, n, workload, chunk, c)

        def kept_at(n: int) -> tuple[dict[str, int], bool]:
            return checkpointed(lambda c: kept_parts(n, c), adapter_at(n))

        def kept_tenants(n: int, sampling: bool = False) -> int:
            return max(0, (usable - sum(kept_parts(n, activation_checkpointing != "off").values()))
                       // (adapter_at(n) + (snapshot if sampling else 0)))

        n_kept = shards_needed(lambda n: sum(kept_at(n)[0].values()) + adapter_at(n), usable, limit=MAX_SHARDS)
        at = at_shards or (n_kept if n_kept is not None and n_kept <= devices else devices)
        parts, on = kept_at(at)
        adapter = adapter_at(at)
        every = kept_parts(devices, False)
        lora = KindPlan("lora", n_kept, n_kept is not None and n_kept <= devices, at, parts,
                        sum(parts.values()) + adapter, host_bytes=streamed_load_bytes(shape) if at > 1 else 0,
                        adapter_bytes=adapter, tenants=kept_tenants(at), tenants_all_devices=kept_tenants(devices),
                        snapshot_bytes=snapshot, sampling_tenants=kept_tenants(at, sampling=True),
                        sampling_tenants_all_devices=kept_tenants(devices, sampling=True),
                        longest_datum=longest_datum(sum(every.values()) + adapter_at(devices) - every["activations"],
                                                    devices if devices > 1 else 1),
                        checkpointing=on, flags=_worker_flags(n_kept, True, kept=True))
    elif quantized_base == "keep" and quantized is not None:
        adapter = adapter_at(1)  # a kept base is served by one process (a group keeps it under --expert-parallel)
        parts, on = checkpointed(lambda c: kept_lora_parts(shape, quantized, workload, chunk, c), adapter)
        fixed = sum(parts.values())
        fits = fixed + adapter <= usable
        # Tenants beside a batch checkpointed unless that is off, as for a group (tenants() above).
        beside = sum(kept_lora_parts(shape, quantized, workload, chunk, activation_checkpointing != "off").values())
        room = max(0, (usable - beside) // adapter)
        sampling = max(0, (usable - beside) // (adapter + snapshot))  # one process: the same on every count
        lora = KindPlan("lora", 1 if fits else None, fits, 1, parts, fixed + adapter, host_bytes=0,
                        adapter_bytes=adapter, tenants=room, tenants_all_devices=room, snapshot_bytes=snapshot,
                        sampling_tenants=sampling, sampling_tenants_all_devices=sampling,
                        longest_datum=longest_datum(fixed + adapter - parts["activations"]), checkpointing=on,
                        flags=_worker_flags(1 if fits else None, False, kept=True))
    full = _served(full, refusal(config, model, "full"), grouped)
    lora = _served(lora, refusal(config, model, "lora"), grouped)
    architecture = (config.get("architectures") or [type(model).__name__])[0]
    note = lora_targets(model)[1]
    return Plan(name, architecture, dtype, shape.parameters, shape.param_bytes, devices, device_bytes, usable,
                workload, adapter_parameters, full, lora, quantized, quantized_base,
                activation_checkpointing=activation_checkpointing, expert_parallel=ep, notes=[note] if note else [])


# -- output --------------------------------------------------------------------------------------------------------


def gb(nbytes: int) -> str:
    return f"{nbytes / GiB:,.1f}"


def _count(n: int) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.2f}M"


def _shards(kind: KindPlan) -> str:
    if kind.refused:
        return "not served"
    if kind.shards is None and kind.group_refused:
        return "not served (one device too small)"
    if kind.shards is None:
        return f">{MAX_SHARDS} (never fits)"
    return f"{kind.shards}" + ("" if kind.fits else " (more than --devices)")


def render(p: Plan) -> str:
    """The human-readable table of one plan (in GiB; in MiB for devices under 8 GiB)."""
    w = p.workload
    unit, size = ("GiB", GiB) if p.device_bytes >= 8 * GiB else ("MiB", 1 << 20)

    def gb(nbytes: int) -> str:
        return f"{nbytes / size:,.1f}"

    lines = [
        f"model {p.model} ({p.architecture}): {_count(p.parameters)} parameters, {gb(p.param_bytes)} {unit} in "
        f"{p.dtype}",
        f"devices: {p.devices} x {gb(p.device_bytes)} {unit} ({gb(p.usable_bytes)} {unit} usable after the headroom)",
        f"batch: {w.batch_tokens} tokens in datums of {w.seq_len}, split over the shards; micro-batches of up to "
        f"{w.microbatch_tokens} tokens; LoRA rank {w.lora_rank} on attention, MLP and output "
        f"({p.lora_parameters / 1e6:,.1f}M parameters)",
    ]
    if p.quantized:
        q = p.quantized
        kept = p.quantized_base == "keep"
        group = kept and p.expert_parallel and p.lora.at > 1 and q.expert_parameters > 0
        lines.append(f"checkpoint: {q.method}, {q.what} ({_count(q.parameters)} parameters at {q.bits:g} bits): "
                     f"{gb(q.checkpoint_bytes)} {unit} as stored; dequantized to {p.dtype} on load: "
                     f"{gb(q.dequantized_bytes)} {unit} (planned below"
                     + ("; the LoRA group keeps its routed experts as stored, each rank its own, the rest "
                        f"dequantized; a layer's experts dequantized when used: {gb(q.expert_layer_bytes)} {unit} "
                        "for the largest, split over the ranks; --expert-parallel --quantized-base keep)" if group
                        else "; the LoRA column keeps the base as stored, on one device, each layer dequantized when "
                        f"used: {gb(q.layer_bytes)} {unit} for the largest; --quantized-base keep)" if kept
                        else "; --quantized-base keep plans the LoRA base as stored)"))
    rows: list[tuple[str, str, str]] = [("", "full session", "LoRA group")]
    rows.append(("shards needed", _shards(p.full), _shards(p.lora)))
    rows.append(("per shard at", f"{p.full.at} shard(s)", f"{p.lora.at} shard(s)"))
    labels = list(dict.fromkeys([*p.full.parts, *p.lora.parts]))
    for label in labels:
        full = p.full.parts.get(label)
        lora = p.lora.parts.get(label)
        rows.append((f"  {label}", "-" if full is None else gb(full), "-" if lora is None else gb(lora)))
    rows.append(("  adapter per tenant (expert factors split)" if p.expert_parallel else
                 "  adapter per tenant (on every shard)", "-", gb(p.lora.adapter_bytes)))
    rows.append((f"  total, {unit} (LoRA: one tenant)", gb(p.full.total), gb(p.lora.total)))
    split = " expert-parallel" if p.expert_parallel and p.devices > 1 else ""  # how the group of all would be made
    every = f"{p.devices}{split}"
    if p.lora.group_refused and p.devices > 1:  # the worker serves no group of it: "all devices" is one
        every = "1 (no shard group served)"
    rows.append(("LoRA tenants that fit", "-", f"{p.lora.tenants:,} at {p.lora.at} shard(s); "
                                               f"{p.lora.tenants_all_devices:,} at {every}"))
    rows.append(("  with a sampler each (RL; a snapshot on rank 0: " + gb(p.lora.snapshot_bytes) + f" {unit})", "-",
                 f"{p.lora.sampling_tenants:,} at {p.lora.at} shard(s); "
                 f"{p.lora.sampling_tenants_all_devices:,} at {every}"))

    def on_one(kind: KindPlan) -> str:
        return " on 1 (no shard group served)" if kind.group_refused and p.devices > 1 else ""

    rows.append((f"longest datum that fits on {p.devices}, tokens", f"{p.full.longest_datum:,}{on_one(p.full)}",
                 f"{p.lora.longest_datum:,} (one tenant){on_one(p.lora)}"))
    rows.append((f"host RAM per rank, {unit}", gb(p.full.host_bytes), gb(p.lora.host_bytes)))
    rows.append(("decoder layers checkpointed", "yes" if p.full.checkpointing else "no",
                 "yes" if p.lora.checkpointing else "no"))
    rows.append(("tinkerq worker flags", p.full.flags, p.lora.flags))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines.append("")
    lines += [f"{a:<{width[0]}}  {b:>{width[1]}}  {c:>{width[2]}}".rstrip() for a, b, c in rows]
    lines.append("")
    lines += p.notes
    if p.expert_parallel:
        lines.append("")
        lines.append("Expert parallel (--expert-parallel): a MoE layer is gathered without its routed experts, and "
                     "a rank's experts are planned for every rank's rows at once (the most uneven routing); a LoRA "
                     "tenant's per-expert factors are split with the experts.")
    if p.chosen:
        lines.append("Layouts chosen by the planner (--expert-parallel auto, --quantized-base auto): each column is "
                     "the layout needing the fewest devices, then holding the most tenants; its flags start that "
                     "group (a group keeping a quantized base serves LoRA only).")
    lines.append(f"({unit}; activation checkpointing {p.activation_checkpointing}: TINKERQ_ACTIVATION_CHECKPOINTING; "
                 f"the longest datum is planned checkpointed unless it is off. "
                 f"The worker admits at most {p.max_lora_sessions} LoRA sessions: TINKERQ_MAX_LORA_SESSIONS. "
                 f"Host RAM: each rank of a shard group reads only its own shards from the files, one weight at a "
                 f"time; rank 0 reads the whole base ({gb(p.param_bytes)} {unit}) only while it writes a merged LoRA "
                 f"save, refused first when its host lacks the room. docs/planning.md)")
    return "\n".join(lines)


def _md_flags(kind: KindPlan) -> str:
    if kind.flags.startswith("--"):
        return f"`{kind.flags}`"
    return "not served" if kind.flags.startswith("(not served") else "-"  # "-": one process, no flags


def render_markdown(plans: list[Plan]) -> str:
    """One markdown table row per plan (the lineup's table in docs/planning.md)."""
    if not plans:
        return ""
    p0 = plans[0]
    head = (f"Per {gb(p0.device_bytes)} GiB device ({gb(p0.usable_bytes)} usable), {p0.devices} devices, {p0.dtype}; "
            f"batch {p0.workload.batch_tokens} tokens in datums of {p0.workload.seq_len}; LoRA rank "
            f"{p0.workload.lora_rank}; activation checkpointing {p0.activation_checkpointing}"
            + ("; expert parallelism and kept quantized bases chosen per model and column (the flags column)"
               if any(p.chosen for p in plans) else
               f"{'; MoE models expert parallel' if any(p.expert_parallel for p in plans) else ''}"
               f"{'; quantized checkpoints kept as stored' if p0.quantized_base == 'keep' else ''}") + ".\n\n")
    lines = ["| model | params | weights GiB | full: shards | full: GiB per shard | LoRA: shards | "
             "LoRA: base + gather + acts GiB per shard | adapter GiB | LoRA tenants (at shards; at all devices) | "
             "longest datum, tokens (full; LoRA) | layers checkpointed (full; LoRA) | "
             "LoRA tenants with a sampler each (at shards; at all devices) | "
             "host RAM per rank GiB (full; LoRA) | worker flags (full; LoRA) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    notes = {p.model: i + 1 for i, p in enumerate(q for q in plans if q.notes)}  # footnotes, numbered
    for p in plans:
        fixed = p.lora.total - p.lora.adapter_bytes
        mark = f" ({notes[p.model]})" if p.model in notes else ""
        lines.append(f"| {p.model}{mark} | {p.parameters / 1e9:,.1f}B | {gb(p.param_bytes)} | {_shards(p.full)} | "
                     f"{gb(p.full.total)} | {_shards(p.lora)} | {gb(fixed)} | {gb(p.lora.adapter_bytes)} | "
                     f"{p.lora.tenants:,}; {p.lora.tenants_all_devices:,} | "
                     f"{p.full.longest_datum:,}; {p.lora.longest_datum:,} | "
                     f"{'yes' if p.full.checkpointing else 'no'}; {'yes' if p.lora.checkpointing else 'no'} | "
                     f"{p.lora.sampling_tenants:,}; {p.lora.sampling_tenants_all_devices:,} | "
                     f"{gb(p.full.host_bytes)}; {gb(p.lora.host_bytes)} | {_md_flags(p.full)}; {_md_flags(p.lora)} |")
    footnotes = [f"({notes[p.model]}) {p.model}: {'; '.join(p.notes)}." for p in plans if p.model in notes]
    return head + "\n".join(lines) + ("\n\n" + "\n".join(footnotes) if footnotes else "")


def to_json(p: Plan) -> dict[str, Any]:
    out = asdict(p)
    out["workload"]["lengths"] = p.workload.lengths()
    return out

