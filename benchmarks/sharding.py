"""A model in N shards vs one worker: training-state memory per shard, and the step time it costs.

Model: the ~20M-parameter Llama of train_step.py (random weights, fixed seed, save_pretrained); batch:
4 datums x 512 tokens, float32, AdamW. One redis-server; one unsharded `tinkerq worker` (the baseline,
measured in the same run) and one shard group per N in ``--shards`` (N `tinkerq worker --shards N --rank
r` processes, gloo on the CPU). Each runs the same forward_backward + optim_step steps, alternating.

Memory: every optim_step of a sharded session reports ``shard_state_bytes:max``, the bytes of parameters,
gradients and AdamW moments the fullest shard holds (counted from its local tensors); the whole is
4 tensors x 4 bytes x parameters. Time: on one CPU machine the shards share its cores, so the ratio shows
the cost of splitting work and of the collectives, not a speed-up.

With ``--lora RANK`` every setup trains a LoRA session of that rank instead (the base sharded once and frozen,
the adapter and its AdamW state whole on every rank): memory per shard is then the base's shard (counted from
rank 0's local tensors, ``base_shard_bytes`` in create_model's reply) plus the adapter state
(``shard_state_bytes:max``; on one worker ``state_bytes``), against the whole base plus that state.

    .venv/bin/python benchmarks/sharding.py [--shards 2 4] [--reps 5] [--threads 2] [--lora 32]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from _fleet import Fleet, build_llama, machine, median, print_table
from train_step import LLAMA_20M

from tinkerq import types
from tinkerq.launcher.processes import free_port, start_process, wait_for, worker_command

DATUMS, SEQ = 4, 512


def make_batch(vocab: int) -> list[types.Datum]:
    rng = np.random.default_rng(0)
    data = []
    for _ in range(DATUMS):
        seq = rng.integers(0, vocab, SEQ + 1, dtype=np.int64)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                                loss_fn_inputs={"target_tokens": seq[1:], "weights": np.ones(SEQ, np.float32)}))
    return data


def start_group(fleet: Fleet, shards: int, threads: int, logs: Path) -> list:
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for rank in reversed(range(shards)):
        cmd = worker_command(str(fleet.model_dir), fleet.url, threads=threads, extra=[
            "--name", f"bench-{shards}-shards", "--shards", str(shards), "--rank", str(rank),
            "--rendezvous", rendezvous])
        procs.append(start_process(cmd, logs / f"shards{shards}-rank{rank}.log",
                                   {"TINKERQ_MICROBATCH_TOKENS": "65536"}))
    return procs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[2])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the unsharded worker; each "
                        "of N shards gets max(1, threads // N), so every setup uses the same cores")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="train LoRA sessions of this rank")
    args = parser.parse_args()
    adam = types.AdamParams(learning_rate=1e-4)
    data = make_batch(LLAMA_20M["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_llama(Path(tmp) / "llama-20m", **LLAMA_20M)
        with Fleet(model_dir, threads=args.threads, env={"TINKERQ_MICROBATCH_TOKENS": "65536"}) as fleet:
            groups = {n: start_group(fleet, n, max(1, args.threads // n), Path(tmp)) for n in args.shards}
            service = fleet.service()
            try:
                for n, procs in groups.items():
                    wait_for(lambda n=n: bool(service.connection.workers_serving(f"bench-{n}-shards")), 300,
                             f"{n}-shard group", procs[-1], Path(tmp) / f"shards{n}-rank0.log")
                def open_client(name: str):
                    if args.lora:
                        return service.create_lora_training_client(name, rank=args.lora, seed=1).result()
                    return service.create_training_client(name).result()

                clients = {1: open_client(str(fleet.model_dir))}
                clients.update({n: open_client(f"bench-{n}-shards") for n in args.shards})
                n_params = clients[1].info.num_parameters
                base_bytes = {n: float(tc.info.extra.get("base_shard_bytes", 4.0 * n_params))
                              for n, tc in clients.items()}
                times: dict[int, list[float]] = {n: [] for n in clients}
                state_bytes: dict[int, float] = {}
                losses: dict[int, list[float]] = {n: [] for n in clients}
                for rep in range(args.warmup + args.reps):
                    for n, tc in clients.items():
                        t0 = time.perf_counter()
                        fb, step = tc.forward_backward(data), tc.optim_step(adam)
                        losses[n].append(fb.result(timeout=600).metrics["loss:sum"])
                        metrics = step.result(timeout=600).metrics
                        if rep >= args.warmup:
                            times[n].append(time.perf_counter() - t0)
                        whole_state = (float(tc.info.extra["lora"]["state_bytes"]) if args.lora
                                       else 16.0 * n_params)
                        state_bytes[n] = metrics.get("shard_state_bytes:max", whole_state)
                        if args.lora:  # the frozen base (its shard) + the adapter's weights, grads, moments
                            state_bytes[n] += base_bytes[n]
                    print(f"  rep {rep}{' (warm-up)' if rep < args.warmup else ''}: "
                          + ", ".join(f"{n} shard(s) {times[n][-1] if times[n] else 0:.3f} s" for n in clients),
                          flush=True)
                for tc in clients.values():
                    tc.close()
            finally:
                service.close()
                for procs in groups.values():
                    for proc in reversed(procs):  # rank 0 first: it tells the others to stop
                        proc.terminate()
                        proc.wait(60)
    whole = state_bytes[1]
    base = median(times[1])
    rows = [(f"{n} shard(s)", state_bytes[n] / 2**20, state_bytes[n] / whole, median(times[n]), median(times[n]) / base)
            for n in clients]
    what = f"LoRA rank {args.lora}" if args.lora else "full-parameter"
    print(f"sharding ({what}): {n_params / 1e6:.2f}M-parameter Llama, {DATUMS}x{SEQ} tokens, float32; {args.reps} reps "
          f"after {args.warmup} warm-up; {machine()}")
    print_table(["setup", "state MiB/shard", "x whole", "step s", "x one worker"], rows)
    worst = max(abs(a - b) / abs(b) for n in args.shards for a, b in zip(losses[n], losses[1], strict=True))
    print(f"loss agreement shards vs one worker (max relative diff over all steps): {worst:.2e}")


if __name__ == "__main__":
    main()
