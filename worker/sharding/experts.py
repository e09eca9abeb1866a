"""Expert parallelism on a shard group: each rank holds E/N of every MoE layer's routed experts and computes them
for every rank's tokens, which travel to their experts and back by all-to-all.

Under FSDP2 alone a MoE layer's experts are sharded too (dim 0 of the fused (E, ...) tensors), but every rank
gathers the whole layer for its forward and backward (21.4 GiB for one DeepSeek-V3 layer: docs/planning.md).
With expert parallelism (``TINKERQ_EXPERT_PARALLEL``, ``--expert-parallel``) the fused expert tensors are left out
of FSDP (``ignored_params``): each is a DTensor sharded on dim 0 over the group's mesh, so a rank's local part is
its E/N experts, read from the files by the streaming load exactly as FSDP's shards are
(worker/sharding/streaming.py), saved and loaded as whole tensors like every other DTensor (the engine's
``full_tensor`` / ``distribute_tensor``). Attention, norms, embeddings and the router stay under FSDP.

The forward of one experts module, on each rank, for its own N tokens routed to k experts each:

    slots (N k)          each (token, expert) pair, sorted by the rank owning the expert (stable)
    send counts (W,)     slots per destination rank; all_to_all of the counts gives what this rank receives
    rows (M, H)          all_to_all of the slots' hidden states: every rank's tokens routed to this rank's experts
    out (M, H)           the experts module's own forward over its local experts (index = expert - rank E/N,
                         weight 1: unweighted)
    back (N k, H)        all_to_all of ``out`` to the slots' owners, unsorted
    result (N, H)        sum over k of back x routing weight (the weights never leave their rank: the router's
                         gradient is local)

Both all-to-alls of the hidden states are autograd's (torch's functional ``all_to_all_single_autograd``): the
backward sends the gradients the other way, so every rank runs the same collectives in the same order as long as
every rank's output depends on what it received (ensured below even when it received nothing). Nothing is capped:
a token's output depends only on its own routing, and an uneven routing (every token to one rank's experts) costs
that rank rows, never a dropped token or a deadlock.

Gradients: the engine scales each rank's loss by the group size and FSDP averages its parameters' gradients over
the ranks, which sums them; an expert's gradient already sums every rank's tokens (the all-to-all's backward), so
its local view divides the gradient by the group size to match.

LoRA sessions keep today's layout (their frozen base under FSDP, the tenants' expert factors replicated): the
expert factors travelling with the tokens is the next step (docs/sharding.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import types as pytypes
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from tinkerq.errors import ServerError, ValidationError
from tinkerq.worker.checkpoints.quant_formats import QuantizedTensor
from tinkerq.worker.loading import quantized_base, support
from tinkerq.worker.lora import experts as lora_experts
from tinkerq.worker.lora import routing
from tinkerq.worker.lora.adapter import adapter_key
from tinkerq.worker.lora.experts import ExpertsLayout, is_fused_experts, layout

log = logging.getLogger("tinkerq.shards")


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's fused routed-experts modules whose forward takes (hidden, top_k_index, top_k_weights)."""
    found = []
    for name, module in model.named_modules():
        if is_fused_experts(module):
            if layout(module, name).dense:  # every expert on every token (Llama-4): nothing to dispatch
                raise ValidationError(f"{name}: {type(module).__name__} runs every expert on every token; expert "
                                      f"parallelism needs routed experts: start the group without --expert-parallel")
            found.append((name, module))
    return found


def check_expert_parallel(model: torch.nn.Module, world: int) -> list[tuple[str, torch.nn.Module]]:
    """The routed-experts modules of ``model``, or a ValidationError when it has none or their count does not
    divide over ``world`` ranks."""
    for path in ("shard_group", "expert_parallel"):  # an expert-parallel group is a shard group
        support.check(type(model).__name__, path)
    modules = experts_modules(model)
    if not modules:
        raise ValidationError(f"{type(model).__name__} has no routed experts; expert parallelism is for mixture-of-"
                              f"experts models: start the group without --expert-parallel")
    for name, module in modules:
        experts = layout(module, name).num_experts
        if experts % world:
            raise ValidationError(f"{name}: {experts} experts do not split evenly over {world} ranks; start the "
                                  f"group with a shard count that divides {experts}, or without --expert-parallel")
    return modules


