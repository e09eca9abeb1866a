"""Ranks of a CPU (gloo) group for tests/test_expert_parallel.py, started with torch.multiprocessing.spawn.

Each rank builds the model expert-parallel (its experts split by expert, the rest under FSDP2, filled from the
files as a shard group's ranks fill theirs), runs its own batch forward and backward as the training engine does
(the loss scaled by the group size), and compares with the whole model loaded by ``from_pretrained`` running every
rank's batch: its logprobs, and every parameter's whole gradient. Results go to ``<out>/rank<r>.json``."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.streaming_ranks import _join
from tinkerq.worker.loading.models import load_causal_lm, load_skeleton
from tinkerq.worker.lora.experts import is_fused_experts
from tinkerq.worker.sharding.fsdp import LogprobModule, shard
from tinkerq.worker.sharding.streaming import fill_shards
from tinkerq.worker.training import checkpointing as activation_checkpointing
from tinkerq.worker.training.logprobs import LogprobComputer


class _Group:
    def __init__(self, mesh) -> None:
        self.mesh = mesh


def _batch(vocab: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows: a different length and mask per rank (variable-length datums)."""
    gen = torch.Generator().manual_seed(100 + rank)
    length = 7 + 3 * rank
    tokens = torch.randint(0, vocab, (2, length), generator=gen)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, length - 2 - rank:] = False
    return tokens, mask, torch.roll(tokens, -1, 1)


def _expert_parallel(path: str, mesh) -> tuple[LogprobModule, set[str]]:
    skeleton = load_skeleton(path)
    model = copy.deepcopy(skeleton)

    def fill(root: torch.nn.Module, lm) -> None:
        fill_shards(root, lm, skeleton, path, device="cpu", dtype=torch.float32)

    root = shard(model, _Group(mesh), LogprobComputer(skeleton, device="cpu"), fill, expert_parallel=True)
    by_expert = {n for n, m in root.lm.named_modules() if hasattr(m, "_tinkerq_ep")}
    return root, by_expert


def _skew(model: torch.nn.Module, world: int) -> None:
    """Every token's experts remapped into rank 0's (index mod E/W): the most uneven routing there is."""
    for module in model.modules():
        if is_fused_experts(module):
            per = module.num_experts // world

            def to_rank0(mod, args, per=per):
                hidden, index, weights = args
                return hidden, index % per, weights

            module.register_forward_pre_hook(to_rank0)


