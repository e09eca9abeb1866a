"""A LoRA base kept in its stored quantized format: each weight dequantized when a forward uses it, recomputed in
the backward, never all at once (QLoRA's scheme: the base is frozen, the adapters train in float32). docs/quantized.md.

:func:`keep_quantized` takes a loaded (dequantized) model and the checkpoint's quantized tensors
(worker/checkpoints/quant_formats.py, keyed by checkpoint name) and puts each tensor's stored parts in place of the
float weight
it was dequantized into:

- a Linear (``<module>.weight``: block FP8 in DeepSeek-V3's attention, dense and shared-expert layers) keeps its
  parts as buffers; its ``weight`` becomes a property that dequantizes them into the model's dtype on each access;
- a fused-experts module (worker/lora/experts.py ``layout``) keeps each projection's parts stacked over the
  experts, from per-expert keys (``<experts>.E.{gate,up,down}_proj.weight``: FP8, INT4) or stacked ones
  (``<experts>.{gate_up,down}_proj``, (E, out, in): gpt-oss's MXFP4); ``gate_up_proj`` / ``down_proj`` /
  ``up_proj`` become properties that dequantize expert by expert into the parameter's own layout (gate and up
  concatenated or interleaved, transposed or not; gate and up keep separate scale grids: FP8 tiles of the two do
  not line up once concatenated).

The module's class is swapped for a subclass of its own class with the same name (isinstance checks, the LoRA
hooks and the families' class-name rules all still hold). Within one call of a kept module its weights are
dequantized once (a forward scope: the eager experts read ``gate_up_proj[e]`` once per expert).

**Recompute in backward** (:func:`recomputed`, entered around the base's forward in worker/training/logprobs.py): a
saved-tensors hook recognises a tensor whose storage is a live dequantized weight and saves how to rebuild it
(the module, the weight's name, and the view's size, stride and offset) instead of the tensor. So a layer's
dequantized weights are freed once its forward is done, and rebuilt once when its backward needs them (shared by
every saved view of them, released after the last one is unpacked): the working set is one module's weights.

A kept model refuses ``copy.deepcopy`` with a user error: full fine-tuning (a deep copy whose every weight trains)
needs float weights; such a worker serves LoRA sessions and samplers (docs/quantized.md).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tinkerq.errors import UserError, ValidationError
from tinkerq.worker.checkpoints.quant_formats import FP8_BLOCK, INT4_PACKED, MXFP4, QuantizedTensor
from tinkerq.worker.lora import experts as fused

log = logging.getLogger("tinkerq.worker")

KEEP, DEQUANTIZE = "keep", "dequantize"
MODES = (DEQUANTIZE, KEEP)

# <experts module>.<expert index>.<projection>.weight (per expert, as DeepSeek-V3, Qwen3-MoE and Kimi-K2 ship them;
# Mixtral's w1/w3/w2 too) and <experts module>.<fused projection>[.weight] (stacked over the experts: gpt-oss).
_PER_EXPERT = re.compile(r"^(?P<module>.+)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_STACKED = re.compile(r"^(?P<module>.+)\.(?P<proj>gate_up_proj|up_proj|down_proj)(?:\.weight)?$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def expert_key(key: str) -> tuple[str, int | None, str] | None:
    """A checkpoint name of routed experts' weights as (experts module, expert index or None when the tensor is
    stacked over the experts, projection), or None for any other name."""
    match = _PER_EXPERT.match(key)
    if match:
        return match["module"], int(match["expert"]), match["proj"]
    match = _STACKED.match(key)
    return (match["module"], None, match["proj"]) if match else None


def expert_parameter(projection: str, gated: bool) -> str:
    """The fused-experts parameter a checkpoint projection (:func:`expert_key`) fills."""
    if projection in _ROLE:
        return "down_proj" if _ROLE[projection] == "down" else "gate_up_proj" if gated else "up_proj"
    return projection


class KeepQuantizedError(UserError):
    """The checkpoint's quantized tensors cannot be kept on this model (the message says which, and what to do)."""


class FullSessionOnQuantizedBase(UserError):
    """A full-parameter session asked of a worker whose base is kept quantized."""


