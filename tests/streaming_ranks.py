"""Ranks of a CPU (gloo) group for tests/test_streaming_load.py, started with torch.multiprocessing.spawn.

Each rank writes what it found to ``<out>/rank<r>.json``; an exception in a rank fails the spawn (and the test)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tinkerq.worker.loading.models import load_causal_lm, load_skeleton
from tinkerq.worker.sharding.fsdp import shard
from tinkerq.worker.sharding.streaming import fill_shards
from tinkerq.worker.training.logprobs import LogprobComputer


class _Group:
    """What fsdp.shard uses of a ShardGroup."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh


def _whole(path: str, mesh) -> torch.nn.Module:
    """The whole model loaded on this rank, then sharded (what every rank did before streaming loads)."""
    model = load_causal_lm(path)
    return shard(model, _Group(mesh), LogprobComputer(model), lambda root, lm: None)


def _streamed(path: str, mesh) -> torch.nn.Module:
    skeleton = load_skeleton(path)
    model = copy.deepcopy(skeleton)

    def fill(root: torch.nn.Module, lm) -> None:
        fill_shards(root, lm, skeleton, path, device="cpu", dtype=torch.float32)

    return shard(model, _Group(mesh), LogprobComputer(skeleton, device="cpu"), fill)


def _train_once(root: torch.nn.Module, rank: int) -> torch.Tensor:
    """Target logprobs (B, T) of a fixed batch, after which each parameter holds its local gradient."""
    vocab = root.lm.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, vocab, (2, 9), generator=gen)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, 6:] = False
    logprobs = root(tokens, mask, torch.roll(tokens, -1, 1))
    logprobs.sum().backward()
    return logprobs.detach()


def _join(rank: int, world: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def compare(rank: int, world: int, port: int, paths: list[str], out: str) -> None:
    """For each model: this rank's streamed shards against the shards of the whole model loaded, then sharded."""
    mesh = _join(rank, world, port)
    torch.set_num_threads(1)
    found = {}
    for path in paths:
        whole, streamed = _whole(path, mesh), _streamed(path, mesh)
        a, b = dict(whole.named_parameters()), dict(streamed.named_parameters())
        differ = sorted(n for n in a.keys() & b.keys() if not torch.equal(a[n].to_local(), b[n].to_local()))
        a_buf, b_buf = dict(whole.named_buffers()), dict(streamed.named_buffers())
        differ += sorted(n for n in a_buf.keys() & b_buf.keys() if not torch.equal(a_buf[n], b_buf[n]))
        # And they train alike: the same logprobs, the same local gradients (FSDP's view of the shards is right).
        same_logprobs = torch.equal(_train_once(whole, rank), _train_once(streamed, rank))
        grads = [n for n in a.keys() & b.keys() if a[n].grad is not None or b[n].grad is not None]
        differ += sorted(f"grad {n}" for n in grads if a[n].grad is None or b[n].grad is None
                         or not torch.equal(a[n].grad.to_local(), b[n].grad.to_local()))
        found[path] = {"names": sorted(a) == sorted(b) and sorted(a_buf) == sorted(b_buf), "differ": differ,
                       "same_logprobs": same_logprobs, "grads": len(grads),
                       "local_elements": sum(p.to_local().numel() for p in b.values()),
                       "elements": sum(p.numel() for p in b.values())}
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def peak(rank: int, world: int, port: int, path: str, out: str) -> None:
    """This rank's peak RSS growth while it builds the skeleton, shards it and fills its shards from the files."""
    from tests.helpers import peak_rss_growth

    mesh = _join(rank, world, port)
    torch.set_num_threads(1)
    _streamed(path, mesh)  # once first: torch's and gloo's one-time allocations are not the load's
    dist.barrier()
    held: list[torch.nn.Module] = []
    growth = peak_rss_growth(lambda: held.append(_streamed(path, mesh)))
    local = sum(p.to_local().numel() * p.element_size() for p in held[0].lm.parameters())
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak_growth": growth, "local_bytes": local}))
    dist.barrier()
    dist.destroy_process_group()


def load_error(rank: int, world: int, port: int, path: str, out: str) -> None:
    """The error a streamed load raises on this rank (or none)."""
    mesh = _join(rank, world, port)
    found = {"error": None, "type": None}
    try:
        _streamed(path, mesh)
    except Exception as exc:
        found = {"error": str(exc), "type": type(exc).__name__}
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()
