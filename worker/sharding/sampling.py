"""Sampling over a shard group's base: the LoRA base sharded once (worker/sharding/host.py), on the group's devices.

Rank 0's sampling engine (worker/sampling/) holds every running row, its KV cache and its sampling state, as on an
unsharded worker; only the weights are sharded. Each forward the engine makes (a prefill or a decode step) runs
through the FSDP root, which gathers each layer's weights from the ranks as it reaches it; every follower joins
those collectives with a one-token forward of its own (``ShardHost.execute("sample_forward")``), so a group
samples with 1/N of the base on each device. The base and every LoRA snapshot of the group's sessions (adapters
over that base) are sampled this way; a full-parameter snapshot is a whole copy on rank 0 (worker/training/session.py).

On an expert-parallel group (worker/sharding/experts.py) a row's MoE tokens are computed by the ranks holding their
experts, so those ranks need the expert factors of the snapshot the row samples: :class:`AdapterMirror` ships each
LoRA snapshot's expert factors to the followers once, with the first forward that routes rows to it (each follower
keeps its experts' slices and the shared factors), and tells them to drop it once rank 0 has let it go.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from tinkerq.worker.lora import routing
from tinkerq.worker.lora.adapter import FrozenAdapter

if TYPE_CHECKING:
    from tinkerq.worker.sharding.host import ShardHost


class GroupSampling:
    """What rank 0's sampling engine calls as its model: the sharded base, each forward run on every rank."""

    # Prompt logprobs come from the model's own logits: the fused head would read the output weight outside a
    # forward, where FSDP holds only this rank's shard of it.
    fused_head = False

    def __init__(self, host: ShardHost, root: torch.nn.Module, lm: torch.nn.Module) -> None:
        self._host = host
        self._root = root
        self._lm = lm
        self._mirror = AdapterMirror() if host.expert_parallel else None

    def __call__(self, **kwargs: Any) -> Any:
        extra: dict[str, Any] = {}
        if self._mirror is not None:
            extra["mirror"], extra["tensors"] = self._mirror.plan(routing.current(), self._host.group.generation)
        return self._host.run("sample_forward", call=lambda: self._root(sample=kwargs), **extra)

    def __getattr__(self, name: str) -> Any:  # config, forward's signature, parameters(): the model's own
        return getattr(self._lm, name)


def join_forward(root: torch.nn.Module, device: torch.device | str) -> None:
    """A follower's part of one of rank 0's sampling forwards: a one-token forward, for its collectives."""
    one = torch.zeros((1, 1), dtype=torch.long, device=device)
    with torch.no_grad():
        root(sample={"input_ids": one, "use_cache": False, "logits_to_keep": 1})


class AdapterMirror:
    """Rank 0: which LoRA snapshots the followers of an expert-parallel group hold (by serial number), and what a
    forward's command must add or drop. The followers' side is :func:`mirror_on_follower`."""

    def __init__(self) -> None:
        self._serials: dict[int, int] = {}  # id(snapshot's adapter) -> serial, while rank 0 holds it
        self._next = 0
        self._dropped: list[int] = []  # serials rank 0 let go of since the last command
        self._generation = -1  # a re-formed group's followers hold nothing

    def plan(self, route: routing.Routing | None, generation: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The command's ``mirror`` (the forward's adapters by serial, in the routing's order; those new to the
        followers with their expert factors' names and shapes; those to drop) and the new factors, whole, to
        broadcast after it."""
        if generation != self._generation:
            self._serials.clear()
            self._dropped.clear()
            self._generation = generation
        passing, new, tensors = [], [], []
        for adapter in route.passing if route is not None else []:
            serial = self._serials.get(id(adapter))
            if serial is None:
                serial = self._serials[id(adapter)] = self._next
                self._next += 1
                weakref.finalize(adapter, self._forget, id(adapter), serial, generation)
                pairs = [(name, pair) for name, pair in _expert_pairs(adapter)]
                new.append({"serial": serial, "scaling": adapter.scaling, "names": [n for n, _ in pairs],
                            "shapes": [[list(a.shape), list(b.shape)] for _, (a, b) in pairs]})
                tensors += [t.detach().to("cpu", torch.float32).contiguous() for _, pair in pairs for t in pair]
            passing.append(serial)
        drop, self._dropped = self._dropped, []
        return {"passing": passing, "new": new, "drop": drop}, tensors

    def _forget(self, key: int, serial: int, generation: int) -> None:
        if generation == self._generation and self._serials.get(key) == serial:
            del self._serials[key]
            self._dropped.append(serial)


def _expert_pairs(adapter: Any) -> list[tuple[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A snapshot's expert factors (3-D pairs), by target name: what other ranks' experts need of it."""
    pairs = getattr(adapter, "pairs", {})
    return [(name, pair) for name, pair in pairs.items() if pair[0].dim() == 3]


def send_mirrored(tensors: list[torch.Tensor]) -> None:
    """Rank 0: broadcast a command's new expert factors (after the command, before the forward)."""
    for t in tensors:
        dist.broadcast(t, src=0)


def mirror_on_follower(held: dict[int, FrozenAdapter], mirror: dict[str, Any], mesh: Any,
                       device: torch.device | str) -> list[FrozenAdapter]:
    """A follower: drop and add the snapshots ``mirror`` says (receiving the new ones' factors as rank 0 sends
    them, keeping this rank's experts' slices: DTensors sharded like the experts); returns the forward's adapters,
    in rank 0's order."""
    for serial in mirror["drop"]:
        held.pop(int(serial), None)
    world, rank = mesh.size(), mesh.get_local_rank()
    for entry in mirror["new"]:
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, shapes in zip(entry["names"], entry["shapes"], strict=True):
            factors: list[torch.Tensor] = []
            for shape in shapes:
                whole = torch.empty(shape, dtype=torch.float32)
                dist.broadcast(whole, src=0)
                if shape[0] > 1:  # per-expert: this rank's experts
                    per = shape[0] // world
                    local = whole[rank * per:(rank + 1) * per].to(device).contiguous()
                    factors.append(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                      shape=whole.shape, stride=whole.stride()))
                else:
                    factors.append(whole.to(device))
            pairs[name] = (factors[0], factors[1])
        held[int(entry["serial"])] = FrozenAdapter(pairs, float(entry["scaling"]))
    return [held[int(serial)] for serial in mirror["passing"]]
