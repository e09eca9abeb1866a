"""The sampling engine's decode step in-process: the dense decode step (worker/sampling/dense_decode.py) against the
model's own forward, alternated rep by rep in one run, on the models of benchmarks/skyrl_side_by_side.py.

No Redis, no worker: one TorchEngine stepped on this thread (``torch.set_num_threads(--threads)``), the same
requests every rep (fixed seeds), every request submitted before the first step. Loads: ``--prompts`` prompts of
16-32 tokens x ``--samples`` samples, and ``--singles`` one-sample requests, ``--tokens`` new tokens each at
temperature 1. Reported: tokens/s and this process's CPU per generated token (medians; the range over reps), and
the ratio dense / model forward per rep. The two paths' tokens and logprobs are compared as well (bitwise).

With ``--lora RANK`` every job samples from one rank-RANK adapter over every target (a LoRA snapshot, as the SDK's
``save_weights_and_get_sampling_client`` makes), and the two paths are both the dense decode step: its LoRA rows
routed as now (one adapter holding every row adds its delta to the whole output) against gathered and scattered by
row index, as every row-index routing was before (worker/lora/routing.py).

With ``--per-step K`` the requests are submitted K before each engine step instead of all before the first: the
way concurrent requests reach a worker through the gateway, one by one, each joining the running rows (more steps,
each prefill its own; the "engine steps" column counts them).

    .venv/bin/python benchmarks/sampling_decode.py [--reps 5] [--models tiny 29m] [--lora 8] [--per-step 1]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from _fleet import machine, median, print_table
from skyrl_side_by_side import MODELS, SEED, build_qwen3, prompts_for

from tinkerq import types


def run(model: Any, prompts: list[list[int]], samples: int, tokens: int, adapter: Any = None,
        per_step: int = 0) -> tuple[float, float, int, list[Any], int]:
    """Wall seconds, CPU seconds, generated tokens, the sequences and the engine's steps of one engine run of every
    prompt: all submitted before the first step, or ``per_step`` before each step (the rest join running rows)."""
    from tinkerq.worker.sampling import SampleJob, StopRule, TorchEngine

    engine, out = TorchEngine(), []
    jobs = [SampleJob(model=model, model_key=0, prompt=p, num_samples=samples,
                      params=types.SamplingParams(max_tokens=tokens, temperature=1.0, seed=SEED),
                      stop=StopRule([], [], None), max_tokens=tokens, adapter=adapter,
                      on_done=lambda seqs, err: out.append(seqs)) for p in prompts]
    wave = per_step or len(jobs)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, len(jobs), wave):
        for job in jobs[i:i + wave]:
            engine.submit(job)
        engine.step()
    engine.run_until_idle()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    engine.close()
    return seconds, cpu, sum(len(s.tokens) for seqs in out for s in seqs), out, engine.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--singles", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="sample from a rank-RANK LoRA snapshot: row routing now against rows gathered")
    parser.add_argument("--per-step", type=int, default=0, metavar="K",
                        help="submit K requests before each engine step (default: all before the first), as "
                             "concurrent requests that reach a worker one by one join the running rows")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from tinkerq.worker.lora import routing
    from tinkerq.worker.sampling import forwards

    every_row = routing._is_every_row
    paths = ["rows gathered", "one adapter"] if args.lora else ["model forward", "dense decode"]

    def choose(path: str) -> None:
        forwards.DENSE_DECODE = path != "model forward"
        # "rows gathered": no routing counts as one adapter over every row (the route before it had that case)
        routing._is_every_row = (lambda rows, batch: False) if path == "rows gathered" else every_row

    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}; torch threads {args.threads}; {args.reps} reps, alternated; requests submitted "
          f"{f'{args.per_step} per step' if args.per_step else 'all before the first step'}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model = AutoModelForCausalLM.from_pretrained(build_qwen3(Path(tmp) / name, MODELS[name])).eval()
            adapter = snapshot(model, args.lora) if args.lora else None
            vocab = MODELS[name]["vocab_size"]
            loads = {"batch": (prompts_for(args.prompts, vocab, 1), args.samples),
                     "singles": (prompts_for(args.singles, vocab, 2), 1)}
            rows, ratio_rows = [], []
            for load, (prompts, samples) in loads.items():
                got: dict[str, list[tuple[float, float, int]]] = {path: [] for path in paths}
                answers: dict[str, Any] = {}
                steps_of: dict[str, int] = {}  # engine steps of a run (the same every rep: fixed requests)
                for rep in range(args.reps + 1):  # the first is a warm-up
                    for path in (paths if rep % 2 else paths[::-1]):
                        choose(path)
                        seconds, cpu, n, out, steps = run(model, prompts, samples, args.tokens, adapter,
                                                          args.per_step)
                        answers[path] = sorted((s.tokens, s.logprobs) for seqs in out for s in seqs)
                        steps_of[path] = steps
                        if rep:
                            got[path].append((seconds, cpu, n))
                choose(paths[1])
                same = answers[paths[0]] == answers[paths[1]]
                for path, runs in got.items():
                    rates = [n / s for s, _, n in runs]
                    rows.append((load, path, median(rates), f"{min(rates):.0f}-{max(rates):.0f}",
                                 median([1e3 * c / n for _, c, n in runs]), steps_of[path]))
                ratios = [(n2 / s2) / (n1 / s1) for (s1, _, n1), (s2, _, n2)
                          in zip(got[paths[0]], got[paths[1]], strict=True)]
                cpu_ratios = [(c2 / n2) / (c1 / n1) for (_, c1, n1), (_, c2, n2)
                              in zip(got[paths[0]], got[paths[1]], strict=True)]
                ratio_rows.append((load, median(ratios), f"{min(ratios):.2f}-{max(ratios):.2f}", median(cpu_ratios),
                                   "yes" if same else "NO"))
            print(f"\n{name} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)")
            print_table(["load", "decode", "tokens/s", "range", "CPU ms/token", "engine steps"], rows)
            print_table(["load", f"tokens/s {paths[1]} / {paths[0]}", "range", f"CPU/token {paths[1]} / {paths[0]}",
                         "same tokens"], ratio_rows)


def snapshot(model: Any, rank: int) -> Any:
    """A rank-``rank`` LoRA snapshot over every target of ``model`` (hooks installed), its B factors nonzero."""
    import torch

    from tinkerq.worker.lora.session import LoraBase, LoraSession
    from tinkerq.worker.training.logprobs import LogprobComputer

    base = LoraBase(model, LogprobComputer(model, "torch"), model_dir="/nonexistent", microbatch_tokens=4096)
    session = LoraSession("bench", base, types.LoraConfig(rank=rank, seed=SEED), base_model="bench")
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in session.engine.params:
            p.add_(torch.randn(p.shape, generator=gen), alpha=0.02)
    return session.adapter.frozen()


if __name__ == "__main__":
    main()
