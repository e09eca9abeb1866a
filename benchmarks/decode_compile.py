"""What ``torch.compile`` would buy the sampling engine's decode step on this CPU (issue 29, item 6): a what-if.

The dense decode step (worker/sampling/dense_decode.py) of the tiny Qwen3 of benchmarks/skyrl_side_by_side.py runs
eager (as the engine runs it) and as ``torch.compile(step, dynamic=True)`` (inductor; ``--cpp-wrapper`` for its C++
wrapper instead of the Python one), on the same rows: ``--rows`` rows prefilled with prompts of ``--prompt`` tokens,
then ``--steps`` decode steps, each feeding the greedy token. Eager and compiled runs alternate rep by rep, after
the compile (its first run, timed apart) and one warm run each. Reported: this process's CPU per decode step
(medians; the range over reps), compiled / eager, the compile's wall time, and how far the compiled logits are
from the eager ones (the compiled step is not bitwise the model's forward: its fused kernels round otherwise).

``--lora RANK`` samples from a rank-RANK LoRA snapshot (as ``save_weights_and_get_sampling_client`` makes), its
deltas added by the routing hooks (worker/lora/routing.py), which dynamo traces through or breaks the graph at.

Nothing here is used by the worker: it measures whether compiling the step is worth building (docs/benchmarks.md
§21 has the figures and the reading).

    .venv/bin/python benchmarks/decode_compile.py [--rows 16] [--reps 5] [--cpp-wrapper] [--lora 8]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from _fleet import machine, median, print_table
from sampling_decode import snapshot
from skyrl_side_by_side import MODELS, build_qwen3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="tiny")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt", type=int, default=24)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpp-wrapper", action="store_true", help="inductor's C++ wrapper (cpp_wrapper=True)")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="decode through a LoRA snapshot")
    args = parser.parse_args()

    import torch
    import torch._dynamo
    import torch._inductor.config
    from transformers import AutoModelForCausalLM

    from tinkerq.worker.sampling import forwards
    from tinkerq.worker.sampling.dense_decode import dense_decode

    torch.set_num_threads(args.threads)
    # dynamo's warning for the step's one graph break (``bool(mask.all())``), once per compile: said here instead
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    torch._inductor.config.cpp_wrapper = args.cpp_wrapper
    print(f"machine: {machine()}; torch {torch.__version__}, threads {args.threads}; {args.model} Qwen3, "
          f"prompts of {args.prompt} tokens, {args.steps} decode steps; inductor "
          f"{'C++' if args.cpp_wrapper else 'Python'} wrapper; {f'LoRA rank {args.lora}' if args.lora else 'no LoRA'}; "
          f"{args.reps} reps, alternated; the compiled step breaks its graph once, at its mask.all() test")
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(build_qwen3(Path(tmp) / args.model, MODELS[args.model])).eval()
        adapter = snapshot(model, args.lora) if args.lora else None
        dense = dense_decode(model)
        assert dense is not None, "the dense decode step does not apply to this model"
        rows, ratios = [], []
        for n in args.rows:
            ids = torch.randint(0, MODELS[args.model]["vocab_size"], (n, args.prompt),
                                generator=torch.Generator().manual_seed(n))
            with torch.no_grad(), forwards.routed([adapter] * n if adapter else [None], device=ids.device):
                torch._dynamo.reset()
                compiled = torch.compile(dense.__call__, dynamic=True)
                first, prefilled = dense.prefill(ids)

                def run(step: Any, first: Any = first, prefilled: Any = prefilled) -> tuple[float, Any]:
                    return decode_steps(step, first, prefilled, args.steps)

                t0 = time.perf_counter()
                run(compiled)
                compile_s = time.perf_counter() - t0
                run(dense)
                got: dict[str, list[float]] = {"eager": [], "compiled": []}
                logits: dict[str, torch.Tensor] = {}
                for rep in range(args.reps):
                    for name in (("eager", "compiled") if rep % 2 == 0 else ("compiled", "eager")):
                        cpu, logits[name] = run(dense if name == "eager" else compiled)
                        got[name].append(1e3 * cpu / args.steps)
            diff = (logits["compiled"] - logits["eager"]).abs().max().item()
            same = bool(torch.equal(logits["compiled"].argmax(-1), logits["eager"].argmax(-1)))
            for name, ms in got.items():
                rows.append((n, name, median(ms), f"{min(ms):.3f}-{max(ms):.3f}",
                             f"{compile_s:.1f}" if name == "compiled" else "-"))
            per_rep = [c / e for c, e in zip(got["compiled"], got["eager"], strict=True)]
            ratios.append((n, median(per_rep), f"{min(per_rep):.2f}-{max(per_rep):.2f}", f"{diff:.1e}",
                           "yes" if same else "no"))
        print_table(["rows", "step", "CPU ms/step", "range", "compile s"], rows)
        print_table(["rows", "CPU compiled / eager", "range", "max |logit diff|", "same greedy tokens"], ratios)


def decode_steps(step: Any, first: Any, prefilled: Any, steps: int) -> tuple[float, Any]:
    """CPU seconds of ``steps`` decode steps of ``step`` from a prefill (its logits ``first`` (N, V) and cache
    ``prefilled``), each feeding the greedy token; and the last step's logits (N, V)."""
    import torch

    state = [[layer.keys, layer.values] for layer in prefilled.layers]
    n, prompt = state[0][0].shape[0], state[0][0].shape[2]
    last, pos = first.argmax(-1), torch.full((n,), prompt)
    mask = torch.ones(n, prompt, dtype=torch.long)
    start = time.process_time()
    for _ in range(steps):
        mask = torch.cat([mask, mask.new_ones(n, 1)], 1)
        logits, state = step(last, pos, mask, state)
        last, pos = logits.argmax(-1), pos + 1
    return time.process_time() - start, logits


if __name__ == "__main__":
    main()
