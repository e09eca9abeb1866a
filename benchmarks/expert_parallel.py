"""Expert parallelism (worker/sharding/experts.py) against FSDP2 alone, on a real CPU group (gloo, started here with
torch.multiprocessing.spawn): every rank builds one sharded copy of a Qwen3-MoE (streamed from the files, as a
shard group's full session is made), then runs forward_backward passes over its own rows, either

- **fsdp**: every decoder layer under FSDP2, experts included: each rank gathers a MoE layer's experts whole for its
  forward and again for its backward; or
- **ep**: the routed experts split by expert (E/N per rank, left out of FSDP), tokens sent to them and back by
  all-to-all; attention, norms, router and embeddings under FSDP2 as before.

Each rank reports the seconds of one pass (forward and backward, the loss scaled as the engine scales it) and its
peak RSS growth during it (``VmHWM``, reset before each), alternated rep by rep after a warm-up. The model is built
from a config with a fixed seed and written with save_pretrained (no download).

With ``--lora T``, the same two layouts as a LoRA group's frozen base instead, with T tenants of rank ``--lora-rank``
(attention, MLP and experts adapted) in one mixed pass (worker/lora/batch.py): under **fsdp** each tenant's adapter
is whole on every rank; under **ep** its per-expert factors live with their experts (worker/sharding/experts.py).
Each rank also reports the tenants' adapter state (weights, gradients, AdamW moments) it holds.

    .venv/bin/python benchmarks/expert_parallel.py [--ranks 4] [--reps 3] [--rows 2] [--tokens 128] [--experts 32]
                                                   [--skew] [--lora 2 --lora-rank 32]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path
from typing import Any

from _fleet import join_group, leave_group, machine, median, peak_growth, print_table, spawn_ranks

MiB = 1 << 20


def _model(experts: int) -> dict[str, Any]:
    return dict(vocab_size=4000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
                num_experts=experts, num_experts_per_tok=4, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64)


def _rank(rank: int, world: int, port: int, path: str, reps: int, rows: int, tokens: int, out: str,
          skew: bool, tenants: int = 0, lora_rank: int = 32) -> None:
    import torch
    import torch.distributed as dist

    from tinkerq.worker.loading.models import load_skeleton
    from tinkerq.worker.sharding.fsdp import shard
    from tinkerq.worker.sharding.streaming import fill_shards
    from tinkerq.worker.training.logprobs import LogprobComputer

    group = join_group(rank, world, port)
    skeleton = load_skeleton(path)

    def build(expert_parallel: bool) -> Any:
        def fill(root: Any, lm: Any) -> None:
            fill_shards(root, lm, skeleton, path, device="cpu", dtype=torch.float32)

        return shard(copy.deepcopy(skeleton), group, LogprobComputer(skeleton, device="cpu"), fill,
                     expert_parallel=expert_parallel)

    if tenants:
        _lora_rank(rank, world, port, group, skeleton, path, reps, rows, tokens, out, skew, tenants, lora_rank)
        return
    models = {"fsdp": build(False), "ep": build(True)}
    if skew:
        for root in models.values():
            _skewed(root.lm, world)
    gen = torch.Generator().manual_seed(rank)
    tokens_ = torch.randint(0, 4000, (rows, tokens), generator=gen)
    mask = torch.ones_like(tokens_, dtype=torch.bool)
    targets = torch.roll(tokens_, -1, 1)

    def step(root: Any) -> None:
        (root(tokens_, mask, targets).sum() * world).backward()
        for p in root.parameters():
            p.grad = None

    got: dict[str, list[tuple[int, float]]] = {"fsdp": [], "ep": []}
    for rep in range(reps + 1):  # the first rep warms up (gloo, allocator)
        for kind in (("fsdp", "ep") if rep % 2 else ("ep", "fsdp")):
            dist.barrier()
            measured = peak_growth(lambda k=kind: step(models[k]))
            if rep:
                got[kind].append(measured)
    leave_group(rank, out, got)


def _skewed(model: Any, world: int) -> None:
    """Every token's experts remapped into rank 0's: the most uneven routing there is."""
    for module in model.modules():
        if hasattr(module, "num_experts") and hasattr(module, "gate_up_proj"):
            per = module.num_experts // world
            module.register_forward_pre_hook(lambda mod, args, per=per: (args[0], args[1] % per, args[2]))


def _lora_rank(rank: int, world: int, port: int, group: Any, skeleton: Any, path: str, reps: int, rows: int,
               tokens: int, out: str, skew: bool, tenants: int, lora_rank: int) -> None:
    """``--lora``: the two layouts as a LoRA group's base, ``tenants`` adapters in one mixed pass per measurement."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from tinkerq import types
    from tinkerq.worker.lora.batch import LossItem
    from tinkerq.worker.lora.session import LoraBase, LoraSession
    from tinkerq.worker.sharding.experts import shard_expert_factors
    from tinkerq.worker.sharding.fsdp import shard_frozen
    from tinkerq.worker.sharding.group import ShardGroup, ShardSpec
    from tinkerq.worker.sharding.streaming import fill_shards
    from tinkerq.worker.training.logprobs import LogprobComputer

    collectives = ShardGroup(ShardSpec(world, rank, "127.0.0.1", port, "cpu", 300.0, 300.0))
    collectives.mesh = group.mesh  # the sessions' collectives run on the default group, joined already

    def build(expert_parallel: bool) -> list[Any]:
        model = copy.deepcopy(skeleton)
        base = LoraBase(model, LogprobComputer(skeleton, device="cpu"), model_dir=path, microbatch_tokens=16384,
                        group=collectives, device="cpu")

        def fill(root: Any, lm: Any) -> None:
            fill_shards(root, lm, skeleton, path, device="cpu", dtype=torch.float32)

        base.root = shard_frozen(model, collectives, base.logprobs, fill, expert_parallel=expert_parallel)
        if expert_parallel:
            base.shard_adapter = lambda adapter: shard_expert_factors(adapter, group.mesh)
        if skew:
            _skewed(model, world)
        return [LoraSession(f"t{i}", base, types.LoraConfig(rank=lora_rank, seed=i), base_model="bench")
                for i in range(tenants)]

    sessions = {"fsdp": build(False), "ep": build(True)}
    rng = np.random.default_rng(7)  # the same datums on every rank: each computes its share of every request
    data = [[types.Datum(model_input=types.ModelInput.from_ints(rng.integers(0, 4000, tokens).tolist()),
                         loss_fn_inputs={"target_tokens": rng.integers(0, 4000, tokens).tolist(),
                                         "weights": np.ones(tokens, dtype=np.float32)})
             for _ in range(rows * world)] for _ in range(tenants)]

    def step(kind: str) -> None:
        items = [LossItem(s, d, "cross_entropy", None) for s, d in zip(sessions[kind], data, strict=True)]
        sessions[kind][0].pass_group.pass_here(items, True)
        for s in sessions[kind]:
            for p in s.engine.params:  # the pending gradients stay allocated, as in a session
                p.grad.zero_()

    got: dict[str, Any] = {"fsdp": [], "ep": [], "state": {k: sum(s.state_bytes() for s in v)
                                                           for k, v in sessions.items()}}
    for rep in range(reps + 1):
        for kind in (("fsdp", "ep") if rep % 2 else ("ep", "fsdp")):
            dist.barrier()
            measured = peak_growth(lambda k=kind: step(k))
            if rep:
                got[kind].append(measured)
    leave_group(rank, out, got)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=2, help="datums per rank")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per datum")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--skew", action="store_true", help="every token routed into rank 0's experts")
    parser.add_argument("--lora", type=int, default=0, metavar="T",
                        help="a LoRA group's base instead, T tenants in one mixed pass")
    parser.add_argument("--lora-rank", type=int, default=32)
    args = parser.parse_args()


    from tinkerq.recipes.families import build_model
    from tinkerq.worker.loading.models import load_skeleton
    from tinkerq.worker.memory import ModelShape

    spec = _model(args.experts)
    label = (f"Qwen3-MoE ({spec['num_hidden_layers']} layers, hidden {spec['hidden_size']}, {args.experts} experts "
             f"of width {spec['moe_intermediate_size']}, top-{spec['num_experts_per_tok']})")
    print(f"machine: {machine()}; {args.ranks} ranks (gloo, 1 torch thread each), float32; {label}; "
          f"{args.rows} x {args.tokens} tokens per rank; {args.reps} reps after a warm-up, alternated")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp, "model")
        build_model("qwen3_moe", 0, **spec).save_pretrained(directory)
        shape = ModelShape.of(load_skeleton(str(directory)))
        ranks = spawn_ranks(_rank, args.ranks, (str(directory), args.reps, args.rows, args.tokens, tmp, args.skew,
                                                args.lora, args.lora_rank), tmp)
    rows, medians = [], {}
    if args.lora:
        for kind in ("fsdp", "ep"):
            peaks = [p for r in ranks for p, _ in r[kind]]
            seconds = [s for r in ranks for _, s in r[kind]]
            medians[kind] = (median(peaks), median(seconds))
            rows.append((kind, max(r["state"][kind] for r in ranks) / MiB, median(peaks) / MiB, max(peaks) / MiB,
                         median(seconds)))
        print(f"\n{args.lora} LoRA tenants of rank {args.lora_rank} (attention, MLP, experts), one mixed pass of "
              f"{args.rows} x {args.tokens} tokens per rank each")
        print_table(["base layout", "adapters' state per rank MiB", "peak RSS growth per rank in a pass MiB (median)",
                     "max MiB", "s per pass (median)"], rows)
        print()
        print_table(["state ep / fsdp", "peak ep / fsdp", "time ep / fsdp"],
                    [(rows[1][1] / rows[0][1], medians["ep"][0] / medians["fsdp"][0],
                      medians["ep"][1] / medians["fsdp"][1])])
        return
    for kind in ("fsdp", "ep"):
        peaks = [p for r in ranks for p, _ in r[kind]]
        seconds = [s for r in ranks for _, s in r[kind]]
        medians[kind] = (median(peaks), median(seconds))
        rows.append((kind, shape.param_bytes / MiB, median(peaks) / MiB, max(peaks) / MiB, median(seconds)))
    print()
    print_table(["layout", "model MiB", "peak RSS growth per rank in a pass MiB (median)", "max MiB",
                 "s per pass (median)"], rows)
    # What the worker admits a pass with (worker/memory/): the batch (activations, expert-parallel at worst, the
    # gradients, the data) and FSDP's gather room, against the largest rank's peak.
    from tinkerq.worker.memory import batch_bytes, gather_bytes

    lengths = [args.tokens] * (args.rows * args.ranks)
    planned = {kind: batch_bytes(shape, lengths, microbatch_tokens=16384, backward=True, chunk_tokens=None,
                                 shards=args.ranks, expert_parallel=kind == "ep")
               + gather_bytes(shape, args.ranks, weight_grads=True, expert_parallel=kind == "ep")
               for kind in ("fsdp", "ep")}
    print()
    print_table(["layout", "admitted MiB (batch + gather room)", "largest peak / admitted"],
                [(k, planned[k] / MiB, max(p for r in ranks for p, _ in r[k]) / planned[k]) for k in planned])
    print()
    print_table(["peak ep / fsdp", "time ep / fsdp"],
                [(medians["ep"][0] / medians["fsdp"][0], medians["ep"][1] / medians["fsdp"][1])])


if __name__ == "__main__":
    main()