def compare(rank: int, world: int, port: int, paths: list[str], out: str, skew: bool = False,
            checkpointing: bool = False) -> None:
    """``skew``: every token routed to rank 0's experts, in both models. ``checkpointing``: the expert-parallel
    model's decoder layers are checkpointed (their all-to-alls run again in the backward's recomputation)."""
    mesh = _join(rank, world, port)
    torch.set_num_threads(1)
    found = {}
    for path in paths:
        root, by_expert = _expert_parallel(path, mesh)
        reference = load_causal_lm(path)
        if skew:
            _skew(root.lm, world)
            _skew(reference, world)
        ref_root = LogprobModule(reference, LogprobComputer(reference, device="cpu"))
        vocab = reference.get_input_embeddings().weight.shape[0]
        # The whole model over every rank's rows: the sum of their logprobs is the loss.
        ref_total = 0
        ref_mine = None
        for r in range(world):
            lp = ref_root(*_batch(vocab, r))
            ref_total = ref_total + lp.sum()
            if r == rank:
                ref_mine = lp.detach()
        ref_total.backward()
        # Expert parallel: this rank's rows only, the loss scaled by the group size (the engine's convention).
        with activation_checkpointing.enabled(checkpointing):
            lp = root(*_batch(vocab, rank))
            (lp.sum() * world).backward()
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        grad_diff, local, whole, expert_local = 0.0, 0, 0, 0
        for name, p in root.lm.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            want = ref_grads[name]
            if g is None or want is None:  # a parameter no loss reaches (Kimi-Linear has one): in both, or a bug
                grad_diff = max(grad_diff, 0.0 if g is None and want is None else float("inf"))
            else:
                grad_diff = max(grad_diff, float((g - want).abs().max()) / max(1.0, float(want.abs().max())))
            part = p.to_local() if isinstance(p, DTensor) else p
            local += part.numel()
            whole += p.numel()
            if name.rsplit(".", 1)[0] in by_expert:
                expert_local += part.numel()
        weights_same = all(torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, reference.state_dict()[n])
                           for n, p in root.lm.named_parameters())
        found[path] = {"experts_modules": len(by_expert), "logprob_diff": float((lp.detach() - ref_mine).abs().max()),
                       "grad_diff": grad_diff, "weights_same": weights_same, "local": local, "whole": whole,
                       "expert_local": expert_local,
                       "rows": [m._tinkerq_ep_rows for n, m in root.lm.named_modules() if n in by_expert]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def peak_pass(rank: int, world: int, port: int, path: str, out: str, rows: int, tokens: int) -> None:
    """This rank's peak RSS growth over one checkpointed forward_backward pass of an expert-parallel model whose every
    token is routed into rank 0's experts (after a warm-up pass), its gradients allocated by the pass."""
    from tests.helpers import peak_rss_growth

    mesh = _join(rank, world, port)
    torch.set_num_threads(1)
    root, _ = _expert_parallel(path, mesh)
    _skew(root.lm, world)
    vocab = root.lm.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, vocab, (rows, tokens), generator=gen)
    mask = torch.ones_like(batch, dtype=torch.bool)

    def step() -> None:
        with activation_checkpointing.enabled(True):
            (root(batch, mask, torch.roll(batch, -1, 1)).sum() * world).backward()
        for p in root.parameters():
            p.grad = None

    step()  # torch's, gloo's and the allocator's one-time costs are not the pass's
    dist.barrier()
    growth = peak_rss_growth(step)
    rows_computed = [m._tinkerq_ep_rows for m in root.lm.modules() if hasattr(m, "_tinkerq_ep")]
    Path(out, f"rank{rank}.json").write_text(json.dumps({"growth": growth, "rows": rows_computed}))
    dist.barrier()
    dist.destroy_process_group()


def _lora_datums(vocab: int, seed: int, count: int):
    """``count`` datums of different lengths, the last rows' weights partly masked (variable-length, masked)."""
    import numpy as np

    from tinkerq import types

    gen = np.random.default_rng(seed)
    out = []
    for i in range(count):
        n = int(gen.integers(4, 13))
        tokens = gen.integers(0, vocab, n + 1)
        weights = np.ones(n, dtype=np.float32)
        weights[: i % 3] = 0.0
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": tokens[1:].tolist(), "weights": weights}))
    return out