def distribute_experts(model: torch.nn.Module, mesh: DeviceMesh, *,
                       kept_from: str | None = None) -> set[torch.nn.Parameter]:
    """Make every routed-experts module of ``model`` (a skeleton: parameters on the meta device) expert-parallel over
    ``mesh``; returns the parameters now sharded by expert, which FSDP must leave alone (``ignored_params``).
    Raises as :func:`check_expert_parallel`.

    ``kept_from``: the checkpoint directory of a base kept quantized (``--quantized-base keep``): each expert weight
    the checkpoint stores quantized keeps this rank's experts' stored parts, read from the files now (only those
    experts), dequantized when a forward uses them (worker/loading/quantized_base.py); its other expert parameters
    (gpt-oss's biases) are split as above."""
    world = mesh.size()
    modules = check_expert_parallel(model, world)
    kept = _quantized_expert_weights(kept_from, modules) if kept_from is not None else {}
    whole = {name: layout(module, name) for name, module in modules}  # all E experts, before any is split
    sharded: set[torch.nn.Parameter] = set()
    for name, module in modules:
        experts = whole[name].num_experts
        for pname, p in list(module.named_parameters(recurse=False)):
            if p.dim() == 0 or p.shape[0] != experts:
                continue
            if pname in kept.get(name, ()):  # a placeholder of this rank's shape, never allocated: replaced below
                module.register_parameter(pname, torch.nn.Parameter(torch.empty(
                    (experts // world, *p.shape[1:]), dtype=p.dtype, device="meta"), requires_grad=False))
                continue
            local = torch.empty((experts // world, *p.shape[1:]), dtype=p.dtype, device=p.device)
            param = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape,
                                                          stride=p.stride()), requires_grad=p.requires_grad)
            module.register_parameter(pname, param)
            sharded.add(param)
        module._tinkerq_ep = (mesh, experts)  # type: ignore[assignment]
        # An instance attribute: deep copies rebind it to the copy (copy's MethodType handling).
        module.forward = pytypes.MethodType(_expert_parallel_forward, module)  # type: ignore[method-assign]
    log.info("expert parallel over %d ranks: %d MoE layer(s), experts per rank %s", world, len(modules),
             "/".join(sorted({str(lay.num_experts // world) for lay in whole.values()})))
    if kept:
        assert kept_from is not None
        _keep_local_experts(model, {n: lay for n, lay in whole.items() if n in kept}, kept_from, mesh)
    return sharded


def _quantized_expert_weights(directory: str, modules: list[tuple[str, torch.nn.Module]]) -> dict[str, set[str]]:
    """Experts module name -> the parameters of it the checkpoint stores quantized."""
    from tinkerq.worker.checkpoints.reader import open_checkpoint

    gated = {name: layout(module, name).gated for name, module in modules}
    found: dict[str, set[str]] = {}
    for key in open_checkpoint(Path(directory)).quantized:
        parsed = quantized_base.expert_key(key)
        if parsed is not None and parsed[0] in gated:
            found.setdefault(parsed[0], set()).add(quantized_base.expert_parameter(parsed[2], gated[parsed[0]]))
    return found


def kept_base_bytes(skeleton: torch.nn.Module, directory: str, world: int) -> int:
    """Per rank, the frozen base an expert-parallel group makes when it keeps its quantized routed experts as stored
    (``distribute_experts(kept_from=...)``): its experts' stored parts, counted from the files' headers, and its
    share of the rest, dequantized. What the worker admits a group's first LoRA session with."""
    from tinkerq.worker.checkpoints.reader import drop_extra_layers, open_checkpoint

    modules = experts_modules(skeleton)
    kept = _quantized_expert_weights(directory, modules)
    by_name = dict(modules)
    dequantized = sum(getattr(by_name[m], p).numel() * getattr(by_name[m], p).element_size()
                      for m, params in kept.items() for p in params)
    checkpoint = open_checkpoint(Path(directory))
    weights = drop_extra_layers(checkpoint, {w: parts for w, parts in checkpoint.quantized.items()
                                             if (k := quantized_base.expert_key(w)) is not None and k[0] in kept})
    stored = sum(checkpoint.headers[part].nbytes for parts in weights.values() for part in parts.values())
    whole = sum(p.numel() * p.element_size() for p in skeleton.parameters())
    buffers = sum(b.numel() * b.element_size() for b in skeleton.buffers())
    return (whole - dequantized + stored) // world + buffers


def _keep_local_experts(model: torch.nn.Module, whole: dict[str, ExpertsLayout], directory: str,
                        mesh: DeviceMesh) -> None:
    """Read this rank's experts' stored parts of each experts module named in ``whole`` (its layout over all E
    experts; its quantized weights now placeholders of this rank's shape) and keep them as the module's weights
    (quantized_base.keep_quantized), experts renumbered from 0 on this rank. One module at a time: host memory holds
    one module's parts (twice, while they are stacked), never the rank's whole share."""
    from tinkerq.allocator import trim_heap
    from tinkerq.worker.checkpoints.reader import open_checkpoint, read_quantized_tensors

    world, rank = mesh.size(), mesh.get_local_rank()
    checkpoint = open_checkpoint(Path(directory))
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else \
        torch.device(mesh.device_type)
    stored_bytes = dequantized_bytes = modules = 0
    for name, lay in whole.items():
        lo, hi = rank * lay.num_experts // world, (rank + 1) * lay.num_experts // world

        def mine(key: str, name: str = name, lo: int = lo, hi: int = hi) -> bool:
            parsed = quantized_base.expert_key(key)
            return parsed is not None and parsed[0] == name and (parsed[1] is None or lo <= parsed[1] < hi)

        local: dict[str, QuantizedTensor] = {}
        for key, q in read_quantized_tensors(directory, mine, checkpoint=checkpoint).items():
            _, index, projection = quantized_base.expert_key(key)  # type: ignore[misc]  # selected by mine()
            if index is not None:  # per-expert keys: this rank's experts, from 0
                local[f"{name}.{index - lo}.{projection}.weight"] = q
            else:  # stacked over the experts: this rank's rows of each part
                local[key] = QuantizedTensor(q.format, {p: t[lo:hi].clone() for p, t in q.parts.items()},
                                             (hi - lo, *q.shape[1:]), q.block)
        stats = quantized_base.keep_quantized(model, local, device=device)
        del local
        trim_heap()
        stored_bytes, dequantized_bytes = stored_bytes + stats.stored_bytes, dequantized_bytes + stats.dequantized_bytes
        modules += stats.modules
        model.get_submodule(name)._tinkerq_layout = lay  # type: ignore[assignment]  # all E experts (targets)
    log.info("kept quantized: %d experts module(s), this rank's experts as stored (%.1f MB; %.1f MB dequantized)",
             modules, stored_bytes / 1e6, dequantized_bytes / 1e6)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class _LocalExperts:
    """The experts module seen with only this rank's experts: its parameters' local parts (gradients scaled to
    the FSDP convention) and ``num_experts`` E/N; every other attribute is the module's."""

    def __init__(self, module: torch.nn.Module, world: int, experts: int) -> None:
        lay = dataclasses.replace(layout(module, "experts"), num_experts=experts // world)
        local: dict[str, Any] = {"num_experts": experts // world, "_tinkerq_layout": lay}
        for pname, p in module.named_parameters(recurse=False):
            if isinstance(p, DTensor):
                part = p.to_local()
                local[pname] = _ScaleGrad.apply(part, 1.0 / world) if torch.is_grad_enabled() else part
        self.__dict__["_module"], self.__dict__["_local"] = module, local

    def __getattr__(self, name: str) -> Any:
        local = self.__dict__["_local"]
        return local[name] if name in local else getattr(self.__dict__["_module"], name)


def _expert_parallel_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    route = routing.current()
    # Products here run as called: the slot tensors' row counts could equal the batch's by chance.
    with route.whole() if route is not None else contextlib.nullcontext():
        return _dispatched(self, hidden_states, top_k_index, top_k_weights, route)


def _dispatched(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, route: routing.Routing | None) -> torch.Tensor:
    mesh, experts = self._tinkerq_ep  # type: ignore[misc]
    group, world = mesh.get_group(), mesh.size()
    per = experts // world
    n, k = top_k_index.shape
    hidden = hidden_states.shape[-1]
    flat = top_k_index.reshape(-1)  # (N k,)
    owner = torch.div(flat, per, rounding_mode="floor")  # (N k,) the rank holding each slot's expert
    order = torch.argsort(owner, stable=True)  # slots grouped by destination, in token order within each
    send = torch.bincount(owner, minlength=world)  # (W,)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    rows = int(sum(recv_sizes))
    self._tinkerq_ep_rows = rows  # type: ignore[assignment]  # what this rank computed last (tests)

    sent = hidden_states[torch.div(order, k, rounding_mode="floor")]  # (N k, H) each slot's token, sorted
    received = _exchange(sent, recv_sizes, send_sizes, group)  # (M, H)
    # Each slot's local expert index and its token's adapter (its index in the pass, -1: none) in one integer.
    tenant = route.token_ids(n, flat.device) if route is not None else torch.full((n,), -1, device=flat.device)
    packed = (flat - owner * per) + per * (tenant.repeat_interleave(k) + 1)  # (N k,)
    arrived = torch.empty(rows, dtype=flat.dtype, device=flat.device)
    dist.all_to_all_single(arrived, packed[order].contiguous(), recv_sizes, send_sizes, group=group)
    local_index, tenant_of_row = arrived % per, torch.div(arrived, per, rounding_mode="floor") - 1  # (M,) each

    view = _LocalExperts(self, world, experts)
    out = _local_rows(self, view, received, local_index, tenant_of_row, route, mesh.get_local_rank(), per)
    # The output must depend on what arrived even when nothing did (the eager forward then returns fresh zeros):
    # otherwise this rank would skip the first all-to-all's backward that every other rank runs.
    out = out + received.sum() * 0

    back = _exchange(out.to(hidden_states.dtype), send_sizes, recv_sizes, group)  # (N k, H) sorted
    unsorted = back[torch.argsort(order)].view(n, k, hidden)  # (N, k, H)
    return (unsorted * top_k_weights.unsqueeze(-1)).to(hidden_states.dtype).sum(1)  # (N, H)


def _local_rows(module: torch.nn.Module, view: _LocalExperts, rows: torch.Tensor, local_index: torch.Tensor,
                tenant: torch.Tensor, route: routing.Routing | None, rank: int, per: int) -> torch.Tensor:
    """This rank's experts over the rows every rank sent them (M, H), unweighted: each row with its adapter's
    expert deltas (the adapters of the pass, their factors sliced to these experts) where the pass has any."""
    name = lora_experts.registered_name(module)
    passing = route.passing if route is not None else []
    if name is not None and passing:
        adapters = [_LocalFactors(a, rank, per) for a in passing] + [None]  # the last: rows of no adapter
        group = torch.where(tenant < 0, len(passing), tenant)
        out = lora_experts.rows_forward(view, name, rows, local_index, adapters, group)
        if out is not None:
            return out
    elif bool((tenant >= 0).any()):  # another rank's rows need adapters this rank does not have: a bug
        raise ServerError(f"rank {rank} received rows of a LoRA adapter it does not hold")
    forward = getattr(type(module), "_tinkerq_original_forward", type(module).forward)  # not LoRA's wrapper
    ones = torch.ones((rows.shape[0], 1), dtype=rows.dtype, device=rows.device)
    return forward(view, rows, local_index.unsqueeze(1), ones)


class _LocalFactors:
    """An adapter seen by one rank's experts: a per-expert factor (E, ...) is this rank's E/N experts' slice (a
    DTensor sharded with the experts: its local part); shared factors (1, ...) and other targets as they are."""

    def __init__(self, adapter: Any, rank: int, per: int) -> None:
        self._adapter, self._rank, self._per = adapter, rank, per
        self.scaling = adapter.scaling

    def pair(self, target: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        pair = self._adapter.pair(target)
        if pair is None:
            return None
        a, b = (self._local(t) for t in pair)
        return a, b

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            return t.to_local()
        if t.dim() == 3 and t.shape[0] > 1:  # whole per-expert factors (a snapshot): this rank's experts
            return t[self._rank * self._per:(self._rank + 1) * self._per]
        return t


def shard_expert_factors(adapter: Any, mesh: DeviceMesh) -> None:
    """Keep each per-expert factor of ``adapter`` (worker/lora/adapter.py: w1/w3's B (E, I, r), w2's A (E, r, I))
    only for this rank's experts: a DTensor sharded on dim 0 like the experts themselves, its local part sliced
    from the whole factor as initialised (so a group's adapter starts as an unsharded worker's). The shared factors
    stay whole on every rank (their gradients are summed over the ranks by the engine)."""
    world, rank = mesh.size(), mesh.get_local_rank()
    for target in adapter.targets:
        if not target.experts:
            continue
        store = adapter.b if target.shared_a else adapter.a
        key = adapter_key(target.name)
        whole = store[key].detach()
        per = target.experts // world
        local = whole[rank * per:(rank + 1) * per].clone()
        store[key] = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                           shape=whole.shape, stride=whole.stride()))


def _exchange(rows: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: Any) -> torch.Tensor:
    """All-to-all of ``rows`` (sum(in_sizes), H) -> (sum(out_sizes), H), differentiable (the backward sends the
    gradients back the same way), waited for here."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(rows.contiguous(), out_sizes, in_sizes, group))
