"""Streaming sharded loads (worker/sharding/streaming.py) against the load they replace, on a real CPU group (gloo,
started here with torch.multiprocessing.spawn): every rank builds one sharded copy of the model, either

- **whole**: the whole model read by ``load_causal_lm``, copied (as a full session's copy was made) and sharded: what
  every rank did before; or
- **streamed**: the skeleton copied, sharded on the meta device and filled from the files with this rank's rows.

Each rank reports its seconds and its peak RSS growth (``VmHWM``, reset before each), alternated rep by rep. Models
are built from a config with a fixed seed and written with save_pretrained (no download): a dense Llama and a
Qwen3-MoE of ~400 MiB in float32.

    .venv/bin/python benchmarks/streaming_load.py [--ranks 4] [--reps 2]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path
from typing import Any

from _fleet import join_group, leave_group, machine, median, peak_growth, print_table, spawn_ranks

MiB = 1 << 20
MODELS: dict[str, dict[str, Any]] = {
    "Llama (8 layers, hidden 1024, vocab 8000)": dict(
        family="llama", vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4),
    "Qwen3-MoE (8 layers, hidden 512, 16 experts)": dict(
        family="qwen3_moe", vocab_size=4000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
        num_experts=16, num_experts_per_tok=2, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64),
}


def _rank(rank: int, world: int, port: int, path: str, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from tinkerq.worker.loading.models import load_causal_lm, load_skeleton
    from tinkerq.worker.sharding.fsdp import shard
    from tinkerq.worker.sharding.streaming import fill_shards
    from tinkerq.worker.training.logprobs import LogprobComputer

    group = join_group(rank, world, port)

    def whole() -> Any:
        model = load_causal_lm(path)
        return shard(copy.deepcopy(model), group, LogprobComputer(model), lambda root, lm: None)

    def streamed() -> Any:
        skeleton = load_skeleton(path)

        def fill(root: Any, lm: Any) -> None:
            fill_shards(root, lm, skeleton, path, device="cpu", dtype=torch.float32)

        return shard(copy.deepcopy(skeleton), group, LogprobComputer(skeleton, device="cpu"), fill)

    got: dict[str, list[tuple[int, float]]] = {"whole": [], "streamed": []}
    for rep in range(reps + 1):  # the first rep warms up (imports, gloo, allocator)
        for kind in (("whole", "streamed") if rep % 2 else ("streamed", "whole")):
            dist.barrier()
            held: list[Any] = []  # the sharded model stays alive through the measurement, then goes
            measured = peak_growth(lambda k=kind, h=held: h.append(whole() if k == "whole" else streamed()))
            if rep:
                got[kind].append(measured)
            held.clear()
    leave_group(rank, out, got)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()


    from tinkerq.recipes.families import build_model
    from tinkerq.worker.loading.models import load_skeleton
    from tinkerq.worker.memory import ModelShape, streamed_load_bytes

    print(f"machine: {machine()}; {args.ranks} ranks (gloo, 1 torch thread each), float32; {args.reps} reps after a "
          f"warm-up, alternated")
    rows, ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for label, spec in MODELS.items():
            config = dict(spec)
            directory = Path(tmp, config["family"])
            build_model(config.pop("family"), 0, **config).save_pretrained(directory)
            shape = ModelShape.of(load_skeleton(str(directory)))
            ranks = spawn_ranks(_rank, args.ranks, (str(directory), args.reps, tmp), tmp)
            planned = shape.param_bytes // args.ranks + streamed_load_bytes(shape)
            medians = {}
            for kind in ("whole", "streamed"):
                peaks = [p for r in ranks for p, _ in r[kind]]
                seconds = [s for r in ranks for _, s in r[kind]]
                medians[kind] = (median(peaks), median(seconds))
                rows.append((label, kind, shape.param_bytes / MiB, median(peaks) / MiB, max(peaks) / MiB,
                             planned / MiB if kind == "streamed" else "-", median(seconds)))
            ratios.append((label, medians["streamed"][0] / medians["whole"][0],
                           medians["streamed"][1] / medians["whole"][1]))
    print()
    print_table(["model", "load", "model MiB", "peak RSS growth per rank MiB (median)", "max MiB",
                 "planned MiB (shard + 2 x largest weight)", "s per rank (median)"], rows)
    print()
    print_table(["model", "peak streamed / whole", "time streamed / whole"], ratios)


if __name__ == "__main__":
    main()
