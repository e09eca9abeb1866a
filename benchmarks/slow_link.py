"""Pipelined training when the worker's Redis sits behind a slow link, beside a direct link in the same run.

An operator's Redis is often a network hop away from the GPU hosts. This measures what that costs: one real
worker serves a ~5M-parameter Llama; the producer (this process) talks to Redis directly, the worker either
directly ("direct") or through a TCP proxy that delays every byte by ``--delay-ms`` each way ("slow").
A training client submits ``--steps`` steps of forward_backward + optim_step without waiting (pipelined, as
tinker-cookbook does), then waits for all; steps/s is the figure. Full-parameter and LoRA sessions, small
steps (``--datums`` x ``--tokens`` tokens). The ratio slow/direct is what the link costs.

    .venv/bin/python benchmarks/slow_link.py [--delay-ms 10] [--steps 60] [--datums 2] [--tokens 64] [--repeats 2]
                                             [--intake-batch 1 16] [--churn] [--baseline REV]

``--churn`` adds a third session kind, "lora+churn": the LoRA run again while other tenants come and go at the
worker's LoRA session limit (``TINKERQ_MAX_LORA_SESSIONS=2``): a second client thread opens a LoRA session, runs one
forward_backward, and opens the next, whose creation makes the previous (idle) one leave: released, parked. The
figure is the busy session's steps/s, and how many other sessions per second came and went during its run: what
making room costs the tenants already training, and how fast newcomers get in.

Each configuration gets a fresh worker; each figure is the best of ``--repeats`` runs (the machine may be shared).
``--intake-batch`` runs the whole comparison once per value of the worker's ``TINKERQ_INTAKE_BATCH`` (messages taken
off its own queue per round trip; 1 is kombu's one at a time), in one run, so the values compare A/B.
``--baseline REV`` runs every configuration a second time with commit REV's worker (benchmarks/_baseline.py).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
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


CHURN_IDLE_TTL_S = 0.05  # the worker's TINKERQ_SESSION_IDLE_TTL_S: a session idle longer may make room


def make_batch(rng: np.random.Generator, datums: int, tokens: int, vocab: int) -> list[types.Datum]:
    out = []
    for _ in range(datums):
        ids = rng.integers(0, vocab, tokens + 1)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": ids[1:].tolist(), "weights": [1.0] * tokens}))
    return out


def steps_per_s(fleet: Fleet, kind: str, args: argparse.Namespace) -> tuple[float, float]:
    """Best steps/s over ``args.repeats`` pipelined runs of ``args.steps`` steps, on a new session each; and, for
    "lora+churn", how many other sessions per second were opened during that best run."""
    rng = np.random.default_rng(0)
    batch = make_batch(rng, args.datums, args.tokens, MODEL["vocab_size"])
    adam = types.AdamParams(learning_rate=1e-4)
    best, best_churned = 0.0, 0.0
    with fleet.service() as sc:
        for _ in range(args.repeats):
            base = str(fleet.model_dir)
            tc = (sc.create_training_client(base) if kind == "full"
                  else sc.create_lora_training_client(base, rank=8, seed=0)).result(timeout=300)
            for _ in range(3):  # warm up: first-call costs are not the link's
                tc.forward_backward(batch).result(timeout=120)
                tc.optim_step(adam).result(timeout=120)
            done, churned = threading.Event(), [0]
            churn = threading.Thread(target=_churn, args=(sc, base, batch, done, churned))
            if kind == "lora+churn":
                churn.start()
                time.sleep(1.0)  # the first other session is open: from now on each one opened makes room
            started = time.perf_counter()
            at_start = churned[0]
            futures = []
            for _ in range(args.steps):
                futures.append(tc.forward_backward(batch))
                futures.append(tc.optim_step(adam))
            for fut in futures:
                fut.result(timeout=600)
            elapsed = time.perf_counter() - started
            rate = args.steps / elapsed
            done.set()
            if churn.is_alive():
                churn.join(120)
            if rate > best:
                best, best_churned = rate, (churned[0] - at_start) / elapsed
            tc.close()
    return best, best_churned


def _churn(sc: Any, base: str, batch: list[types.Datum], done: threading.Event, churned: list[int]) -> None:
    """Other tenants coming and going: open a LoRA session, one forward_backward, then the next (each opened at the
    limit makes the previous one, idle past TINKERQ_SESSION_IDLE_TTL_S, leave) until ``done``."""
    while not done.is_set():
        tc = sc.create_lora_training_client(base, rank=8, seed=1).result(timeout=300)
        tc.forward_backward(batch).result(timeout=300)
        churned[0] += 1
        time.sleep(CHURN_IDLE_TTL_S * 2)  # idle long enough to be the one that makes room


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
    parser.add_argument("--churn", action="store_true",
                        help="also the LoRA run while other tenants' sessions come and go at the session limit")
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
        churned: dict[tuple[str, int, str, str], float] = {}
        kinds = ("full", "lora", "lora+churn") if args.churn else ("full", "lora")
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
                        env = {"TINKERQ_INTAKE_BATCH": str(batch), "TINKERQ_MAX_LORA_SESSIONS": "2",
                               "TINKERQ_SESSION_IDLE_TTL_S": str(CHURN_IDLE_TTL_S), **tree_env}
                        with Fleet(model_dir, threads=args.threads, worker_url=worker_url, env=env) as fleet:
                            for kind in kinds:
                                key = (tree, batch, link, kind)
                                results[key], churned[key] = steps_per_s(fleet, kind, args)
                                print(f"  {tree:8s} intake batch {batch:3d} {link:6s} {kind:10s}: "
                                      f"{results[key]:.2f} steps/s"
                                      + (f" (other sessions came and went at {churned[key]:.2f}/s)"
                                         if kind == "lora+churn" else ""), flush=True)
                    finally:
                        for proxy in proxies:
                            proxy.close()
                for kind in kinds:
                    direct, slow = results[(tree, batch, "direct", kind)], results[(tree, batch, "slow", kind)]
                    rows.append([tree, kind, batch, direct, slow, slow / direct,
                                 *((churned[(tree, batch, link, kind)] for link in ("direct", "slow"))
                                   if kind == "lora+churn" else ("", ""))])
    print()
    print_table(["worker", "session", "intake batch", "direct steps/s", f"+{args.delay_ms:g} ms link steps/s",
                 "slow / direct", "others/s direct", "others/s slow"], rows)
    print(f"machine after: {machine()}")


if __name__ == "__main__":
    main()