def lora_compare(rank: int, world: int, port: int, paths: list[str], out: str, skew: bool = False,
                 checkpointing: bool = False, kept: bool = False) -> None:
    """LoRA tenants on an expert-parallel base (its experts and the tenants' per-expert factors split by expert,
    worker/sharding/experts.py) against the same tenants on the whole model loaded by ``from_pretrained``: one mixed
    pass of three tenants (each request's datums split over the ranks), its outputs on rank 0, every factor's whole
    gradient, and the factors after an AdamW step, on every rank. ``kept``: the base's quantized routed experts kept
    as stored (each rank only its experts'), against the whole model dequantized on load."""
    from tinkerq import types
    from tinkerq.worker.lora.batch import LossItem
    from tinkerq.worker.lora.session import LoraBase, LoraSession
    from tinkerq.worker.sharding.experts import shard_expert_factors
    from tinkerq.worker.sharding.fsdp import shard_frozen
    from tinkerq.worker.sharding.group import ShardGroup, ShardSpec

    mesh = _join(rank, world, port)
    torch.set_num_threads(1)
    group = ShardGroup(ShardSpec(world, rank, "127.0.0.1", port, "cpu", 60.0, 60.0))
    group.mesh = mesh  # the collectives the sessions use run on the default group, joined above
    configs = [types.LoraConfig(rank=4, seed=1), types.LoraConfig(rank=8, seed=2, train_attn=False),
               types.LoraConfig(rank=4, seed=3, train_mlp=False)]  # the last adapts no expert
    adam = types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0, eps=1e-3)
    found = {}
    for path in paths:
        skeleton = load_skeleton(path)
        model = copy.deepcopy(skeleton)
        base = LoraBase(model, LogprobComputer(skeleton, device="cpu"), model_dir=path, microbatch_tokens=64,
                        group=group, device="cpu")

        def fill(root: torch.nn.Module, lm, skeleton=skeleton, path=path) -> None:
            fill_shards(root, lm, skeleton, path, device="cpu", dtype=torch.float32)

        base.root = shard_frozen(model, group, base.logprobs, fill, expert_parallel=True,
                                 kept_from=path if kept else None)
        base.shard_adapter = lambda adapter: shard_expert_factors(adapter, mesh)
        reference = load_causal_lm(path)
        ref_base = LoraBase(reference, LogprobComputer(reference, device="cpu"), model_dir=path,
                            microbatch_tokens=64, device="cpu")
        if skew:
            _skew(base.model, world)
            _skew(reference, world)
        mine = [LoraSession(f"t{i}", base, c, base_model="m") for i, c in enumerate(configs)]
        theirs = [LoraSession(f"r{i}", ref_base, c, base_model="m") for i, c in enumerate(configs)]
        vocab = reference.get_input_embeddings().weight.shape[0]
        batches = [_lora_datums(vocab, 40 + i, 2 * world + i) for i in range(len(configs))]
        items = [LossItem(s, b, "cross_entropy", None, checkpointing=checkpointing)
                 for s, b in zip(mine, batches, strict=True)]
        refs = [LossItem(s, b, "cross_entropy", None) for s, b in zip(theirs, batches, strict=True)]
        base.run_pass(items, True)
        ref_base.run_pass(refs, True)
        from tinkerq.worker.loading import quantized_base

        result = {"logprob_diff": 0.0, "grad_diff": 0.0, "weight_diff": 0.0, "sharded_factors": 0,
                  "rows": [m._tinkerq_ep_rows for m in base.model.modules() if hasattr(m, "_tinkerq_ep")],
                  "kept_modules": sum(quantized_base.stored_bytes(m) > 0 for m in base.model.modules()),
                  "stored_bytes": sum(quantized_base.stored_bytes(m) for m in base.model.modules())}
        if kept:  # what this rank holds of the base, against what the worker admits for it
            from tinkerq.worker.sharding.experts import kept_base_bytes

            held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                       for p in base.model.parameters())
            held += sum(b.numel() * b.element_size() for b in base.model.buffers())  # the kept parts too
            result["base_held"], result["base_admitted"] = held, kept_base_bytes(skeleton, path, world)
        for item, ref in zip(items, refs, strict=True):
            assert item.error is None and ref.error is None, (item.error, ref.error)
            if rank == 0:
                for a, b in zip(item.output.loss_fn_outputs, ref.output.loss_fn_outputs, strict=True):
                    diff = float(abs(a["logprobs"].to_numpy() - b["logprobs"].to_numpy()).max())
                    result["logprob_diff"] = max(result["logprob_diff"], diff)
        for s, r in zip(mine, theirs, strict=True):
            result["sharded_factors"] += sum(isinstance(p, DTensor) for p in s.engine.params)
            saved = s.engine.gather_state()  # a collective: every rank, in order
            if rank == 0:
                for name, want in zip(r.engine.param_names, r.engine.grads(), strict=True):
                    got = saved.grads[name]
                    scale = max(1.0, float(want.abs().max()))
                    result["grad_diff"] = max(result["grad_diff"], float((got - want).abs().max()) / scale)
            s.optim_step(adam)
            r.optim_step(adam)
            weights = s.engine.gather_weights()
            if rank == 0:
                for name, want in r.adapter.named_pairs():
                    diff = float((weights[name] - want.detach()).abs().max())
                    result["weight_diff"] = max(result["weight_diff"], diff)
        # Trained, the adapters change the outputs (B was zero): a forward-only pass of new datums on both.
        probes = [_lora_datums(vocab, 60 + i, world + i) for i in range(len(configs))]
        items = [LossItem(s, b, "cross_entropy", None) for s, b in zip(mine, probes, strict=True)]
        refs = [LossItem(s, b, "cross_entropy", None) for s, b in zip(theirs, probes, strict=True)]
        base.run_pass(items, False)
        ref_base.run_pass(refs, False)
        result["trained_logprob_diff"] = max(
            (float(abs(a["logprobs"].to_numpy() - b["logprobs"].to_numpy()).max())
             for item, ref in zip(items, refs, strict=True) if rank == 0
             for a, b in zip(item.output.loss_fn_outputs, ref.output.loss_fn_outputs, strict=True)), default=0.0)
        found[path] = result
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def planned_peak(rank: int, world: int, port: int, paths: list[str], out: str, datums: int, seq_len: int,
                 microbatch_tokens: int, lora_rank: int) -> None:
    """For each model: one LoRA tenant's first forward_backward + optim_step on an expert-parallel group keeping its
    quantized experts as stored, decoder layers checkpointed, every token routed into rank 0's experts (the routing
    the plan covers). What this rank holds of the base and of the adapter before, and the peak of live tensor bytes
    over the step above that (tests.helpers.LiveTensorBytes), to ``<out>/rank<r>.json``."""
    import numpy as np

    from tests.helpers import LiveTensorBytes
    from tinkerq import types
    from tinkerq.worker.lora.batch import LossItem
    from tinkerq.worker.lora.session import LoraBase, LoraSession
    from tinkerq.worker.sharding.experts import shard_expert_factors
    from tinkerq.worker.sharding.fsdp import shard_frozen
    from tinkerq.worker.sharding.group import ShardGroup, ShardSpec

    mesh = _join(rank, world, port)
    torch.set_num_threads(1)
    group = ShardGroup(ShardSpec(world, rank, "127.0.0.1", port, "cpu", 60.0, 60.0))
    group.mesh = mesh

    def nbytes(tensors) -> int:
        return sum((t.to_local() if isinstance(t, DTensor) else t).untyped_storage().nbytes() for t in tensors)

    found = {}
    for path in paths:
        skeleton = load_skeleton(path)
        model = copy.deepcopy(skeleton)
        base = LoraBase(model, LogprobComputer(skeleton, device="cpu"), model_dir=path,
                        microbatch_tokens=microbatch_tokens, group=group, device="cpu")

        def fill(root: torch.nn.Module, lm, skeleton=skeleton, path=path) -> None:
            fill_shards(root, lm, skeleton, path, device="cpu", dtype=torch.float32)

        base.root = shard_frozen(model, group, base.logprobs, fill, expert_parallel=True, kept_from=path)
        base.shard_adapter = lambda adapter: shard_expert_factors(adapter, mesh)
        _skew(base.model, world)
        held_base = nbytes([*base.model.parameters(), *base.model.buffers()])  # the kept experts' parts: buffers
        tenant = LoraSession("t", base, types.LoraConfig(rank=lora_rank, seed=1), base_model="m")
        vocab = skeleton.get_input_embeddings().weight.shape[0]
        gen = np.random.default_rng(7)
        data = []
        for _ in range(datums):
            tokens = gen.integers(0, vocab, seq_len + 1)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                                    loss_fn_inputs={"target_tokens": tokens[1:].tolist(),
                                                    "weights": np.ones(seq_len, dtype=np.float32)}))
        item = LossItem(tenant, data, "cross_entropy", None, checkpointing=True)
        dist.barrier()
        with LiveTensorBytes() as live:
            base.run_pass([item], True)
            tenant.optim_step(types.AdamParams(learning_rate=1e-3))
        assert item.error is None, item.error
        found[path] = {"base": held_base, "adapter": nbytes(tenant.engine.params), "step_peak": live.peak,
                       "rows": [m._tinkerq_ep_rows for m in base.model.modules() if hasattr(m, "_tinkerq_ep")]}
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()
