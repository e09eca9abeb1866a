"""Pipelined training when the worker's Redis sits behind a slow link, beside a direct link in the same run.

An operator's Redis is often a network hop away from the GPU hosts. This measures what that costs: one real
worker serves a ~5M-parameter Llama; the producer (this process) talks to Redis directly, the worker either
directly ("direct") or through a TCP proxy that delays every byte by ``--delay-ms`` each way ("slow").
A training client submits ``--steps`` steps of forward_backward + optim_step without waiting (pipelined, as
tinker-cookbook does), then waits for all; steps/s is the figure. Full-parameter and LoRA sessions, small
steps (``--datums`` x ``--tokens`` tokens). The ratio slow/direct is what the link costs.

    .venv/bin/python benchmarks/slow_link.py [--delay-ms 10] [--steps 60] [--datums 2] [--tokens 64] [--repeats 2]
                                             [--intake-batch 1 16] [--baseline REV]

Each configuration gets a fresh worker; each figure is the best of ``--repeats`` runs (the machine may be shared).
``--intake-batch`` runs the whole comparison once per value of the worker's ``TINKERQ_INTAKE_BATCH`` (messages taken
off its own queue per round trip; 1 is kombu's one at a time), in one run, so the values compare A/B.
``--baseline REV`` runs every configuration a second time with commit REV's worker (benchmarks/_baseline.py).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _baseline import baseline_env
from _delay_proxy import DelayProxy
from _fleet import Fleet, build_llama, machine, print_table

from tinkerq import types

# ~5M parameters: big enough that a step is real compute, small enough for a CPU.
MODEL: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False,
)


def make_batch(rng: np.random.Generator, datums: int, tokens: int, vocab: int) -> list[types.Datum]:
    out = []
    for _ in range(datums):
        ids = rng.integers(0, vocab, tokens + 1)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": ids[1:].tolist(), "weights": [1.0] * tokens}))
    return out


def steps_per_s(fleet: Fleet, lora: bool, args: argparse.Namespace) -> float:
    """Best steps/s over ``args.repeats`` pipelined runs of ``args.steps`` steps, on a new session each."""
    rng = np.random.default_rng(0)
    batch = make_batch(rng, args.datums, args.tokens, MODEL["vocab_size"])
    adam = types.AdamParams(learning_rate=1e-4)
    best = 0.0
    with fleet.service() as sc:
        for _ in range(args.repeats):
            base = str(fleet.model_dir)
            tc = (sc.create_lora_training_client(base, rank=8, seed=0) if lora
                  else sc.create_training_client(base)).result(timeout=300)
            for _ in range(3):  # warm up: first-call costs are not the link's
                tc.forward_backward(batch).result(timeout=120)
                tc.optim_step(adam).result(timeout=120)
            started = time.perf_counter()
            futures = []
            for _ in range(args.steps):
                futures.append(tc.forward_backward(batch))
                futures.append(tc.optim_step(adam))
            for fut in futures:
                fut.result(timeout=600)
            best = max(best, args.steps / (time.perf_counter() - started))
            tc.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=10.0, help="added to each direction of the worker's link")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--datums", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="the worker's torch threads")
    parser.add_argument("--intake-batch", type=int, nargs="+", default=[16],
                        help="the worker's TINKERQ_INTAKE_BATCH; several values: the comparison for each, in one run")
    parser.add_argument("--baseline", metavar="REV",
                        help="also run every configuration with commit REV's worker (benchmarks/_baseline.py): A/B")
    args = parser.parse_args()

    print(f"machine: {machine()}")
    print(f"steps of {args.datums} x {args.tokens} tokens, {args.steps} pipelined per run, best of {args.repeats}; "
          f"slow link: +{args.delay_ms:g} ms each way on the worker's Redis connections")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_llama(Path(tmp) / "llama-5m", **MODEL)
        trees: dict[str, dict[str, str]] = {"current": {}}
        if args.baseline:
            trees[args.baseline] = baseline_env(args.baseline, Path(tmp) / "baseline")
        results: dict[tuple[str, int, str, str], float] = {}
        for batch in args.intake_batch:
            for tree, tree_env in trees.items():
                for link in ("direct", "slow"):
                    proxies: list[DelayProxy] = []

                    def worker_url(port: int, link: str = link, proxies: list[DelayProxy] = proxies) -> str:
                        if link == "direct":
                            return f"redis://127.0.0.1:{port}/0"
                        proxy = DelayProxy(port, args.delay_ms / 1000).__enter__()
                        proxies.append(proxy)
                        return proxy.url

                    try:
                        with Fleet(model_dir, threads=args.threads, worker_url=worker_url,
                                   env={"TINKERQ_INTAKE_BATCH": str(batch), **tree_env}) as fleet:
                            for kind in ("full", "lora"):
                                key = (tree, batch, link, kind)
                                results[key] = steps_per_s(fleet, kind == "lora", args)
                                print(f"  {tree:8s} intake batch {batch:3d} {link:6s} {kind:4s}: "
                                      f"{results[key]:.2f} steps/s", flush=True)
                    finally:
                        for proxy in proxies:
                            proxy.close()
                for kind in ("full", "lora"):
                    direct, slow = results[(tree, batch, "direct", kind)], results[(tree, batch, "slow", kind)]
                    rows.append([tree, kind, batch, direct, slow, slow / direct])
    print()
    print_table(["worker", "session", "intake batch", "direct steps/s", f"+{args.delay_ms:g} ms link steps/s",
                 "slow / direct"], rows)
    print(f"machine after: {machine()}")


if __name__ == "__main__":
    main()