FULL_SESSION_MESSAGE = ("this worker keeps its base model quantized (--quantized-base keep): it serves LoRA sessions "
                        "and sampling only, since full fine-tuning trains float copies of every weight. Use "
                        "create_lora_training_client, or a worker started with --quantized-base dequantize")


@dataclass
class Source:
    """One stored quantized tensor of a kept module: its format, block and dequantized ``shape`` (per expert for
    experts), the buffers holding its parts, and what it fills: ``role`` ``all`` (the whole weight, or every
    expert's whole projection), ``gate`` or ``up`` (those rows of ``gate_up_proj``)."""

    format: str
    shape: tuple[int, ...]
    block: tuple[int, ...]
    buffers: dict[str, str]  # part -> buffer name on the module
    role: str = "all"
    stacked: bool = False  # parts carry a leading expert dimension

    def parts(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {part: _state(module).part(module, name) for part, name in self.buffers.items()}


@dataclass
class KeptStats:
    """What :func:`keep_quantized` replaced."""

    modules: int = 0
    tensors: int = 0  # quantized checkpoint tensors placed
    stored_bytes: int = 0  # their parts, as kept in memory
    dequantized_bytes: int = 0  # the float weights they replaced (what the model held before)
    largest_module_bytes: int = 0  # one module's weights dequantized: the working set of a forward or backward
    names: list[str] = field(default_factory=list)  # the kept modules


# -- placing the checkpoint's tensors -------------------------------------------------------------------------------


def keep_quantized(model: torch.nn.Module, quantized: dict[str, QuantizedTensor],
                   device: torch.device | None = None) -> KeptStats:
    """Replace every float weight of ``model`` that ``quantized`` (checkpoint name -> stored tensor) holds by its
    stored parts, dequantized on access. Raises :class:`KeepQuantizedError` (nothing changed) when a name matches
    no Linear or fused-experts module, or a shape differs from the model's. ``device``: where the stored parts go
    (default: the weight's; a skeleton's weights are on the meta device)."""
    modules = dict(model.named_modules())
    # module -> parameter -> [(source, its stored tensor: per-expert tensors stacked over the experts)]
    plans: dict[str, dict[str, list[tuple[Source, QuantizedTensor]]]] = {}
    per_expert: dict[tuple[str, str], dict[int, QuantizedTensor]] = {}
    for key, q in quantized.items():
        if key.endswith(".weight") and isinstance(modules.get(key[:-7]), torch.nn.Linear):
            linear = modules[key[:-7]]
            _check_shape(key, tuple(q.shape), tuple(linear.weight.shape))
            plans.setdefault(key[:-7], {})["weight"] = [(_source(q, "weight", "all", False), q)]
            continue
        match = _PER_EXPERT.match(key) or _STACKED.match(key)
        owner = modules.get(match["module"]) if match else None
        if match is None or owner is None or not fused.is_fused_experts(owner):
            raise KeepQuantizedError(f"cannot keep {key} quantized: it names no Linear or fused-experts module of "
                                     f"{type(model).__name__}; serve it with --quantized-base dequantize")
        if "expert" in match.groupdict():
            per_expert.setdefault((match["module"], _ROLE[match["proj"]]), {})[int(match["expert"])] = q
        else:
            param = match["proj"]
            lay = _layout(owner, match["module"])
            expected = tuple(getattr(owner, param).shape)
            _check_shape(key, tuple(q.shape), (expected[0], expected[2], expected[1]) if lay.transposed else expected)
            plans.setdefault(match["module"], {})[param] = [(_source(q, param, "all", True, tuple(q.shape[1:])), q)]
    for (name, role), by_index in per_expert.items():
        owner = modules[name]
        lay = _layout(owner, name)
        if sorted(by_index) != list(range(lay.num_experts)):
            raise KeepQuantizedError(f"{name}: the checkpoint holds {role} projections of experts {sorted(by_index)}, "
                                     f"not of all {lay.num_experts}")
        param = "down_proj" if role == "down" else "gate_up_proj" if lay.gated else "up_proj"
        rows = (lay.hidden, lay.intermediate) if role == "down" else (lay.intermediate, lay.hidden)
        tensors = [by_index[e] for e in range(lay.num_experts)]
        for e, q in enumerate(tensors):
            _check_shape(f"{name}.{e}.{role}", tuple(q.shape), rows)
            if (q.format, q.block) != (tensors[0].format, tensors[0].block):
                raise KeepQuantizedError(f"{name}: experts 0 and {e} of {role} are stored in different formats")
        stacked = QuantizedTensor(tensors[0].format, {p: torch.stack([q.parts[p] for q in tensors])
                                                      for p in tensors[0].parts}, tensors[0].shape, tensors[0].block)
        plans.setdefault(name, {}).setdefault(param, []).append(
            (_source(tensors[0], param, role if param == "gate_up_proj" else "all", True), stacked))
    stats = KeptStats(tensors=len(quantized))
    if (device is not None and device.type == "cpu") or any(p.device.type == "cpu" for p in model.parameters()):
        fix_mmap_threshold()
    for name, params in plans.items():
        module = modules[name]
        before = {p: getattr(module, p) for p in params}
        dtype = next(iter(before.values())).dtype
        for param, sources in params.items():
            roles = {s.role for s, _ in sources}
            if param == "gate_up_proj" and roles not in ({"all"}, {"gate", "up"}):
                raise KeepQuantizedError(f"{name}: the checkpoint holds {sorted(roles)} of gate_up_proj, not both "
                                         f"gate and up")
        stats.dequantized_bytes += sum(t.numel() * t.element_size() for t in before.values())
        stats.largest_module_bytes = max(stats.largest_module_bytes,
                                         sum(t.numel() * t.element_size() for t in before.values()))
        _install(module, name, params, dtype, device)
        stats.modules += 1
        stats.names.append(name)
        stats.stored_bytes += stored_bytes(module)
    return stats


def keep_checkpoint_quantized(model: torch.nn.Module, path: str) -> KeptStats:
    """:func:`keep_quantized` with the quantized tensors of the checkpoint ``model`` was loaded (dequantized) from
    (worker/checkpoints/reader.py), the layers the model leaves out (DeepSeek's multi-token prediction) skipped;
    the freed heap is given back. An unquantized checkpoint keeps nothing (logged)."""
    from tinkerq.allocator import trim_heap
    from tinkerq.worker.checkpoints.reader import drop_extra_layers, open_checkpoint, read_quantized_tensors

    quantized = drop_extra_layers(open_checkpoint(Path(path)), read_quantized_tensors(path))
    stats = keep_quantized(model, quantized)
    del quantized
    trim_heap()
    if stats.modules:
        log.info("model: %d quantized weights in %d modules kept as stored (%.1f MB; %.1f MB dequantized, %.1f MB "
                 "for the largest module)", stats.tensors, stats.modules, stats.stored_bytes / 1e6,
                 stats.dequantized_bytes / 1e6, stats.largest_module_bytes / 1e6)
    else:
        log.warning("--quantized-base keep: %s is not a quantized checkpoint; nothing is kept quantized", path)
    return stats


def _layout(module: torch.nn.Module, name: str) -> fused.ExpertsLayout:
    try:
        return fused.layout(module, name)
    except ValidationError as exc:
        raise KeepQuantizedError(f"cannot keep {name}'s experts quantized: {exc}") from None


def _check_shape(key: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if got != expected:
        raise KeepQuantizedError(f"{key}: the checkpoint's quantized tensor is {got} dequantized, the model's "
                                 f"weight {expected}")


def _source(q: QuantizedTensor, param: str, role: str, stacked: bool, shape: tuple[int, ...] | None = None) -> Source:
    prefix = f"{param}_{role}_q" if role != "all" else f"{param}_q"
    return Source(q.format, tuple(shape or q.shape), tuple(q.block), {p: f"{prefix}_{p}" for p in q.parts}, role,
                  stacked)


def _install(module: torch.nn.Module, name: str, params: dict[str, list[tuple[Source, QuantizedTensor]]],
             dtype: torch.dtype, device: torch.device | None = None) -> None:
    """Swap ``module``'s class, drop its float weights and register the stored parts as buffers."""
    shapes = {p: tuple(getattr(module, p).shape) for p in params}
    # Read once from the float weights: the adapter factory and every forward read it, and must not dequantize
    # to get shapes.
    if not isinstance(module, torch.nn.Linear):
        module._tinkerq_layout = _layout(module, name)  # type: ignore[assignment]  # a plain attribute
    device = device or getattr(module, next(iter(params))).device
    for param in params:
        del module._parameters[param]  # the float weight: freed once nothing else holds it
    for sources in params.values():
        for src, q in sources:
            for part, buffer in src.buffers.items():
                module.register_buffer(buffer, q.parts[part].to(device).contiguous(), persistent=False)
    module.__dict__[_STATE] = _Kept({p: [s for s, _ in sources] for p, sources in params.items()}, shapes, dtype)
    module.__class__ = _kept_class(type(module), tuple(params))
    module.register_forward_pre_hook(_open_scope)
    module.register_forward_hook(_close_scope, always_call=True)
    global _kept_modules
    _kept_modules += 1


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20


def fix_mmap_threshold() -> None:
    """Serve allocations of 1 MiB and more with mmap, returned to the OS when freed. A kept base allocates and
    frees each layer's dequantized weights (MBs) on every pass; glibc's dynamic threshold rises to the size of the
    first such block freed and then serves the next ones from the heap, where they fragment between smaller
    allocations: a forward's peak RSS was 157-198 MiB instead of 70-76 MiB on an 8-layer base of 24 MiB layers
    (tests/test_quantized_base.py). Process-wide; glibc only."""
    from tinkerq.allocator import GLIBC

    if GLIBC is not None:
        GLIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


@dataclass
class _Kept:
    """A kept module's state (in its ``__dict__``): each weight's sources and float shape, the dtype it is
    dequantized into, and the weights of the call in progress (None outside one)."""

    sources: dict[str, list[Source]]
    shapes: dict[str, tuple[int, ...]]
    dtype: torch.dtype
    scope: dict[str, torch.Tensor] | None = None

    def part(self, module: torch.nn.Module, buffer: str) -> torch.Tensor:
        t = module._buffers[buffer]
        assert t is not None
        return t

    def buffers(self) -> list[str]:
        return [b for srcs in self.sources.values() for s in srcs for b in s.buffers.values()]


_STATE = "_tinkerq_kept_state"


def _state(module: torch.nn.Module) -> _Kept:
    state: _Kept = module.__dict__[_STATE]
    return state


def stored_bytes(module: torch.nn.Module) -> int:
    """Bytes of a kept module's stored parts (0 for any other module)."""
    if _STATE not in module.__dict__:
        return 0
    state = _state(module)
    return sum(state.part(module, b).numel() * state.part(module, b).element_size() for b in state.buffers())


def parameter_count(model: torch.nn.Module) -> int:
    """The model's parameters, the kept weights included (``model.parameters()`` no longer yields them)."""
    kept = sum(math.prod(shape) for m in model.modules() if _STATE in m.__dict__
               for shape in _state(m).shapes.values())
    return sum(p.numel() for p in model.parameters()) + kept


def kept_weight_keys(model: torch.nn.Module, keys: list[str]) -> set[str]:
    """Of the checkpoint names ``keys``, those of routed-experts weights ``model`` keeps quantized (a loader of the
    rest leaves them out)."""
    kept = {name for name, m in model.named_modules() if _STATE in m.__dict__}
    out = set()
    for key in keys:
        parsed = expert_key(key)
        if parsed is not None and parsed[0] in kept:
            module = model.get_submodule(parsed[0])
            if expert_parameter(parsed[2], bool(getattr(module, "has_gate", True))) in _state(module).sources:
                out.add(key)
    return out


def is_kept(model: torch.nn.Module) -> bool:
    """Whether any module of ``model`` is kept quantized."""
    return any(_STATE in m.__dict__ for m in model.modules())


def refuse_full_session(model: torch.nn.Module, *, kept: bool = False) -> None:
    """A user error when ``model``'s base is kept quantized, or ``kept`` says so (a shard group's: its ranks hold
    the kept parts): a full session needs float weights."""
    if kept or is_kept(model):
        raise FullSessionOnQuantizedBase(FULL_SESSION_MESSAGE)


# -- the kept modules' class --------------------------------------------------------------------------------------

_classes: dict[tuple[type, tuple[str, ...]], type] = {}
_kept_modules = 0  # modules kept in this process: the saved-tensor hooks run only when some are


def _kept_class(cls: type, params: tuple[str, ...]) -> type:
    """A subclass of ``cls`` (same name) whose ``params`` are properties dequantizing the stored parts."""
    key = (cls, params)
    if key not in _classes:
        namespace: dict[str, Any] = {name: property(_getter(name)) for name in params}
        namespace.update(_apply=_kept_apply, _save_to_state_dict=_kept_save, __deepcopy__=_refuse_copy,
                         __module__=cls.__module__, __qualname__=cls.__qualname__, _tinkerq_kept=params,
                         _tinkerq_experts=not issubclass(cls, torch.nn.Linear))  # worker/lora/experts.py
        _classes[key] = type(cls.__name__, (cls,), namespace)
    return _classes[key]


def _getter(name: str) -> Callable[[torch.nn.Module], torch.Tensor]:
    def get(self: torch.nn.Module) -> torch.Tensor:
        return _weight(self, name)
    return get


def _kept_apply(self: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
    """``Module._apply`` (``.to``, ``.cuda``, ``.half`` ...) moving the stored parts in their own dtypes (a float8
    weight or a float32 scale cast to bfloat16 would change the stored format); the dequantized weights follow
    the dtype a float weight would get."""
    state = _state(self)
    parts = {n: state.part(self, n) for n in state.buffers()}
    for n in parts:
        del self._buffers[n]
    try:
        super(type(self), self)._apply(fn, recurse)  # type: ignore[misc]  # the kept module's own class
    finally:
        probe = fn(torch.empty(0, dtype=state.dtype, device=next(iter(parts.values())).device))
        for n, t in parts.items():
            self._buffers[n] = t.to(probe.device)
        state.dtype = probe.dtype
    return self


_plain_state = 0  # inside without_kept_weights(): state_dict() leaves the kept weights out


def _kept_save(self: torch.nn.Module, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
    """``state_dict()`` gives the dequantized weights under their own names, as the float model would (merged
    LoRA files are written from it); the stored parts are non-persistent buffers."""
    super(type(self), self)._save_to_state_dict(destination, prefix, keep_vars)  # type: ignore[misc]
    if _plain_state:
        return
    for name in _state(self).sources:
        destination[prefix + name] = _weight(self, name).detach()


@contextlib.contextmanager
def without_kept_weights() -> Iterator[None]:
    """``state_dict()`` without the kept modules' weights while the block runs: a loader filling the rest of a
    model (worker/sharding/streaming.py) asks for its keys, which must not dequantize every kept weight."""
    global _plain_state
    _plain_state += 1
    try:
        yield
    finally:
        _plain_state -= 1


def _refuse_copy(self: torch.nn.Module, memo: dict[int, Any]) -> Any:
    raise FullSessionOnQuantizedBase(FULL_SESSION_MESSAGE)


def _open_scope(module: torch.nn.Module, args: Any) -> None:
    _state(module).scope = {}


def _close_scope(module: torch.nn.Module, args: Any, output: Any) -> None:
    _state(module).scope = None


# -- dequantizing, and rebuilding in the backward -----------------------------------------------------------------


def build(module: torch.nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
    """``module``'s weight ``name`` dequantized into ``dtype``, contiguous in the float parameter's own shape."""
    state = _state(module)
    sources, shape = state.sources[name], state.shapes[name]
    if not sources[0].stacked:  # a Linear's (out, in)
        src = sources[0]
        return QuantizedTensor(src.format, src.parts(module), src.shape, src.block).dequantize(dtype)
    lay_transposed, concatenated = bool(module.is_transposed), bool(getattr(module, "is_concatenated", True))
    device = next(iter(sources[0].parts(module).values())).device
    out = torch.empty(shape, dtype=dtype, device=device)  # the parameter's layout: (E, out, in) or (E, in, out)
    math = out.transpose(1, 2) if lay_transposed else out  # (E, out, in)
    half = math.shape[1] // 2
    for src in sources:
        rows: slice = slice(None)
        if src.role == "gate":
            rows = slice(0, half) if concatenated else slice(0, None, 2)
        elif src.role == "up":
            rows = slice(half, None) if concatenated else slice(1, None, 2)
        for start, stop, q in _chunks(src, module):  # a few experts' temporaries at a time
            math[start:stop, rows] = q.dequantize(dtype).view(stop - start, *src.shape)
    return out


CHUNK_ELEMENTS = 1 << 18  # weights dequantized in one call: per-call overhead amortized, temporaries bounded


def _chunks(src: Source, module: torch.nn.Module) -> Iterator[tuple[int, int, QuantizedTensor]]:
    """A stacked source's experts in runs of ~CHUNK_ELEMENTS weights, each run as one quantized tensor whose
    dequantization is the run's experts' rows one after another: MXFP4 takes leading dimensions as they are,
    INT4 rows are independent, FP8 tiles stay within an expert when its rows are whole tiles (else one expert at a
    time)."""
    parts = src.parts(module)
    experts = next(iter(parts.values())).shape[0]
    rows, cols = src.shape
    flat = src.format == MXFP4 or src.format == INT4_PACKED or (src.format == FP8_BLOCK and rows % src.block[0] == 0)
    step = max(1, CHUNK_ELEMENTS // (rows * cols)) if flat else 1
    for start in range(0, experts, step):
        stop = min(start + step, experts)
        run = {k: v[start:stop] for k, v in parts.items()}
        if src.format == MXFP4:
            yield start, stop, QuantizedTensor(src.format, run, (stop - start, rows, cols), src.block)
        else:  # (n, R, ...) -> (n * R, ...): experts' rows one after another
            run = {k: v.flatten(0, 1) for k, v in run.items()}
            yield start, stop, QuantizedTensor(src.format, run, ((stop - start) * rows, cols), src.block)


class _Rebuild:
    """One dequantized weight's recipe, shared by every saved view of it: rebuilt at the first unpack, released
    after the last (``pending``: views saved and not yet unpacked)."""

    def __init__(self, module: torch.nn.Module, name: str, dtype: torch.dtype) -> None:
        self.module, self.name, self.dtype = module, name, dtype
        self.pending = 0
        self.tensor: torch.Tensor | None = None

    def take(self) -> torch.Tensor:
        t = self.tensor if self.tensor is not None else build(self.module, self.name, self.dtype)
        self.pending -= 1
        self.tensor = t if self.pending > 0 else None
        return t


_live: dict[int, tuple[StorageWeakRef, _Rebuild]] = {}  # storage address -> (its weak reference, its recipe)


def _weight(module: torch.nn.Module, name: str) -> torch.Tensor:
    state = _state(module)
    scope, dtype = state.scope, state.dtype
    if scope is not None and name in scope:
        return scope[name]
    t = build(module, name, dtype)
    if torch.is_grad_enabled():  # only a forward that records a graph saves tensors
        storage = t.untyped_storage()
        if len(_live) > 4 * _kept_modules + 64:  # drop the entries of freed weights
            for key in [k for k, (ref, _) in _live.items() if ref.expired()]:
                del _live[key]
        _live[storage.data_ptr()] = (StorageWeakRef(storage), _Rebuild(module, name, dtype))
    if scope is not None:
        scope[name] = t
    return t


@dataclass(frozen=True)
class _Saved:
    rebuild: _Rebuild
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _pack(t: torch.Tensor) -> Any:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor without a plain storage
        return t
    entry = _live.get(storage.data_ptr())
    if entry is None or storage.data_ptr() == 0 or entry[0].expired() or \
            entry[0].cdata != StorageWeakRef(storage).cdata:
        return t
    entry[1].pending += 1
    return _Saved(entry[1], tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))


def _unpack(saved: Any) -> torch.Tensor:
    if not isinstance(saved, _Saved):
        return saved  # type: ignore[no-any-return]
    return saved.rebuild.take().as_strided(saved.size, saved.stride, saved.offset)


def recomputed() -> contextlib.AbstractContextManager[Any]:
    """Around a forward whose graph will be backpropagated: kept weights are saved as recipes, rebuilt in the
    backward. Nothing (not even the hooks) where no module of this process is kept quantized."""
    if not _kept_modules:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


@contextlib.contextmanager
def saving_weights() -> Iterator[None]:
    """Within it, :func:`recomputed` saves the dequantized weights themselves (the plain autograd behaviour): the
    memory test's and the benchmark's comparison."""
    global _kept_modules
    before, _kept_modules = _kept_modules, 0
    try:
        yield
    finally:
        _kept_modules = before
