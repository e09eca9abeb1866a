"""Streaming sharded loads: each rank of a shard group fills its own FSDP2 shards from the checkpoint's files.

A rank never holds the whole model. It builds a skeleton (parameters on the meta device:
:func:`worker.loading.models.load_skeleton`), shards a copy of it (worker/sharding/fsdp.py: meta parameters become
DTensors), allocates its local shards (:func:`allocate`) and then reads the checkpoint one weight at a time with
transformers' own loader (``convert_and_load_state_dict_in_model``), straight into the model's DTensors: its key
conversions apply (per-expert tensors stacked into fused 3-D experts, renamed keys), and its shard-on-read
(``DtensorShardOperation``) reads only this rank's rows of each weight (dim 0, split as FSDP2 splits it) and, of a
MoE layer's per-expert tensors, only this rank's experts. The loader would replace FSDP's parameters (``setattr``): a
registration hook copies each value into the tensor FSDP holds and keeps that one registered. Quantized weights are
read and dequantized by our reader, only the rows asked for (worker/checkpoints/reader.py ``LazyTensors``).
Host memory: the rank's shards, plus the weight being read and the loader's converted copy of it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from tinkerq.allocator import GLIBC
from tinkerq.worker.checkpoints.reader import LazyTensors, ModelLoadError, open_checkpoint
from tinkerq.worker.loading import quantized_base, support

log = logging.getLogger("tinkerq.shards")


def fill_shards(root: torch.nn.Module, model: PreTrainedModel, skeleton: PreTrainedModel, model_dir: str, *,
                device: torch.device | str, dtype: torch.dtype) -> None:
    """Allocate the local shards of ``model`` (a copy of ``skeleton``, the unsharded meta model, sharded on the meta
    device under the FSDP root ``root``) on ``device`` and fill them, and its buffers, from the checkpoint in
    ``model_dir``.

    Raises ModelLoadError when a weight of the model is not in the files or has another shape."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    refused = support.message(type(model).__name__, "shard_group")  # a class whose streamed load is not proven
    if refused is not None:
        raise ModelLoadError(refused)
    directory = Path(model_dir)  # load_skeleton made sure it holds safetensors files
    allocate(root, model, device)
    names = {id(m): prefix for prefix, m in model.named_modules(remove_duplicate=False)}
    filled: set[str] = set()

    def put(module: torch.nn.Module, name: str, value: torch.Tensor) -> torch.Tensor | None:
        """The loader sets ``module.name`` to ``value`` (this rank's rows, a DTensor like the parameter's): copied
        into the tensor FSDP holds, which stays in place."""
        prefix = names.get(id(module))
        current = module._parameters.get(name) if name in module._parameters else module._buffers.get(name)
        if prefix is None or current is None or value is current:
            return None  # not this model's (another thread's module), or nothing to copy
        with torch.no_grad():
            _local(current).copy_(_local(value).to(current.dtype))
        filled.add(f"{prefix}.{name}" if prefix else name)
        if GLIBC is not None:  # the weights freed before it go back to the OS, not into glibc's heap for reuse
            GLIBC.malloc_trim(0)
        return current

    lazy = LazyTensors(open_checkpoint(directory), dtype)
    # Routed experts kept quantized (worker/sharding/experts.py) hold their stored parts already: not read again.
    kept = quantized_base.kept_weight_keys(model, list(lazy.entries))
    config = LoadStateDictConfig(pretrained_model_name_or_path=model_dir, dtype=dtype,
                                 dtype_plan=model._get_dtype_plan(dtype),
                                 weight_mapping=cast(Any, get_model_conversion_mapping(model, None, None)))
    try:
        # The loader reads each weight into the model's own DTensors: only this rank's rows of it (transformers'
        # DtensorShardOperation), and of a MoE layer's per-expert tensors only this rank's experts.
        with _caught(put), _one_at_a_time(), quantized_base.without_kept_weights():
            entries = {k: v for k, v in lazy.entries.items() if k not in kept}
            info, _ = convert_and_load_state_dict_in_model(model, entries, config)
    finally:
        lazy.close()
    if info.mismatched_keys:
        name, got, want = sorted(info.mismatched_keys)[0]
        raise ModelLoadError(f"cannot load a causal LM from {model_dir!r}: {name} has shape {tuple(got)} where "
                             f"config.json makes it {tuple(want)}; the weights and config.json are not of the same "
                             f"model (download them again)")
    with quantized_base.without_kept_weights():
        missing = _unfilled(model, filled)
    if missing:
        raise ModelLoadError(f"cannot load a causal LM from {model_dir!r}: {len(missing)} weight(s) are not in its "
                             f"files ({', '.join(missing[:3])}); a shard group loads every weight from the files "
                             f"(download the model again)")


def allocate(root: torch.nn.Module, model: torch.nn.Module, device: torch.device | str) -> None:
    """Give ``model``'s meta parameters storage on ``device``, unset, and keep its buffers (the rotary tables its
    constructor computed). ``root`` is the module to allocate from: the FSDP root of a sharded model, where FSDP2's
    modules re-point their sharded parameters at the new storage (a parameter of the root's own, such as the
    embeddings, would otherwise stay on the meta device for FSDP); the model itself otherwise."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    root.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def _unfilled(model: torch.nn.Module, filled: set[str]) -> list[str]:
    """Parameters and persistent buffers no name of which was filled (a tied weight is filled under either)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    persistent = set(model.state_dict(keep_vars=True))
    for name, b in model.named_buffers(remove_duplicate=False):
        if name in persistent:
            names.setdefault(id(b), []).append(name)
    return sorted(ns[0] for ns in names.values() if not filled.intersection(ns))


def _local(target: torch.Tensor) -> torch.Tensor:
    return target.to_local() if isinstance(target, DTensor) else target


@contextmanager
def _caught(put: Any) -> Iterator[None]:
    """While the loader sets the model's weights (``setattr``, which would replace FSDP's parameters): each goes to
    ``put``, and what ``put`` returns is registered instead (the parameter FSDP holds, now filled)."""
    from torch.nn.modules import module as nn_module

    def hook(module: torch.nn.Module, name: str, value: torch.Tensor | None) -> torch.Tensor | None:
        return put(module, name, value) if value is not None and value.device.type != "meta" else None

    # (torch types these hooks as returning None; a returned tensor replaces the registered one)
    hooks = [nn_module.register_module_parameter_registration_hook(cast(Any, hook)),
             nn_module.register_module_buffer_registration_hook(cast(Any, hook))]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def _one_at_a_time() -> Iterator[None]:
    """transformers' loader reads every weight at once on a thread pool unless told not to: one at a time here."""
    before = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = before
