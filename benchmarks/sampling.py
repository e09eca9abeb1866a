"""RL-shaped sampling through the fleet, against one batched in-process ``generate`` in the same run.

Load: ``--prompts`` prompts (default 64) of 8–40 random tokens × ``--samples`` (8) samples × ``--tokens`` (32)
new tokens at temperature 1, every request submitted before any is awaited (the cookbook's pattern), on a
~5M-parameter Llama built from a config with a fixed seed. Rows may end early at the model's EOS, so the
figure compared is time per generated token.

* baseline: one ``model.generate`` of all rows (left padding, sampling, ``max_new_tokens=min_new_tokens``),
  in this process, ``torch.set_num_threads(--threads)``;
* fleet, 1 worker: a real Redis + one ``tinkerq worker --threads --threads``, a ServiceClient sampling a
  snapshot (``save_weights_and_get_sampling_client``);
* fleet, 2 workers: the same load over two workers with ``--threads 1`` each (``--role sampler`` for the
  second), and one worker with ``--threads 1`` as its baseline.

Runs are interleaved rep by rep; medians are printed. Nothing is asserted.

    .venv/bin/python benchmarks/sampling.py [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from _fleet import Fleet, build_llama, machine, median, print_table
from sampling_engine import LLAMA_5M

from tinkerq import types
from tinkerq.launcher.processes import start_process, wait_for, worker_command

# The ~5M-parameter Llama of benchmarks/sampling_engine.py (5.3M), so the two benchmarks' figures compare.
MODEL: dict[str, Any] = {**LLAMA_5M, "eos_token_id": 2}


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, MODEL["vocab_size"]) for _ in range(rng.randint(8, 40))] for _ in range(n)]


def run_generate(model: Any, prompts: list[list[int]], samples: int, tokens: int) -> tuple[float, int]:
    """Seconds and generated tokens of one batched generate of every row (left padded)."""
    import torch

    rows = [p for p in prompts for _ in range(samples)]
    width = max(len(p) for p in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)
    seconds = time.perf_counter() - t0
    return seconds, int(out.shape[0] * (out.shape[1] - width))


def run_fleet(sampler: Any, prompts: list[list[int]], samples: int, tokens: int, seed: int) -> tuple[float, int]:
    """Seconds from the first submit to the last answer, and generated tokens, through the fleet."""
    params = types.SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed)
    t0 = time.perf_counter()
    futures = [sampler.sample(types.ModelInput.from_ints(p), samples, params) for p in prompts]
    generated = sum(len(s.tokens) for f in futures for s in f.result(timeout=900).sequences)
    return time.perf_counter() - t0, generated


def add_worker(fleet: Fleet, threads: int, role: str) -> None:
    """A second worker process on the fleet's Redis, registered when this returns."""
    from tinkerq.connection import Connection
    from tinkerq.settings import Settings

    log = fleet.workdir / f"worker-{role}.log"
    cmd = worker_command(str(fleet.model_dir), fleet.url, threads=threads, extra=["--role", role])
    proc = start_process(cmd, log, {"TINKERQ_CHECKPOINT_DIR": str(fleet.workdir / "ckpt")})
    fleet.extra_procs = [*getattr(fleet, "extra_procs", []), proc]  # type: ignore[attr-defined]
    conn = Connection.open(Settings(broker_url=fleet.url))
    try:
        wait_for(lambda: len(conn.workers_serving(str(fleet.model_dir))) >= 2, 180, "second worker", proc, log)
    finally:
        conn.close()


def stop_extra(fleet: Fleet) -> None:
    for proc in getattr(fleet, "extra_procs", []):
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads: baseline and the single worker")
    parser.add_argument("--skip-two", action="store_true", help="skip the 2-worker comparison")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.prompts)
    print(f"machine: {machine()}")
    print(f"load: {args.prompts} prompts of 8-40 tokens x {args.samples} samples x {args.tokens} new tokens, "
          f"{args.reps} reps, medians")
    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float, generated: int) -> None:
        times.setdefault(name, []).append(1e3 * seconds / max(generated, 1))  # ms per generated token

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_llama(Path(tmp) / "llama-5m", **MODEL)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
        with Fleet(model_dir, threads=args.threads) as fleet:
            service = fleet.service()
            tc = service.create_training_client(str(fleet.model_dir)).result()
            sampler = tc.save_weights_and_get_sampling_client().result()
            run_fleet(sampler, prompts[:4], 2, 4, seed=0)  # warm-up: the first request loads nothing twice
            run_generate(model, prompts[:4], 2, 4)
            for rep in range(args.reps):
                record("generate (in-process)", *run_generate(model, prompts, args.samples, args.tokens))
                record(f"fleet, 1 worker x {args.threads} threads",
                       *run_fleet(sampler, prompts, args.samples, args.tokens, seed=rep))
            tc.close()
            service.close()
        rows = []
        base = median(times["generate (in-process)"])
        for name, ms in times.items():
            rows.append((name, median(ms), median(ms) / base))
        print_table(["path", "ms / token", "x generate"], rows)

        if args.skip_two:
            return
        two: dict[str, list[float]] = {}
        with Fleet(model_dir, threads=1) as fleet:
            service = fleet.service()

            def measure(label: str) -> None:
                sampler = service.create_sampling_client(base_model=str(fleet.model_dir)).result()
                run_fleet(sampler, prompts[:4], 2, 4, seed=0)  # warm-up
                two[label] = []
                for rep in range(args.reps):
                    seconds, generated = run_fleet(sampler, prompts, args.samples, args.tokens, seed=rep)
                    two[label].append(1e3 * seconds / generated)

            measure("1 worker x 1 thread")
            add_worker(fleet, threads=1, role="sampler")
            measure("2 workers x 1 thread")
            service.close()
            stop_extra(fleet)
        first = median(two["1 worker x 1 thread"])
        print_table(["fleet", "ms / token", "x 1 worker"], [(k, median(v), median(v) / first) for k, v in two.items()])


if __name__ == "__main__":
    main()
